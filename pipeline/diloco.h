// DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (Douillard et al.
// 2025) over a flat parameter vector, torch-free (docs/design/ALGORITHMS.md,
// "DiLoCo"). Each replica runs its own AdamW for H = inner_steps steps with no
// data-parallel traffic; then the replicas all-reduce the pseudo-gradient
// and take one outer Nesterov step from the anchor (the parameters at the
// last sync), identical on every replica:
//
//   inner (every step, own gradient g, per-replica m and v):
//             m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//             p *= 1 - lr*wd (matrices);  p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)
//   outer (step t, 1-based, where (t + offset_f) % H == 0, fragment f):
//             d = mean_replicas~(anchor - p)         (compressed)
//             mom = mu mom + d
//             anchor -= outer_lr * (d + mu mom)      (torch SGD, nesterov=True)
//             p = anchor
//
// mean_replicas~ is min-max with worker and server error feedback
// (AllReduceMean) or Global-QSGD's integer sum (GlobalQsgdAllReduceMean,
// unbiased, no error feedback), over elements [0, num_compressed); the rest
// (biases, LayerNorm: tiny tensors) go float32 in a second round.
//
// Layer-wise bits (L-GreCo, pipeline/layerwise_plan.h; min-max only): with
// layerwise_every_steps = N > 0, after every N-th outer exchange of a
// fragment its compressed tensors get new widths in [layerwise_min_bits,
// layerwise_max_bits], chosen at no more measured error than
// compressed.codec.bits everywhere from the fragment's outer momentum after
// that step (the same everywhere: the same plan on every replica). Not from
// the exchanged mean: it lies on the exchange's own min-max grid, so
// re-encoding it at the current width measures no error and no narrower
// width ever fits the budget (with outer_momentum 0 the momentum is that
// mean, and the widths stay). A new plan zeroes the error buffers (of every
// fragment: their layout follows the plans).
//
// Streaming: the vector is cut into `fragments` F contiguous groups of whole
// tensors of about n / F elements each; fragment f's offset is f * H / F, so
// with F <= H no two fragments sync on the same step and a stage's
// exchanges spread over the H inner steps. Each fragment has its own slice
// of the anchor, the momentum and the error buffers (the server error is the
// concatenation of each fragment's owned chunks).
//
// Identity: every replica decodes the same mean bytes and holds the same
// momentum, so the anchor (and the momentum) stay bit-identical on every
// replica at every step; right after fragment f's outer step its parameters
// equal its anchor everywhere. Between syncs the parameters are the
// replica's own.
//
// State (checkpointed and handed to a joining replica): m, v (this
// replica's inner AdamW), anchor, outer momentum, worker error, server error,
// error owner, inner Adam step, layer-wise plans, step (NamedState /
// LoadState). The error
// buffers follow QuantizedAdam's "error_owner" rule: a replica whose error
// buffers were another rank's (or of unknown owner) starts its error feedback
// from zero buffers at its next compressed exchange.
//
// Not thread-safe.
#ifndef AQSWARM_PIPELINE_DILOCO_H_
#define AQSWARM_PIPELINE_DILOCO_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "pipeline/dp_allreduce.h"
#include "pipeline/dp_optimizer.h"
#include "pipeline/quantized_adam.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

struct DiLoCoOptions {
  // Inner AdamW.
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  // H: steps between two syncs of a fragment; >= 1. Default: 32.
  int64_t inner_steps = 32;
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  // F: fragments synced on staggered steps (Streaming DiLoCo); 0 or 1 = the
  // whole vector at once. Default: 1.
  int64_t fragments = 1;
  // Exchange rounds of an outer step: first_round (compressed part) and
  // first_round + 1 (float32 part). Only one fragment syncs per step, so the
  // fragments share them. Two optimizers exchanging in the same step (a
  // stage's parameters and its tied-embedding copy) use disjoint rounds; the
  // rounds also key the stochastic rounding. Default: 0.
  uint32_t first_round = 0;
  // Layer-wise widths (see the banner). 0 = off (compressed.codec.bits
  // everywhere). Default: 0.
  int64_t layerwise_every_steps = 0;
  int layerwise_min_bits = 2;
  int layerwise_max_bits = 8;
  // Codec and buckets of the pseudo-gradient exchange (min-max: with error
  // feedback; Global-QSGD: without). Default: QuantizedAdam's (min-max, 4
  // bits, buckets of 512).
  AllReduceOptions compressed = QuantizedAdamOptions().compressed;
};

// From a job: what QuantizedAdamOptionsFromJob takes (optimizer
// betas/eps/decay, dp.{codec, bits, bucket_size, robust, robust_clip,
// layerwise_*}) + dp.{inner_steps, outer_lr, outer_momentum, fragments}.
DiLoCoOptions DiLoCoOptionsFromJob(const v1::JobSpec& job);

