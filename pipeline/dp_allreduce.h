// Averaging a flat float vector across the D replicas of a stage, torch-free
// and transport-free (the gRPC ReplicaExchange lives in peer/).
//
// Layout: the vector is cut into buckets of at most `bucket_elements`; each
// bucket into D contiguous chunks (sizes differ by at most one); replica r
// owns chunk r. Per bucket:
//   SCATTER  replica i encodes chunk k of its input and sends it to owner k
//            (its own chunk too, through the same encode/decode);
//   reduce   owner k decodes the D contributions and sums them in rank order
//            0..D-1, then multiplies by 1/D (fixed order: deterministic);
//   GATHER   owner k encodes the mean and sends it to every replica; every
//            replica (the owner included) decodes those bytes into the output.
// So all replicas end with bit-identical outputs. Buckets are pipelined:
// the SCATTER of up to kAllReduceUnitsInFlight buckets ahead leaves before a
// bucket's contributions are awaited, and the means of as many buckets
// before the first mean is awaited, so a call costs about two one-way
// latencies whatever its number of buckets. AllReduceMeanParts runs several vectors
// (rounds) in the same lockstep: a float32 round beside a compressed one
// shares its round trips. Memory: that many buckets of encoded chunks in
// flight.
//
// Error feedback (QuantizedAdam, docs/design/ALGORITHMS.md §3): with `worker_error`, the
// input is u = x + e_w and e_w <- u - D(Q(u)) per chunk; with `server_error`
// (this replica's owned chunks, concatenated over buckets), the owner encodes
// u_k = mean + e_s and keeps e_s <- u_k - D(Q(u_k)). Lossless codecs leave
// both errors zero.
//
// Tests only: AQSWARM_TEST_FAULT_DP_SCATTER="<rank>:<factor>|nan" makes that
// rank corrupt the float32 contributions it sends (a hostile replica, for
// live tests of dp.robust; see dp_allreduce.cc);
// AQSWARM_TEST_FAULT_DIE_IN_EXCHANGE_AT_STEP=<step> kills the peer (the
// stage's parent and the stage) mid-round at that step, after it took a
// contribution (fault-domain tests).
//
//   AllReduceOptions o;  o.codec.codec = v1::CODEC_MINMAX;  o.codec.bits = 4;
//   AQSWARM_RETURN_IF_ERROR(AllReduceMean(exchange, o, step, round, in, out, &e_w, &e_s));
#ifndef AQSWARM_PIPELINE_DP_ALLREDUCE_H_
#define AQSWARM_PIPELINE_DP_ALLREDUCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "compression/codec.h"
#include "proto/exchange.pb.h"

namespace aqswarm::pipeline {

// Point-to-point messages among the replicas of one stage. Implementations:
// gRPC (stage/gradient_exchange.h) and in-process (tests).
class ReplicaExchange {
 public:
  virtual ~ReplicaExchange() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Delivers `chunk` to replica `to` (to != rank()). May block for flow
  // control; fails with a clear status when `to` is unreachable.
  virtual absl::Status Send(int to, const v1::ExchangeChunk& chunk) = 0;
  // The chunk from `from` matching (step, round, phase, bucket, chunk);
  // bounded by the exchange's timeout.
  virtual absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round,
                                                    v1::ExchangeChunk::Phase phase, uint32_t bucket,
                                                    uint32_t chunk) = 0;
};

// How the owner of a chunk combines the D replicas' contributions to it
// (job: dp.robust). Every mode is computed by the owner alone, in rank
// order, so the replicas stay bit-identical (they decode the owner's bytes).
// Norms are of each replica's contribution to one chunk of one bucket.
//   kOff          the mean; any non-finite contribution fails the round.
//   kClipNorm     each contribution scaled down to at most robust_clip x the
//                 median contribution norm, then the mean.
//   kCenteredClip center c = the coordinate-wise median of the
//                 contributions; each deviation x_i - c scaled down to at
//                 most robust_clip x the median deviation norm; c + their
//                 mean.
// Under both robust modes a contribution that does not decode to finite
// values is dropped (counted in AllReduceStats::robust_dropped) and the
// rest are combined. Medians are the lower median (element floor((k-1)/2)
// of k sorted values). With D = 2 there is no majority: the larger of the
// two contributions is held to robust_clip x the smaller, but nothing says
// which replica is honest; use D >= 3 to outvote one faulty replica.
enum class RobustAggregation { kOff, kClipNorm, kCenteredClip };

struct AllReduceOptions {
  // Codec of both phases. Default: raw float32 (lossless).
  compression::CodecOptions codec = [] {
    compression::CodecOptions c;
    c.codec = v1::CODEC_RAW_F32;
    return c;
  }();
  // Largest bucket in elements. Default: 4 Mi.
  int64_t bucket_elements = 4 << 20;
  // Robust combination at each chunk's owner (see RobustAggregation).
  // Default: off.
  RobustAggregation robust = RobustAggregation::kOff;
  // Multiple of the median norm a contribution (or deviation) may reach
  // under the robust modes; > 0. Default: 2.
  double robust_clip = 2;
};

