#include "coordinator/coordinator_metrics.h"

#include <map>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "coordinator/swarm_coordinator.h"

namespace aqswarm::coordinator {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;

// Every metric of the coordinator: the one place they are declared.
struct CoordinatorFamilies {
  Family<Gauge>& peers = DeclareGauge("aqswarm_coordinator_peers",
                                      "Members by state (active, waiting = placed in an incomplete grid, standby).",
                                      {"state"});
  Family<Gauge>& version =
      DeclareGauge("aqswarm_coordinator_assignment_version", "Current assignment version (bumped by every re-plan).");
  Family<Gauge>& grid_complete =
      DeclareGauge("aqswarm_coordinator_grid_complete", "1 when every stage of every pipeline has a peer.");
  Family<Gauge>& stages = DeclareGauge("aqswarm_coordinator_stages", "Pipeline stages of the job.");
  Family<Gauge>& pipelines = DeclareGauge("aqswarm_coordinator_pipelines", "Data-parallel pipelines of the job.");
  Family<Gauge>& step = DeclareGauge(
      "aqswarm_coordinator_step",
      "Swarm step: the most any peer reported under the current plan (a re-plan lowers it to its resume step).");
  Family<Gauge>& loss = DeclareGauge("aqswarm_coordinator_loss", "Swarm training loss (reported by the peers).");
  Family<Gauge>& tps =
      DeclareGauge("aqswarm_coordinator_tokens_per_second", "Swarm tokens/s: sum over pipelines of their reports.");
  Family<Gauge>& checkpoint_step =
      DeclareGauge("aqswarm_coordinator_checkpoint_step", "Step of the latest complete checkpoint.");
  Family<Counter>& expiries = DeclareCounter("aqswarm_coordinator_lease_expiries_total",
                                             "Peers removed because their lease ran out without a heartbeat.");
  Family<Counter>& heartbeats =
      DeclareCounter("aqswarm_coordinator_heartbeats_total", "Heartbeats accepted (lease renewed).");
  Family<Counter>& rejected = DeclareCounter(
      "aqswarm_coordinator_rejected_requests_total",
      "Requests refused, by reason (the status code: invalid_argument, unauthenticated, permission_denied, "
      "not_found, failed_precondition, ...).",
      {"reason"});
  Family<Counter>& refusals = DeclareCounter(
      "aqswarm_coordinator_refusals_total",
      "Hostile or buggy input refused or dropped, by cause: join_certificate_name, join_name_held, "
      "join_token_replayed, join_rate, join_replan_held, join_evicted, report_rate, progress_backward, "
      "progress_ahead, held_foreign_stage, held_future_step, watch_superseded.",
      {"cause"});
  Family<Counter>& blames = DeclareCounter(
      "aqswarm_coordinator_blame_reports_total",
      "Blame reports of placed peers whose stage failed, by outcome: recorded (settled with the plan's others), "
      "stale (an older plan, or not the reporter's neighbour).",
      {"outcome"});
  Family<Counter>& strikes = DeclareCounter("aqswarm_coordinator_strikes_total",
                                            "Strikes counted against peers that the settled blame reports point to.");
  Family<Counter>& evictions = DeclareCounter("aqswarm_coordinator_evictions_total",
                                              "Peers evicted for reaching the strike limit (--evict_strikes).");
  Family<Counter>& hash_disagreements =
      DeclareCounter("aqswarm_coordinator_state_hash_disagreements_total",
                     "Reports of a stage state whose SHA-256 differs from another holder's for the same stage and "
                     "step (the majority, then the longest-standing holder, wins).");
};

CoordinatorFamilies& Families() {
  static CoordinatorFamilies* f = new CoordinatorFamilies();
  return *f;
}

constexpr Refusal kAllRefusals[] = {
    Refusal::kJoinCertificateName, Refusal::kJoinNameHeld,     Refusal::kJoinTokenReplayed,
    Refusal::kJoinRate,            Refusal::kReportRate,       Refusal::kProgressBackward,
    Refusal::kHeldForeignStage,    Refusal::kHeldFutureStep,   Refusal::kWatchSuperseded,
    Refusal::kJoinReplanHeld,      Refusal::kProgressAhead,    Refusal::kJoinEvicted};

std::string Reason(absl::StatusCode code) { return absl::AsciiStrToLower(absl::StatusCodeToString(code)); }

}  // namespace

