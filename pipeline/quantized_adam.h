// Data-parallel Adam over a flat parameter vector, torch-free: AdamW on
// averaged gradients for `warmup_steps`, then QuantizedAdam (1-bit-Adam style,
// docs/design/ALGORITHMS.md §3): the variance is frozen and the momentum is exchanged
// compressed with worker and server error feedback.
//
//   warm-up:  g = mean_replicas(g_local)                (raw float32, or
//             min-max at warmup_bits with stochastic rounding)
//             m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//             p *= 1 - lr*wd (matrices);  p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)
//   freeze:   v = v / bc2 at the last warm-up step; where v is 0 (no
//             gradient yet) v = 0.01 * mean over the tensor of v. There is
//             at least one warm-up step (on a variance of zeros x would be
//             m / eps); a job runs at least kMinQuantizedAdamWarmup.
//   after:    m_local = b1 m + (1-b1) g_local
//             x = mean_replicas~(m_local / s),  s = sqrt(v) + eps   (compressed)
//             m = x s;  u = clamp(x / bc1, -B, B)   (bc1 = 1 - b1^t keeps going after the freeze)
//             p *= 1 - lr*wd (matrices);  p -= lr * u
//             where |x / bc1| > B:  v = (m / bc1 / B)^2   (raise_variance_at_bound)
//             error buffers clamped to [-bc1 B, bc1 B] (no residue larger
//             than the largest step it could become)
//   refresh:  at the end of each refresh interval I after the freeze (R =
//             variance_refresh_steps, doubling after every refresh_growth
//             refreshes: VarianceRefreshInterval) exchanges g as the
//             warm-up does instead: m = b1 m + (1-b1) g;
//             v = (b2^I bc2(t-I) v + (1 - b2^I) g^2) / bc2(t), zeros filled
//             as at the freeze; the error buffers are zeroed; the step is as above.
//   local:    with max_local_steps > 1, between two syncs (LocalStepsSyncAt;
//             the step before a refresh always syncs) a replica steps alone:
//             m = b1 m + (1-b1) g_local;  x = m / s;  acc += lr x;
//             p *= 1 - lr*wd (matrices);  p -= lr * clamp(x / bc1, -B, B)
//             (no traffic; v never raised: it must stay the same everywhere).
//             The sync that ends the interval is a compressed step that
//             exchanges y = (acc + lr x) / lr_sum (lr_sum: the lrs of the
//             interval, this step's included; with no local step before it
//             y = x, the plain step) and sets, on every replica,
//             m = mean~(y) s;  p = anchor * prod(1 - lr*wd) - lr_sum * clamp(mean~(y) / bc1, -B, B)
//             from the anchor (the parameters at the last sync), as 0/1
//             Adam (Lu et al. 2022, Algorithm 1) resets its replicas to the
//             anchor minus the mean of their accumulated updates. Error
//             feedback carries over between plain steps and syncs (y and x
//             are both in units of m / s).
//   layer-wise: with layerwise_every_steps = N > 0 (min-max only), after
//             every N compressed exchanges the tensors of the compressed part
//             get new bit widths (pipeline/layerwise_plan.h) measured on the
//             raw x of the N-th exchange (each replica measures its own; the
//             measurements are averaged in a float32 round of that exchange,
//             so every replica chooses the same plan). Not on the exchanged
//             mean: it lies on the exchange's min-max grid, so the current
//             width measures no error there and no narrower width fits the
//             budget. A changed plan zeroes both error buffers (their layout
//             follows the plan's width groups).
//   with B = AdamUpdateBound(b1, b2, t), the largest step Adam could take at
//   step t (1.12 at t = 17, 1.83 at t = 65 for the default betas) and
//   mean_replicas~ the compressed allreduce: min-max with error feedback on
//   both sides (AllReduceMean), or Global-QSGD's integer sum
//   (GlobalQsgdAllReduceMean, unbiased, no error feedback).
//
// Why not plain 1-bit Adam (DeepSpeed: raw m exchanged, v frozen as is, no
// bias correction, no bound)? DeepSpeed freezes after thousands of steps; a
// short warm-up leaves coordinates whose token (embedding or output row) was
// never or rarely seen with a tiny v, so the first gradient they get after
// the freeze makes m/sqrt(v) hundreds: a step
// of hundreds of lr on one row, the loss spikes. Adam itself can never step
// further than B lr at step t; the bound restores that, and raising v where it
// binds lets the next steps decay with m as Adam's would (a stale v would
// otherwise keep the coordinate at B lr every step). v is a function of the
// exchanged m, the same on every replica: no communication. The floor only
// fills zeros (which would make x = m / eps): a floor at a fraction of the
// tensor's mean, as before, froze most of the output head (rows of rare
// tokens, whose v is orders of magnitude under the frequent rows') far above
// its v, shrinking those steps far below Adam's (docs/CONVERGENCE.md). Exchanging m / s instead of m puts the min-max
// bucket error in units of the step: with raw m, a bucket's error is sized by
// its largest momenta and divided by the small sqrt(v) of its quiet
// coordinates. Since v is the same on every replica, mean(m / s) = mean(m) /
// s: lossless codecs give the same update either way. The refresh is 0/1
// Adam's (Lu et al. 2022: v updated from full-precision gradients at
// growing intervals); one refresh costs a warm-up step's bytes.
// Elements [0, num_compressed) are exchanged with the compressed codec after
// warm-up; the rest (biases, LayerNorm: tiny tensors) always go raw.
// All replicas apply the same decoded bytes and the same v, so parameters
// stay bit-identical.
//
// State (checkpointed and handed to a joining replica): m, v, worker error,
// server error, error owner, pending local steps (anchor, summed update,
// lr sum, decay product), the layer-wise plan, step, frozen flag
// (NamedState / LoadState). The schedules are functions of the step alone.
// A joiner given another replica's state and parameters in the middle of a
// local interval syncs with the group at its end (the anchor is the same on
// every replica; its summed update counts the giver's local steps as its own).
// After the freeze the error buffers are in units of m / s. m and v are the
// same on every replica; the error buffers are not: they hold one replica's
// quantization residues (the server error over the chunks its rank owns), and
// "error_owner" = {rank, replicas} says whose. A replica whose state was
// another rank's (a joiner given a live replica's state, a peer moved to
// another pipeline) or of unknown owner starts its error feedback from zero
// buffers of its own sizes at its next compressed step, instead of counting
// the other replica's residues a second time on the wrong coordinates; its
// steps then equal those of an undisturbed group whose replica of that rank
// had its error buffers reset (the variance refresh resets everyone's).

