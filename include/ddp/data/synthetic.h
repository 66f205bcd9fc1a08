// A built-in dataset that needs no files and can be learned.
//
// It lets ddptrain, its tests and its CI run end to end where Fashion-MNIST is
// not installed, while still showing that training works: the loss must fall
// and accuracy must climb well above chance. Each of the 10 classes is a
// fixed arrangement of four soft blobs on a 4 x 4 grid of 28 x 28 pixels; any
// two classes share at most two grid cells, so no single pixel tells the
// classes apart but a small CNN separates them within an epoch (about 99% test
// accuracy after one epoch of 60,000 with a two-layer CNN). Samples vary by a
// shift of up to 3 pixels, a further 1-pixel jitter and random brightness per
// blob, a fainter distractor blob in a random cell, and pixel noise.
//
// Every sample is a pure function of (seed, split, index), so the data is the
// same for any thread count and sample i does not depend on how many samples
// are generated. 70,000 samples take well under a second.
#pragma once

#include <cstdint>

#include "ddp/data/dataset.h"

namespace ddp::data {

/// Train and test splits of the synthetic dataset: uint8 1 x 28 x 28 images
/// in 10 classes, exactly balanced in every run of 10 consecutive samples.
/// Both splits share the class patterns of `seed` but no samples. mean and
/// std are measured on the train images; synthetic is true. Datasets are
/// named "synthetic (train)" and "synthetic (test)".
Splits make_synthetic(int64_t n_train = 60000, int64_t n_test = 10000, uint64_t seed = 0);

/// A learnable regression, the seed template's MSE-on-a-scalar task done
/// right: 1 x 28 x 28 images of a bright disc of random radius and place on
/// a noisy background; the target (shape {1}) is the radius, scaled to
/// [0, 1]. A small CNN reaches R squared above 0.9 in an epoch. Samples are
/// made on demand, a pure function of (seed, split, index).
Splits make_synthetic_regression(int64_t n_train = 20000, int64_t n_test = 4000, uint64_t seed = 0);

}  // namespace ddp::data
