#include "compression/global_qsgd.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "compression/bit_pack.h"
#include "compression/bucketed.h"
#include "compression/wire.h"

namespace aqswarm::compression {
namespace {

constexpr size_t kChunk = 4096;

// Writes n codes of `bits` (2..8 packed, or 16 as LE uint16).
void PackCodes(const uint32_t* codes, size_t n, int bits, std::string* out) {
  if (bits == 16) {
    out->resize(2 * n);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t v = static_cast<uint16_t>(codes[i]);
      std::memcpy(out->data() + 2 * i, &v, 2);
    }
    return;
  }
  out->resize(PackedBytes(n, bits));
  uint8_t* p = reinterpret_cast<uint8_t*>(out->data());
  uint8_t tmp[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t len = std::min(kChunk, n - start);
    for (size_t j = 0; j < len; ++j) tmp[j] = static_cast<uint8_t>(codes[start + j]);
    PackBits(tmp, len, bits, p + start / 8 * bits);
  }
}

void UnpackCodes(const std::string& in, size_t n, int bits, uint32_t* codes) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(in.data());
  if (bits == 16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      codes[i] = v;
    }
    return;
  }
  uint8_t tmp[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t len = std::min(kChunk, n - start);
    UnpackBits(p + start / 8 * bits, len, bits, tmp);
    for (size_t j = 0; j < len; ++j) codes[start + j] = tmp[j];
  }
}

inline int32_t SignExtend(uint32_t code, int bits) {
  const uint32_t m = 1u << (bits - 1);
  return static_cast<int32_t>((code ^ m) - m) ;
}

// Uniform level for y = |x| * mul: min(floor(y + u), s).
inline uint32_t UniformLevel(float y, float u, int s) {
  float t = y + u;
  const float sf = static_cast<float>(s);
  t = t > sf ? sf : t;
  return static_cast<uint32_t>(static_cast<int>(t));
}

// Exponential level index i (value 2^-i, i in 0..s-1) or -1 for zero, for
// y = |x| / N in [0, 1]; unbiased between neighbouring levels when
// u ~ U[0,1), round-to-nearer-in-value when u = 0.5.
inline int ExponentialLevel(float y, float u, int s) {
  if (y >= 1.0f) return 0;
  const float lmin = std::ldexp(1.0f, -(s - 1));
  if (y < lmin) return u < y * std::ldexp(1.0f, s - 1) ? s - 1 : -1;
  // y in [2^-j, 2^-(j-1)), normal since y >= lmin >= 2^-65534 is not; s <= 65535
  // would allow subnormal lmin, but then y < lmin was handled above.
  const uint32_t bits = FloatToBits(y);
  const int j = 127 - static_cast<int>(bits >> 23);
  const float f = static_cast<float>(bits & 0x7fffffu) * (1.0f / 8388608.0f);  // y*2^j - 1
  return u < f ? j - 1 : j;
}

absl::Status ResolveLevels(const GlobalQsgdOptions& o, int* s, int* t) {
  const int a = o.bits;
  if (!((a >= 2 && a <= 8) || a == 16)) {
    return absl::InvalidArgumentError(absl::StrCat("global_qsgd bits ", a, " not in 2..8 or 16"));
  }
  if (o.num_workers < 1 || o.num_workers > (1 << 30)) {
    return absl::InvalidArgumentError("global_qsgd num_workers not in 1..2^30");
  }
  if (o.bucket_size < 1 || o.bucket_size > (size_t{1} << 24)) {
    return absl::InvalidArgumentError("global_qsgd bucket_size not in 1..2^24");
  }
  const int lg = CeilLog2(static_cast<uint64_t>(o.num_workers));
  if (o.levels == v1::LEVELS_UNIFORM) {
    *t = 0;
    *s = o.num_levels > 0 ? o.num_levels : (1 << std::max(0, a - 1 - lg)) - 1;
    if (*s < 1 || RequiredAccumulatorBits(*s, o.num_workers) > a) {
      return absl::InvalidArgumentError(
          absl::StrCat("global_qsgd: ", a, "-bit codes cannot hold sums of ", o.num_workers,
                       " workers with s=", *s, " (rule 1 + log2(s+1) + log2(n) <= bits)"));
    }
  } else if (o.levels == v1::LEVELS_EXPONENTIAL) {
    *t = 1 + lg;
    const int max_e = (1 << (a - 1)) - 1;
    // s <= 126 keeps every non-zero level a normal float (2^-(s-1) >= 2^-125).
    *s = o.num_levels > 0 ? o.num_levels : std::min(126, max_e + 1 - *t);
    if (*s < 1 || *s > 126 || *s - 1 + *t > max_e || *t > 31) {
      return absl::InvalidArgumentError(
          absl::StrCat("global_qsgd: exponents up to s-1+t = ", *s - 1 + *t, " for ", o.num_workers,
                       " workers do not fit ", a - 1, " bits"));
    }
  } else {
    return absl::InvalidArgumentError("unknown level family");
  }
  return absl::OkStatus();
}

}  // namespace

