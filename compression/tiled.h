// Tiled quantizer (CODEC_TILED): a direct codec for activations with no
// previous message (AQ-SGD's first visits, and the `tiled` link mode), after
// TAH-Quant (arXiv 2506.01352). Low-level kernels over raw buffers; most
// callers use Encode()/Decode() in compression/codec.h with CODEC_TILED.
//
// The flat values are cut into tiles of T values (T = bucket_size, a power of
// two; the last tile may be shorter); with TILES_DOWN_COLUMNS (codec.h) the
// flat values are the tensor [R, C] read column by column, so a tile is T
// tokens of one channel. Per tile:
//   rotate  = TileRotation says so, the tile is whole, and the rotated tile's
//             scale fits binary16 (kOutliers: max|x|^2 > 16 * mean(x^2),
//             i.e. max |x| above 4 RMS, where one big value would stretch the
//             grid for the other T - 1)
//   y       = rotate ? H x : x      (H: the unnormalised Walsh-Hadamard
//             transform, entries +-1, which spreads an outlier over the tile)
//   scale   = max |y| rounded UP to the next binary16 value (> 65504: error)
//   grid, midrise (2^b levels symmetric about zero, none at zero):
//     steps = 2^b - 1, h = (float)scale / (float)steps   (one IEEE division)
//     t = y * (steps / 2 / scale) + steps / 2, codes clamped to [0, 2^b - 1]
//   grid, midtread (2^b - 1 levels, one at zero; bits >= 2), off = 2^(b-1):
//     steps = off - 1, h = (float)scale / (float)steps
//     t = y * (steps / scale) + off, codes clamped to [1, 2^b - 1]
//   nearest q = floor(t + 0.5), stochastic q = floor(t + u_i) (u_i =
//   DrawUnit(rng_key, i), i the flat index).
// Wire: scales = the tiles' binary16 scales, then one bit per tile (LSB
// first) set for rotated tiles; payload = the codes, bit-packed
// (bit_pack.h).
//
// Decode (the bit-exact contract; evaluated exactly like this everywhere):
//   midrise v = (float)(2q - steps) * h, midtread v = (float)(q - off) * h
//   (one IEEE multiply; a midtread code 0, which encoders never write,
//   decodes to -off * h, just past -scale)
//   rotated tile: x = WalshHadamard(v) * (1/T)    (the butterflies below in
//   their fixed order, then an exact power-of-two multiply); else x = v.
//
// Example:
//   std::vector<uint8_t> scales(TiledScalesBytes(n, 64)), payload(PackedBytes(n, 3));
//   AQSWARM_RETURN_IF_ERROR(TiledEncode(x, 64, 3, TileRotation::kOutliers, /*midtread=*/true,
//                                       false, 0, scales.data(), payload.data()));
//   TiledDecode(scales.data(), payload.data(), n, 64, 3, /*midtread=*/true, out.data());
#ifndef AQSWARM_COMPRESSION_TILED_H_
#define AQSWARM_COMPRESSION_TILED_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace aqswarm::compression {

enum class TileRotation {
  kNone,      // never rotate
  kOutliers,  // rotate tiles whose max |x| is above 4 RMS
  kAll,       // rotate every whole tile
};

const char* TileRotationName(TileRotation rotation);

// Tile sizes the wire accepts: powers of two in 2..4096.
inline bool IsValidTileSize(uint64_t tile) {
  return tile >= 2 && tile <= 4096 && (tile & (tile - 1)) == 0;
}

inline size_t NumTiles(size_t n, size_t tile) { return (n + tile - 1) / tile; }

// Bytes of a tiled message's `scales`: 2 per tile + the rotation bitmap.
inline size_t TiledScalesBytes(size_t n, size_t tile) {
  const size_t tiles = NumTiles(n, tile);
  return 2 * tiles + (tiles + 7) / 8;
}

// Encodes `values` into TiledScalesBytes(n, tile) bytes of `scales` and
// PackedBytes(n, bits) bytes of `payload`. InvalidArgument on NaN/Inf or a
// tile whose max |x| exceeds the binary16 range, or midtread with bits 1.
// tile: IsValidTileSize; bits: 1..8.
absl::Status TiledEncode(absl::Span<const float> values, size_t tile, int bits, TileRotation rotation,
                         bool midtread, bool stochastic, uint32_t rng_key, uint8_t* scales, uint8_t* payload);

// DataLoss unless every scale is a finite non-negative binary16 and the
// rotation bitmap flags only whole tiles (its padding bits zero).
absl::Status ValidateTiledScales(const uint8_t* scales, size_t n, size_t tile);

// Decodes n values (scales validated; midtread: bits >= 2); see the header
// comment.
void TiledDecode(const uint8_t* scales, const uint8_t* payload, size_t n, size_t tile, int bits, bool midtread,
                 float* out);

// In-place unnormalised Walsh-Hadamard transform of `len` (a power of two)
// values: for h = 1, 2, 4, ... < len, each pair (a, b) at distance h becomes
// (a + b, a - b). Applying it twice multiplies by len.
void WalshHadamard(float* x, size_t len);

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_TILED_H_
