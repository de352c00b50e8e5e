// Global-QSGD (papers/global-qsgd; reference/seeds_001_002_004.md §2):
// allreduce-compatible quantization. All data-parallel workers quantize a
// bucket onto the SAME grid (scale N_k = max-abs of bucket k across workers,
// obtained by an allreduce-MAX of LocalBucketMaxAbs), each with its own RNG,
// so their integer codes can be combined without decoding.
//
// Wire (CODEC_GLOBAL_QSGD): scales = one float32 N_k per bucket; payload =
// one A-bit code per element (A = `bits`, 2..8 bit-packed, or 16 as int16 LE).
//
// Uniform levels {0, 1/s, ..., 1}: code = signed level k in two's complement.
//   encode: k = sign(x) * min(floor(|x| * (s / N_k) + u_i), s)
//   sum:    codes of n workers add as integers; the accumulator needs
//           RequiredAccumulatorBits(s, n) = 1 + ceil(log2(s+1)) + ceil(log2 n)
//           <= A bits, else CombineGlobalQsgd refuses (never overflows).
//   decode: unit_k = N_k / (float)(s * n); out = (float)k * unit_k
//           (n = num_summed; this is the mean over the n workers)
// Exponential levels {0, 2^-(s-1), ..., 1/2, 1}: code = sign << (A-1) | e,
//   where e = 0 means zero and e >= 1 means sign * 2^-e; values are
//   pre-scaled by 2^-t, t = exponent_shift = 1 + ceil(log2 workers), so
//   partial sums of a balanced tree stay <= 1/2 and e >= 1.
//   encode: y = |x| / N_k; level 2^-j chosen by unbiased stochastic rounding
//           between neighbouring levels; e = j + t (0 for the zero level).
//   combine: ReduceExponential per element with k = ReducerK(DrawU32(key, i), m),
//           m = min(32, max exponent): unbiased rounding of the true sum to a
//           neighbouring power of two (variance x <= 9/8 per hop).
//   decode: P_e = ldexpf(1, t - e) (exact or IEEE-rounded subnormal);
//           mag = (N_k * P_e) / (float)n; out = sign ? -mag : mag; e == 0 -> 0.
//
// Example (one worker of n; `comm` is the caller's collective layer):
//   std::vector<float> scales(NumBuckets(x.size(), 1024));
//   AQSWARM_RETURN_IF_ERROR(LocalBucketMaxAbs(x, 1024, absl::MakeSpan(scales)));
//   comm.AllreduceMax(scales);
//   GlobalQsgdOptions o;  o.num_workers = n;
//   v1::EncodedTensor mine;
//   AQSWARM_RETURN_IF_ERROR(EncodeGlobalQsgd(o, x, shape, scales, key, &mine));
//   ... tree-reduce with CombineGlobalQsgd(a, b, {.rng_key = k}, &sum) ...
//   AQSWARM_RETURN_IF_ERROR(Decode(sum, absl::MakeSpan(mean)));   // codec.h
#ifndef AQSWARM_COMPRESSION_GLOBAL_QSGD_H_
#define AQSWARM_COMPRESSION_GLOBAL_QSGD_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/tensor.pb.h"

