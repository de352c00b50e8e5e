// The step protocol of one pipeline stage: per training step, the
// forwards and backwards of its M micro-batches in the order of the job's
// schedule (pipeline/step_schedule.h: adaptive runs whichever op has its
// input first, 1f1b interleaves in a fixed order, gpipe runs all forwards
// first; backwards always in increasing micro-batch order), each output sent
// downstream and each input gradient upstream as soon as it is computed;
// then the commit: the last backward (micro-batch M-1) carries the squared
// gradient norm of the stages below and the step's loss upstream, stage 0
// completes the norm and sends a StepCommit down the pipeline, so every
// stage clips by the whole model's norm. With tied embeddings across stages
// the last backward also carries the head's gradient up and the commit
// stage 0's embedding gradient down; both ends add the other's, so their
// copies of the matrix stay bit-identical. Resend requests from downstream
// (AQ-SGD rows whose m(xi) differs) are served while the step runs.
// Evaluation is forward-only with raw activations; the loss travels back up.
//
// It runs against StageLink (stage/stage_link.h) and StageCompute (below),
// so it is tested without gRPC or a model (stage/step_protocol_test.cc).
// Every wait on a neighbour is bounded by `link_timeout`; a vanished
// neighbour is an Unavailable error naming the link.
//
// What a neighbour sends is checked before it is used: decoded activations
// and gradients must be finite (a NaN or infinity fails the step with
// DATA_LOSS naming the step and micro-batch, before any m(xi) row or
// gradient takes it); the squared norms of the commit and of the last
// backward must be finite (or +infinity with loss scaling: an overflow),
// >= 0, and the committed total at least the partial norm this stage sent up
// (INVALID_ARGUMENT otherwise). Each refusal is reported to `rejected`. A
// stage whose own gradient norm is not finite fails the step
// (FAILED_PRECONDITION naming it) instead of sending that norm on.
//
//   StepProtocol p(options, &compute, {up, down, sender, receiver});
//   AQSWARM_ASSIGN_OR_RETURN(StepOutcome out, p.RunStep({step, epoch, ids_of_micro_batch}));
//   worker->Step(step, out.total_grad_sq);
#ifndef AQSWARM_STAGE_STEP_PROTOCOL_H_
#define AQSWARM_STAGE_STEP_PROTOCOL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/events.pb.h"
#include "stage/reject_reason.h"
#include "stage/stage_link.h"
#include "stage/wait_history.h"
#include "pipeline/link_endpoint.h"
#include "pipeline/step_schedule.h"
#include "proto/job.pb.h"

namespace aqswarm::stage {

// What the protocol asks of the stage's model (stage/stage_runner.cc wraps
// pipeline::StageWorker and the corpus).
class StageCompute {
 public:
  virtual ~StageCompute() = default;
  // Training forward of micro-batch `mb` over the samples `ids`; `in` is the
  // activations from upstream (empty on stage 0). The last stage sets
  // *loss, the others fill *out.
  virtual absl::Status Forward(int mb, absl::Span<const int64_t> ids, absl::Span<const float> in,
                               std::vector<float>* out, double* loss) = 0;
  // Backward of `mb`: grad_out is empty on the last stage; grad_in is null
  // on stage 0.
  virtual absl::Status Backward(int mb, absl::Span<const float> grad_out, std::vector<float>* grad_in) = 0;
  // Squared norm of this stage's accumulated gradient (the last stage
  // leaves out a tied-embedding copy).
  virtual double GradSquaredNorm() const = 0;
  // Tied embeddings across stages (first and last stage only, see
  // pipeline/stage_worker.h): this copy's gradient contribution, and adding
  // the other copy's.
  virtual absl::Status TiedGradient(std::vector<uint32_t>* rows, std::vector<float>* values) {
    return absl::UnimplementedError("this stage holds no tied embedding copy");
  }
  virtual absl::Status AddTiedGradient(absl::Span<const uint32_t> rows, absl::Span<const float> values) {
    return absl::UnimplementedError("this stage holds no tied embedding copy");
  }
  // Evaluation forward (no graph kept), shapes as Forward.
  virtual absl::Status Eval(absl::Span<const int64_t> ids, absl::Span<const float> in, std::vector<float>* out,
                            double* loss) = 0;
};

struct StepProtocolOptions {
  int stage = 0;
  int num_stages = 1;
  int micro_batches = 1;  // M
  int64_t micro_batch_size = 1;
  int64_t seq_len = 1;
  int64_t d_model = 1;
  // The job's: how gradients sent upstream are encoded (unset mode: fp32).
  v1::LinkCompression compression;
  pipeline::StepSchedule schedule;
  // model.tie_embeddings with num_stages > 1: the last stage's tied-head
  // gradient travels up with micro-batch M-1's gradient, stage 0 adds it
  // before it completes the norm, and stage 0's contribution travels down
  // with the commit; middle stages relay both.
  bool tie_embeddings = false;
  int64_t tied_elements = 0;  // vocab x d_model: the largest tied gradient accepted
  absl::Duration link_timeout = absl::Seconds(120);
  // Mid-step waits bounded by the link's recent waits (stage/wait_history.h);
  // a wait past that bound fails blaming the neighbour as slow. Off: every
  // wait gets link_timeout. Default: off; a peer daemon's stages have it
  // with `aqswarm peer --adaptive_deadline`.
  AdaptiveDeadlineOptions adaptive_deadline;
  // Dynamic loss scaling (pipeline/job_spec.h DynamicLossScaling): a squared
  // gradient norm of +infinity is an overflow somewhere in the pipeline and
  // every stage skips the step, so a neighbour may send one. Otherwise every
  // norm received must be finite. Default: false.
  bool loss_scaling = false;
  // Told of every message refused as invalid (activations, gradients,
  // norms, resend requests). Default: none.
  std::function<void(RejectReason reason)> rejected;
};

// The stage's ends of its links. Stage 0 has no `up`/`receiver`, the last
// stage no `down`/`sender`.
struct StepLinks {
  StageLink* up = nullptr;
  StageLink* down = nullptr;
  pipeline::ActivationSender* sender = nullptr;
  pipeline::ActivationReceiver* receiver = nullptr;
};

struct StepInput {
  int64_t step = 0;   // global step
  int64_t epoch = 0;
  // Sample ids of micro-batch `mb` of this step.
  std::function<absl::Span<const int64_t>(int mb)> micro_batch;
};

struct StepOutcome {
  double loss = 0;           // the step's mean training loss (every stage learns it)
  double total_grad_sq = 0;  // the whole model's squared gradient norm (the commit)
  pipeline::GradientCodecStats gradient_stats;  // of the gradients this stage sent
};

class StepProtocol {
 public:
  StepProtocol(StepProtocolOptions options, StageCompute* compute, StepLinks links);
  // Detaches the links from its arrival counter (they may outlive it).
  ~StepProtocol();

