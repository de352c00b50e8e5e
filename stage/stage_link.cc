#include "stage/stage_link.h"

namespace aqswarm::stage {

uint64_t FrameArrivals::count() const {
  absl::MutexLock l(&mu_);
  return count_;
}

bool FrameArrivals::WaitPast(uint64_t seen, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_ != seen; };
  return mu_.AwaitWithDeadline(absl::Condition(&changed), deadline);
}

bool FrameArrivals::WaitFor(uint64_t n, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_ >= n; };
  return mu_.AwaitWithDeadline(absl::Condition(&reached), deadline);
}

void FrameArrivals::Notify() {
  absl::MutexLock l(&mu_);
  ++count_;
}

}  // namespace aqswarm::stage