namespace aqswarm::compression {

// ceil(log2(n)) for n >= 1 (0 for n <= 1).
int CeilLog2(uint64_t n);

// 1 + ceil(log2(s + 1)) + ceil(log2(n)): bits for a two's complement
// accumulator holding any sum of n codes in [-s, s].
int RequiredAccumulatorBits(uint64_t s, uint64_t n);

// The narrowest code width in 2..8 whose codes can carry the sums of
// `num_workers` workers with `levels` at the default level count; 0 when
// none can.
int MinGlobalQsgdBits(v1::LevelFamily levels, int num_workers);

// Per-bucket max |x| (bucket_size values per bucket); InvalidArgument on NaN/Inf.
// out.size() must be NumBuckets(values.size(), bucket_size).
absl::Status LocalBucketMaxAbs(absl::Span<const float> values, size_t bucket_size,
                               absl::Span<float> out);

struct GlobalQsgdOptions {
  // Wire width A of every code, in bits: 2..8 or 16. Default: 8.
  int bits = 8;
  // Level family. Default: exponential (the paper: uniform 8-bit lost ~9 PPL
  // on Transformer-XL with Adam, exponential ~0.7).
  v1::LevelFamily levels = v1::LEVELS_EXPONENTIAL;
  // Values per bucket (one shared scale each). Default: 1024.
  size_t bucket_size = 1024;
  // Number of workers whose codes will be combined; sizes s and t. Default: 1.
  int num_workers = 1;
  // s; 0 = the largest s for which n workers' combined codes fit `bits`.
  int num_levels = 0;
  // Unbiased stochastic rounding (default) or nearest.
  bool stochastic = true;
};

// Encodes this worker's values against the caller's shared per-bucket scales
// (global_scales.size() == NumBuckets). InvalidArgument on NaN/Inf input, on a
// value above its bucket's scale, or when the widths cannot hold n workers.
absl::Status EncodeGlobalQsgd(const GlobalQsgdOptions& options, absl::Span<const float> values,
                              absl::Span<const int64_t> shape, absl::Span<const float> global_scales,
                              uint32_t rng_key, v1::EncodedTensor* out);

struct CombineOptions {
  // Uniform levels: width of the output codes (0 = same as the inputs);
  // widening lets sums of many workers travel. Exponential: must be 0 or equal.
  int out_bits = 0;
  // Keys the reducer's k draws (exponential levels); independent per hop.
  uint32_t rng_key = 0;
};

// out = a (+) b: integer sum (uniform) or the stochastic exponential reducer.
// Both must share shape, bucket size, levels, s, t and bit-identical scales.
// FailedPrecondition, without writing `out`, if the result would not fit.
absl::Status CombineGlobalQsgd(const v1::EncodedTensor& a, const v1::EncodedTensor& b,
                               const CombineOptions& options, v1::EncodedTensor* out);

// Signed codes of a validated message: uniform -> level sums k; exponential
// -> +-e (sign of the value, exponent magnitude). For tests and tooling.
absl::Status UnpackGlobalQsgdCodes(const v1::EncodedTensor& msg, absl::Span<int32_t> out);

// Decodes a message already validated by ValidateEncodedTensor (codec.h's
// Decode does that first).
void DecodeGlobalQsgd(const v1::EncodedTensor& msg, absl::Span<float> out);

// k for the exponential reducer: min(m, 1 + clz(r)), so P(k > b) = 2^-b for
// b < m and k in {1..m}; r is a uniform 32-bit draw, m in 1..32.
inline int ReducerK(uint32_t r, int m) {
  const int k = 1 + (r == 0 ? 32 : __builtin_clz(r));
  return k < m ? k : m;
}

struct ExpValue {
  int sign;      // +1 or -1 (ignored when exponent == 0)
  int exponent;  // 0 = zero, else |value| = 2^-exponent
};

// The branch-free reducer of seeds_001_002_004.md §2.4 (corrected form).
// Same signs: keep 2^-min(e) and double it (e-1) if k > |e1-e2|; opposite
// signs: halve it (e+1) if k > |e1-e2| - 1; equal opposite values cancel to
// 0; zero is the identity. A non-zero result is saturated at exponent 1 (only
// reachable when a partial sum exceeds 1/2, i.e. more workers than 2^(t-1)
// or an unbalanced tree).
inline ExpValue ReduceExponential(ExpValue a, ExpValue b, int k) {
  const int e1 = a.exponent, e2 = b.exponent;
  const int nz1 = e1 > 0, nz2 = e2 > 0, z2 = 1 - nz2;
  const int s12 = a.sign * b.sign * nz1 * nz2;
  const int gap = e1 > e2 ? e1 - e2 : e2 - e1;
  const int diff = gap - (1 - s12) / 2;
  const int leq = ((e1 <= e2) + z2) * nz1;
  const int nonzero = 1 - ((e1 == e2) & (s12 == -1));
  const int sign_out = a.sign * leq + b.sign * (1 - leq);
  int e_out = (e1 * leq + e2 * (1 - leq) - s12 * (k > diff)) * nonzero;
  e_out += (e_out == 0) & nonzero & (nz1 | nz2);  // saturate instead of reading as zero
  return {sign_out, e_out};
}

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_GLOBAL_QSGD_H_
