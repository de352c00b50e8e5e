// Data-parallel Adam over a flat parameter vector, torch-free: AdamW on
// averaged gradients for `warmup_steps`, then QuantizedAdam (1-bit-Adam style,
// docs/design/ALGORITHMS.md §3): the variance is frozen and the momentum is exchanged
// compressed with worker and server error feedback.
//
//   warm-up:  g = mean_replicas(g_local)                (raw float32)
//             m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//             p *= 1 - lr*wd (matrices);  p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)
//   freeze:   v = v / bc2 at the last warm-up step; where v is 0 (no
//             gradient yet) v = 0.01 * mean over the tensor of v.
//   after:    m_local = b1 m + (1-b1) g_local
//             x = mean_replicas~(m_local / s),  s = sqrt(v) + eps   (compressed)
//             m = x s;  u = clamp(x / bc1, -B, B)   (bc1 = 1 - b1^t keeps going after the freeze)
//             p *= 1 - lr*wd (matrices);  p -= lr * u
//             where |x / bc1| > B:  v = (m / bc1 / B)^2   (raise_variance_at_bound)
//   refresh:  every R-th step after the freeze (variance_refresh_steps = R)
//             exchanges g in float32 instead: m = b1 m + (1-b1) g;
//             v = (b2^R bc2(t-R) v + (1 - b2^R) g^2) / bc2(t), zeros filled
//             as at the freeze; the error buffers are zeroed; the step is as above.
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
// the freeze makes m/sqrt(v) 100-700 (measured, docs/CONVERGENCE.md): a step
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
// Adam's (Lu et al. 2022: v updated from full-precision gradients at growing
// intervals; ours is fixed); one refresh costs a warm-up step's bytes.
// Elements [0, num_compressed) are exchanged with the compressed codec after
// warm-up; the rest (biases, LayerNorm: tiny tensors) always go raw.
// All replicas apply the same decoded bytes and the same v, so parameters
// stay bit-identical.
//
// State (checkpointed and handed to a joining replica): m, v, worker error,
// server error, error owner, step, frozen flag (NamedState / LoadState).
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
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

struct QuantizedAdamOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  // Plain data-parallel AdamW steps before the variance freezes. Default: 100
  // here; a job's dp.warmup_steps (QuantizedAdamOptionsFromJob) is 0 unless set,
  // so a job freezes at once unless it asks for warm-up.
  int64_t warmup_steps = 100;
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
  // After the freeze, every Nth step is a variance refresh (see the banner).
  // 0 = never. Default: 0 (a job's default is 4, pipeline/job_spec.cc).
  int64_t variance_refresh_steps = 0;
  // Exchange rounds this optimizer uses within a step: first_round and
  // first_round + 1. Two optimizers sharing one exchange in the same step
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

// From a job: optimizer betas/eps/decay + dp.{optimizer, warmup_steps, codec, bits, bucket_size,
// robust, robust_clip}. The robust aggregation applies to every round with a
// bucketed or float32 codec (not Global-QSGD's integer sums).
QuantizedAdamOptions QuantizedAdamOptionsFromJob(const v1::JobSpec& job);

// The largest per-coordinate step (in units of lr, eps = 0) bias-corrected
// Adam can take at step `step` (1-based) over all gradient histories:
// (1-b1)/bc1 * sqrt(bc2/(1-b2) * sum_{j<t} (b1^2/b2)^j). 1 at step 1; for the
// default betas 1.12 at step 17, 1.83 at 65, 7.27 in the limit.
double AdamUpdateBound(double beta1, double beta2, int64_t step);

class QuantizedAdam {
 public:
  // `decay[i]` says whether element i gets weight decay; elements
  // [0, num_compressed) are compressed after warm-up; `tensor_sizes` cut the
  // flat vector into its tensors (for the variance floor; empty = one tensor).
  QuantizedAdam(int64_t n, int64_t num_compressed, std::vector<uint8_t> decay, const QuantizedAdamOptions& options,
                std::vector<int64_t> tensor_sizes = {});

  // One step with this replica's (already clipped) gradient.
  absl::Status Step(ReplicaExchange& ex, double lr, absl::Span<float> params, absl::Span<const float> grads);

  int64_t step() const { return step_; }
  bool frozen() const { return frozen_; }
  const AllReduceStats& stats() const { return stats_; }
  // What the last Step exchanged (events.proto StepDataParallel.kind):
  // "adamw" (not quantized), "warmup", "compressed" or "refresh"; "" before
  // the first step.
  const std::string& last_step_kind() const { return last_step_kind_; }
  // Named flat buffers: "m", "v", "worker_error", "server_error",
  // "error_owner" ({rank, replicas} of the error buffers; empty: none yet).
  std::vector<std::pair<std::string, std::vector<float>*>> NamedState();
  std::vector<std::pair<std::string, const std::vector<float>*>> NamedState() const;
  // m and v must hold n values; the error buffers none or at most
  // num_compressed (worker_error exactly num_compressed); "error_owner"
  // (optional: older states lack it) none or {rank, replicas} with
  // 0 <= rank < replicas. Anything else is InvalidArgument naming the buffer
  // and both sizes, and nothing is changed.
  absl::Status LoadState(const std::vector<std::pair<std::string, std::vector<float>>>& state, int64_t step,
                         bool frozen);

 private:
  const int64_t n_, num_compressed_;
  const std::vector<uint8_t> decay_;
  const std::vector<int64_t> tensor_sizes_;
  const QuantizedAdamOptions options_;
  std::vector<float> m_, v_, worker_error_, server_error_, g_, scratch_;
  std::vector<float> error_owner_;  // {rank, replicas} whose residues the error buffers hold; empty: unknown
  int64_t step_ = 0;
  bool frozen_ = false;
  AllReduceStats stats_;
  std::string last_step_kind_;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_QUANTIZED_ADAM_H_
