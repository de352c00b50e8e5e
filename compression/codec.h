// Generic entry points of the compression library: encode a float32 tensor
// into an aqswarm.v1.EncodedTensor with any codec, decode one back, and a
// Compressor interface + factory so wrappers (error feedback) and exchanges
// (pipeline links, data-parallel) treat codecs uniformly.
//
// Codecs (wire layout and exact decode arithmetic in each kernel header):
//   CODEC_RAW_F32       payload = float32 LE                 (bits 32)
//   CODEC_RAW_F16       payload = binary16 LE, RNE           (bits 16)
//   CODEC_FIXED_POINT   fixed_point.h  per-channel fp16 scales (bits 1..8)
//   CODEC_QSGD          bucketed.h     per-bucket norm          (bits 2..8)
//   CODEC_MINMAX        bucketed.h     per-bucket (min, unit)   (bits 1..8)
//   CODEC_GLOBAL_QSGD   global_qsgd.h  caller's shared scales; here, Encode
//                       uses local scales (a single worker's message)
//   CODEC_TILED         tiled.h        per-tile fp16 scales, Hadamard-rotated
//                       outlier tiles (bits 1..8, bucket_size = tile)
// With `entropy`, the codes of a fixed-point, QSGD, min-max or tiled
// message travel as one zstd frame of one byte per code (ENTROPY_ZSTD) when
// that is smaller than packing them; Decode unpacks either form. Lossless:
// entropy coding never changes a decoded value.
// Tensors with fewer than `min_compress_elements` values are sent as
// CODEC_RAW_F32 whatever the codec (biases, LayerNorm: not worth it).
//
// Determinism: Decode of a given message is bit-identical on every peer and
// build (pure IEEE single operations, -ffp-contract=off, integer RNG).
// Encode's stochastic rounding draws u_i = DrawUnit(rng_key, i) for flat
// element index i, so it depends only on (values, options, rng_key).
//
// Example:
//   CodecOptions o;  o.codec = v1::CODEC_FIXED_POINT;  o.bits = 4;
//   v1::EncodedTensor msg;
//   AQSWARM_RETURN_IF_ERROR(Encode(o, values, {rows, 768}, /*rng_key=*/step, &msg));
//   std::vector<float> out(values.size());
//   AQSWARM_RETURN_IF_ERROR(Decode(msg, absl::MakeSpan(out)));  // validates first
//
// Thread-safety: the free functions are reentrant; a Compressor is not
// thread-safe unless documented otherwise.
#ifndef AQSWARM_COMPRESSION_CODEC_H_
#define AQSWARM_COMPRESSION_CODEC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compression/tiled.h"
#include "compression/wire.h"
#include "proto/tensor.pb.h"

namespace aqswarm::compression {

inline constexpr int64_t kDefaultMinCompressElements = 1024;

struct CodecOptions {
  // Which codec. Default: fixed point (the AQ-SGD activation quantizer).
  v1::Codec codec = v1::CODEC_FIXED_POINT;
  // Bits per code: 1..8 fixed point / min-max, 2..8 QSGD, 2..8 or 16
  // Global-QSGD; ignored for raw codecs. Default: 4.
  int bits = 4;
  // Values per bucket for QSGD, min-max and Global-QSGD. Default: 1024.
  int64_t bucket_size = 1024;
  // Nearest or unbiased stochastic rounding. Default: nearest.
  v1::Rounding rounding = v1::ROUNDING_NEAREST;
  // Global-QSGD level family. Default: uniform (set exponential for Adam).
  v1::LevelFamily levels = v1::LEVELS_UNIFORM;
  // QSGD bucket norm. Default: max.
  v1::NormKind norm = v1::NORM_MAX;
  // Attach an XXH3-64 of scales||payload, verified on decode. Default: off.
  bool checksum = false;
  // Tensors smaller than this many values go raw float32. Default: 1024.
  int64_t min_compress_elements = kDefaultMinCompressElements;
  // Tiled codec: which tiles are rotated (tiled.h). Default: outliers.
  TileRotation rotation = TileRotation::kOutliers;
  // Tiled codec: tiles along rows (T channels of a token; the default) or
  // down columns (T tokens of a channel).
  v1::TileOrder tile_order = v1::TILES_ALONG_ROWS;
  // Tiled codec: the grid of levels (tiled.h). Default: midrise.
  v1::TileGrid tile_grid = v1::TILE_GRID_MIDRISE;
  // zstd-code the quantized codes when that saves bytes. Default: off.
  bool entropy = false;
};

// InvalidArgument if the options are inconsistent (e.g. bits 1 for QSGD).
absl::Status ValidateCodecOptions(const CodecOptions& options);

// Encodes `values` (row-major `shape`, last dim = channels; product must equal
// values.size()). InvalidArgument on NaN/Inf or bad options/shape. `out` is
// overwritten.
absl::Status Encode(const CodecOptions& options, absl::Span<const float> values,
                    absl::Span<const int64_t> shape, uint32_t rng_key, v1::EncodedTensor* out);

// Validates `msg` against `limits` (wire.h), then decodes into `out`, whose
// size must equal num_elements. Every decoded value is finite: a raw payload
// holding NaN/Inf, or a quantized message whose scales make a value overflow,
// is a non-finite error (NonFiniteError below, DATA_LOSS naming the first bad
// index). On error `out` is left untouched, except after such an overflow of
// a quantized codec (its values are only known once decoded).
absl::Status Decode(const v1::EncodedTensor& msg, absl::Span<float> out,
                    const WireLimits& limits = WireLimits());

// A received value that is NaN or infinite: DATA_LOSS with `message`, marked
// so that IsNonFiniteError() tells it from other malformed input (receivers
// count the two apart: a non-finite value is a poisoned message, not a bug).
absl::Status NonFiniteError(absl::string_view message);
bool IsNonFiniteError(const absl::Status& status);
// NonFiniteError naming `what` and the first bad index when `values` holds a
// NaN or an infinity; OK otherwise.
absl::Status CheckReceivedFinite(absl::Span<const float> values, absl::string_view what);

// Bytes on the wire that matter for compression ratios: scales + payload.
inline uint64_t EncodedBytes(const v1::EncodedTensor& msg) {
  return msg.scales().size() + msg.payload().size();
}

// "raw_f32", "raw_f16", "fixed_point", "qsgd", "minmax", "global_qsgd", "tiled".
const char* CodecName(v1::Codec codec);
absl::StatusOr<v1::Codec> ParseCodec(std::string_view name);

// Uniform view of one codec configuration (c10d/BytePS style): the error
// feedback wrapper and data-parallel exchanges hold one of these.
class Compressor {
 public:
  virtual ~Compressor() = default;
  // Encodes `values`; same contract as Encode().
  virtual absl::Status Compress(absl::Span<const float> values, absl::Span<const int64_t> shape,
                                uint32_t rng_key, v1::EncodedTensor* out) = 0;
  // Decodes; same contract as Decode().
  virtual absl::Status Decompress(const v1::EncodedTensor& msg, absl::Span<float> out) const = 0;
  virtual const CodecOptions& options() const = 0;
};

// A Compressor running Encode/Decode with `options` (validated here).
absl::StatusOr<std::unique_ptr<Compressor>> CreateCompressor(const CodecOptions& options,
                                                             const WireLimits& limits = WireLimits());

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_CODEC_H_
