#include "pipeline/step_schedule.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"

namespace aqswarm::pipeline {

absl::StatusOr<StepSchedule> StepScheduleFromJob(const v1::JobSpec& job) {
  StepSchedule s;
  if (job.schedule() == "gpipe") {
    s.kind = StepSchedule::kGpipe;
  } else if (job.schedule().empty() || job.schedule() == "1f1b") {
    s.kind = StepSchedule::k1F1B;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("job spec: schedule: '", job.schedule(), "' is not 1f1b or gpipe"));
  }
  s.stages = std::max<int>(1, job.stages());
  s.micro_batches = std::max<int>(1, job.micro_batches_per_step());
  s.in_flight = static_cast<int>(job.schedule_in_flight());
  return s;
}

std::string StepScheduleName(const StepSchedule& s) {
  if (s.kind == StepSchedule::kGpipe) return "gpipe";
  if (s.in_flight == 0) return "1f1b";
  return absl::StrCat("1f1b/", s.in_flight);
}

int InFlightAt(const StepSchedule& s, int stage) {
  const int k = s.stages, m = s.micro_batches;
  if (s.kind == StepSchedule::kGpipe) return m;
  const int w0 = std::max(1, s.in_flight > 0 ? s.in_flight : 2 * k - 1);
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

double LinkBoundStepTime(const StepSchedule& s, double t_fw, double t_bw) {
  const int k = s.stages, m = s.micro_batches;
  // act[i][j] / grad[i][j]: when micro-batch j's activations / gradient have
  // fully arrived at stage i.
  std::vector<std::vector<std::optional<double>>> act(k, std::vector<std::optional<double>>(m));
  std::vector<std::vector<std::optional<double>>> grad(k, std::vector<std::optional<double>>(m));
  for (int j = 0; j < m; ++j) act[0][j] = 0.0;
  std::vector<double> fw_free(k, 0), bw_free(k, 0), now(k, 0);
  std::vector<std::vector<StepOp>> ops(k);
  for (int i = 0; i < k; ++i) ops[i] = StageStepOps(s, i);
  std::vector<size_t> pos(k, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int i = 0; i < k; ++i) {
      for (; pos[i] < ops[i].size(); ++pos[i], progress = true) {
        const StepOp op = ops[i][pos[i]];
        const int j = op.micro_batch;
        if (op.forward) {
          if (!act[i][j]) break;
          now[i] = std::max(now[i], *act[i][j]);
          if (i + 1 < k) {
            fw_free[i] = std::max(now[i], fw_free[i]) + t_fw;
            act[i + 1][j] = fw_free[i];
          }
        } else {
          if (i + 1 < k) {
            if (!grad[i][j]) break;
            now[i] = std::max(now[i], *grad[i][j]);
          }
          if (i > 0) {
            bw_free[i - 1] = std::max(now[i], bw_free[i - 1]) + t_bw;
            grad[i - 1][j] = bw_free[i - 1];
          }
        }
      }
    }
  }
  // Every stage finishes (the schedules are deadlock-free); stage 0 last.
  double end = 0;
  for (int i = 0; i < k; ++i) end = std::max(end, pos[i] == ops[i].size() ? now[i] : INFINITY);
  return end;
}

}  // namespace aqswarm::pipeline