int MinGlobalQsgdBits(v1::LevelFamily levels, int num_workers) {
  for (int bits = 2; bits <= 8; ++bits) {
    GlobalQsgdOptions o;
    o.bits = bits;
    o.levels = levels;
    o.num_workers = num_workers;
    int s = 0, t = 0;
    if (ResolveLevels(o, &s, &t).ok()) return bits;
  }
  return 0;
}

int CeilLog2(uint64_t n) {
  int r = 0;
  while (r < 64 && (uint64_t{1} << r) < n) ++r;
  return r;
}

int RequiredAccumulatorBits(uint64_t s, uint64_t n) { return 1 + CeilLog2(s + 1) + CeilLog2(n); }

absl::Status LocalBucketMaxAbs(absl::Span<const float> values, size_t bucket_size,
                               absl::Span<float> out) {
  if (bucket_size < 1 || out.size() != NumBuckets(values.size(), bucket_size)) {
    return absl::InvalidArgumentError("LocalBucketMaxAbs: bad bucket_size or output size");
  }
  return QsgdNorms(values, bucket_size, NormKind::kMax, out.data());
}

absl::Status EncodeGlobalQsgd(const GlobalQsgdOptions& o, absl::Span<const float> values,
                              absl::Span<const int64_t> shape, absl::Span<const float> global_scales,
                              uint32_t rng_key, v1::EncodedTensor* out) {
  int s = 0, t = 0;
  AQSWARM_RETURN_IF_ERROR(ResolveLevels(o, &s, &t));
  uint64_t product = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d != 0 && product > UINT64_MAX / static_cast<uint64_t>(d))) {
      return absl::InvalidArgumentError("global_qsgd: bad shape");
    }
    product *= static_cast<uint64_t>(d);
  }
  const size_t n = values.size();
  if (product != n) return absl::InvalidArgumentError("global_qsgd: shape product != values");
  const size_t nb = NumBuckets(n, o.bucket_size);
  if (global_scales.size() != nb) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_qsgd: ", global_scales.size(), " scales for ", nb, " buckets"));
  }
  std::vector<float> local(nb);
  AQSWARM_RETURN_IF_ERROR(LocalBucketMaxAbs(values, o.bucket_size, absl::MakeSpan(local)));
  for (size_t k = 0; k < nb; ++k) {
    if (!(global_scales[k] >= local[k]) || !std::isfinite(global_scales[k])) {
      return absl::InvalidArgumentError(absl::StrCat("global_qsgd: bucket ", k, " has max-abs ",
                                                     local[k], " above its global scale ",
                                                     global_scales[k]));
    }
  }
  std::vector<uint32_t> codes(n);
  const int a = o.bits;
  const uint32_t mask = a == 32 ? 0xffffffffu : (1u << a) - 1;
  for (size_t k = 0; k < nb; ++k) {
    const float scale = global_scales[k];
    const size_t begin = k * o.bucket_size, end = std::min(n, begin + o.bucket_size);
    float mul = 0.0f;
    if (scale > 0.0f) {
      mul = (o.levels == v1::LEVELS_UNIFORM ? static_cast<float>(s) : 1.0f) / scale;
      if (!std::isfinite(mul)) mul = FLT_MAX;  // subnormal scale: flush
    }
    for (size_t i = begin; i < end; ++i) {
      const uint32_t xb = FloatToBits(values[i]);
      const uint32_t neg = xb >> 31;
      const float y = BitsToFloat(xb & 0x7fffffffu) * mul;
      const float u = o.stochastic ? DrawUnit(rng_key, static_cast<uint32_t>(i)) : 0.5f;
      if (o.levels == v1::LEVELS_UNIFORM) {
        const int32_t lvl = static_cast<int32_t>(UniformLevel(y, u, s));
        codes[i] = static_cast<uint32_t>(neg ? -lvl : lvl) & mask;
      } else {
        const int li = ExponentialLevel(y, u, s);
        codes[i] = li < 0 ? 0u : ((neg << (a - 1)) | static_cast<uint32_t>(li + t));
      }
    }
  }
  v1::EncodedTensor msg;
  msg.set_format_version(kFormatVersion);
  msg.set_codec(v1::CODEC_GLOBAL_QSGD);
  msg.set_bits(a);
  msg.set_bucket_size(o.bucket_size);
  msg.set_rounding(o.stochastic ? v1::ROUNDING_STOCHASTIC : v1::ROUNDING_NEAREST);
  msg.set_levels(o.levels);
  for (int64_t d : shape) msg.add_shape(d);
  msg.set_num_elements(n);
  msg.set_num_summed(1);
  msg.set_num_levels(s);
  msg.set_exponent_shift(t);
  msg.mutable_scales()->assign(reinterpret_cast<const char*>(global_scales.data()), 4 * nb);
  PackCodes(codes.data(), n, a, msg.mutable_payload());
  *out = std::move(msg);
  return absl::OkStatus();
}

