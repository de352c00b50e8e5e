#include "compression/fixed_point.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/random.h"
#include "compression/bit_pack.h"

namespace aqswarm::compression {
namespace {

// Elements per pack/unpack chunk: a multiple of 8 so every chunk starts on a
// byte boundary of the packed stream for every width; small enough for L1.
constexpr size_t kChunk = 4096;
// x + 1.5*2^23 - 1.5*2^23 rounds to the nearest integer (ties to even) for
// |x| < 2^22, in plain IEEE arithmetic that vectorises (no SSE4.1 needed).
constexpr float kMagic = 12582912.0f;

// Per-channel max of |x| as uint32 bit patterns: for non-negative floats the
// integer order is the float order, and NaN/Inf sort above every finite
// value, so one integer max both finds the scale and detects non-finite input.
__attribute__((target_clones("avx2", "default")))
void MaxAbsBitsRow(const float* x, size_t len, uint32_t* mx) {
  for (size_t c = 0; c < len; ++c) {
    uint32_t u;
    std::memcpy(&u, x + c, 4);
    u &= 0x7fffffffu;
    mx[c] = u > mx[c] ? u : mx[c];
  }
}

__attribute__((target_clones("avx2", "default")))
void QuantizeNearestSeg(const float* x, const float* mul, size_t len, float lo, float hi, int off,
                        uint8_t* codes) {
  for (size_t j = 0; j < len; ++j) {
    float y = x[j] * mul[j];
    y = y < lo ? lo : y;
    y = y > hi ? hi : y;
    const float r = (y + kMagic) - kMagic;
    codes[j] = static_cast<uint8_t>(static_cast<int>(r) + off);
  }
}

__attribute__((target_clones("avx2", "default")))
void QuantizeStochasticSeg(const float* x, const float* mul, size_t len, uint32_t key,
                           uint32_t index0, float off_f, int max_code, uint8_t* codes) {
  for (size_t j = 0; j < len; ++j) {
    const float u = DrawUnit(key, index0 + static_cast<uint32_t>(j));
    // t >= 0 up to rounding, so truncation is floor; clamps fix the edges.
    const float t = x[j] * mul[j] + u + off_f;
    int q = static_cast<int>(t);
    q = q < 0 ? 0 : q;
    q = q > max_code ? max_code : q;
    codes[j] = static_cast<uint8_t>(q);
  }
}

__attribute__((target_clones("avx2", "default")))
void DequantizeSeg(const uint8_t* codes, const float* step, size_t len, int off, float* out) {
  for (size_t j = 0; j < len; ++j) {
    out[j] = static_cast<float>(static_cast<int>(codes[j]) - off) * step[j];
  }
}

}  // namespace

absl::Status FixedPointScales(absl::Span<const float> values, int64_t channels, uint16_t* scales) {
  const size_t c = static_cast<size_t>(channels);
  std::vector<uint32_t> mx(c, 0);
  for (size_t i = 0; i < values.size(); i += c) MaxAbsBitsRow(values.data() + i, c, mx.data());
  for (size_t k = 0; k < c; ++k) {
    if (mx[k] >= 0x7f800000u) {
      return absl::InvalidArgumentError(
          absl::StrCat("fixed point: non-finite value (NaN/Inf) in channel ", k));
    }
    const float m = BitsToFloat(mx[k]);
    uint16_t h = FloatToHalf(m);
    if (HalfToFloat(h) < m) ++h;  // round up: next binary16 magnitude
    if (h >= 0x7c00u) {
      return absl::InvalidArgumentError(absl::StrCat("fixed point: channel ", k, " max-abs ", m,
                                                     " exceeds the binary16 scale range"));
    }
    scales[k] = h;
  }
  return absl::OkStatus();
}

void FixedPointEncode(absl::Span<const float> values, int64_t channels, const uint16_t* scales,
                      int bits, bool stochastic, uint32_t rng_key, uint8_t* payload) {
  const size_t c = static_cast<size_t>(channels);
  const int off = 1 << (bits - 1);
  std::vector<float> mul(c);
  for (size_t k = 0; k < c; ++k) {
    const float s = HalfToFloat(scales[k]);
    mul[k] = s > 0.0f ? static_cast<float>(off) / s : 0.0f;
  }
  const size_t n = values.size();
  uint8_t codes[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t end = std::min(n, start + kChunk);
    size_t i = start;
    while (i < end) {
      const size_t ch = i % c;
      const size_t len = std::min(end - i, c - ch);
      if (stochastic) {
        QuantizeStochasticSeg(values.data() + i, mul.data() + ch, len, rng_key,
                              static_cast<uint32_t>(i), static_cast<float>(off), 2 * off - 1,
                              codes + (i - start));
      } else {
        QuantizeNearestSeg(values.data() + i, mul.data() + ch, len, static_cast<float>(-off),
                           static_cast<float>(off - 1), off, codes + (i - start));
      }
      i += len;
    }
    PackBits(codes, end - start, bits, payload + start / 8 * bits);
  }
}

void FixedPointDecode(const uint8_t* payload, size_t n, int64_t channels, const uint16_t* scales,
                      int bits, float* out) {
  const size_t c = static_cast<size_t>(channels);
  const int off = 1 << (bits - 1);
  const float inv_off = 1.0f / static_cast<float>(off);  // exact power of two
  std::vector<float> step(c);
  for (size_t k = 0; k < c; ++k) step[k] = HalfToFloat(scales[k]) * inv_off;
  uint8_t codes[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t end = std::min(n, start + kChunk);
    UnpackBits(payload + start / 8 * bits, end - start, bits, codes);
    size_t i = start;
    while (i < end) {
      const size_t ch = i % c;
      const size_t len = std::min(end - i, c - ch);
      DequantizeSeg(codes + (i - start), step.data() + ch, len, off, out + i);
      i += len;
    }
  }
}

}  // namespace aqswarm::compression
