// One pipeline stage's compute, behind a torch-free interface.
//
// The link layer (peer/, pipeline/link*) moves flat float buffers between
// processes; StageWorker turns them into tensors, runs the stage's forward and
// backward for one micro-batch at a time, keeps what backward needs, and steps
// the optimizer. Activations at a boundary are [micro_batch, seq_len, d_model]
// float32, row-major; one sample's slice is seq_len*d_model floats.
//
//   AQSWARM_ASSIGN_OR_RETURN(auto w, StageWorker::Create(job, stage));
//   w->ForwardTokens(mb, tokens, &act);          // stage 0
//   w->ForwardHidden(mb, act_in, &act_out);      // middle stages
//   w->ForwardLoss(mb, act_in, {}, targets, b, &loss);  // last stage
//   w->Backward(mb, grad_out, &grad_in);         // any order; gradients accumulate
//   w->AddTiedGradient(rows, values);            // tied embeddings across stages (first, last)
//   w->Step(step, sum_over_stages(GradSquaredNorm()));  // after all micro-batches
//
// Not thread-safe: one compute thread drives it.
#ifndef AQSWARM_PIPELINE_STAGE_WORKER_H_
#define AQSWARM_PIPELINE_STAGE_WORKER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

class ReplicaExchange;

class StageWorker {
 public:
  // Builds stage `stage` of job.stages(), initialised from job.seed (or from
  // job.model.init_weights when set). Sets torch's intra-op threads.
  static absl::StatusOr<std::unique_ptr<StageWorker>> Create(const v1::JobSpec& job, int stage);
  virtual ~StageWorker() = default;

  virtual int stage() const = 0;
  virtual bool is_first() const = 0;
  virtual bool is_last() const = 0;
  // Floats per sample at this stage's output boundary (seq_len * d_model).
  virtual int64_t boundary_elements_per_sample() const = 0;

  // Stage 0: tokens [B, T] int32 -> activations [B, T, D].
  virtual absl::Status ForwardTokens(int micro_batch, absl::Span<const int32_t> tokens, int64_t batch,
                                     std::vector<float>* out) = 0;
  // Middle stage: [B, T, D] -> [B, T, D].
  virtual absl::Status ForwardHidden(int micro_batch, absl::Span<const float> in, int64_t batch,
                                     std::vector<float>* out) = 0;
  // Last stage: [B, T, D] + targets [B, T] -> mean loss (kept for backward).
  // A single-stage job passes tokens instead of `in`.
  virtual absl::Status ForwardLoss(int micro_batch, absl::Span<const float> in, absl::Span<const int32_t> tokens,
                                   absl::Span<const int32_t> targets, int64_t batch, double* loss) = 0;
  // Backward of `micro_batch`. grad_out is empty on the last stage; grad_in is
  // not produced on stage 0 (may be null). The loss is scaled by 1/M, M =
  // micro-batches per step, so gradients accumulate to the step mean.
  virtual absl::Status Backward(int micro_batch, absl::Span<const float> grad_out, std::vector<float>* grad_in) = 0;
  // Evaluation forward (no graph kept): same shapes as above.
  virtual absl::Status EvalHidden(absl::Span<const float> in, absl::Span<const int32_t> tokens, int64_t batch,
                                  std::vector<float>* out) = 0;
  virtual absl::Status EvalLoss(absl::Span<const float> in, absl::Span<const int32_t> tokens,
                                absl::Span<const int32_t> targets, int64_t batch, double* loss) = 0;

  // model.tie_embeddings across stages: the first and the last stage each
  // hold a copy of the tied matrix [vocab, d_model] (the embedding, the head).
  // Every step, after its last backward, each copy's gradient contribution
  // goes to the other end (the step protocol relays them) and both add the
  // two in the same way, so the copies stay bit-identical.
  virtual bool holds_tied_copy() const = 0;
  // This copy's contribution, before AddTiedGradient: stage 0 gives the rows
  // of the tokens it embedded this step (sorted; values rows x d_model; every
  // other row is zero), the last stage its dense head gradient (rows empty,
  // values vocab x d_model).
  virtual absl::Status TiedGradient(std::vector<uint32_t>* rows, std::vector<float>* values) = 0;
  // Adds the other copy's contribution (layout as above) to this copy's
  // gradient: the two are summed elementwise, the same way at both ends.
  // InvalidArgument on a row outside the vocabulary, a size that does not
  // match, or a non-finite value; nothing is changed then.
  virtual absl::Status AddTiedGradient(absl::Span<const uint32_t> rows, absl::Span<const float> values) = 0;
  // XXH3 of this stage's copy of the tied matrix (0 without one).
  virtual uint64_t TiedEmbeddingHash() const = 0;

