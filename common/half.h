// IEEE 754 binary16 <-> binary32 conversion, bit-exact and portable.
//
// FloatToHalf rounds to nearest, ties to even (overflow -> inf, NaN kept as a
// quiet NaN); HalfToFloat is exact (NaNs come out quiet). The result never depends on the CPU or
// compiler, which AQ-SGD needs: both ends of a link must hold identical m(xi).
#ifndef AQSWARM_COMMON_HALF_H_
#define AQSWARM_COMMON_HALF_H_

#include <cstdint>
#include <cstring>

#include "absl/types/span.h"

namespace aqswarm {

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatToBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520 -> inf
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {  // subnormal or zero in half precision
    // Scale into the subnormal range with float arithmetic: adding 0.5f
    // (2^-1) forces rounding at the 2^-24 position, ties to even.
    const float v = BitsToFloat(abs) + 0.5f;
    return static_cast<uint16_t>(sign | (FloatToBits(v) - 0x3f000000u));
  }
  // Normal: rebias exponent, round mantissa to 10 bits (ties to even).
  const uint32_t mant_odd = (abs >> 13) & 1u;
  uint32_t v = abs + 0xc8000fffu + mant_odd;  // -(127-15)<<23 + rounding bias
  return static_cast<uint16_t>(sign | (v >> 13));
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return BitsToFloat(sign | FloatToBits(v));
  }
  // NaNs come out quiet (as F16C does), so decoding is the same on every CPU.
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Span versions; `out` must be at least as long as `in`. They use the CPU's
// F16C instructions when present (same bits as the scalar functions for all
// finite input; ~10x faster), else the portable code.
void FloatToHalf(absl::Span<const float> in, uint16_t* out);
void HalfToFloat(absl::Span<const uint16_t> in, float* out);
// The portable loops, for tests that compare the two paths.
void FloatToHalfPortable(absl::Span<const float> in, uint16_t* out);
void HalfToFloatPortable(absl::Span<const uint16_t> in, float* out);

// Rounds every value through binary16 and back (what an fp16 store returns).
inline float RoundToHalf(float f) { return HalfToFloat(FloatToHalf(f)); }

// m[i] = RoundToHalf(m[i] + d[i]) for i < n, in one pass (F16C when present;
// the same bits as the scalar expression for every input).
void AddRoundToHalf(float* m, const float* d, size_t n);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_HALF_H_
