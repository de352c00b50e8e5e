#include "compression/codec.h"
#include "compression/max_abs.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/row_format.h"
#include "common/status_macros.h"
#include "compression/bit_pack.h"
#include "compression/bucketed.h"
#include "compression/fixed_point.h"
#include "compression/global_qsgd.h"
#include "compression/tiled.h"
#include "zstd.h"

namespace aqswarm::compression {
namespace {

using internal::MaxAbsBits;

uint8_t* MutableBytes(std::string* s, size_t n) {
  s->resize(n);
  return reinterpret_cast<uint8_t*>(s->data());
}

absl::Status CheckShape(absl::Span<const float> values, absl::Span<const int64_t> shape) {
  uint64_t product = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative shape dim ", d));
    if (d != 0 && product > UINT64_MAX / static_cast<uint64_t>(d)) {
      return absl::InvalidArgumentError("shape product overflows");
    }
    product *= static_cast<uint64_t>(d);
  }
  if (product != values.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape product ", product, " != number of values ", values.size()));
  }
  return absl::OkStatus();
}

// Finite check via MaxAbsBits (max_abs.h); the error names the first bad index.

absl::Status CheckFinite(absl::Span<const float> values) {
  if (MaxAbsBits(values.data(), values.size()) < 0x7f800000u) return absl::OkStatus();
  return ValidateFinite(values);
}

constexpr absl::string_view kNonFinitePayload = "type.aqswarm.dev/aqswarm.NonFiniteValue";

// Index of the first binary16 NaN/Inf of a raw_f16 payload of n halves, or n.
size_t FirstNonFiniteHalf(const uint8_t* payload, size_t n) {
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, payload + 2 * i, 2);
    any |= static_cast<uint32_t>((h & 0x7c00u) == 0x7c00u);
  }
  if (!any) return n;
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, payload + 2 * i, 2);
    if ((h & 0x7c00u) == 0x7c00u) return i;
  }
  return n;
}

// Index of the first float32 NaN/Inf of a raw_f32 payload of n floats, or n.
size_t FirstNonFiniteFloat(const uint8_t* payload, size_t n) {
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, payload + 4 * i, 4);
    any |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  if (!any) return n;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, payload + 4 * i, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return i;
  }
  return n;
}

// Channels of a tensor: its last dim (a scalar has one). Callers have checked
// that the shape's product is the number of values, so a tensor with values
// has no zero dim.
template <typename Shape>
size_t Channels(const Shape& shape) {
  return shape.empty() ? 1 : static_cast<size_t>(shape[shape.size() - 1]);
}

// out[c * rows + r] = in[r * cols + c]: [rows, cols] to [cols, rows].
void Transpose(const float* in, size_t rows, size_t cols, float* out) {
  constexpr size_t kBlock = 32;
  for (size_t r0 = 0; r0 < rows; r0 += kBlock) {
    for (size_t c0 = 0; c0 < cols; c0 += kBlock) {
      for (size_t r = r0; r < std::min(rows, r0 + kBlock); ++r) {
        for (size_t c = c0; c < std::min(cols, c0 + kBlock); ++c) out[c * rows + r] = in[r * cols + c];
      }
    }
  }
}

// A zstd context for the codes (one per thread). Codes of 2-4 bits, a byte
// each, repeat short runs everywhere, which zstd's default match finders turn
// into matches that cost more than the literals they replace. A tiny hash
// table (hashLog 6, chainLog 6, one search, matches of 7 bytes or more)
// leaves almost every code to the Huffman-coded literals: near the codes'
// entropy, and faster than level 1 (docs/BENCHMARKS.md, "Entropy coding of the codes").
// Frames are standard: any zstd decoder reads them.
ZSTD_CCtx* CodesContext() {
  struct Free {
    void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
  };
  thread_local std::unique_ptr<ZSTD_CCtx, Free> ctx = [] {
    std::unique_ptr<ZSTD_CCtx, Free> c(ZSTD_createCCtx());
    if (c != nullptr) {
      for (const auto& [param, value] : {std::pair{ZSTD_c_strategy, static_cast<int>(ZSTD_fast)},
                                         std::pair{ZSTD_c_hashLog, 6}, std::pair{ZSTD_c_chainLog, 6},
                                         std::pair{ZSTD_c_searchLog, 1}, std::pair{ZSTD_c_minMatch, 7},
                                         std::pair{ZSTD_c_targetLength, 0}}) {
        ZSTD_CCtx_setParameter(c.get(), param, value);
      }
    }
    return c;
  }();
  return ctx.get();
}

