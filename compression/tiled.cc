#include "compression/tiled.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/random.h"
#include "compression/bit_pack.h"
#include "compression/max_abs.h"

namespace aqswarm::compression {
namespace {

// Values per pack/unpack chunk: a multiple of every tile size (<= 4096) and
// of 8, so chunks start on tile and byte boundaries.
constexpr size_t kChunk = 4096;
// max^2 > kOutlierRatio2 * mean(x^2): a tile with an outlier (max above 4 RMS).
constexpr float kOutlierRatio2 = 16.0f;

// Sum of x^2 in 8 interleaved partial sums (vectorises; len is a tile).
__attribute__((target_clones("avx2", "default")))
float SumSquares(const float* x, size_t len) {
  float acc[8] = {};
  size_t j = 0;
  for (; j + 8 <= len; j += 8) {
    for (size_t k = 0; k < 8; ++k) acc[k] += x[j + k] * x[j + k];
  }
  float s = 0.0f;
  for (; j < len; ++j) s += x[j] * x[j];
  for (float a : acc) s += a;
  return s;
}

// t = y * mul + offset (+ 0.5 or + u_i), clamped to [lo, hi], floored.
__attribute__((target_clones("avx2", "default")))
void QuantizeNearest(const float* y, size_t len, float mul, float offset, int lo, int hi, uint8_t* codes) {
  const float bottom = static_cast<float>(lo), top = static_cast<float>(hi);
  for (size_t j = 0; j < len; ++j) {
    float t = y[j] * mul + offset + 0.5f;
    t = t < bottom ? bottom : t;
    t = t > top ? top : t;
    codes[j] = static_cast<uint8_t>(static_cast<int>(t));  // t >= 0: truncation is floor
  }
}

void QuantizeStochastic(const float* y, size_t len, float mul, float offset, int lo, int hi, uint32_t key,
                        uint32_t index0, uint8_t* codes) {
  const float bottom = static_cast<float>(lo), top = static_cast<float>(hi);
  for (size_t j = 0; j < len; ++j) {
    float t = y[j] * mul + offset + DrawUnit(key, index0 + static_cast<uint32_t>(j));
    t = t < bottom ? bottom : t;
    t = t > top ? top : t;
    codes[j] = static_cast<uint8_t>(static_cast<int>(t));
  }
}

__attribute__((target_clones("avx2", "default")))
void Dequantize(const uint8_t* codes, size_t len, int mult, int center, float h, float* out) {
  for (size_t j = 0; j < len; ++j) {
    out[j] = static_cast<float>(mult * static_cast<int>(codes[j]) - center) * h;
  }
}

__attribute__((target_clones("avx2", "default")))
void Scale(float* x, size_t len, float f) {
  for (size_t j = 0; j < len; ++j) x[j] *= f;
}

// binary16 bits of m rounded up (m finite, >= 0); 0x7c00 when above 65504.
uint16_t HalfAtLeast(float m) {
  uint16_t h = FloatToHalf(m);
  if (HalfToFloat(h) < m) ++h;
  return h;
}

bool BitmapGet(const uint8_t* bitmap, size_t i) { return (bitmap[i / 8] >> (i % 8)) & 1u; }

// A grid at `bits`: scale s maps to code t = y * (steps / s) + offset; a code
// q decodes to (mult * q - center) * (s / steps) (tiled.h).
struct Grid {
  int steps, mult, center, lo, hi;
  float offset;
};

Grid MakeGrid(int bits, bool midtread) {
  const int top = (1 << bits) - 1;
  if (midtread) {
    const int off = 1 << (bits - 1);
    return {off - 1, 1, off, 1, top, static_cast<float>(off)};
  }
  return {top, 2, top, 0, top, 0.5f * static_cast<float>(top)};
}

}  // namespace

const char* TileRotationName(TileRotation rotation) {
  switch (rotation) {
    case TileRotation::kNone: return "none";
    case TileRotation::kOutliers: return "outliers";
    case TileRotation::kAll: return "all";
  }
  return "?";
}

__attribute__((target_clones("avx2", "default")))
void WalshHadamard(float* x, size_t len) {
  // Stages h = 1, 2, 4 touch each block of 8 values alone: run them block by
  // block, unrolled; the wider stages' inner loops are contiguous and
  // vectorise. Every value sees the same additions in the same order as the
  // plain stage-by-stage loop, so the result is the same bits.
  // In a block, stage h's lane j is v[j] + v[j + h] (bit h of j clear) or
  // v[j - h] + (-v[j]) = v[j - h] - v[j] (set): two shuffles, an exact sign
  // flip and one add per stage.
  typedef float V8 __attribute__((vector_size(32)));
  size_t h = 1;
  if (len >= 8) {
    const V8 s1 = {1, -1, 1, -1, 1, -1, 1, -1}, s2 = {1, 1, -1, -1, 1, 1, -1, -1}, s4 = {1, 1, 1, 1, -1, -1, -1, -1};
    for (size_t i = 0; i < len; i += 8) {
      V8 v;
      std::memcpy(&v, x + i, sizeof(v));
      v = __builtin_shufflevector(v, v, 0, 0, 2, 2, 4, 4, 6, 6) +
          __builtin_shufflevector(v, v, 1, 1, 3, 3, 5, 5, 7, 7) * s1;
      v = __builtin_shufflevector(v, v, 0, 1, 0, 1, 4, 5, 4, 5) +
          __builtin_shufflevector(v, v, 2, 3, 2, 3, 6, 7, 6, 7) * s2;
      v = __builtin_shufflevector(v, v, 0, 1, 2, 3, 0, 1, 2, 3) +
          __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7) * s4;
      std::memcpy(x + i, &v, sizeof(v));
    }
    h = 8;
  }
  for (; h < len; h *= 2) {
    for (size_t i = 0; i < len; i += 2 * h) {
      float* lo = x + i;
      float* hi = x + i + h;
      for (size_t j = 0; j < h; ++j) {
        const float a = lo[j], b = hi[j];
        lo[j] = a + b;
        hi[j] = a - b;
      }
    }
  }
}