void DeclareCoordinatorMetrics() {
  CoordinatorFamilies& f = Families();
  for (absl::StatusCode c : {absl::StatusCode::kInvalidArgument, absl::StatusCode::kUnauthenticated,
                             absl::StatusCode::kPermissionDenied, absl::StatusCode::kNotFound,
                             absl::StatusCode::kFailedPrecondition, absl::StatusCode::kResourceExhausted,
                             absl::StatusCode::kAlreadyExists}) {
    f.rejected.Add({{"reason", Reason(c)}});
  }
  for (Refusal r : kAllRefusals) f.refusals.Add({{"cause", RefusalCause(r)}});
  f.hash_disagreements.Add({});
  for (const char* o : {"recorded", "stale"}) f.blames.Add({{"outcome", o}});
  f.strikes.Add({});
  f.evictions.Add({});
  f.expiries.Add({});
  f.heartbeats.Add({});
  for (const char* s : {"active", "waiting", "standby"}) f.peers.Add({{"state", s}});
}

void CountRejectedRequest(absl::StatusCode code) {
  if (code == absl::StatusCode::kOk) return;
  Families().rejected.Add({{"reason", Reason(code)}}).Increment();
}

const char* RefusalCause(Refusal r) {
  switch (r) {
    case Refusal::kJoinCertificateName: return "join_certificate_name";
    case Refusal::kJoinNameHeld: return "join_name_held";
    case Refusal::kJoinTokenReplayed: return "join_token_replayed";
    case Refusal::kJoinRate: return "join_rate";
    case Refusal::kJoinReplanHeld: return "join_replan_held";
    case Refusal::kJoinEvicted: return "join_evicted";
    case Refusal::kReportRate: return "report_rate";
    case Refusal::kProgressBackward: return "progress_backward";
    case Refusal::kProgressAhead: return "progress_ahead";
    case Refusal::kHeldForeignStage: return "held_foreign_stage";
    case Refusal::kHeldFutureStep: return "held_future_step";
    case Refusal::kWatchSuperseded: return "watch_superseded";
  }
  return "unknown";
}

void CountRefusal(Refusal r, double n) { Families().refusals.Add({{"cause", RefusalCause(r)}}).Increment(n); }

double RefusalCount(Refusal r) { return Families().refusals.Add({{"cause", RefusalCause(r)}}).Value(); }

void CountStateHashDisagreement() { Families().hash_disagreements.Add({}).Increment(); }
double StateHashDisagreements() { return Families().hash_disagreements.Add({}).Value(); }

void CountBlame(const char* outcome) { Families().blames.Add({{"outcome", outcome}}).Increment(); }
void CountStrike() { Families().strikes.Add({}).Increment(); }
void CountEviction() { Families().evictions.Add({}).Increment(); }

void CountHeartbeat() { Families().heartbeats.Add({}).Increment(); }

void CountLeaseExpiries(size_t peers) { Families().expiries.Add({}).Increment(static_cast<double>(peers)); }

CoordinatorStatusSampler::CoordinatorStatusSampler(const SwarmCoordinator* coordinator) {
  DeclareCoordinatorMetrics();
  sampler_ = std::make_unique<MetricsSampler>([coordinator] {
    CoordinatorFamilies& f = Families();
    const v1::StatusResponse st = coordinator->GetStatus();
    std::map<std::string, int> by_state = {{"active", 0}, {"waiting", 0}, {"standby", 0}};
    for (const v1::PeerStatus& p : st.peers()) {
      ++by_state[absl::AsciiStrToLower(v1::PeerStatus::State_Name(p.state()))];
    }
    for (const auto& [state, n] : by_state) f.peers.Add({{"state", state}}).Set(n);
    f.version.Add({}).Set(static_cast<double>(st.assignment_version()));
    f.grid_complete.Add({}).Set(st.grid_complete() ? 1 : 0);
    f.stages.Add({}).Set(st.num_stages());
    f.pipelines.Add({}).Set(st.num_pipelines());
    f.step.Add({}).Set(static_cast<double>(st.step()));
    f.loss.Add({}).Set(st.loss());
    f.tps.Add({}).Set(st.tokens_per_second());
    f.checkpoint_step.Add({}).Set(static_cast<double>(st.checkpoint_step()));
  });
}

CoordinatorStatusSampler::~CoordinatorStatusSampler() = default;

}  // namespace aqswarm::coordinator