// Chunk [begin, end) of `bucket_len` elements owned by `rank` of `size`.
std::pair<int64_t, int64_t> ChunkRange(int64_t bucket_len, int rank, int size);
// Total elements this replica owns over all buckets of an n-vector (the
// length of its server error buffer).
int64_t OwnedElements(int64_t n, int rank, int size, int64_t bucket_elements);

// The bytes a float32 AllReduceMean of an n-vector sends from `rank`
// (AllReduceStats::raw_bytes of such a call): the other owners' chunks
// scattered plus its own chunks' means gathered to the size - 1 others. The
// data-parallel baseline every optimizer's traffic is compared to (AdamW
// sends it every step).
uint64_t Float32AllReduceBytes(int64_t n, int rank, int size, int64_t bucket_elements);

struct AllReduceStats {
  uint64_t bytes_sent = 0;  // encoded scales+payload sent to other replicas
  uint64_t raw_bytes = 0;   // float32 bytes of the same chunks
  // Robust modes, at this replica's owned chunks: contributions dropped as
  // non-finite, and contributions (or deviations) scaled down by the clip.
  uint64_t robust_dropped = 0;
  uint64_t robust_clipped = 0;
};

// The robust combination of `contributions` (each of `out.size()` values)
// into `out`; kOff is their mean. Rows marked false in `keep` are left
// out. FailedPrecondition when no row is kept. Exposed for tests.
absl::Status CombineContributions(RobustAggregation mode, double clip,
                                  const std::vector<std::vector<float>>& contributions,
                                  const std::vector<bool>& keep, absl::Span<float> out, AllReduceStats* stats);

// out = mean over replicas of `in` (see the banner). `in` and `out` may alias.
// worker_error / server_error may be null (no error feedback).
absl::Status AllReduceMean(ReplicaExchange& ex, const AllReduceOptions& options, uint64_t step, uint32_t round,
                           absl::Span<const float> in, absl::Span<float> out, std::vector<float>* worker_error,
                           std::vector<float>* server_error, AllReduceStats* stats = nullptr);

// Float32 options with `like`'s buckets and robust aggregation: the round of
// the tensors too small to compress, beside a compressed round.
AllReduceOptions Float32Like(const AllReduceOptions& like);

// Buckets (of all parts together) whose phases overlap; see the banner.
constexpr int64_t kAllReduceUnitsInFlight = 8;

// One vector of AllReduceMeanParts, with AllReduceMean's arguments.
struct AllReducePart {
  AllReduceOptions options;
  uint32_t round = 0;
  absl::Span<const float> in;
  absl::Span<float> out;
  std::vector<float>* worker_error = nullptr;
  std::vector<float>* server_error = nullptr;
};

// AllReduceMean of every part, their buckets interleaved (part 0's bucket 0,
// part 1's bucket 0, ..., then the buckets 1) and pipelined as the banner
// says. Each part's output is bit for bit what AllReduceMean would give it
// alone. Parts must have distinct rounds; a part's `out` may alias its own
// `in`, not another part's.
absl::Status AllReduceMeanParts(ReplicaExchange& ex, uint64_t step, absl::Span<const AllReducePart> parts,
                                AllReduceStats* stats = nullptr);

// Global-QSGD integer-sum allreduce (docs/design/ALGORITHMS.md §1.4): every replica
// quantizes onto the SAME per-bucket grid, so codes are combined without
// decoding.
//   1. scales: each replica's per-bucket max |x| is all-gathered and the
//      element-wise max taken (exact, order-free: identical everywhere);
//   2. SCATTER: chunk k (whole buckets) of the codes goes to owner k;
//   3. the owner combines the D code messages pairwise in a fixed balanced
//      tree over ranks (integer sums for uniform levels; the stochastic
//      exponential reducer, log2 D hops, for exponential levels);
//   4. GATHER: the owner's combined codes go to everyone; each decodes the
//      same bytes to the mean.
// No error feedback (the paper's estimator is unbiased as it is).
struct GlobalQsgdAllReduceOptions {
  int bits = 8;                                          // wire width of every code
  v1::LevelFamily levels = v1::LEVELS_EXPONENTIAL;       // the paper's choice for Adam
  int64_t bucket_size = 1024;                            // values per shared scale
};
// Global-QSGD options from a codec's bits, level family and bucket size.
GlobalQsgdAllReduceOptions GlobalQsgdOptionsOf(const compression::CodecOptions& codec);
absl::Status GlobalQsgdAllReduceMean(ReplicaExchange& ex, const GlobalQsgdAllReduceOptions& options, uint64_t step,
                                     uint32_t round, absl::Span<const float> in, absl::Span<float> out,
                                     AllReduceStats* stats = nullptr);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_DP_ALLREDUCE_H_