absl::Status TiledEncode(absl::Span<const float> values, size_t tile, int bits, TileRotation rotation,
                         bool midtread, bool stochastic, uint32_t rng_key, uint8_t* scales, uint8_t* payload) {
  if (midtread && bits < 2) return absl::InvalidArgumentError("tiled: the midtread grid needs bits >= 2");
  const size_t n = values.size();
  const size_t tiles = NumTiles(n, tile);
  uint8_t* bitmap = scales + 2 * tiles;
  std::memset(bitmap, 0, (tiles + 7) / 8);
  const Grid g = MakeGrid(bits, midtread);
  const float steps = static_cast<float>(g.steps);
  std::vector<float> rotated(tile);
  uint8_t codes[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t end = std::min(n, start + kChunk);
    for (size_t i = start; i < end; i += tile) {
      const size_t len = std::min(tile, end - i);
      const size_t k = i / tile;
      const float* x = values.data() + i;
      const uint32_t mx_bits = internal::MaxAbsBits(x, len);
      if (mx_bits >= 0x7f800000u) {
        return absl::InvalidArgumentError(absl::StrCat("tiled: non-finite value (NaN/Inf) in tile ", k));
      }
      const float mx = BitsToFloat(mx_bits);
      const float* y = x;
      float ymax = mx;
      bool rotate = len == tile && mx > 0.0f &&
                    (rotation == TileRotation::kAll ||
                     (rotation == TileRotation::kOutliers &&
                      mx * mx * static_cast<float>(len) > kOutlierRatio2 * SumSquares(x, len)));
      if (rotate) {
        std::copy(x, x + len, rotated.begin());
        WalshHadamard(rotated.data(), len);
        const float rmax = BitsToFloat(internal::MaxAbsBits(rotated.data(), len));
        if (HalfAtLeast(rmax) < 0x7c00u) {
          y = rotated.data();
          ymax = rmax;
        } else {
          rotate = false;  // the rotated scale would not fit binary16
        }
      }
      const uint16_t h = HalfAtLeast(ymax);
      if (h >= 0x7c00u) {
        return absl::InvalidArgumentError(
            absl::StrCat("tiled: tile ", k, " max-abs ", mx, " exceeds the binary16 scale range"));
      }
      std::memcpy(scales + 2 * k, &h, 2);
      if (rotate) bitmap[k / 8] |= static_cast<uint8_t>(1u << (k % 8));
      const float s = HalfToFloat(h);
      const float mul = s > 0.0f ? (midtread ? steps / s : g.offset / s) : 0.0f;
      if (stochastic) {
        QuantizeStochastic(y, len, mul, g.offset, g.lo, g.hi, rng_key, static_cast<uint32_t>(i),
                           codes + (i - start));
      } else {
        QuantizeNearest(y, len, mul, g.offset, g.lo, g.hi, codes + (i - start));
      }
    }
    PackBits(codes, end - start, bits, payload + start / 8 * bits);
  }
  return absl::OkStatus();
}

absl::Status ValidateTiledScales(const uint8_t* scales, size_t n, size_t tile) {
  const size_t tiles = NumTiles(n, tile);
  for (size_t k = 0; k < tiles; ++k) {
    uint16_t h;
    std::memcpy(&h, scales + 2 * k, 2);
    if ((h & 0x7c00u) == 0x7c00u || (h & 0x8000u)) {
      return absl::DataLossError(absl::StrCat("tiled: scale of tile ", k, " is negative or non-finite"));
    }
  }
  const uint8_t* bitmap = scales + 2 * tiles;
  const size_t whole = n / tile;
  for (size_t k = whole; k < (tiles + 7) / 8 * 8; ++k) {
    if (BitmapGet(bitmap, k)) {
      return absl::DataLossError(absl::StrCat("tiled: rotation bit set for tile ", k,
                                              ", which is not a whole tile"));
    }
  }
  return absl::OkStatus();
}

void TiledDecode(const uint8_t* scales, const uint8_t* payload, size_t n, size_t tile, int bits, bool midtread,
                 float* out) {
  const size_t tiles = NumTiles(n, tile);
  const uint8_t* bitmap = scales + 2 * tiles;
  const Grid g = MakeGrid(bits, midtread);
  const float steps = static_cast<float>(g.steps);
  const float inv_tile = 1.0f / static_cast<float>(tile);  // exact: a power of two
  uint8_t codes[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t end = std::min(n, start + kChunk);
    UnpackBits(payload + start / 8 * bits, end - start, bits, codes);
    for (size_t i = start; i < end; i += tile) {
      const size_t len = std::min(tile, end - i);
      const size_t k = i / tile;
      uint16_t hbits;
      std::memcpy(&hbits, scales + 2 * k, 2);
      const float h = HalfToFloat(hbits) / steps;
      Dequantize(codes + (i - start), len, g.mult, g.center, h, out + i);
      if (BitmapGet(bitmap, k)) {
        WalshHadamard(out + i, len);
        Scale(out + i, len, inv_tile);
      }
    }
  }
}

}  // namespace aqswarm::compression