// ENTROPY_ZSTD: replaces the packed payload of `msg` by a zstd frame of its
// codes, one byte each, when that frame is smaller.
absl::Status EntropyCode(v1::EncodedTensor* msg) {
  const size_t n = msg->num_elements();
  const int bits = static_cast<int>(msg->bits());
  if (n == 0) return absl::OkStatus();
  std::vector<uint8_t> codes(n);
  UnpackBits(reinterpret_cast<const uint8_t*>(msg->payload().data()), n, bits, codes.data());
  ZSTD_CCtx* ctx = CodesContext();
  if (ctx == nullptr) return absl::ResourceExhaustedError("zstd: cannot create a compression context");
  std::string frame(ZSTD_compressBound(n), '\0');
  const size_t size = ZSTD_compress2(ctx, frame.data(), frame.size(), codes.data(), n);
  if (ZSTD_isError(size)) {
    return absl::InternalError(absl::StrCat("zstd: ", ZSTD_getErrorName(size)));
  }
  if (size >= msg->payload().size()) return absl::OkStatus();
  frame.resize(size);
  *msg->mutable_payload() = std::move(frame);
  msg->set_entropy(v1::ENTROPY_ZSTD);
  return absl::OkStatus();
}

// The packed codes of an ENTROPY_ZSTD message (validated: one frame whose
// content is num_elements bytes), into `packed`.
absl::Status EntropyDecode(const v1::EncodedTensor& msg, std::vector<uint8_t>* packed) {
  const size_t n = msg.num_elements();
  const int bits = static_cast<int>(msg.bits());
  std::vector<uint8_t> codes(n);
  const size_t got = ZSTD_decompress(codes.data(), n, msg.payload().data(), msg.payload().size());
  if (ZSTD_isError(got) || got != n) {
    return absl::DataLossError(absl::StrCat("EncodedTensor: zstd payload does not decode to ", n, " codes",
                                            ZSTD_isError(got) ? absl::StrCat(" (", ZSTD_getErrorName(got), ")")
                                                              : ""));
  }
  uint8_t high = 0;
  for (uint8_t c : codes) high |= c;
  if (bits < 8 && (high >> bits) != 0) {
    return absl::DataLossError(absl::StrCat("EncodedTensor: a zstd-coded code exceeds ", bits, " bits"));
  }
  packed->resize(PackedBytes(n, bits));
  PackBits(codes.data(), n, bits, packed->data());
  return absl::OkStatus();
}

class CodecCompressor final : public Compressor {
 public:
  CodecCompressor(const CodecOptions& options, const WireLimits& limits)
      : options_(options), limits_(limits) {}
  absl::Status Compress(absl::Span<const float> values, absl::Span<const int64_t> shape,
                        uint32_t rng_key, v1::EncodedTensor* out) override {
    return Encode(options_, values, shape, rng_key, out);
  }
  absl::Status Decompress(const v1::EncodedTensor& msg, absl::Span<float> out) const override {
    return Decode(msg, out, limits_);
  }
  const CodecOptions& options() const override { return options_; }

 private:
  const CodecOptions options_;
  const WireLimits limits_;
};

}  // namespace