class DiLoCo final : public DataParallelOptimizer {
 public:
  // `decay[i]` says whether element i gets weight decay; elements
  // [0, num_compressed) are exchanged compressed; `tensor_sizes` cut the
  // vector into tensors (fragments are groups of whole tensors; empty = one
  // tensor).
  DiLoCo(int64_t n, int64_t num_compressed, std::vector<uint8_t> decay, const DiLoCoOptions& options,
         std::vector<int64_t> tensor_sizes = {});

  // One inner step with this replica's (already clipped) gradient, then the
  // outer step of every fragment due at this step. The first call takes
  // `params` as the anchor (replicas start equal).
  absl::Status Step(ReplicaExchange& ex, double lr, absl::Span<float> params,
                    absl::Span<const float> grads) override;

  // Drops this replica's inner progress: params = anchor, m = v = 0 and the
  // inner Adam step restarts. For a state that must not depend on the
  // replica (the tied-embedding copy after a state load). InvalidArgument on
  // a size mismatch; a no-op before the anchor exists.
  absl::Status RestartFromAnchor(absl::Span<float> params);
  absl::Status RestartFromShared(absl::Span<float> params) override { return RestartFromAnchor(params); }

  // Goes on at `step`: its inner steps since are skipped, and the outer
  // steps among them are joined at the next Step with params = the anchor
  // (a zero pseudo-gradient): the replicas that took them wait for it.
  absl::Status SkipTo(int64_t step) override;
  int64_t step() const { return step_; }
  // Empty before the first Step.
  const std::vector<float>& anchor() const { return anchor_; }
  const std::vector<float>* shared_params() const override { return &anchor_; }
  DpStateMeta meta() const override { return {step_, false}; }
  // [begin, end) of fragment f, f < num_fragments().
  std::pair<int64_t, int64_t> fragment(int f) const { return {bounds_[f], bounds_[f + 1]}; }
  int num_fragments() const { return static_cast<int>(bounds_.size()) - 1; }
  const AllReduceStats& stats() const override { return stats_; }
  // What the last Step did: kLocal (inner step only) or kOuter (some
  // fragment synced); kNone before the first.
  DpStepKind last_step_kind() const override { return last_step_kind_; }

  // Named flat buffers: "m", "v", "anchor", "outer_momentum",
  // "worker_error", "server_error", "error_owner" ({rank, replicas}; empty:
  // none yet), "adam_step" ({inner Adam steps since the last restart}),
  // "layerwise" (empty: none yet; else F exchange counts, then a width per
  // compressed tensor piece, fragment by fragment, 0 = dp.bits).
  std::vector<std::pair<std::string, std::vector<float>*>> NamedState();
  std::vector<std::pair<std::string, const std::vector<float>*>> NamedState() const override;
  // m and v must hold n values; anchor and outer_momentum none or n;
  // worker_error none or num_compressed; server_error at most
  // num_compressed; error_owner none or {rank, replicas} with
  // 0 <= rank < replicas; adam_step (optional: absent = `step`) one value
  // in [0, step]; layerwise (optional) none or F + pieces values, each
  // fragment's widths all 0 or all in [1, 8]. Anything else is InvalidArgument naming the buffer and
  // both sizes, and nothing is changed.
  absl::Status LoadState(const DpState& state, const DpStateMeta& meta) override;

 private:
  absl::Status SyncFragment(ReplicaExchange& ex, int f, uint64_t s, absl::Span<float> params);
  // Fragment f's layer-wise widths (empty: dp.bits for all).
  std::vector<int> FragmentBits(int f) const;
  // Its server error length at rank/size under its current widths.
  int64_t OwnedOf(int f, int rank, int size) const;
  // After fragment f's outer step (its compressed part's outer momentum):
  // count it and, every layerwise_every_steps, re-plan its widths.
  absl::Status UpdatePlan(ReplicaExchange& ex, int f, absl::Span<const float> momentum);

  const int64_t n_, num_compressed_;
  const std::vector<uint8_t> decay_;
  const DiLoCoOptions options_;
  std::vector<int64_t> bounds_;  // fragment f is [bounds_[f], bounds_[f + 1])
  // Fragment f's compressed tensor pieces (sizes) and where its widths start
  // in layerwise_ (after the F counts).
  std::vector<std::vector<int64_t>> pieces_;
  std::vector<int64_t> piece_begin_;
  std::vector<float> m_, v_, anchor_, momentum_, worker_error_, server_error_;
  std::vector<float> error_owner_;  // {rank, replicas} whose residues the error buffers hold; empty: unknown
  std::vector<float> adam_step_;    // {inner Adam steps since the last restart}
  std::vector<float> layerwise_;    // see NamedState
  std::vector<float> delta_, mean_, we_, se_;  // scratch of an outer step
  int64_t step_ = 0;
  // (fragment, step index) of outer steps SkipTo passed over, taken at the next Step.
  std::vector<std::pair<int, int64_t>> skipped_syncs_;
  AllReduceStats stats_;
  DpStepKind last_step_kind_ = DpStepKind::kNone;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_DILOCO_H_
