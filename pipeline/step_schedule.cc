#include "pipeline/step_schedule.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"

namespace aqswarm::pipeline {

absl::StatusOr<StepSchedule> StepScheduleFromJob(const v1::JobSpec& job) {
  StepSchedule s;
  switch (job.schedule()) {
    case v1::JobSpec::Schedule::gpipe: s.kind = StepSchedule::kGpipe; break;
    case v1::JobSpec::Schedule::one_f_one_b: s.kind = StepSchedule::k1F1B; break;
    case v1::JobSpec::Schedule::UNSPECIFIED:  // a job stored before the field existed: the default
    case v1::JobSpec::Schedule::adaptive: s.kind = StepSchedule::kAdaptive; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("job spec: schedule: ", job.schedule(), " is not 1f1b, adaptive or gpipe"));
  }
  s.stages = std::max<int>(1, job.stages());
  s.micro_batches = std::max<int>(1, job.micro_batches_per_step());
  s.in_flight = static_cast<int>(job.schedule_in_flight());
  return s;
}

std::string StepScheduleName(const StepSchedule& s) {
  if (s.kind == StepSchedule::kGpipe) return "gpipe";
  const char* name = s.kind == StepSchedule::kAdaptive ? "adaptive" : "1f1b";
  if (s.in_flight == 0) return name;
  return absl::StrCat(name, "/", s.in_flight);
}

int InFlightAt(const StepSchedule& s, int stage) {
  const int k = s.stages, m = s.micro_batches;
  if (s.kind == StepSchedule::kGpipe) return m;
  const int w0 = std::max(1, s.in_flight > 0 ? s.in_flight : s.kind == StepSchedule::kAdaptive ? 4 * k - 1 : 2 * k - 1);
  if (k <= 1) return 1;
  const int64_t num = int64_t{w0 - 1} * (k - 1 - stage);
  const int w = 1 + static_cast<int>((num + k - 2) / (k - 1));  // 1 + ceil(num / (k - 1))
  return std::clamp(w, 1, m);
}

std::vector<StepOp> StageStepOps(const StepSchedule& s, int stage) {
  const int m = s.micro_batches;
  const int w = InFlightAt(s, stage);
  std::vector<StepOp> ops;
  ops.reserve(2 * m);
  int f = 0, b = 0;
  while (f < w) ops.push_back({true, f++});
  while (f < m) {
    ops.push_back({false, b++});
    ops.push_back({true, f++});
  }
  while (b < m) ops.push_back({false, b++});
  return ops;
}

StepOpSequencer::StepOpSequencer(const StepSchedule& s, int stage)
    : m_(s.micro_batches), window_(InFlightAt(s, stage)) {
  if (s.kind != StepSchedule::kAdaptive) ops_ = StageStepOps(s, stage);
}

std::optional<StepOp> StepOpSequencer::backward() const {
  if (!adaptive()) {
    if (done()) return std::nullopt;
    const StepOp& op = ops_[forwards_ + backwards_];
    return op.forward ? std::nullopt : std::optional<StepOp>(op);
  }
  if (backwards_ == forwards_) return std::nullopt;
  return StepOp{false, backwards_};
}

std::optional<StepOp> StepOpSequencer::forward() const {
  if (!adaptive()) {
    if (done()) return std::nullopt;
    const StepOp& op = ops_[forwards_ + backwards_];
    return op.forward ? std::optional<StepOp>(op) : std::nullopt;
  }
  if (forwards_ == m_ || forwards_ - backwards_ >= window_) return std::nullopt;
  return StepOp{true, forwards_};
}

void StepOpSequencer::Ran(const StepOp& op) { ++(op.forward ? forwards_ : backwards_); }

double LinkBoundStepTime(const StepSchedule& s, double t_fw, double t_bw) {
  const int k = s.stages, m = s.micro_batches;
  // act[i][j] / grad[i][j]: when micro-batch j's activations / gradient have
  // fully arrived at stage i (the last stage's gradients are its own).
  std::vector<std::vector<std::optional<double>>> act(k, std::vector<std::optional<double>>(m));
  std::vector<std::vector<std::optional<double>>> grad(k, std::vector<std::optional<double>>(m));
  for (int j = 0; j < m; ++j) act[0][j] = grad[k - 1][j] = 0.0;
  std::vector<double> fw_free(k, 0), bw_free(k, 0), now(k, 0);
  std::vector<StepOpSequencer> seq;
  for (int i = 0; i < k; ++i) seq.emplace_back(s, i);
  // Events in time order: the op, over all stages, that can start first. An
  // input not known yet comes from an op starting no earlier, plus a
  // transfer, so it cannot arrive before that.
  while (true) {
    int stage = -1;
    StepOp best;
    double best_start = INFINITY;
    for (int i = 0; i < k; ++i) {
      for (const std::optional<StepOp>& op : {seq[i].backward(), seq[i].forward()}) {
        if (!op) continue;
        const std::optional<double>& in = op->forward ? act[i][op->micro_batch] : grad[i][op->micro_batch];
        if (in && std::max(now[i], *in) < best_start) {  // strict: a backward wins a tie
          stage = i;
          best = *op;
          best_start = std::max(now[i], *in);
        }
      }
    }
    if (stage < 0) break;
    const int i = stage, j = best.micro_batch;
    now[i] = best_start;
    seq[i].Ran(best);
    if (best.forward && i + 1 < k) {
      fw_free[i] = std::max(now[i], fw_free[i]) + t_fw;
      act[i + 1][j] = fw_free[i];
    } else if (!best.forward && i > 0) {
      bw_free[i - 1] = std::max(now[i], bw_free[i - 1]) + t_bw;
      grad[i - 1][j] = bw_free[i - 1];
    }
  }
  // Every stage finishes (the schedules are deadlock-free); stage 0 last.
  double end = 0;
  for (int i = 0; i < k; ++i) end = std::max(end, seq[i].done() ? now[i] : INFINITY);
  return end;
}

}  // namespace aqswarm::pipeline