  // Sum of squares of this stage's accumulated gradients (with loss scaling,
  // of the unscaled ones; infinite after an overflow). The last stage leaves
  // out its tied copy: stage 0 counts the summed tied gradient once.
  // Clipping is by the norm of the WHOLE model's gradient, so the pipeline
  // adds these up across stages (one double per stage travels the links)
  // before stepping.
  virtual double GradSquaredNorm() const = 0;
  // Clips by sqrt(total_grad_squared_norm), applies AdamW at the scheduled
  // learning rate for `step`, zeroes gradients, drops saved micro-batches.
  virtual absl::Status Step(int64_t step, double total_grad_squared_norm) = 0;

  // Data-parallel step (job.data_parallel > 1): FailedPrecondition naming
  // the step, before anything is exchanged, when the norm or this replica's
  // gradient is NaN or infinite. Clips this replica's gradient
  // by its pipeline's whole-model norm, then AdamW on the replicas' mean
  // gradient for dp.warmup_steps, then QuantizedAdam (pipeline/quantized_adam.h)
  // over `exchange`. Replicas that start equal stay bit-identical.
  // With dp.optimizer diloco, DiLoCo (pipeline/diloco.h) instead: this
  // replica's own AdamW every step, an outer step over `exchange` every
  // dp.inner_steps (per fragment); the anchors stay bit-identical, the
  // parameters between syncs are the pipeline's own.
  //
  // With dp.delayed_update the exchange and optimizer step of `step` run on a
  // background thread and this returns once the PREVIOUS step's update is
  // applied: the next step computes on those parameters extrapolated by that
  // update (2 M_t - M_{t-1}), not on the ones its gradient will update. `exchange`
  // must then outlive the update in flight, i.e. the next StepDataParallel,
  // FinishDataParallel, or this worker; an update that failed fails the call
  // that waits for it.
  virtual absl::Status StepDataParallel(int64_t step, double total_grad_squared_norm, ReplicaExchange& exchange) = 0;
  // Waits for a delayed update still in flight and applies it, so the
  // parameters are the latest (after the last step, before evaluating or
  // exporting them). A no-op without one. Under dp.optimizer diloco, sets
  // the parameters to the anchors (the model all replicas share; the inner
  // steps since each fragment's last outer step are dropped: none when the
  // job's last step is an outer step of every fragment).
  virtual absl::Status FinishDataParallel() = 0;
  // Bytes this stage sent to its replicas so far (encoded), and what AdamW's
  // float32 all-reduce of the whole stage would have sent over the same steps
  // (pipeline/dp_allreduce.h Float32AllReduceBytes; a diloco inner step or a
  // local step counts it too, though it sends nothing).
  virtual uint64_t dp_bytes_sent() const = 0;
  virtual uint64_t dp_raw_bytes() const = 0;
  // What the last data-parallel step exchanged (events.proto
  // StepDataParallel.kind): QuantizedAdam's "adamw", "warmup", "compressed"
  // or "refresh"; DiLoCo's "local" (no traffic) or "outer"; "" before the
  // first step.
  virtual std::string dp_step_kind() const = 0;
  // dp.robust, since the worker started: contributions of other replicas
  // dropped as non-finite and contributions clipped, at the chunks this
  // replica owns (pipeline/dp_allreduce.h AllReduceStats).
  virtual uint64_t dp_robust_dropped() const = 0;
  virtual uint64_t dp_robust_clipped() const = 0;

  virtual int64_t num_parameters() const = 0;
  // XXH3 of all parameter bytes: replicas compare it to prove bit-identity.
  // Under dp.optimizer diloco (once it has stepped) the XXH3 of the anchors
  // instead (the tied copy's, then the stage's: the parameters at the last
  // outer step, pipeline/diloco.h): between outer steps each pipeline's
  // parameters are its own, the anchors are what every replica shares. With
  // one fragment the parameters equal the anchor right after an outer step.
  virtual uint64_t ParameterHash() const = 0;

  // With a delayed update in flight, waits for it first and saves the
  // parameters in use, the update's result and the parameters before it (a
  // loader resumes with the update still to apply, as here). A checkpoint
  // whose delayed state does not fit the stage fails to load with DataLoss.
  virtual absl::Status SaveCheckpoint(const std::string& path) = 0;
  virtual absl::Status LoadCheckpoint(const std::string& path) = 0;
  virtual int64_t optimizer_step() const = 0;
  // After LoadCheckpoint (or none: a seeded start): the stage's parameters
  // become those every replica shares (DiLoCo's anchor), the state's own
  // inner progress is dropped (DataParallelOptimizer::RestartFromShared)
  // and its optimizers go on at `step` (SkipTo; DiLoCo only, else `step`
  // must be the state's). A pipeline healing into running replicas from
  // another replica's state starts so.
  virtual absl::Status RestartFromShared(int64_t step) = 0;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_STAGE_WORKER_H_