//
// Not thread-safe.
#ifndef AQSWARM_PIPELINE_QUANTIZED_ADAM_H_
#define AQSWARM_PIPELINE_QUANTIZED_ADAM_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "pipeline/dp_allreduce.h"
#include "pipeline/dp_optimizer.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

// The fewest warm-up steps a job runs (QuantizedAdamOptionsFromJob): the
// variance frozen after them holds two gradients. Frozen from one, v = g^2
// and the steps m / |g| have no finite mean (|g| near 0: steps up to the
// bound, which then raises v for good); frozen from two, they do
// (docs/CONVERGENCE.md, "QuantizedAdam's warm-up").
constexpr int64_t kMinQuantizedAdamWarmup = 2;

struct QuantizedAdamOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  // Plain data-parallel AdamW steps before the variance freezes; 0 is taken
  // as 1 (a variance of zeros would make x = m / eps). Default: 100 here; a
  // job's is DefaultQuantizedAdamWarmup (pipeline/job_spec.h), and a job runs
  // at least kMinQuantizedAdamWarmup.
  int64_t warmup_steps = 100;
  // How the warm-up and refresh steps exchange the gradient: 0 = float32;
  // 2..8 = min-max at this many bits over compressed.codec.bucket_size
  // buckets, stochastic rounding (unbiased; no error feedback, so the error
  // buffers stay the momentum's), on [0, num_compressed) (the rest float32).
  // Default: 0.
  int warmup_bits = 0;
  // false: AdamW on raw averaged gradients forever (the fp32 baseline).
  bool quantized = true;
  // After the freeze, exchange the preconditioned momentum m / (sqrt(v) + eps)
  // instead of m (see the banner). Default: true.
  bool precondition_exchange = true;
  // After the freeze, each coordinate's step is at most update_clip * lr.
  // 0 = unbounded; < 0 = AdamUpdateBound(beta1, beta2, t). Default: -1.
  double update_clip = -1;
  // After the freeze, divide m by 1 - beta1^t as in the warm-up. Default: true.
  bool bias_correct_frozen = true;
  // After the freeze, where the bound binds, raise v to (m / bc1 / bound)^2
  // (see the banner). Default: true.
  bool raise_variance_at_bound = true;
  // After the freeze, the first variance refresh is at step R =
  // variance_refresh_steps after it, then every R steps (see the banner).
  // 0 = never. Default: 0 (a job's default is 4, pipeline/job_spec.cc).
  int64_t variance_refresh_steps = 0;
  // 0/1 Adam's growing refresh interval: it starts at R and doubles after
  // every refresh_growth refreshes (VarianceRefreshInterval). 0 = fixed.
  // Default: 0.
  int64_t refresh_growth = 0;
  // 0/1 Adam's local steps after the freeze (see the banner): the interval
  // between syncs starts at 1 and doubles after every local_step_growth
  // syncs, capped at max_local_steps (local_step_growth 0: max_local_steps
  // from the start). max_local_steps <= 1 = every step syncs. Default: 0.
  int64_t max_local_steps = 0;
  int64_t local_step_growth = 0;
  // Layer-wise bit widths of the min-max exchange (L-GreCo, see the banner):
  // re-chosen after every layerwise_every_steps compressed exchanges within
  // [layerwise_min_bits, layerwise_max_bits] against compressed.codec.bits
  // everywhere. 0 = off. Ignored under Global-QSGD. Default: 0.
  int64_t layerwise_every_steps = 0;
  int layerwise_min_bits = 2;
  int layerwise_max_bits = 8;
  // Exchange rounds this optimizer uses within a step: first_round and
  // first_round + 1; with layer-wise widths also 16 + 8 first_round + bits - 1
  // and, at a re-plan, LayerwiseMeasureRound(first_round) (48 + first_round)
  // (bits 1..8: rounds 16..23 for first_round 0, 32..39 for 2). Two optimizers sharing one exchange in the same step
  // (a stage's parameters and its tied-embedding copy) use disjoint rounds;
  // the rounds also key the stochastic rounding, so optimizers with the same
  // first_round, inputs and state produce the same bytes. Default: 0.
  uint32_t first_round = 0;
  // Codec and buckets of the compressed momentum exchange. Default: min-max,
  // 4 bits, buckets of 512 values.
  AllReduceOptions compressed = [] {
    AllReduceOptions a;
    a.codec.codec = v1::CODEC_MINMAX;
    a.codec.bits = 4;
    a.codec.bucket_size = 512;
    return a;
  }();
};

