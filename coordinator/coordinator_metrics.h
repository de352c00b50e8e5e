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

// Why the coordinator refused (or dropped part of) what a caller sent:
// aqswarm_coordinator_refusals_total{cause}. Every cause is declared up front.
enum class Refusal {
  kJoinCertificateName,  // under TLS, the certificate names another peer
  kJoinNameHeld,         // the name has a live lease and the joiner proved no claim to it
  kJoinTokenReplayed,    // a join token already used under that name, without proof
  kJoinRate,             // joins of one name, or of everyone, over the rate limit
  kJoinReplanHeld,       // a name whose departures re-planned the swarm repeatedly, during its hold
  kJoinEvicted,          // a name evicted for blame strikes, during its hold
  kReportRate,           // one peer's reports over its rate limit
  kProgressBackward,     // progress lower than the peer already reported under the same plan
  kProgressAhead,        // progress its pipeline cannot back, or past the job's max_steps (ignored)
  kHeldForeignStage,     // held states of a stage that is neither the peer's nor its mirror
  kHeldFutureStep,       // held states past any step the swarm reached
  kWatchSuperseded,      // a second assignment watch of the same peer ended the first
};
const char* RefusalCause(Refusal r);
void CountRefusal(Refusal r, double n = 1);
// The counter's value in this process (tests).
double RefusalCount(Refusal r);
// Two holders reported different SHA-256 for the same stage state:
// aqswarm_coordinator_state_hash_disagreements_total.
void CountStateHashDisagreement();
double StateHashDisagreements();  // the counter's value in this process (tests)
void CountLeaseExpiries(size_t peers);
// Blame (SwarmCoordinator::ReportBlame, SettleBlames).
void CountBlame(const char* outcome);  // "recorded" or "stale"
void CountStrike();
void CountEviction();

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
