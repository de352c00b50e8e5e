// Data-parallel Adam over a flat parameter vector, torch-free: AdamW on
// averaged gradients for `warmup_steps`, then QuantizedAdam (1-bit-Adam style,
// ALGORITHMS.md §3): the variance is frozen and the momentum is exchanged
// compressed with worker and server error feedback.
//
//   warm-up:  g = mean_replicas(g_local)                (raw float32)
//             m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//             p *= 1 - lr*wd (matrices);  p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)
//   freeze:   v = max(v / bc2, 0.01 * mean over the tensor of v / bc2)
//             at the last warm-up step (the floor is ours: a coordinate that
//             saw no gradient during warm-up would otherwise freeze at 0).
//   after:    m_local = b1 m + (1-b1) g_local
//             x = mean_replicas~(m_local / s),  s = sqrt(v) + eps   (compressed)
//             m = x s;  u = clamp(x / bc1, -B, B)   (bc1 = 1 - b1^t keeps going after the freeze)
//             p *= 1 - lr*wd (matrices);  p -= lr * u
//   with B = AdamUpdateBound = max(1, (1-b1)/sqrt(1-b2)) (3.16 for the
//   default betas) and mean_replicas~ the compressed allreduce: min-max with
//   error feedback on both sides (AllReduceMean), or Global-QSGD's integer sum
//   (GlobalQsgdAllReduceMean, unbiased, no error feedback).
//
// Why not plain 1-bit Adam (DeepSpeed: raw m exchanged, v frozen as is, no
// bias correction, no bound)? DeepSpeed freezes after thousands of steps; a
// short warm-up leaves coordinates whose token (embedding or output row) was
// never or rarely seen at the floor, so the first gradient they get after the
// freeze makes m/sqrt(v) 100-700 (measured, docs/CONVERGENCE.md): a step of
// hundreds of lr on one row, the loss spikes, the next gradient throws it
// back. Adam itself cannot step further than B lr in one step; the bound B
// restores that. Exchanging m / s instead of m puts the min-max bucket error in
// units of the step: with raw m, a bucket's error is sized by its largest
// momenta and divided by the small sqrt(v) of its quiet coordinates. Since
// v is the same on every replica, mean(m / s) = mean(m) / s: lossless codecs
// give the same update either way.
// Elements [0, num_compressed) are exchanged with the compressed codec after
// warm-up; the rest (biases, LayerNorm: tiny tensors) always go raw.
// All replicas apply the same decoded bytes and the same v, so parameters
// stay bit-identical.
//
// State (checkpointed and handed to a joining replica): m, v, worker error,
// server error, step, frozen flag (NamedState / LoadState). After the freeze
// the error buffers are in units of m / s.
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
  // Plain data-parallel AdamW steps before the variance freezes. Default: 100.
  int64_t warmup_steps = 100;
  // false: AdamW on raw averaged gradients forever (the fp32 baseline).
  bool quantized = true;
  // After the freeze, exchange the preconditioned momentum m / (sqrt(v) + eps)
  // instead of m (see the banner). Default: true.
  bool precondition_exchange = true;
  // After the freeze, each coordinate's step is at most update_clip * lr.
  // 0 = unbounded; < 0 = AdamUpdateBound(beta1, beta2). Default: -1.
  double update_clip = -1;
  // After the freeze, divide m by 1 - beta1^t as in the warm-up. Default: true.
  bool bias_correct_frozen = true;
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

// From a job: optimizer betas/eps/decay + dp.{optimizer, warmup_steps, codec, bits, bucket_size}.
QuantizedAdamOptions QuantizedAdamOptionsFromJob(const v1::JobSpec& job);

// The largest per-coordinate step (in units of lr) bias-corrected Adam can
// take: max(1, (1 - beta1) / sqrt(1 - beta2)) (Kingma & Ba, section 2.1).
double AdamUpdateBound(double beta1, double beta2);

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
  // Named flat buffers: "m", "v", "worker_error", "server_error".
  std::vector<std::pair<std::string, std::vector<float>*>> NamedState();
  std::vector<std::pair<std::string, const std::vector<float>*>> NamedState() const;
  absl::Status LoadState(const std::vector<std::pair<std::string, std::vector<float>>>& state, int64_t step,
                         bool frozen);

 private:
  const int64_t n_, num_compressed_;
  const std::vector<uint8_t> decay_;
  const std::vector<int64_t> tensor_sizes_;
  const QuantizedAdamOptions options_;
  std::vector<float> m_, v_, worker_error_, server_error_, g_, scratch_;
  int64_t step_ = 0;
  bool frozen_ = false;
  AllReduceStats stats_;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_QUANTIZED_ADAM_H_