absl::Status UnpackGlobalQsgdCodes(const v1::EncodedTensor& msg, absl::Span<int32_t> out) {
  AQSWARM_RETURN_IF_ERROR(ValidateEncodedTensor(msg));
  if (msg.codec() != v1::CODEC_GLOBAL_QSGD || out.size() != msg.num_elements()) {
    return absl::InvalidArgumentError("UnpackGlobalQsgdCodes: not global_qsgd or wrong size");
  }
  const size_t n = out.size();
  const int a = static_cast<int>(msg.bits());
  std::vector<uint32_t> raw(n);
  UnpackCodes(msg.payload(), n, a, raw.data());
  for (size_t i = 0; i < n; ++i) {
    if (msg.levels() == v1::LEVELS_UNIFORM) {
      out[i] = SignExtend(raw[i], a);
    } else {
      const int32_t e = static_cast<int32_t>(raw[i] & ((1u << (a - 1)) - 1));
      out[i] = (raw[i] >> (a - 1)) ? -e : e;
    }
  }
  return absl::OkStatus();
}

void DecodeGlobalQsgd(const v1::EncodedTensor& msg, absl::Span<float> out) {
  const size_t n = msg.num_elements();
  const int a = static_cast<int>(msg.bits());
  const size_t bs = msg.bucket_size();
  const uint64_t summed = msg.num_summed();
  const int t = static_cast<int>(msg.exponent_shift());
  std::vector<float> scales(msg.scales().size() / 4);
  if (!scales.empty()) std::memcpy(scales.data(), msg.scales().data(), msg.scales().size());  // never from null
  std::vector<uint32_t> raw(std::min(n, kChunk));
  const float nf = static_cast<float>(summed);
  const float sn = static_cast<float>(static_cast<uint64_t>(msg.num_levels()) * summed);
  // P[e] = 2^(t-e), computed once: ldexp is exact (or correctly rounded to a
  // subnormal / zero), so this table is identical everywhere.
  const uint32_t emask = (1u << (a - 1)) - 1;
  std::vector<float> pow2;
  if (msg.levels() == v1::LEVELS_EXPONENTIAL) {
    pow2.resize(emask + 1);
    for (uint32_t e = 0; e <= emask; ++e) pow2[e] = std::ldexp(1.0f, t - static_cast<int>(e));
  }
  // Unpack chunk by chunk straight from the payload (byte-aligned chunks).
  const uint8_t* p = reinterpret_cast<const uint8_t*>(msg.payload().data());
  uint8_t tmp[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t len = std::min(kChunk, n - start);
    if (a == 16) {
      for (size_t j = 0; j < len; ++j) {
        uint16_t v;
        std::memcpy(&v, p + 2 * (start + j), 2);
        raw[j] = v;
      }
    } else {
      UnpackBits(p + start / 8 * a, len, a, tmp);
      for (size_t j = 0; j < len; ++j) raw[j] = tmp[j];
    }
    for (size_t j = 0; j < len; ++j) {
      const size_t i = start + j;
      const float scale = scales[i / bs];
      if (msg.levels() == v1::LEVELS_UNIFORM) {
        const float unit = scale / sn;
        out[i] = static_cast<float>(SignExtend(raw[j], a)) * unit;
      } else {
        const uint32_t e = raw[j] & emask;
        const float mag = e == 0 ? 0.0f : (scale * pow2[e]) / nf;
        out[i] = (raw[j] >> (a - 1)) && e != 0 ? -mag : mag;
      }
    }
  }
}

