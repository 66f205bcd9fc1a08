// Random numbers that are a pure function of a key.
//
// Data generation and augmentation must give the same result whichever
// thread produces a sample and in whatever order, so their randomness is
// derived by hashing (seed, epoch, rank, position, ...) instead of being drawn
// from a shared, stateful generator. The mixer is splitmix64's finaliser: a
// cheap bijection on 64 bits whose output bits each depend on every input bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace ddp::data {

/// splitmix64's finaliser.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// An order-sensitive hash of several words: {a, b} and {b, a} differ.
inline uint64_t hash_words(std::initializer_list<uint64_t> words) {
  uint64_t h = 0x6a09e667f3bcc909ull;
  for (uint64_t w : words) h = mix64(h ^ mix64(w));
  return h;
}

/// A stream of draws from one key (splitmix64). Cheap to create, so each
/// sample gets its own and no state is shared between threads.
class KeyedRandom {
 public:
  explicit KeyedRandom(uint64_t key) : state_(key) {}

  uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1), 53 bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  /// Uniform integer in [0, n); the modulo bias is below 2^-40 for small n.
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  /// Standard normal (Box-Muller). Written out rather than using
  /// std::normal_distribution, whose output differs between standard libraries.
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1], so the log is finite
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace ddp::data
