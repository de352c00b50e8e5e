// Bucketed quantizers: QSGD (docs/design/ALGORITHMS.md §1.2) and CGX min-max
// (§1.3).
// Low-level kernels; most callers use Encode()/Decode() in codec.h.
//
// The flat tensor is cut into buckets of B consecutive values (the last one
// may be shorter); bucket k covers [k*B, min(n, (k+1)*B)). u_i below is
// DrawUnit(rng_key, i) with i the flat element index; "nearest" uses u = 0.5.
//
// QSGD, bits b in 2..8, s = 2^(b-1) - 1 levels, scales = one float32 per bucket:
//   norm_k = max |x| (NORM_MAX) or sqrt(sum x^2) (NORM_L2, accumulated in double)
//   level  = min(floor(|x| * (s / norm_k) + u_i), s)     (0 when norm_k == 0)
//   code   = level | signbit(x) << (b-1)
// Decode (bit-exact contract):
//   unit_k = norm_k / (float)s                           (one IEEE division)
//   v      = (float)level * unit_k                       (one IEEE multiply)
//   out    = sign ? -v : v                               (sign bit set on v)
// Stochastic QSGD is unbiased; per-coordinate variance is
// (hi - y)(y - lo) * unit_k^2 with y = |x|/unit_k in [lo, hi] = [lo, lo+1].
//
// Min-max (CGX), bits b in 1..8, L = 2^b - 1, scales = (min_k, unit_k) float32
// pairs per bucket, so the size is 2*ceil(n/B)*4 + ceil(n*b/8) bytes:
//   unit_k = (max_k - min_k) / (float)L
//   level  = min(floor((x - min_k) * (1 / unit_k) + u_i), L)   (0 when unit_k == 0)
// Decode (bit-exact contract):
//   out = min_k + (float)level * unit_k                  (multiply, then add; no FMA)
//
// Example:
//   std::vector<float> norms(NumBuckets(n, 512));
//   AQSWARM_RETURN_IF_ERROR(QsgdNorms(x, 512, NormKind::kMax, norms.data()));
//   QsgdEncode(x, 512, norms.data(), 4, /*stochastic=*/true, key, payload.data());
//   QsgdDecode(payload.data(), n, 512, norms.data(), 4, out.data());
#ifndef AQSWARM_COMPRESSION_BUCKETED_H_
#define AQSWARM_COMPRESSION_BUCKETED_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace aqswarm::compression {

inline size_t NumBuckets(size_t n, size_t bucket_size) { return (n + bucket_size - 1) / bucket_size; }

enum class NormKind { kMax, kL2 };

// One norm per bucket. InvalidArgument on NaN/Inf input or a norm that
// overflows float32.
absl::Status QsgdNorms(absl::Span<const float> values, size_t bucket_size, NormKind norm,
                       float* norms);
void QsgdEncode(absl::Span<const float> values, size_t bucket_size, const float* norms, int bits,
                bool stochastic, uint32_t rng_key, uint8_t* payload);
void QsgdDecode(const uint8_t* payload, size_t n, size_t bucket_size, const float* norms, int bits,
                float* out);

// Writes (min, unit) pairs: 2 floats per bucket. InvalidArgument on NaN/Inf
// input or when max - min overflows float32.
absl::Status MinMaxScales(absl::Span<const float> values, size_t bucket_size, int bits,
                          float* min_unit);
void MinMaxEncode(absl::Span<const float> values, size_t bucket_size, const float* min_unit,
                  int bits, bool stochastic, uint32_t rng_key, uint8_t* payload);
void MinMaxDecode(const uint8_t* payload, size_t n, size_t bucket_size, const float* min_unit,
                  int bits, float* out);

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_BUCKETED_H_
