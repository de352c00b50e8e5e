// The order in which one pipeline stage runs the forwards and backwards of a
// step's M micro-batches (job.schedule, proto/job.proto), and a model of the
// step time it allows when only the links cost time.
//
//   StepSchedule s = StepScheduleFromJob(job);
//   for (const StepOp& op : StageStepOps(s, stage)) op.forward ? Forward(op.micro_batch) : Backward(op.micro_batch);
//
// All three schedules run every stage's backwards in increasing micro-batch
// order (so gradients accumulate in the same order and they train to
// bit-identical weights), and a step always ends with a flush: the runner
// commits the global gradient norm and steps the optimizer after the last
// backward.
//
//   gpipe  all M forwards, then all M backwards. A link's activations (down)
//          and gradients (up) are never on the wire at the same time.
//   1f1b   PipeDream-flush: stage i runs W_i warm-up forwards, then one
//          backward and one forward alternately, then the remaining
//          backwards; W_i micro-batches are in flight at stage i (forwarded,
//          backward not done). W_0 = in_flight; later stages scale it down to
//          1 at the last stage: W_i = 1 + ceil((W_0 - 1) (K - 1 - i) / (K - 1)),
//          capped at M. W_0 = K is the classic schedule (W_i = K - i), which
//          is enough when compute dominates (a micro-batch's round trip from
//          stage i is K-1-i forward and K-1-i backward computes, and a stage's
//          period is one forward plus one backward). When transfers dominate
//          the two directions of a link work in parallel, so the period is
//          one transfer while the round trip crosses 2 (K-1-i) transfers:
//          W_0 = 2K - 1 (the default; W_i = 2 (K-1-i) + 1) keeps both
//          directions busy. Deeper is not better: a stage that runs more
//          forwards before a backward delays the gradients of every stage
//          above it.
//
//   adaptive  the 1f1b window (W_i in flight) and orders (forwards and
//          backwards each in increasing micro-batch order), but each op runs
//          when its input is there rather than at a fixed place: the next
//          backward as soon as its gradient has arrived, otherwise the next
//          forward whose activations have, while fewer than W_i are in
//          flight (StepOpSequencer). A middle stage then never holds a
//          gradient back behind a forward whose input is late, or a forward
//          behind a late gradient, so a window deeper than 2K - 1 costs only
//          memory, and it covers the round trip where compute and links are
//          about as slow (it then crosses 2(K - 1) transfers and as many
//          computes, which take longer when stages share cores). Its
//          default window is W_0 = 4K - 1, about twice 1f1b's (how it was
//          chosen: docs/notebook/slownet.md). The default schedule.
//
// Any W_i that does not grow along the pipeline (W_{i-1} >= W_i, W_last = 1)
// is deadlock-free with asynchronous sends: a stage never waits for an
// activation that its upstream will only send after a backward this stage
// has not run yet.
//
// Thread-safe (pure functions).
#ifndef AQSWARM_PIPELINE_STEP_SCHEDULE_H_
#define AQSWARM_PIPELINE_STEP_SCHEDULE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

struct StepSchedule {
  enum Kind { kGpipe, k1F1B, kAdaptive };
  Kind kind = kAdaptive;
  int stages = 1;          // K
  int micro_batches = 1;   // M
  // 1f1b, adaptive: micro-batches in flight at stage 0 (W_0). 0 = 2K - 1
  // (1f1b), 4K - 1 (adaptive). Ignored by gpipe.
  int in_flight = 0;
};

// From job.schedule ("adaptive" or empty: adaptive; "1f1b"; "gpipe"),
// job.schedule_in_flight, job.stages and job.micro_batches_per_step.
absl::StatusOr<StepSchedule> StepScheduleFromJob(const v1::JobSpec& job);
// "gpipe", "1f1b" (W_0 = 2K - 1), "1f1b/W" (another W_0), "adaptive"
// (W_0 = 4K - 1), "adaptive/W".
std::string StepScheduleName(const StepSchedule& s);

struct StepOp {
  bool forward = true;
  int micro_batch = 0;
};

// Micro-batches in flight at `stage` (W_i above; M for gpipe).
int InFlightAt(const StepSchedule& s, int stage);
// The step's 2M operations of `stage`, in order (gpipe, 1f1b; for adaptive,
// the 1f1b order, which is what it runs when every input arrives in it).
std::vector<StepOp> StageStepOps(const StepSchedule& s, int stage);

// Hands out one stage's ops of one step.
//
//   StepOpSequencer seq(schedule, stage);
//   while (!seq.done()) {
//     std::optional<StepOp> op = ...;  // backward() or forward(), see below
//     Run(*op);
//     seq.Ran(*op);
//   }
//
// gpipe and 1f1b offer exactly one op at a time, their fixed order: run it
// (waiting for its input). adaptive offers the next backward (once its
// forward ran) and the next forward (while fewer than W_i are in flight):
// the caller runs the backward if its gradient has arrived (at the last
// stage it always has: the loss is local), else the forward if its
// activations have (at stage 0 they always have), else waits for a frame.
class StepOpSequencer {
 public:
  StepOpSequencer(const StepSchedule& s, int stage);
  bool adaptive() const { return ops_.empty(); }
  bool done() const { return backwards_ == m_; }
  std::optional<StepOp> backward() const;
  std::optional<StepOp> forward() const;
  // Records that `op`, one of the two above, ran.
  void Ran(const StepOp& op);

 private:
  int m_ = 0, window_ = 1;
  std::vector<StepOp> ops_;  // static schedules; empty for adaptive
  int forwards_ = 0, backwards_ = 0;
};

// Link-bound step time: every stage runs its StepOpSequencer with zero
// compute (an adaptive stage takes whichever offered op's input arrives
// first, a backward on a tie);
// each link direction sends one micro-batch at a time (t_fw seconds for the
// activations on every link, t_bw for the gradients), FIFO, and a stage
// forwards a micro-batch only once it has fully arrived (store-and-forward).
// Returns when the last backward of stage 0 can run. gpipe gives
// (M + K - 2)(t_fw + t_bw); an unbounded window gives the lower bound of any
// schedule with a flush per step, (M - 1) max(t_fw, t_bw) + (K - 1)(t_fw + t_bw).
double LinkBoundStepTime(const StepSchedule& s, double t_fw, double t_bw);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_STEP_SCHEDULE_H_