// From a job: optimizer betas/eps/decay + dp.{optimizer, warmup_steps (at least
// kMinQuantizedAdamWarmup), codec, bits, bucket_size,
// robust, robust_clip}. The robust aggregation applies to every round with a
// bucketed or float32 codec (not Global-QSGD's integer sums).
QuantizedAdamOptions QuantizedAdamOptionsFromJob(const v1::JobSpec& job);

// The largest per-coordinate step (in units of lr, eps = 0) bias-corrected
// Adam can take at step `step` (1-based) over all gradient histories:
// (1-b1)/bc1 * sqrt(bc2/(1-b2) * sum_{j<t} (b1^2/b2)^j). 1 at step 1; for the
// default betas 1.12 at step 17, 1.83 at 65, 7.27 in the limit.
double AdamUpdateBound(double beta1, double beta2, int64_t step);

// The length of the variance-refresh interval that ends at post-freeze step
// k (1-based: the first step after the freeze is 1), or 0 when step k is no
// refresh. Intervals: `refresh_steps` (R) `growth` (G) times, then 2R G
// times, 4R, ... (G = 0: R forever; R = 0: never). For R = 4, G = 2 the
// refreshes are at 4, 8, 16, 24, 40, 56, ... A function of k alone, so a
// replica that loads the state at any step follows the same schedule.
int64_t VarianceRefreshInterval(int64_t k, int64_t refresh_steps, int64_t growth);

// Whether post-freeze step k (1-based) ends a local-step interval: intervals
// 1 `growth` times, then 2 `growth` times, 4, ... capped at `max_local_steps`
// (growth 0: max_local_steps from the start; max_local_steps <= 1: every step).
bool LocalStepsSyncAt(int64_t k, int64_t max_local_steps, int64_t growth);

