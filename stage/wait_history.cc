#include "stage/wait_history.h"

#include <algorithm>

namespace aqswarm::stage {

void WaitHistory::Record(absl::Duration waited) {
  if (!o_.enabled || o_.window <= 0) return;
  if (ring_.size() < static_cast<size_t>(o_.window)) {
    ring_.push_back(waited);
  } else {
    ring_[next_] = waited;
  }
  next_ = (next_ + 1) % static_cast<size_t>(o_.window);
}

absl::Duration WaitHistory::P99() const {
  if (ring_.empty()) return absl::ZeroDuration();
  std::vector<absl::Duration> sorted = ring_;
  const size_t k = static_cast<size_t>(0.99 * static_cast<double>(sorted.size() - 1));
  std::nth_element(sorted.begin(), sorted.begin() + k, sorted.end());
  return sorted[k];
}

std::optional<absl::Duration> WaitHistory::Bound() const {
  if (!o_.enabled || ring_.size() < static_cast<size_t>(std::max(1, o_.min_samples))) return std::nullopt;
  return std::max(o_.floor, o_.multiple * P99());
}

}  // namespace aqswarm::stage
