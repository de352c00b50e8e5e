// Layer-wise bit widths for a compressed data-parallel exchange (L-GreCo,
// docs/design/ALGORITHMS.md §3 and §1.5), torch-free. A flat vector is cut
// into tensors (`tensor_sizes`); each tensor travels with its own min-max bit
// width.
//
//   ChooseLayerwiseBits: for each tensor and each width b in [min_bits,
//     max_bits], encode -> decode the tensor's values with the min-max codec
//     and measure the squared L2 error and the encoded bytes; then
//     compression::AllocateAgainstUniform picks the widths of least total
//     bytes whose total error is at most that of `uniform_bits` everywhere
//     (never more bytes than uniform). Deterministic: replicas that measure
//     bit-identical data (e.g. an exchanged mean, decoded by everyone from the
//     same bytes) choose the same plan.
//   AllReduceMeanLayerwise: AllReduceMean with per-tensor widths. Tensors of
//     one width are gathered into one contiguous vector and averaged in round
//     first_round + bits - 1 (so at most 8 rounds: first_round .. +7).
//
// Error feedback: worker_error holds one value per element of the flat
// vector (in its own order); server_error is the concatenation, in
// increasing width, of each width group's owned-chunk buffer (AllReduceMean's
// layout for that group's vector). Both depend on the plan: when the plan
// changes, the caller resets them (empty buffers start from zero).
//
//   LayerwisePlanOptions o;  o.codec = minmax;  o.min_bits = 2;  o.max_bits = 8;  o.uniform_bits = 4;
//   AQSWARM_ASSIGN_OR_RETURN(LayerwisePlan plan, ChooseLayerwiseBits(mean, sizes, o));
//   AQSWARM_RETURN_IF_ERROR(AllReduceMeanLayerwise(ex, options, sizes, plan.bits, step, 16, in, out, &ew, &es));
//
// Pure functions; thread-safe.
#ifndef AQSWARM_PIPELINE_LAYERWISE_PLAN_H_
#define AQSWARM_PIPELINE_LAYERWISE_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compression/codec.h"
#include "pipeline/dp_allreduce.h"

namespace aqswarm::pipeline {

struct LayerwisePlanOptions {
  // The exchange's min-max codec (bucket size, rounding, min_compress_elements);
  // its `bits` is ignored. Default: min-max, buckets of 512.
  compression::CodecOptions codec = [] {
    compression::CodecOptions c;
    c.codec = v1::CODEC_MINMAX;
    c.bucket_size = 512;
    return c;
  }();
  int min_bits = 2;      // widths tried: [min_bits, max_bits] within [1, 8]
  int max_bits = 8;
  int uniform_bits = 4;  // the uniform plan whose error is the budget; in [min_bits, max_bits]
  // Replicas of the exchange: a width group whose chunks (its elements / replicas)
  // would be under codec.min_compress_elements travels as float32, so such a
  // group's tensors move up to the next wider group (never more error). Default: 1.
  int replicas = 1;
  int error_bins = 1000;  // resolution of the knapsack DP (compression/layerwise.h)
};

// The plan options of an exchange with `exchange`'s codec (its bits the
// uniform width) at widths [min_bits, max_bits] among `replicas` replicas.
LayerwisePlanOptions LayerwisePlanOptionsOf(const AllReduceOptions& exchange, int min_bits, int max_bits,
                                            int replicas);

struct LayerwisePlan {
  std::vector<int> bits;  // per tensor
  double cost_bytes = 0, error = 0;                  // measured, of `bits`
  double uniform_cost_bytes = 0, uniform_error = 0;  // measured, of uniform_bits everywhere
};

// InvalidArgument when the sizes do not add up to data.size(), a size is not
// positive, or the widths are out of range; the codec's errors otherwise.
absl::StatusOr<LayerwisePlan> ChooseLayerwiseBits(absl::Span<const float> data,
                                                  absl::Span<const int64_t> tensor_sizes,
                                                  const LayerwisePlanOptions& options);

// ChooseLayerwiseBits in two halves, for data that differs by replica (each
// replica's own momentum): each measures its data, the replicas average the
// measurements (e.g. a float32 round of the exchange), and every replica
// chooses from the same mean. Measurements: {bytes, squared error} for each
// tensor and each width in [min_bits, max_bits], tensor-major.
// ChooseLayerwiseBits(d, s, o) is ChooseLayerwiseBitsFrom(MeasureLayerwise(d, s, o), s, o).
using LayerwiseMeasurements = std::vector<float>;
absl::StatusOr<LayerwiseMeasurements> MeasureLayerwise(absl::Span<const float> data,
                                                       absl::Span<const int64_t> tensor_sizes,
                                                       const LayerwisePlanOptions& options);
// InvalidArgument on a count that is not 2 x tensors x widths, or a
// measurement that is negative or not finite.
absl::StatusOr<LayerwisePlan> ChooseLayerwiseBitsFrom(absl::Span<const float> measurements,
                                                      absl::Span<const int64_t> tensor_sizes,
                                                      const LayerwisePlanOptions& options);

// The exchange round in which replicas average their MeasureLayerwise
// measurements, for an optimizer whose rounds start at first_round (clear
// of its own rounds and its layer-wise width groups').
constexpr uint32_t LayerwiseMeasureRound(uint32_t first_round) { return 48 + first_round; }

// Length of the server error buffer of AllReduceMeanLayerwise for this plan.
int64_t LayerwiseOwnedElements(absl::Span<const int64_t> tensor_sizes, absl::Span<const int> bits, int rank, int size,
                               int64_t bucket_elements);

// out = mean over replicas of `in` with tensor t at bits[t] (options.codec
// is min-max; its bits are ignored). `in` and `out` may alias; the error
// buffers may be null, empty (zeros) or of the sizes above. InvalidArgument
// on sizes that do not match (nothing sent). The width groups, and `also`
// (other vectors in rounds of their own, e.g. the float32 part), share one
// AllReduceMeanParts lockstep.
absl::Status AllReduceMeanLayerwise(ReplicaExchange& ex, const AllReduceOptions& options,
                                    absl::Span<const int64_t> tensor_sizes, absl::Span<const int> bits, uint64_t step,
                                    uint32_t first_round, absl::Span<const float> in, absl::Span<float> out,
                                    std::vector<float>* worker_error, std::vector<float>* server_error,
                                    AllReduceStats* stats = nullptr, absl::Span<const AllReducePart> also = {});

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_LAYERWISE_PLAN_H_
