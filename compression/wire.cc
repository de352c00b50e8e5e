#include "compression/wire.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/status_macros.h"
#include "compression/bit_pack.h"
#include "compression/bucketed.h"
#include "compression/global_qsgd.h"
#include "common/half.h"
#include "compression/tiled.h"
#include "zstd.h"

namespace aqswarm::compression {
namespace {

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("EncodedTensor: ", what));
}

bool Bucketed(v1::Codec c) {
  return c == v1::CODEC_QSGD || c == v1::CODEC_MINMAX || c == v1::CODEC_GLOBAL_QSGD;
}

}  // namespace

absl::StatusOr<ExpectedSizes> ExpectedEncodedSizes(const v1::EncodedTensor& msg,
                                                   const WireLimits& limits) {
  if (msg.format_version() != kFormatVersion) {
    return Bad(absl::StrCat("unsupported format_version ", msg.format_version()));
  }
  const v1::Codec codec = msg.codec();
  if (codec == v1::CODEC_UNSPECIFIED || !v1::Codec_IsValid(codec)) {
    return Bad(absl::StrCat("unknown codec ", static_cast<int>(codec)));
  }
  if (!v1::Rounding_IsValid(msg.rounding()) || !v1::LevelFamily_IsValid(msg.levels()) ||
      !v1::NormKind_IsValid(msg.norm()) || !v1::Entropy_IsValid(msg.entropy()) ||
      !v1::TileOrder_IsValid(msg.tile_order()) || !v1::TileGrid_IsValid(msg.tile_grid())) {
    return Bad("unknown rounding, levels, norm, entropy, tile order or tile grid enum value");
  }
  if ((msg.tile_order() != v1::TILES_ALONG_ROWS || msg.tile_grid() != v1::TILE_GRID_MIDRISE) &&
      codec != v1::CODEC_TILED) {
    return Bad("tile_order and tile_grid are for the tiled codec only");
  }
  if (msg.entropy() != v1::ENTROPY_NONE && codec != v1::CODEC_FIXED_POINT && codec != v1::CODEC_QSGD &&
      codec != v1::CODEC_MINMAX && codec != v1::CODEC_TILED) {
    return Bad("entropy coding is for fixed_point, qsgd, minmax and tiled codes only");
  }
  const uint32_t bits = msg.bits();
  switch (codec) {
    case v1::CODEC_RAW_F32:
      if (bits != 32) return Bad(absl::StrCat("raw_f32 needs bits 32, got ", bits));
      break;
    case v1::CODEC_RAW_F16:
      if (bits != 16) return Bad(absl::StrCat("raw_f16 needs bits 16, got ", bits));
      break;
    case v1::CODEC_FIXED_POINT:
    case v1::CODEC_MINMAX:
      if (bits < 1 || bits > 8) return Bad(absl::StrCat("bits ", bits, " not in 1..8"));
      break;
    case v1::CODEC_TILED:
      if (bits < 1 || bits > 8) return Bad(absl::StrCat("tiled bits ", bits, " not in 1..8"));
      if (bits < 2 && msg.tile_grid() == v1::TILE_GRID_MIDTREAD) {
        return Bad("tiled midtread grid needs bits >= 2");
      }
      if (!IsValidTileSize(msg.bucket_size())) {
        return Bad(absl::StrCat("tiled tile size ", msg.bucket_size(), " is not a power of two in 2..4096"));
      }
      break;
    case v1::CODEC_QSGD:
      if (bits < 2 || bits > 8) return Bad(absl::StrCat("qsgd bits ", bits, " not in 2..8"));
      break;
    case v1::CODEC_GLOBAL_QSGD:
      if (!((bits >= 2 && bits <= 8) || bits == 16)) {
        return Bad(absl::StrCat("global_qsgd bits ", bits, " not in 2..8 or 16"));
      }
      break;
    default:
      return Bad("unknown codec");
  }
  if (Bucketed(codec) &&
      (msg.bucket_size() < 1 || msg.bucket_size() > limits.max_bucket_size)) {
    return Bad(absl::StrCat("bucket_size ", msg.bucket_size(), " not in 1..",
                            limits.max_bucket_size));
  }
  if (msg.shape_size() > limits.max_rank) {
    return Bad(absl::StrCat("rank ", msg.shape_size(), " exceeds ", limits.max_rank));
  }
  uint64_t product = 1;
  for (int64_t d : msg.shape()) {
    if (d < 0 || static_cast<uint64_t>(d) > limits.max_elements) {
      return Bad(absl::StrCat("shape dim ", d, " not in 0..", limits.max_elements));
    }
    // Both factors <= max_elements <= 2^32-ish is not guaranteed; check the
    // multiplication itself.
    if (d != 0 && product > limits.max_elements / static_cast<uint64_t>(d)) {
      return Bad("shape product exceeds max_elements");
    }
    product *= static_cast<uint64_t>(d);
  }
  const uint64_t n = msg.num_elements();
  if (n > limits.max_elements) {
    return Bad(absl::StrCat("num_elements ", n, " exceeds limit ", limits.max_elements));
  }
  if (product != n) {
    return Bad(absl::StrCat("shape product ", product, " != num_elements ", n));
  }
  if (codec == v1::CODEC_GLOBAL_QSGD) {
    const uint64_t s = msg.num_levels(), summed = msg.num_summed(), t = msg.exponent_shift();
    if (s < 1 || s > 65535) return Bad(absl::StrCat("global_qsgd num_levels ", s, " not in 1..65535"));
    if (summed < 1 || summed > (uint64_t{1} << 30)) {
      return Bad(absl::StrCat("global_qsgd num_summed ", summed, " not in 1..2^30"));
    }
    if (msg.levels() == v1::LEVELS_UNIFORM) {
      if (t != 0) return Bad("global_qsgd uniform levels need exponent_shift 0");
      if (RequiredAccumulatorBits(s, summed) > static_cast<int>(bits)) {
        return Bad(absl::StrCat("global_qsgd: ", summed, " sums of s=", s, " need ",
                                RequiredAccumulatorBits(s, summed), " bits, codes have ", bits));
      }
    } else {
      if (t < 1 || t > 31) return Bad(absl::StrCat("global_qsgd exponent_shift ", t, " not in 1..31"));
      if (summed > (uint64_t{1} << (t - 1))) {
        return Bad(absl::StrCat("global_qsgd: ", summed, " summed workers exceed 2^(t-1) for t=", t));
      }
      if (s - 1 + t > (uint64_t{1} << (bits - 1)) - 1) {
        return Bad(absl::StrCat("global_qsgd: exponents up to ", s - 1 + t, " do not fit ",
                                bits - 1, " bits"));
      }
    }
  } else if (msg.num_levels() != 0 || msg.exponent_shift() != 0 || msg.num_summed() > 1) {
    return Bad("num_levels/exponent_shift/num_summed are for global_qsgd only");
  }

  ExpectedSizes sz;
  switch (codec) {
    case v1::CODEC_RAW_F32: sz.payload_bytes = 4 * n; break;
    case v1::CODEC_RAW_F16: sz.payload_bytes = 2 * n; break;
    case v1::CODEC_FIXED_POINT: {
      // One binary16 scale per channel (last dim; a scalar has one channel).
      const uint64_t c = msg.shape_size() == 0 ? 1 : static_cast<uint64_t>(msg.shape(msg.shape_size() - 1));
      sz.scales_bytes = 2 * c;
      sz.payload_bytes = PackedBytes(n, bits);
      break;
    }
    case v1::CODEC_QSGD:
      sz.scales_bytes = 4 * NumBuckets(n, msg.bucket_size());
      sz.payload_bytes = PackedBytes(n, bits);
      break;
    case v1::CODEC_MINMAX:
      sz.scales_bytes = 8 * NumBuckets(n, msg.bucket_size());
      sz.payload_bytes = PackedBytes(n, bits);
      break;
    case v1::CODEC_GLOBAL_QSGD:
      sz.scales_bytes = 4 * NumBuckets(n, msg.bucket_size());
      sz.payload_bytes = bits == 16 ? 2 * n : PackedBytes(n, bits);
      break;
    case v1::CODEC_TILED:
      sz.scales_bytes = TiledScalesBytes(n, msg.bucket_size());
      sz.payload_bytes = PackedBytes(n, bits);
      break;
    default: break;
  }
  return sz;
}

