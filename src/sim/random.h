// Rng: a small seeded generator whose sequence is fixed by this code alone (splitmix64), so the
// simulator's output is byte-identical across standard libraries for the same seed.
#pragma once

#include <cmath>
#include <cstdint>

namespace nbos::sim {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // In [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  double Exponential(double mean) { return -mean * std::log(1.0 - Uniform()); }
  double Normal() {  // Box-Muller, one value per call
    const double u1 = 1.0 - Uniform(), u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Marsaglia-Tsang; shape < 1 boosted by U^(1/shape).
  double Gamma(double shape, double scale) {
    if (shape < 1) return Gamma(shape + 1, scale) * std::pow(Uniform(), 1.0 / shape);
    const double d = shape - 1.0 / 3, c = 1.0 / std::sqrt(9 * d);
    for (;;) {
      double x, v;
      do {
        x = Normal();
        v = 1 + c * x;
      } while (v <= 0);
      v = v * v * v;
      const double u = Uniform();
      if (u < 1 - 0.0331 * x * x * x * x) return d * v * scale;
      if (std::log(u) < 0.5 * x * x + d * (1 - v + std::log(v))) return d * v * scale;
    }
  }

 private:
  uint64_t state_;
};

}  // namespace nbos::sim
