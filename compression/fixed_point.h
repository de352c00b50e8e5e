// Fixed-point per-channel quantizer: the AQ-SGD reference quantizer
// (docs/design/ALGORITHMS.md §1.1). Low-level kernels over raw buffers; most callers use
// Encode()/Decode() in compression/codec.h with CODEC_FIXED_POINT.
//
// Tensor [rows, channels] row-major (channels = last dim). Per channel c:
//   scale_c = max_r |x[r, c]| rounded UP to the next binary16 value (so
//             |x| <= scale_c always; a channel max above 65504 is an error).
//   off     = 2^(b-1)
//   mul_c   = (float)off / scale_c            (0 when scale_c == 0)
//   nearest:    q = (int)nearbyint(clamp(x * mul_c, -off, off - 1)) + off
//   stochastic: q = clamp(floor(x * mul_c + u_i), -off, off - 1) + off,
//               u_i = DrawUnit(rng_key, i), i = flat element index (uint32)
// Codes q in [0, 2^b - 1] are bit-packed (compression/bit_pack.h).
//
// Decode (the bit-exact contract; evaluated exactly like this everywhere):
//   step_c = HalfToFloat(scale_c) * 2^-(b-1)      (exact: power-of-two multiply)
//   out    = (float)((int)q - off) * step_c       (one IEEE multiply, no FMA)
// This equals (q - 2^(b-1)) / 2^(b-1) * scale_c of the reference, rounded once.
// Note the reference grid is asymmetric: the top level is (off-1)/off*scale,
// so stochastic rounding is unbiased only for x*mul_c <= off - 1.
//
// Example:
//   std::vector<uint16_t> scales(channels);
//   AQSWARM_RETURN_IF_ERROR(FixedPointScales(x, channels, scales.data()));
//   std::vector<uint8_t> payload(PackedBytes(x.size(), 4));
//   FixedPointEncode(x, channels, scales.data(), 4, /*stochastic=*/false, 0, payload.data());
//   FixedPointDecode(payload.data(), x.size(), channels, scales.data(), 4, out.data());
#ifndef AQSWARM_COMPRESSION_FIXED_POINT_H_
#define AQSWARM_COMPRESSION_FIXED_POINT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace aqswarm::compression {

// Writes `channels` binary16 scales. InvalidArgument if any value is NaN/Inf
// or a channel's max-abs exceeds the binary16 range. values.size() must be a
// multiple of channels (channels >= 1).
absl::Status FixedPointScales(absl::Span<const float> values, int64_t channels, uint16_t* scales);

// Packs PackedBytes(values.size(), bits) bytes into `payload`. bits in 1..8.
void FixedPointEncode(absl::Span<const float> values, int64_t channels, const uint16_t* scales,
                      int bits, bool stochastic, uint32_t rng_key, uint8_t* payload);

// Decodes n values; see the header comment for the exact arithmetic.
void FixedPointDecode(const uint8_t* payload, size_t n, int64_t channels, const uint16_t* scales,
                      int bits, float* out);

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_FIXED_POINT_H_