uint64_t EncodedTensorChecksum(const v1::EncodedTensor& msg) {
  Checksummer c;
  c.Update(msg.scales().data(), msg.scales().size());
  c.Update(msg.payload().data(), msg.payload().size());
  return c.Digest();
}

absl::Status ValidateEncodedTensor(const v1::EncodedTensor& msg, const WireLimits& limits) {
  auto sizes = ExpectedEncodedSizes(msg, limits);
  if (!sizes.ok()) return sizes.status();
  if (msg.scales().size() != sizes->scales_bytes) {
    return absl::DataLossError(absl::StrCat("EncodedTensor: scales has ", msg.scales().size(),
                                            " bytes, codec needs ", sizes->scales_bytes));
  }
  if (msg.entropy() == v1::ENTROPY_ZSTD) {
    // One zstd frame, nothing after it, whose content is one byte per code
    // (the frame header says so; decoding checks it again).
    const char* p = msg.payload().data();
    const size_t len = msg.payload().size();
    const unsigned long long content = ZSTD_getFrameContentSize(p, len);
    if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN ||
        content != msg.num_elements() || ZSTD_findFrameCompressedSize(p, len) != len) {
      return absl::DataLossError(absl::StrCat("EncodedTensor: zstd payload of ", len,
                                              " bytes is not one frame of ", msg.num_elements(), " codes"));
    }
  } else if (msg.payload().size() != sizes->payload_bytes) {
    return absl::DataLossError(absl::StrCat("EncodedTensor: payload has ", msg.payload().size(),
                                            " bytes, codec needs ", sizes->payload_bytes));
  }
  // Scale values: a NaN/Inf (or negative magnitude) scale would decode to
  // garbage on one peer and be silently accepted; refuse it instead.
  const char* sp = msg.scales().data();
  const size_t sb = msg.scales().size();
  if (msg.codec() == v1::CODEC_TILED) {
    AQSWARM_RETURN_IF_ERROR(ValidateTiledScales(reinterpret_cast<const uint8_t*>(sp), msg.num_elements(),
                                                msg.bucket_size()));
  } else if (msg.codec() == v1::CODEC_FIXED_POINT) {
    for (size_t i = 0; i < sb; i += 2) {
      uint16_t h;
      std::memcpy(&h, sp + i, 2);
      if ((h & 0x7c00u) == 0x7c00u || (h & 0x8000u)) {
        return absl::DataLossError("EncodedTensor: fixed-point scale is negative or non-finite");
      }
    }
  } else {
    const bool magnitude = msg.codec() != v1::CODEC_MINMAX;
    for (size_t i = 0; i < sb; i += 4) {
      float f;
      std::memcpy(&f, sp + i, 4);
      if (!std::isfinite(f) || (magnitude && f < 0.0f) ||
          (!magnitude && (i / 4) % 2 == 1 && f < 0.0f)) {
        return absl::DataLossError("EncodedTensor: scale is negative or non-finite");
      }
    }
  }
  if (msg.has_checksum() && msg.checksum() != EncodedTensorChecksum(msg)) {
    return absl::DataLossError("EncodedTensor: checksum mismatch");
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::compression
