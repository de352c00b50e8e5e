// Adaptive deadlines for the waits on a neighbour inside a step: a wait
// that follows a frame of the same step (the neighbour is mid-step, not at
// its step boundary, where a data-parallel exchange, a checkpoint or an
// evaluation may take long) is bounded by what such waits took recently:
// max(floor, multiple x p99 of the last `window`), once `min_samples` were
// seen, and never past the link timeout. A straggler or a slow sender is
// then noticed within a step instead of after the link timeout, while a
// peer that is slow all along sets its own baseline (placement's business,
// not blame's).
//
//   WaitHistory h(o);
//   std::optional<absl::Duration> bound = h.Bound();   // nullopt: the link timeout
//   ... wait ...;  h.Record(waited);
#ifndef AQSWARM_STAGE_WAIT_HISTORY_H_
#define AQSWARM_STAGE_WAIT_HISTORY_H_

#include <optional>
#include <vector>

#include "absl/time/time.h"

namespace aqswarm::stage {

struct AdaptiveDeadlineOptions {
  bool enabled = false;
  double multiple = 8;
  absl::Duration floor = absl::Seconds(5);
  int window = 64;
  int min_samples = 16;
};

class WaitHistory {
 public:
  explicit WaitHistory(AdaptiveDeadlineOptions options) : o_(options) {}
  void Record(absl::Duration waited);
  // The bound of the next mid-step wait (nullopt: not enabled or too few samples yet).
  std::optional<absl::Duration> Bound() const;
  // The 99th percentile of the recorded waits (the window's element at
  // floor(0.99 x (n - 1)) in sorted order); zero with none.
  absl::Duration P99() const;

 private:
  const AdaptiveDeadlineOptions o_;
  std::vector<absl::Duration> ring_;
  size_t next_ = 0;
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_WAIT_HISTORY_H_
