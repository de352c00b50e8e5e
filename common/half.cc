#include "common/half.h"

#include <cpuid.h>
#include <immintrin.h>

namespace aqswarm {
namespace {

// F16C converts with IEEE round-to-nearest-even, exactly like the portable
// FloatToHalf above for every finite input (half_test checks equality on
// millions of values, subnormals and halfway cases included); stored rows are
// always finite (ValidateFinite runs first), so the paths are interchangeable.
__attribute__((target("f16c,avx"))) void FloatToHalfF16c(const float* in, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

__attribute__((target("f16c,avx"))) void HalfToFloatF16c(const uint16_t* in, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

bool HasF16c() {
  // F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports
  // does not know "f16c".
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0 && __builtin_cpu_supports("avx");
  }();
  return has;
}

// One 8-value block of AddRoundToHalf; false (m untouched) if a sum is not
// finite, which the caller then rounds on the portable path.
__attribute__((target("f16c,avx"))) bool AddRoundBlockF16c(float* m, const float* d) {
  const __m256 sum = _mm256_add_ps(_mm256_loadu_ps(m), _mm256_loadu_ps(d));
  const __m256i exp = _mm256_castps_si256(_mm256_and_ps(sum, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000))));
  // Non-finite: exponent all ones. AVX1 has no 256-bit integer compare: compare as floats
  // (exponent-only bit patterns are finite floats or +inf, never NaN).
  const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
  if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_castsi256_ps(exp), inf, _CMP_EQ_OQ)) != 0) return false;
  const __m128i h = _mm256_cvtps_ph(sum, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_ps(m, _mm256_cvtph_ps(h));
  return true;
}

bool AllFinite(absl::Span<const float> in) {
  uint32_t bad = 0;
  for (float f : in) bad |= static_cast<uint32_t>((FloatToBits(f) & 0x7f800000u) == 0x7f800000u);
  return bad == 0;
}

}  // namespace

void FloatToHalf(absl::Span<const float> in, uint16_t* out) {
  // NaN payloads may differ between the paths: keep non-finite input on the
  // portable one so its documented NaN encoding holds.
  if (HasF16c() && AllFinite(in)) return FloatToHalfF16c(in.data(), in.size(), out);
  for (size_t i = 0; i < in.size(); ++i) out[i] = FloatToHalf(in[i]);
}

void AddRoundToHalf(float* m, const float* d, size_t n) {
  size_t i = 0;
  if (HasF16c()) {
    for (; i + 8 <= n; i += 8) {
      if (!AddRoundBlockF16c(m + i, d + i)) {
        for (size_t j = i; j < i + 8; ++j) m[j] = RoundToHalf(m[j] + d[j]);
      }
    }
  }
  for (; i < n; ++i) m[i] = RoundToHalf(m[i] + d[i]);
}

void HalfToFloat(absl::Span<const uint16_t> in, float* out) {
  if (HasF16c()) return HalfToFloatF16c(in.data(), in.size(), out);
  for (size_t i = 0; i < in.size(); ++i) out[i] = HalfToFloat(in[i]);
}

void HalfToFloatPortable(absl::Span<const uint16_t> in, float* out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = HalfToFloat(in[i]);
}

void FloatToHalfPortable(absl::Span<const float> in, uint16_t* out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = FloatToHalf(in[i]);
}

}  // namespace aqswarm
