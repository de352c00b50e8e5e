#include "compression/bucketed.h"
#include "compression/max_abs.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/random.h"
#include "compression/bit_pack.h"

namespace aqswarm::compression {
namespace {

using internal::MaxAbsBits;

constexpr size_t kChunk = 4096;  // multiple of 8: chunks start byte-aligned

// Walks [0, n) in byte-aligned chunks; inside a chunk calls
// seg(first_index, length, bucket, offset_in_chunk) for each bucket piece.
template <typename Seg>
void ForEachBucketSegment(size_t start, size_t end, size_t bucket_size, Seg&& seg) {
  size_t i = start;
  while (i < end) {
    const size_t k = i / bucket_size;
    const size_t len = std::min(end - i, (k + 1) * bucket_size - i);
    seg(i, len, k, i - start);
    i += len;
  }
}


double SumSquares(const float* x, size_t len) {
  // Four independent accumulators: a fixed order, so the result does not
  // depend on vectorisation, yet not latency-bound.
  double a[4] = {0, 0, 0, 0};
  size_t j = 0;
  for (; j + 4 <= len; j += 4) {
    for (int t = 0; t < 4; ++t) a[t] += static_cast<double>(x[j + t]) * x[j + t];
  }
  for (; j < len; ++j) a[0] += static_cast<double>(x[j]) * x[j];
  return (a[0] + a[1]) + (a[2] + a[3]);
}

__attribute__((target_clones("avx2", "default")))
void QsgdQuantizeSeg(const float* x, size_t len, float mul, float s_f, bool stochastic,
                     uint32_t key, uint32_t index0, int sign_shift, uint8_t* codes) {
  for (size_t j = 0; j < len; ++j) {
    uint32_t u;
    std::memcpy(&u, x + j, 4);
    const float a = BitsToFloat(u & 0x7fffffffu);
    const float r = stochastic ? DrawUnit(key, index0 + static_cast<uint32_t>(j)) : 0.5f;
    float y = a * mul + r;
    y = y > s_f ? s_f : y;
    const uint32_t level = static_cast<uint32_t>(static_cast<int>(y));
    codes[j] = static_cast<uint8_t>(level | ((u >> 31) << sign_shift));
  }
}

__attribute__((target_clones("avx2", "default")))
void QsgdDequantizeSeg(const uint8_t* codes, size_t len, float unit, int sign_shift, float* out) {
  const uint32_t level_mask = (1u << sign_shift) - 1;
  for (size_t j = 0; j < len; ++j) {
    const uint32_t c = codes[j];
    const float v = static_cast<float>(static_cast<int>(c & level_mask)) * unit;
    out[j] = BitsToFloat(FloatToBits(v) | ((c >> sign_shift) << 31));
  }
}

__attribute__((target_clones("avx2", "default")))
void MinMaxQuantizeSeg(const float* x, size_t len, float mn, float inv, float l_f, bool stochastic,
                       uint32_t key, uint32_t index0, uint8_t* codes) {
  for (size_t j = 0; j < len; ++j) {
    const float r = stochastic ? DrawUnit(key, index0 + static_cast<uint32_t>(j)) : 0.5f;
    float y = (x[j] - mn) * inv + r;
    y = y > l_f ? l_f : y;
    y = y < 0.0f ? 0.0f : y;
    codes[j] = static_cast<uint8_t>(static_cast<int>(y));
  }
}

__attribute__((target_clones("avx2", "default")))
void MinMaxDequantizeSeg(const uint8_t* codes, size_t len, float mn, float unit, float* out) {
  for (size_t j = 0; j < len; ++j) out[j] = mn + static_cast<float>(static_cast<int>(codes[j])) * unit;
}

}  // namespace

absl::Status QsgdNorms(absl::Span<const float> values, size_t bucket_size, NormKind norm,
                       float* norms) {
  const size_t n = values.size();
  for (size_t k = 0, i = 0; i < n; ++k, i += bucket_size) {
    const size_t len = std::min(bucket_size, n - i);
    const uint32_t mx = MaxAbsBits(values.data() + i, len);
    if (mx >= 0x7f800000u) {
      return absl::InvalidArgumentError(absl::StrCat("qsgd: non-finite value (NaN/Inf) in bucket ", k));
    }
    if (norm == NormKind::kMax) {
      norms[k] = BitsToFloat(mx);
    } else {
      const double l2 = std::sqrt(SumSquares(values.data() + i, len));
      if (!(l2 <= FLT_MAX)) {
        return absl::InvalidArgumentError(absl::StrCat("qsgd: L2 norm of bucket ", k, " overflows float32"));
      }
      // Round up so that |x| <= norm holds after the narrowing.
      float f = static_cast<float>(l2);
      if (static_cast<double>(f) < l2) f = std::nextafter(f, FLT_MAX);
      norms[k] = f;
    }
  }
  return absl::OkStatus();
}

void QsgdEncode(absl::Span<const float> values, size_t bucket_size, const float* norms, int bits,
                bool stochastic, uint32_t rng_key, uint8_t* payload) {
  const int s = (1 << (bits - 1)) - 1;
  const size_t n = values.size();
  uint8_t codes[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t end = std::min(n, start + kChunk);
    ForEachBucketSegment(start, end, bucket_size, [&](size_t i, size_t len, size_t k, size_t o) {
      const float mul = norms[k] > 0.0f ? static_cast<float>(s) / norms[k] : 0.0f;
      QsgdQuantizeSeg(values.data() + i, len, mul, static_cast<float>(s), stochastic, rng_key,
                      static_cast<uint32_t>(i), bits - 1, codes + o);
    });
    PackBits(codes, end - start, bits, payload + start / 8 * bits);
  }
}

void QsgdDecode(const uint8_t* payload, size_t n, size_t bucket_size, const float* norms, int bits,
                float* out) {
  const int s = (1 << (bits - 1)) - 1;
  uint8_t codes[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t end = std::min(n, start + kChunk);
    UnpackBits(payload + start / 8 * bits, end - start, bits, codes);
    ForEachBucketSegment(start, end, bucket_size, [&](size_t i, size_t len, size_t k, size_t o) {
      QsgdDequantizeSeg(codes + o, len, norms[k] / static_cast<float>(s), bits - 1, out + i);
    });
  }
}

absl::Status MinMaxScales(absl::Span<const float> values, size_t bucket_size, int bits,
                          float* min_unit) {
  const size_t n = values.size();
  const float levels = static_cast<float>((1 << bits) - 1);
  for (size_t k = 0, i = 0; i < n; ++k, i += bucket_size) {
    const size_t len = std::min(bucket_size, n - i);
    const float* x = values.data() + i;
    if (MaxAbsBits(x, len) >= 0x7f800000u) {
      return absl::InvalidArgumentError(absl::StrCat("minmax: non-finite value (NaN/Inf) in bucket ", k));
    }
    float mn = x[0], mx = x[0];
    for (size_t j = 1; j < len; ++j) {
      mn = x[j] < mn ? x[j] : mn;
      mx = x[j] > mx ? x[j] : mx;
    }
    const float unit = (mx - mn) / levels;
    if (!std::isfinite(unit)) {
      return absl::InvalidArgumentError(absl::StrCat("minmax: range of bucket ", k, " overflows float32"));
    }
    min_unit[2 * k] = mn;
    min_unit[2 * k + 1] = unit;
  }
  return absl::OkStatus();
}

void MinMaxEncode(absl::Span<const float> values, size_t bucket_size, const float* min_unit,
                  int bits, bool stochastic, uint32_t rng_key, uint8_t* payload) {
  const float levels = static_cast<float>((1 << bits) - 1);
  const size_t n = values.size();
  uint8_t codes[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t end = std::min(n, start + kChunk);
    ForEachBucketSegment(start, end, bucket_size, [&](size_t i, size_t len, size_t k, size_t o) {
      const float unit = min_unit[2 * k + 1];
      const float inv = unit > 0.0f ? 1.0f / unit : 0.0f;
      MinMaxQuantizeSeg(values.data() + i, len, min_unit[2 * k], inv, levels, stochastic, rng_key,
                        static_cast<uint32_t>(i), codes + o);
    });
    PackBits(codes, end - start, bits, payload + start / 8 * bits);
  }
}

void MinMaxDecode(const uint8_t* payload, size_t n, size_t bucket_size, const float* min_unit,
                  int bits, float* out) {
  uint8_t codes[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t end = std::min(n, start + kChunk);
    UnpackBits(payload + start / 8 * bits, end - start, bits, codes);
    ForEachBucketSegment(start, end, bucket_size, [&](size_t i, size_t len, size_t k, size_t o) {
      MinMaxDequantizeSeg(codes + o, len, min_unit[2 * k], min_unit[2 * k + 1], out + i);
    });
  }
}

}  // namespace aqswarm::compression