  absl::StatusOr<StepOutcome> RunStep(const StepInput& in);
  // Validation loss over `batches` (sample ids of each), as the last stage
  // computed it.
  absl::StatusOr<double> RunEval(int64_t step, const std::vector<absl::Span<const int64_t>>& batches);

  // Seconds spent computing (model and codecs) and waiting on a neighbour
  // since the last ResetTimes().
  double compute_seconds() const { return compute_s_; }
  double wait_seconds() const { return wait_s_; }
  void ResetTimes() { compute_s_ = wait_s_ = 0; }

 private:
  struct StepState;
  bool first() const { return o_.stage == 0; }
  bool last() const { return o_.stage + 1 == o_.num_stages; }
  absl::StatusOr<pipeline::StepOp> NextOp(const pipeline::StepOpSequencer& seq, StepState& st);
  absl::Status Forward(StepState& st, int mb);
  absl::Status Backward(StepState& st, int mb, pipeline::GradientCodec& grads);
  absl::Status ReceiveActivations(int64_t step, int mb, const std::vector<uint64_t>& ids, std::vector<float>* in);
  absl::Status ServeResend(const StepState& st, const v1::ResendRequest& req);
  absl::StatusOr<double> Commit(int64_t step, StepState& st);
  absl::Status AddTied(const v1::TiedGradient& tied, v1::Blame::Link from);
  absl::Status OwnTied(v1::TiedGradient* tied);
  // Frames from and to a neighbour; an error blames that link
  // (stage/blame.h: SILENT on a timeout, LINK_LOST otherwise).
  absl::StatusOr<v1::LinkFrame> From(StageLink* link, v1::Blame::Link which, const StageLink::Match& m);
  absl::StatusOr<v1::LinkFrame> FromUp(const StageLink::Match& m);
  absl::StatusOr<v1::LinkFrame> FromDown(const StageLink::Match& m);
  absl::Status ToUp(v1::LinkFrame f);
  absl::StatusOr<bool> Has(StageLink* link, v1::Blame::Link which, const StageLink::Match& m);
  // How long the next wait on a neighbour may take (see adaptive_deadline),
  // and the error when it did not end in time.
  absl::Duration WaitBound() const;
  absl::Status TimedOut(absl::Status s, v1::Blame::Link link, absl::Duration bound) const;
  // A mid-step wait that ended with a frame.
  void Waited(bool was_mid_step, absl::Time since);
  absl::Status ToDown(v1::LinkFrame f);
  // Counts the refusal and blames the neighbour on link `from` for it
  // (REFUSED, the reason's name, the running step).
  absl::Status Rejected(RejectReason reason, v1::Blame::Link from, absl::Status s);
  // Rejected() as the values' *_nonfinite reason for a non-finite value
  // (compression::IsNonFiniteError) and *_invalid otherwise, the message
  // prefixed with `where`.
  enum class Values { kActivation, kGradient };
  absl::Status RejectedValues(Values values, v1::Blame::Link from, absl::string_view where, absl::Status s);
  // This stage's squared gradient norm; FailedPrecondition naming the step
  // when it is NaN or infinite (an overflow's +inf is fine with loss scaling).
  absl::StatusOr<double> OwnNorm(int64_t step) const;
  // A received squared norm: finite (or +inf with loss scaling) and >= 0.
  absl::Status CheckNorm(absl::string_view what, v1::Blame::Link from, int64_t step, double sq);

  const StepProtocolOptions o_;
  StageCompute* const compute_;
  const StepLinks links_;
  FrameArrivals arrivals_;  // adaptive schedule: frames on either link
  double compute_s_ = 0, wait_s_ = 0;
  int64_t step_ = -1;  // the step (or evaluation) running: what blames name
  // Whether a frame of the running step has arrived: later waits are
  // mid-step (adaptive_deadline); an evaluation's never are.
  bool mid_step_ = false;
  bool in_eval_ = false;
  WaitHistory waits_;
};

// Tests only (fault injection, step_protocol.cc): the step from which this
// process's stage goes silent (AQSWARM_TEST_FAULT_SILENT_AT_STEP; -1:
// never). At 0 the stage never even opens its links.
int64_t TestFaultSilentAtStep();

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_STEP_PROTOCOL_H_