const char* CodecName(v1::Codec codec) {
  switch (codec) {
    case v1::CODEC_RAW_F32: return "raw_f32";
    case v1::CODEC_RAW_F16: return "raw_f16";
    case v1::CODEC_FIXED_POINT: return "fixed_point";
    case v1::CODEC_QSGD: return "qsgd";
    case v1::CODEC_MINMAX: return "minmax";
    case v1::CODEC_GLOBAL_QSGD: return "global_qsgd";
    case v1::CODEC_TILED: return "tiled";
    default: return "unknown";
  }
}

absl::StatusOr<v1::Codec> ParseCodec(std::string_view name) {
  for (v1::Codec c : {v1::CODEC_RAW_F32, v1::CODEC_RAW_F16, v1::CODEC_FIXED_POINT, v1::CODEC_QSGD,
                      v1::CODEC_MINMAX, v1::CODEC_GLOBAL_QSGD, v1::CODEC_TILED}) {
    if (name == CodecName(c)) return c;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown codec '", std::string(name),
                                                 "' (want raw_f32, raw_f16, fixed_point, qsgd, "
                                                 "minmax, global_qsgd or tiled)"));
}

absl::Status ValidateCodecOptions(const CodecOptions& o) {
  const int b = o.bits;
  switch (o.codec) {
    case v1::CODEC_RAW_F32:
    case v1::CODEC_RAW_F16:
      break;
    case v1::CODEC_FIXED_POINT:
    case v1::CODEC_MINMAX:
      if (b < 1 || b > 8) return absl::InvalidArgumentError(absl::StrCat("bits ", b, " not in 1..8"));
      break;
    case v1::CODEC_TILED:
      if (b < 1 || b > 8) return absl::InvalidArgumentError(absl::StrCat("tiled bits ", b, " not in 1..8"));
      if (b < 2 && o.tile_grid == v1::TILE_GRID_MIDTREAD) {
        return absl::InvalidArgumentError("tiled: the midtread grid needs bits >= 2");
      }
      if (!IsValidTileSize(static_cast<uint64_t>(o.bucket_size))) {
        return absl::InvalidArgumentError(
            absl::StrCat("tiled: tile size (bucket_size) ", o.bucket_size, " is not a power of two in 2..4096"));
      }
      break;
    case v1::CODEC_QSGD:
      if (b < 2 || b > 8) return absl::InvalidArgumentError(absl::StrCat("qsgd bits ", b, " not in 2..8"));
      break;
    case v1::CODEC_GLOBAL_QSGD:
      if (!((b >= 2 && b <= 8) || b == 16)) {
        return absl::InvalidArgumentError(absl::StrCat("global_qsgd bits ", b, " not in 2..8 or 16"));
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown codec ", static_cast<int>(o.codec)));
  }
  if (o.bucket_size < 1 || o.bucket_size > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(absl::StrCat("bucket_size ", o.bucket_size, " not in 1..2^24"));
  }
  if (!v1::Rounding_IsValid(o.rounding) || !v1::LevelFamily_IsValid(o.levels) ||
      !v1::NormKind_IsValid(o.norm)) {
    return absl::InvalidArgumentError("unknown rounding, levels or norm");
  }
  if (o.min_compress_elements < 0) return absl::InvalidArgumentError("min_compress_elements < 0");
  return absl::OkStatus();
}

absl::Status Encode(const CodecOptions& o, absl::Span<const float> values,
                    absl::Span<const int64_t> shape, uint32_t rng_key, v1::EncodedTensor* out) {
  AQSWARM_RETURN_IF_ERROR(ValidateCodecOptions(o));
  AQSWARM_RETURN_IF_ERROR(CheckShape(values, shape));
  const size_t n = values.size();
  const bool stochastic = o.rounding == v1::ROUNDING_STOCHASTIC;
  v1::Codec codec = o.codec;
  if (static_cast<int64_t>(n) < o.min_compress_elements) codec = v1::CODEC_RAW_F32;

  if (codec == v1::CODEC_GLOBAL_QSGD) {
    // A single worker's message against its own (local) scales.
    GlobalQsgdOptions g;
    g.bits = o.bits;
    g.levels = o.levels;
    g.bucket_size = static_cast<size_t>(o.bucket_size);
    g.stochastic = stochastic;
    std::vector<float> scales(NumBuckets(n, g.bucket_size));
    AQSWARM_RETURN_IF_ERROR(LocalBucketMaxAbs(values, g.bucket_size, absl::MakeSpan(scales)));
    AQSWARM_RETURN_IF_ERROR(EncodeGlobalQsgd(g, values, shape, scales, rng_key, out));
    if (o.checksum) out->set_checksum(EncodedTensorChecksum(*out));
    return absl::OkStatus();
  }

  // Encode in place: Clear() keeps the string capacities, so a caller that
  // reuses `out` avoids re-faulting a fresh payload buffer every message.
  v1::EncodedTensor& msg = *out;
  msg.Clear();
  msg.set_format_version(kFormatVersion);
  msg.set_codec(codec);
  for (int64_t d : shape) msg.add_shape(d);
  msg.set_num_elements(n);
  switch (codec) {
    case v1::CODEC_RAW_F32: {
      AQSWARM_RETURN_IF_ERROR(CheckFinite(values));
      msg.set_bits(32);
      std::memcpy(MutableBytes(msg.mutable_payload(), 4 * n), values.data(), 4 * n);
      break;
    }
    case v1::CODEC_RAW_F16: {
      AQSWARM_RETURN_IF_ERROR(CheckFinite(values));
      msg.set_bits(16);
      uint8_t* p = MutableBytes(msg.mutable_payload(), 2 * n);
      std::vector<uint16_t> halves(n);
      FloatToHalf(values, halves.data());  // F16C when available; same bits
      uint32_t overflow = 0;
      for (size_t i = 0; i < n; ++i) overflow |= static_cast<uint32_t>((halves[i] & 0x7c00u) == 0x7c00u);
      if (overflow) {
        for (size_t i = 0; i < n; ++i) {
          if ((halves[i] & 0x7c00u) == 0x7c00u) {
            return absl::InvalidArgumentError(absl::StrCat("raw_f16: value ", values[i], " at index ",
                                                           i, " overflows binary16"));
          }
        }
      }
      if (n > 0) std::memcpy(p, halves.data(), 2 * n);
      break;
    }
    case v1::CODEC_FIXED_POINT: {
      const int64_t channels = shape.empty() ? 1 : shape.back();
      msg.set_bits(o.bits);
      msg.set_rounding(o.rounding);
      std::vector<uint16_t> scales(static_cast<size_t>(channels));
      if (n > 0) AQSWARM_RETURN_IF_ERROR(FixedPointScales(values, channels, scales.data()));
      std::memcpy(MutableBytes(msg.mutable_scales(), 2 * scales.size()), scales.data(),
                  2 * scales.size());
      FixedPointEncode(values, channels, scales.data(), o.bits, stochastic, rng_key,
                       MutableBytes(msg.mutable_payload(), PackedBytes(n, o.bits)));
      break;
    }
    case v1::CODEC_QSGD: {
      const size_t bs = static_cast<size_t>(o.bucket_size);
      msg.set_bits(o.bits);
      msg.set_bucket_size(bs);
      msg.set_rounding(o.rounding);
      msg.set_norm(o.norm);
      std::vector<float> norms(NumBuckets(n, bs));
      AQSWARM_RETURN_IF_ERROR(QsgdNorms(values, bs, o.norm == v1::NORM_L2 ? NormKind::kL2 : NormKind::kMax,
                                        norms.data()));
      std::memcpy(MutableBytes(msg.mutable_scales(), 4 * norms.size()), norms.data(), 4 * norms.size());
      QsgdEncode(values, bs, norms.data(), o.bits, stochastic, rng_key,
                 MutableBytes(msg.mutable_payload(), PackedBytes(n, o.bits)));
      break;
    }
    case v1::CODEC_MINMAX: {
      const size_t bs = static_cast<size_t>(o.bucket_size);
      msg.set_bits(o.bits);
      msg.set_bucket_size(bs);
      msg.set_rounding(o.rounding);
      std::vector<float> mu(2 * NumBuckets(n, bs));
      AQSWARM_RETURN_IF_ERROR(MinMaxScales(values, bs, o.bits, mu.data()));
      std::memcpy(MutableBytes(msg.mutable_scales(), 4 * mu.size()), mu.data(), 4 * mu.size());
      MinMaxEncode(values, bs, mu.data(), o.bits, stochastic, rng_key,
                   MutableBytes(msg.mutable_payload(), PackedBytes(n, o.bits)));
      break;
    }
    case v1::CODEC_TILED: {
      const size_t tile = static_cast<size_t>(o.bucket_size);
      msg.set_bits(o.bits);
      msg.set_bucket_size(tile);
      msg.set_rounding(o.rounding);
      msg.set_tile_order(o.tile_order);
      msg.set_tile_grid(o.tile_grid);
      std::vector<float> columns;
      if (o.tile_order == v1::TILES_DOWN_COLUMNS && n > 0) {
        columns.resize(n);
        Transpose(values.data(), n / Channels(shape), Channels(shape), columns.data());
      }
      AQSWARM_RETURN_IF_ERROR(TiledEncode(columns.empty() ? values : absl::MakeConstSpan(columns), tile, o.bits,
                                          o.rotation, o.tile_grid == v1::TILE_GRID_MIDTREAD, stochastic, rng_key,
                                          MutableBytes(msg.mutable_scales(), TiledScalesBytes(n, tile)),
                                          MutableBytes(msg.mutable_payload(), PackedBytes(n, o.bits))));
      break;
    }
    default:
      return absl::InternalError("unhandled codec");
  }
  if (o.entropy && codec != v1::CODEC_RAW_F32 && codec != v1::CODEC_RAW_F16) {
    AQSWARM_RETURN_IF_ERROR(EntropyCode(&msg));
  }
  if (o.checksum) msg.set_checksum(EncodedTensorChecksum(msg));
  return absl::OkStatus();
}

absl::Status NonFiniteError(absl::string_view message) {
  absl::Status s = absl::DataLossError(message);
  s.SetPayload(kNonFinitePayload, absl::Cord("1"));
  return s;
}

bool IsNonFiniteError(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kNonFinitePayload).has_value();
}