absl::Status CombineGlobalQsgd(const v1::EncodedTensor& a, const v1::EncodedTensor& b,
                               const CombineOptions& options, v1::EncodedTensor* out) {
  AQSWARM_RETURN_IF_ERROR(ValidateEncodedTensor(a));
  AQSWARM_RETURN_IF_ERROR(ValidateEncodedTensor(b));
  if (a.codec() != v1::CODEC_GLOBAL_QSGD || b.codec() != v1::CODEC_GLOBAL_QSGD) {
    return absl::InvalidArgumentError("CombineGlobalQsgd: both messages must be global_qsgd");
  }
  if (a.levels() != b.levels() || a.num_levels() != b.num_levels() ||
      a.exponent_shift() != b.exponent_shift() || a.bucket_size() != b.bucket_size() ||
      a.num_elements() != b.num_elements() || a.shape_size() != b.shape_size() ||
      a.scales() != b.scales()) {
    return absl::InvalidArgumentError(
        "CombineGlobalQsgd: messages disagree on levels, s, t, bucket size, shape or scales");
  }
  for (int i = 0; i < a.shape_size(); ++i) {
    if (a.shape(i) != b.shape(i)) return absl::InvalidArgumentError("CombineGlobalQsgd: shapes differ");
  }
  const uint64_t summed = static_cast<uint64_t>(a.num_summed()) + b.num_summed();
  const uint64_t s = a.num_levels();
  const size_t n = a.num_elements();
  const bool uniform = a.levels() == v1::LEVELS_UNIFORM;
  int out_bits = options.out_bits;
  if (out_bits == 0) out_bits = static_cast<int>(std::max(a.bits(), b.bits()));
  if (!((out_bits >= 2 && out_bits <= 8) || out_bits == 16)) {
    return absl::InvalidArgumentError(absl::StrCat("CombineGlobalQsgd: out_bits ", out_bits));
  }
  if (uniform) {
    if (RequiredAccumulatorBits(s, summed) > out_bits) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CombineGlobalQsgd: sums of ", summed, " workers with s=", s, " need ",
          RequiredAccumulatorBits(s, summed), " bits (1 + log2(s+1) + log2(n)); refusing ",
          out_bits, "-bit codes"));
    }
  } else {
    if (a.bits() != b.bits() || out_bits != static_cast<int>(a.bits())) {
      return absl::InvalidArgumentError("CombineGlobalQsgd: exponential codes keep one fixed width");
    }
    if (summed > (uint64_t{1} << (a.exponent_shift() - 1))) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CombineGlobalQsgd: ", summed, " workers exceed 2^(t-1) for t=", a.exponent_shift()));
    }
  }
  std::vector<int32_t> ca(n), cb(n);
  AQSWARM_RETURN_IF_ERROR(UnpackGlobalQsgdCodes(a, absl::MakeSpan(ca)));
  AQSWARM_RETURN_IF_ERROR(UnpackGlobalQsgdCodes(b, absl::MakeSpan(cb)));
  std::vector<uint32_t> codes(n);
  const uint32_t mask = (1u << out_bits) - 1;
  if (uniform) {
    const int64_t bound = static_cast<int64_t>(s * summed);
    for (size_t i = 0; i < n; ++i) {
      const int64_t v = static_cast<int64_t>(ca[i]) + cb[i];
      if (v > bound || v < -bound) {
        return absl::DataLossError(absl::StrCat("CombineGlobalQsgd: code sum ", v, " at ", i,
                                                " exceeds n*s = ", bound));
      }
      codes[i] = static_cast<uint32_t>(v) & mask;
    }
  } else {
    const int max_e = static_cast<int>(s) - 1 + static_cast<int>(a.exponent_shift());
    const int m = std::min(32, max_e);
    const int sign_shift = out_bits - 1;
    for (size_t i = 0; i < n; ++i) {
      const ExpValue x{ca[i] < 0 ? -1 : 1, ca[i] < 0 ? -ca[i] : ca[i]};
      const ExpValue y{cb[i] < 0 ? -1 : 1, cb[i] < 0 ? -cb[i] : cb[i]};
      const int k = ReducerK(DrawU32(options.rng_key, static_cast<uint32_t>(i)), m);
      const ExpValue r = ReduceExponential(x, y, k);
      codes[i] = r.exponent == 0 ? 0u
                                 : ((static_cast<uint32_t>(r.sign < 0) << sign_shift) |
                                    static_cast<uint32_t>(r.exponent));
    }
  }
  v1::EncodedTensor msg = a;
  msg.clear_checksum();
  msg.set_bits(out_bits);
  msg.set_num_summed(static_cast<uint32_t>(summed));
  PackCodes(codes.data(), n, out_bits, msg.mutable_payload());
  *out = std::move(msg);
  return absl::OkStatus();
}

}  // namespace aqswarm::compression
