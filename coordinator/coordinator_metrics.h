// Every Prometheus metric the coordinator exports, declared in one place
// (coordinator_metrics.cc; catalogue: `aqswarm metrics list`). Served by
// common/metrics.h's MetricsServer when `aqswarm coordinator` runs with
// --metrics_listen.
//
// Counters are bumped at their update points (the gRPC service's status
// conversion, Heartbeat, the lease sweep); the swarm's state (peers by state,
// assignment version, step, loss, tokens/s) is sampled from
// SwarmCoordinator::GetStatus() just before each scrape:
//   CoordinatorStatusSampler sampler(coordinator.get());   // outlived by coordinator
//
// Thread-safety: all functions are thread-safe.
#ifndef AQSWARM_COORDINATOR_COORDINATOR_METRICS_H_
#define AQSWARM_COORDINATOR_COORDINATOR_METRICS_H_

#include <cstddef>
#include <memory>

#include "absl/status/status.h"

namespace aqswarm {
class MetricsSampler;
}

namespace aqswarm::coordinator {

class SwarmCoordinator;

// Declares every coordinator metric (idempotent).
void DeclareCoordinatorMetrics();
// A request refused with `code` (not OK): aqswarm_coordinator_rejected_requests_total{reason}.
void CountRejectedRequest(absl::StatusCode code);
void CountHeartbeat();
void CountLeaseExpiries(size_t peers);

// Samples `coordinator`'s status into the gauges before every scrape while
// alive; `coordinator` must outlive it.
class CoordinatorStatusSampler {
 public:
  explicit CoordinatorStatusSampler(const SwarmCoordinator* coordinator);
  ~CoordinatorStatusSampler();

 private:
  std::unique_ptr<MetricsSampler> sampler_;
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_COORDINATOR_METRICS_H_