absl::Status CheckReceivedFinite(absl::Span<const float> values, absl::string_view what) {
  if (MaxAbsBits(values.data(), values.size()) < 0x7f800000u) return absl::OkStatus();
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return NonFiniteError(absl::StrCat(what, ": non-finite value ", values[i], " at index ", i, " of ",
                                         values.size(), " refused"));
    }
  }
  return absl::OkStatus();
}

absl::Status Decode(const v1::EncodedTensor& msg, absl::Span<float> out, const WireLimits& limits) {
  AQSWARM_RETURN_IF_ERROR(ValidateEncodedTensor(msg, limits));
  const size_t n = msg.num_elements();
  if (out.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("Decode: output has ", out.size(), " values, message has ", n));
  }
  const uint8_t* payload = reinterpret_cast<const uint8_t*>(msg.payload().data());
  const int bits = static_cast<int>(msg.bits());
  std::vector<uint8_t> packed;
  if (msg.entropy() == v1::ENTROPY_ZSTD && n > 0) {
    AQSWARM_RETURN_IF_ERROR(EntropyDecode(msg, &packed));
    payload = packed.data();
  }
  // Raw payloads are checked before anything is written; the quantized
  // codecs' values are finite codes times finite scales (ValidateEncodedTensor)
  // but may still overflow, so their output is checked after decoding.
  switch (msg.codec()) {
    case v1::CODEC_RAW_F32:
      if (const size_t bad = FirstNonFiniteFloat(payload, n); bad < n) {
        float f;
        std::memcpy(&f, payload + 4 * bad, 4);
        return NonFiniteError(absl::StrCat("EncodedTensor raw_f32: non-finite value ", f, " at index ", bad,
                                           " of ", n, " refused"));
      }
      if (n > 0) std::memcpy(out.data(), payload, 4 * n);
      return absl::OkStatus();
    case v1::CODEC_RAW_F16: {
      if (const size_t bad = FirstNonFiniteHalf(payload, n); bad < n) {
        uint16_t h;
        std::memcpy(&h, payload + 2 * bad, 2);
        return NonFiniteError(absl::StrCat("EncodedTensor raw_f16: non-finite value ", HalfToFloat(h),
                                           " at index ", bad, " of ", n, " refused"));
      }
      if (reinterpret_cast<uintptr_t>(payload) % alignof(uint16_t) == 0) {
        HalfToFloat(absl::MakeConstSpan(reinterpret_cast<const uint16_t*>(payload), n), out.data());
        break;
      }
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, payload + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
      break;
    }
    case v1::CODEC_FIXED_POINT: {
      const int64_t channels = msg.shape_size() == 0 ? 1 : msg.shape(msg.shape_size() - 1);
      if (n == 0) break;
      std::vector<uint16_t> scales(static_cast<size_t>(channels));
      std::memcpy(scales.data(), msg.scales().data(), 2 * scales.size());
      FixedPointDecode(payload, n, channels, scales.data(), bits, out.data());
      break;
    }
    case v1::CODEC_QSGD: {
      std::vector<float> norms(msg.scales().size() / 4);
      if (!msg.scales().empty()) std::memcpy(norms.data(), msg.scales().data(), msg.scales().size());
      QsgdDecode(payload, n, msg.bucket_size(), norms.data(), bits, out.data());
      break;
    }
    case v1::CODEC_MINMAX: {
      std::vector<float> mu(msg.scales().size() / 4);
      if (!msg.scales().empty()) std::memcpy(mu.data(), msg.scales().data(), msg.scales().size());
      MinMaxDecode(payload, n, msg.bucket_size(), mu.data(), bits, out.data());
      break;
    }
    case v1::CODEC_TILED: {
      const auto* scales = reinterpret_cast<const uint8_t*>(msg.scales().data());
      const bool midtread = msg.tile_grid() == v1::TILE_GRID_MIDTREAD;
      if (msg.tile_order() == v1::TILES_DOWN_COLUMNS && n > 0) {
        std::vector<float> columns(n);
        TiledDecode(scales, payload, n, msg.bucket_size(), bits, midtread, columns.data());
        const size_t c = Channels(msg.shape());
        Transpose(columns.data(), c, n / c, out.data());
      } else {
        TiledDecode(scales, payload, n, msg.bucket_size(), bits, midtread, out.data());
      }
      break;
    }
    case v1::CODEC_GLOBAL_QSGD:
      DecodeGlobalQsgd(msg, out);
      break;
    default:
      return absl::InternalError("validated codec not handled");
  }
  if (msg.codec() == v1::CODEC_RAW_F16) return absl::OkStatus();  // checked above
  return CheckReceivedFinite(out, absl::StrCat("EncodedTensor ", CodecName(msg.codec()), " (decoded)"));
}

absl::StatusOr<std::unique_ptr<Compressor>> CreateCompressor(const CodecOptions& options,
                                                             const WireLimits& limits) {
  AQSWARM_RETURN_IF_ERROR(ValidateCodecOptions(options));
  return std::unique_ptr<Compressor>(new CodecCompressor(options, limits));
}

}  // namespace aqswarm::compression