class QuantizedAdam final : public DataParallelOptimizer {
 public:
  // `decay[i]` says whether element i gets weight decay; elements
  // [0, num_compressed) are compressed after warm-up; `tensor_sizes` cut the
  // flat vector into its tensors (for the variance floor; empty = one tensor).
  QuantizedAdam(int64_t n, int64_t num_compressed, std::vector<uint8_t> decay, const QuantizedAdamOptions& options,
                std::vector<int64_t> tensor_sizes = {});

  // One step with this replica's (already clipped) gradient.
  absl::Status Step(ReplicaExchange& ex, double lr, absl::Span<float> params,
                    absl::Span<const float> grads) override;

  int64_t step() const { return step_; }
  bool frozen() const { return frozen_; }
  const AllReduceStats& stats() const override { return stats_; }
  // What the last Step exchanged: kAdamW (not quantized), kWarmup,
  // kCompressed (also a local-step sync), kRefresh or kLocal (no traffic);
  // kNone before the first step.
  DpStepKind last_step_kind() const override { return last_step_kind_; }
  DpStateMeta meta() const override { return {step_, frozen_}; }
  // The layer-wise plan: bits per tensor of the compressed part (the tensors
  // of `tensor_sizes` within [0, num_compressed)); empty while every tensor
  // travels at compressed.codec.bits (layer-wise off, or no plan yet).
  std::vector<int> layerwise_bits() const;
  // Named flat buffers: "m", "v", "worker_error", "server_error",
  // "error_owner" ({rank, replicas} of the error buffers; empty: none yet),
  // "local" ({sum of lr, product of (1 - lr wd)} over the local steps since
  // the last sync; empty: none pending), "anchor" (the parameters at the
  // last sync) and "local_update" (sum of lr x since it), both empty unless
  // local steps are pending, "layerwise" ({compressed exchanges so far,
  // bits per tensor...}; empty: layer-wise off). The last four are listed
  // only when they hold something (a checkpoint's safetensors reader takes
  // an empty tensor that shares its offset with the next one for an overlap).
  std::vector<std::pair<std::string, std::vector<float>*>> NamedState();
  std::vector<std::pair<std::string, const std::vector<float>*>> NamedState() const override;
  // m and v must hold n values; the error buffers none or at most
  // num_compressed (worker_error exactly num_compressed); "error_owner"
  // (optional: older states lack it) none or {rank, replicas} with
  // 0 <= rank < replicas; "local", "anchor", "local_update", "layerwise"
  // (optional) none, or {lr sum >= 0, product in (0, 1]} with anchor and
  // local_update of n values, and {count >= 0, one width in [1, 8] per
  // compressed tensor} (or {count} before the first plan). Anything else is
  // InvalidArgument naming the buffer and both sizes, and nothing is changed.
  absl::Status LoadState(const DpState& state, const DpStateMeta& meta) override;

 private:
  // The mean gradient of a warm-up or refresh step into g_ (float32, or
  // warmup_bits min-max on the compressed part).
  absl::Status GradientMean(ReplicaExchange& ex, uint64_t step, absl::Span<const float> grads);
  // The min-max exchange of the compressed part (uniform or layer-wise
  // widths), and the layer-wise re-plan after it. `also` (the float32 part)
  // is exchanged with it, in the same round trips.
  absl::Status CompressedExchange(ReplicaExchange& ex, uint64_t step, absl::Span<const float> x,
                                  absl::Span<float> mean, absl::Span<const AllReducePart> also);

  // options_.warmup_steps, at least 1 when quantized.
  int64_t WarmupSteps() const;
  // Every buffer of NamedState, the empty ones included.
  std::vector<std::pair<std::string, std::vector<float>*>> AllState();

  const int64_t n_, num_compressed_;
  const std::vector<uint8_t> decay_;
  const std::vector<int64_t> tensor_sizes_;
  std::vector<int64_t> compressed_sizes_;  // the tensors of [0, num_compressed) (the layer-wise plan's)
  const QuantizedAdamOptions options_;
  std::vector<float> m_, v_, worker_error_, server_error_, g_, scratch_;
  std::vector<float> error_owner_;  // {rank, replicas} whose residues the error buffers hold; empty: unknown
  std::vector<float> local_, anchor_, local_update_;  // pending local steps (see NamedState)
  std::vector<float> layerwise_;                      // {exchanges, bits...} (see NamedState)
  int64_t step_ = 0;
  bool frozen_ = false;
  AllReduceStats stats_;
  DpStepKind last_step_kind_ = DpStepKind::kNone;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_QUANTIZED_ADAM_H_
