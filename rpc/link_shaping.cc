#include "rpc/link_shaping.h"

#include <algorithm>

namespace aqswarm::rpc {

absl::Time EmulatedWire::Reserve(size_t bytes, absl::Time queued, double bandwidth_mbps) {
  const absl::Time now = clock_->Now();
  if (bandwidth_mbps <= 0) return now;
  wire_free_ = std::max(queued, wire_free_) + absl::Seconds(bytes * 8.0 / (bandwidth_mbps * 1e6));
  return std::max(wire_free_, now);  // a late sender catches up: the wire did not idle
}

absl::Time EmulatedWire::Transmit(size_t bytes, absl::Time queued, double bandwidth_mbps) {
  const absl::Time done = Reserve(bytes, queued, bandwidth_mbps);
  const absl::Time now = clock_->Now();
  if (done > now) clock_->SleepFor(done - now);  // the emulated wire is busy
  return std::max(done, now);
}

}  // namespace aqswarm::rpc
