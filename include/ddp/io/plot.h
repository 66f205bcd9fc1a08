// curves.svg: the losses (train, test, and any other *_loss metric) on the
// left, and one more metric on the right (the monitor, e.g. test accuracy,
// or R squared for a regression), against epoch.
//
// Two panels with axes, ticks, grid and a legend, one polyline and one
// marker per epoch for each series, so that the run can be looked at in any
// browser or image viewer. The SVG is written by hand: Debian has no C++
// plotting library that fits (matplot++ and gnuplot-iostream are not
// packaged for Debian 12, and calling gnuplot would add a runtime program),
// and the drawing is a few lines of text.
#pragma once

#include <string>
#include <vector>

#include "ddp/io/metrics.h"

namespace ddp {

/// The SVG document for `epochs` (in order; non-finite values are skipped).
std::string curves_svg(const std::vector<EpochMetrics>& epochs);

/// Writes curves_svg(epochs) to `path` atomically (temp file + rename).
void write_curves_svg(const std::string& path, const std::vector<EpochMetrics>& epochs);

}  // namespace ddp
