#include "coordinator/swarm_coordinator.h"

#include <algorithm>
#include <functional>
#include <set>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/outer_schedule.h"
#include "common/status_macros.h"
#include "coordinator/coordinator_metrics.h"
#include "google/protobuf/util/message_differencer.h"

namespace aqswarm::coordinator {
namespace {

MembershipOptions MakeMembershipOptions(const SwarmCoordinatorOptions& o) {
  MembershipOptions m;
  m.swarm_id = o.swarm_id.empty() ? o.job.name() : o.swarm_id;
  m.join_secret = o.join_secret;
  m.lease = o.lease;
  m.max_members = o.max_members;
  return m;
}

// `grid` with the slots of peers not in `alive` cleared.
Grid WithHoles(Grid grid, const std::unordered_set<uint64_t>& gone) {
  for (auto& s : grid.slots) {
    if (gone.count(s)) s = 0;
  }
  return grid;
}

}  // namespace

int64_t PickResumeStep(const Grid& grid, const Membership& members, std::optional<int64_t> bound) {
  std::set<int64_t, std::greater<>> candidates = {0};
  for (const auto& [id, m] : members.members()) {
    for (const auto& [stage, states] : m.held) {
      for (const HeldState& h : states) {
        if (!bound.has_value() || h.step <= *bound) candidates.insert(h.step);
      }
    }
  }
  for (int64_t s : candidates) {
    bool everywhere = true;
    for (int j = 0; j < grid.num_stages && everywhere && s > 0; ++j) {
      bool held = false;
      for (const auto& [id, m] : members.members()) {
        if (FindHeld(m.held, j, s) != nullptr) {
          held = true;
          break;
        }
      }
      everywhere = held;
    }
    if (everywhere) return s;
  }
  return 0;
}

SwarmCoordinator::SwarmCoordinator(SwarmCoordinatorOptions options, std::unique_ptr<CoordinatorState> state)
    : options_(std::move(options)),
      membership_options_(MakeMembershipOptions(options_)),
      clock_(options_.clock != nullptr ? options_.clock : rpc::RealClock::Get()),
      join_per_name_(options_.join_limit_per_name),
      join_all_(options_.join_limit),
      replans_(options_.replan_backoff),
      reports_(options_.report_limit),
      planner_(options_.planner, options_.job),
      state_(std::move(state)),
      membership_(membership_options_, clock_),
      links_(options_.link_guess),
      grid_(Grid::Empty(planner_.num_stages(), planner_.num_pipelines())),
      data_identity_{options_.job.data().dataset_hash(), options_.job.data().tokenizer_hash()} {}

absl::StatusOr<std::unique_ptr<SwarmCoordinator>> SwarmCoordinator::Create(SwarmCoordinatorOptions options) {
  const v1::JobSpec& job = options.job;
  if (job.stages() < 1 || job.stages() > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("job.stages ", job.stages(), " is outside [1, 1024]"));
  }
  if (job.data_parallel() < 1 || job.data_parallel() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("job.data_parallel ", job.data_parallel(), " is outside [1, 1024]"));
  }
  if (options.swarm_id.empty()) options.swarm_id = job.name();
  if (options.swarm_id.empty()) return absl::InvalidArgumentError("swarm id is required (or a job name)");
  if (options.join_secret.empty()) return absl::InvalidArgumentError("join secret is required");
  if (options.lease <= absl::ZeroDuration()) return absl::InvalidArgumentError("lease must be positive");
  if (options.restart_grace <= absl::ZeroDuration()) options.restart_grace = options.lease;
  AQSWARM_RETURN_IF_ERROR(ValidateHashHex(job.data().dataset_hash(), "data.datasetHash"));
  AQSWARM_RETURN_IF_ERROR(ValidateHashHex(job.data().tokenizer_hash(), "data.tokenizerHash"));
  AQSWARM_RETURN_IF_ERROR(
      ValidateLinkEstimate(options.link_guess.bandwidth_bytes_per_second, options.link_guess.rtt_seconds));
  AQSWARM_ASSIGN_OR_RETURN(auto state, CoordinatorState::Open(options.state));
  AQSWARM_ASSIGN_OR_RETURN(PersistedState persisted, state->Load());
  if (persisted.job.has_value() &&
      !google::protobuf::util::MessageDifferencer::Equals(*persisted.job, options.job)) {
    return absl::FailedPreconditionError(
        absl::StrCat("state dir ", options.state.dir, " holds job '", persisted.job->name(),
                     "', which differs from the given job '", options.job.name(),
                     "': restart with the same job, or use a new state dir"));
  }
  std::unique_ptr<SwarmCoordinator> c(new SwarmCoordinator(std::move(options), std::move(state)));
  absl::MutexLock lock(&c->mu_);
  AQSWARM_RETURN_IF_ERROR(c->Restore(persisted));
  return c;
}

SwarmCoordinator::~SwarmCoordinator() {
  if (absl::Status s = FlushReports(); !s.ok()) AQSWARM_LOG(ERROR) << "persisting reports failed: " << s;
}

absl::Status SwarmCoordinator::Restore(const PersistedState& persisted) {
  // A restart holds the restored plan like a fresh one: the links measured
  // before it are gone, and peers are reconnecting (ImprovePlan's hold).
  last_plan_change_ = clock_->Now();
  if (!persisted.job.has_value()) {  // fresh state dir
    CoordinatorState::Change change;
    change.PutJob(options_.job);
    change.PutCounters(counters_);
    change.PutGrid(grid_);
    change.PutProgress(progress_);
    return state_->Commit(change);
  }
  counters_ = persisted.counters;
  progress_ = persisted.progress;
  if (data_identity_.empty() && persisted.data_identity.has_value()) data_identity_ = *persisted.data_identity;
  if (persisted.grid.has_value()) {
    if (persisted.grid->num_stages != planner_.num_stages() ||
        persisted.grid->num_pipelines != planner_.num_pipelines()) {
      return absl::DataLossError("coordinator state: the stored grid does not match the job's shape");
    }
    grid_ = *persisted.grid;
  }
  for (const Member& m : persisted.members) {
    counters_.next_peer_id = std::max(counters_.next_peer_id, m.id + 1);
    membership_.Add(m);
  }
  for (const LinkRow& l : persisted.links) {
    links_.Report(l.from, l.to, l.estimate.bandwidth_bytes_per_second, l.estimate.rtt_seconds,
                  l.estimate.measured_at);
  }
  const int64_t now_s = absl::ToUnixSeconds(clock_->Now());
  for (const UsedToken& u : persisted.used_tokens) {
    if (u.expiry_unix_s > now_s) used_tokens_[{u.token_id, u.peer_name}] = u;
  }
  membership_.ExtendAllLeases(options_.restart_grace);
  {
    absl::MutexLock v(&version_mu_);
    published_version_ = counters_.assignment_version;
  }
  AQSWARM_LOG(INFO) << "coordinator state restored: job '" << options_.job.name() << "', "
                    << membership_.size() << " members, assignment version " << counters_.assignment_version
                    << ", step " << progress_.progress.step;
  return absl::OkStatus();
}

int64_t SwarmCoordinator::ResumeStepLocked(const Grid& grid, const Membership& live,
                                           std::optional<int64_t>* bound) const {
  bound->reset();
  for (uint64_t id : grid.slots) {
    if (id == 0 || !grid_.Find(id).has_value()) continue;
    if (const Member* m = membership_.Find(id)) {
      *bound = std::min(bound->value_or(m->progress.step), m->progress.step);
    }
  }
  return PickResumeStep(grid, live, *bound);
}

bool SwarmCoordinator::FaultDomainsLocked() const {
  return options_.fault_domains && options_.job.dp().optimizer() == v1::DataParallelSpec::diloco &&
         grid_.num_pipelines > 1;
}

bool SwarmCoordinator::KeepPipelinesLocked(Grid* grid, const std::unordered_set<uint64_t>& gone) const {
  if (!FaultDomainsLocked() || grid_.run_plan.empty() || !grid_.complete() || !grid->complete()) return false;
  const int S = grid->num_stages, P = grid->num_pipelines;
  std::vector<bool> kept(P, true);
  bool any = false;
  for (int q = 0; q < P; ++q) {
    for (int j = 0; j < S; ++j) {
      const uint64_t id = grid_.at(j, q);
      if (id == 0 || grid->at(j, q) != id || gone.count(id) || membership_.Find(id) == nullptr) kept[q] = false;
    }
    any = any || kept[q];
  }
  if (!any) return false;
  // Each healing stage loads a state of the kept run that no outer step of
  // its stage has passed since: its anchor is the one the kept replicas of
  // that stage hold. (A stage's replicas may be one outer step ahead of
  // another stage's, stuck in it: a stage that loads an older state joins
  // the outer steps it skips, DiLoCo::SkipTo.)
  const int64_t h = std::max<int64_t>(1, options_.job.dp().inner_steps());
  const int64_t frags = std::max<int64_t>(1, options_.job.dp().fragments());
  auto syncs_at = [&](int64_t t) { return AnyOuterStepDue(t, h, frags); };
  std::vector<int64_t> state(S);
  int64_t newest = 0, furthest = 0;
  for (int j = 0; j < S; ++j) {
    int64_t floor_step = 0;
    std::set<int64_t, std::greater<>> candidates;
    for (int q = 0; q < P; ++q) {
      if (!kept[q]) continue;
      const Member* m = membership_.Find(grid_.at(j, q));
      floor_step = std::max(floor_step, grid_.RunResume(j, q));
      furthest = std::max(furthest, m->progress.step);
      for (int64_t t = m->progress.step; t > std::max<int64_t>(0, m->progress.step - h); --t) {
        if (syncs_at(t)) {
          floor_step = std::max(floor_step, t);
          break;
        }
      }
      if (auto it = m->held.find(j); it != m->held.end()) {
        for (const HeldState& hs : it->second) {
          if (hs.step >= grid_.RunResume(j, q)) candidates.insert(hs.step);
        }
      }
    }
    if (candidates.empty() || *candidates.begin() < floor_step) {
      AQSWARM_LOG(WARNING) << "fault domains: no state of stage " << j << " in the kept pipelines at or past step "
                           << floor_step << ": the whole swarm restarts";
      return false;
    }
    state[j] = *candidates.begin();
    newest = std::max(newest, state[j]);
  }
  // They start near where the kept pipelines are (a quarter of an outer
  // period ahead of the furthest report, for the time a restart takes),
  // before the next outer step after the newest state: the kept pipelines
  // wait at it only for the restart, not for steps redone.
  int64_t next_sync = newest + 1;
  while (!syncs_at(next_sync)) ++next_sync;
  const int64_t start = std::max(newest, std::min(next_sync - 1, furthest + std::max<int64_t>(2, h / frags / 4)));
  for (int q = 0; q < P; ++q) {  // the kept pipelines' run fields are grid_'s already
    if (kept[q]) continue;
    grid->run_plan[q] = grid->plan_version;
    for (int j = 0; j < S; ++j) grid->run_resume[j * P + q] = state[j];
    grid->heal[q] = true;
    grid->run_start[q] = start;
  }
  grid->resume_step = start;
  return true;
}

absl::Status SwarmCoordinator::ChangeMembersLocked(const std::vector<uint64_t>& removed,
                                                   const std::optional<Member>& added, const UsedToken* used,
                                                   const Replacement* replacement, bool restart) {
  const std::unordered_set<uint64_t> gone(removed.begin(), removed.end());
  Counters counters = counters_;
  Grid grid = WithHoles(grid_, gone);
  const bool grid_lost_peer = grid.slots != grid_.slots;
  // Peers that leave having completed the job leave their slots empty: the
  // peers still finishing its last steps keep their plan.
  const bool finished = !restart && replacement == nullptr && !added.has_value() && AllFinishedLocked(removed);
  if (replacement != nullptr) {
    grid = replacement->grid;
    counters.next_generation = replacement->next_generation;
  } else if (!finished && (grid_lost_peer || !grid.complete())) {
    std::vector<PlannerPeer> peers;
    peers.reserve(membership_.size() + 1);
    for (const auto& [id, m] : membership_.members()) {
      if (!gone.count(id)) peers.push_back({id, m.seconds_per_layer, m.memory_bytes, m.reachability == v1::REACHABLE});
    }
    if (added.has_value()) {
      peers.push_back({added->id, added->seconds_per_layer, added->memory_bytes, added->reachability == v1::REACHABLE});
    }
    // Under fault domains the survivors stay put (a moved peer restarts its
    // pipeline) while standbys can fill the holes.
    std::optional<Grid> filled;
    if (FaultDomainsLocked() && grid_.complete()) filled = planner_.FillHoles(grid_, peers, &counters.next_generation);
    absl::StatusOr<Grid> planned =
        filled.has_value() ? *std::move(filled) : planner_.Replan(grid_, peers, links_, &counters.next_generation);
    if (planned.ok()) {
      grid = *std::move(planned);
    } else {
      AQSWARM_LOG(WARNING) << "re-plan failed, keeping the grid with holes: " << planned.status();
    }
  }
  grid.plan_version = grid_.plan_version;
  grid.resume_step = grid_.resume_step;
  grid.run_plan = grid_.run_plan;
  grid.run_resume = grid_.run_resume;
  grid.heal = grid_.heal;
  grid.run_start = grid_.run_start;
  grid.dp_timeline = grid_.dp_timeline;
  const bool replanned = restart || (!finished && grid.slots != grid_.slots);
  bool kept_some = false;
  if (replanned) {
    grid.plan_version += 1;
    kept_some = !restart && KeepPipelinesLocked(&grid, gone);
  }
  if (replanned && !kept_some) {
    // Every placed peer restarts at the same step: the most steps completed,
    // at most the fewest any peer that keeps a place has completed, for which
    // every stage has a state some live member holds (its replicas, a mirror,
    // a restarted peer's disk). Peers ahead roll back; peers without that
    // state pull it (Assignment.state_sources). With no state for some stage
    // anywhere, the job starts over at step 0.
    std::optional<int64_t> bound;
    Membership live = membership_;
    for (uint64_t id : removed) live.Remove(id);
    if (added.has_value()) live.Add(*added);
    grid.resume_step = ResumeStepLocked(grid, live, &bound);
    if (bound.has_value() && grid.resume_step < *bound) {
      AQSWARM_LOG(WARNING) << "re-plan resumes at step " << grid.resume_step << ", behind the " << *bound
                           << " steps the survivors completed: the newest state held for every stage";
    }
    if (FaultDomainsLocked()) {
      // A swarm-wide restart: every pipeline runs the new plan, in a new DP timeline.
      grid.run_plan.assign(grid.num_pipelines, grid.plan_version);
      grid.run_resume.assign(grid.slots.size(), grid.resume_step);
      grid.heal.assign(grid.num_pipelines, false);
      grid.run_start.assign(grid.num_pipelines, grid.resume_step);
      grid.dp_timeline = grid.plan_version;
    } else {
      grid.run_plan.clear();
      grid.run_resume.clear();
      grid.heal.clear();
      grid.run_start.clear();
      grid.dp_timeline = 0;
    }
  }
  counters.assignment_version += 1;
  if (added.has_value()) counters.next_peer_id = std::max(counters.next_peer_id, added->id + 1);

  // A re-plan rolls the job back to its resume step: the swarm's step (and
  // newest checkpoint) with it, so Status says where training is, not where
  // the abandoned timeline got to.
  SwarmProgress progress = progress_;
  if (replanned && !kept_some) {
    progress.progress.step = std::min(progress.progress.step, grid.resume_step);
    progress.checkpoint_step = std::min(progress.checkpoint_step, grid.resume_step);
  }
  CoordinatorState::Change change;
  for (uint64_t id : removed) change.DeleteMember(id);
  if (added.has_value()) change.PutMember(*added);
  if (!(grid == grid_)) change.PutGrid(grid);
  change.PutCounters(counters);
  if (replanned) change.PutProgress(progress);
  if (used != nullptr) change.PutUsedToken(*used);
  AQSWARM_RETURN_IF_ERROR(state_->Commit(change));

  if (replanned) RecordReplanCausesLocked(removed, added);
  for (uint64_t id : removed) {
    dirty_members_.erase(id);
    claimed_steps_.erase(id);
    reports_.Forget(absl::StrCat(id));
    membership_.Remove(id);
    links_.RemovePeer(id);
    probe_cursor_.erase(id);
    for (auto it = probe_asked_.begin(); it != probe_asked_.end();) {
      it = (it->first.first == id || it->first.second == id) ? probe_asked_.erase(it) : std::next(it);
    }
  }
  if (added.has_value()) membership_.Add(*added);
  if (replanned) {
    // Until they report again, placed peers (newcomers included) are where
    // the plan restarts them.
    for (int j = 0; j < grid.num_stages; ++j) {
      for (int q = 0; q < grid.num_pipelines; ++q) {
        const uint64_t id = grid.at(j, q);
        const Member* m = id == 0 ? nullptr : membership_.Find(id);
        if (m == nullptr) continue;
        PeerProgress p = m->progress;
        // A kept pipeline's peers train on from where they are.
        if (grid.RunPlan(q) == grid.plan_version) p.step = grid.RunStart(q);
        p.plan_version = grid.plan_version;
        membership_.SetProgress(id, p);
      }
    }
  }
  if (replanned) last_plan_change_ = clock_->Now();
  grid_ = std::move(grid);
  counters_ = counters;
  progress_ = progress;
  absl::MutexLock v(&version_mu_);
  published_version_ = counters_.assignment_version;
  version_changed_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<JoinResult> SwarmCoordinator::Join(const JoinParams& given) {
  // States on a restarted peer's disk count only for this job's stages.
  JoinParams params = given;
  if (params.held_job_name != options_.job.name()) {
    params.held.clear();
  }
  params.held.erase(params.held.lower_bound(static_cast<uint32_t>(planner_.num_stages())), params.held.end());
  AQSWARM_RETURN_IF_ERROR(ValidateJoinParams(params));
  AQSWARM_RETURN_IF_ERROR(ValidateHeldStates(params.held, planner_.num_stages()));
  // The token before the rate limits: a caller without a valid token for
  // this name costs an HMAC and charges nobody's budget.
  const absl::Time now = clock_->Now();
  AQSWARM_ASSIGN_OR_RETURN(const JoinClaims claims, Membership::CheckToken(membership_options_, params, now));
  if (!join_per_name_.Allow(params.peer_name, now)) {
    CountRefusal(Refusal::kJoinRate);
    return absl::ResourceExhaustedError(absl::StrCat("too many joins as '", params.peer_name, "' (at most ",
                                                     options_.join_limit_per_name.burst, " at once, ",
                                                     options_.join_limit_per_name.per_second, "/s): retry later"));
  }
  if (!join_all_.Allow("", now)) {
    CountRefusal(Refusal::kJoinRate);
    return absl::ResourceExhaustedError(absl::StrCat("too many joins right now (at most ",
                                                     options_.join_limit.per_second, "/s): retry later"));
  }
  absl::MutexLock lock(&mu_);
  const Member* old = membership_.FindByName(params.peer_name);
  const bool same_certificate = !params.certificate_sha256.empty();
  const bool proven = old != nullptr &&
                      ((!params.previous_session_token.empty() &&
                        SameSecret(old->session_token, params.previous_session_token)) ||
                       (same_certificate && old->certificate_sha256 == params.certificate_sha256));
  if (old != nullptr && old->lease_expiry > now && !proven) {
    CountRefusal(Refusal::kJoinNameHeld);
    return absl::AlreadyExistsError(absl::StrCat(
        "peer name '", params.peer_name, "' is held by a live member (id ", old->id, ", lease for another ",
        absl::FormatDuration(absl::Trunc(old->lease_expiry - now, absl::Milliseconds(100))),
        "): a rejoin must send that member's session token (previous_session_token) or, under TLS, present "
        "the same client certificate"));
  }
  const auto used = used_tokens_.find({claims.token_id, params.peer_name});
  if (used != used_tokens_.end() && !proven &&
      !(!params.previous_session_token.empty() &&
        SameSecret(used->second.session_token, params.previous_session_token)) &&
      !(same_certificate && used->second.certificate_sha256 == params.certificate_sha256)) {
    CountRefusal(Refusal::kJoinTokenReplayed);
    return absl::PermissionDeniedError(absl::StrCat(
        "join token ", claims.token_id, " was already used by peer '", params.peer_name,
        "' (tokens are single use): rejoin with the previous session token or the same certificate, or ask "
        "the operator for a new token (aqswarm certs token --peer ", params.peer_name, ")"));
  }
  if (auto e = evicted_.find(params.peer_name); e != evicted_.end() && e->second.held_until > now) {
    CountRefusal(Refusal::kJoinEvicted);
    return absl::PermissionDeniedError(absl::StrCat(
        "peer '", params.peer_name, "' was evicted for the failures its neighbours blamed on it (",
        e->second.evictions, e->second.evictions == 1 ? " eviction" : " evictions",
        "): its joins are refused for another ",
        absl::FormatDuration(absl::Ceil(e->second.held_until - now, absl::Seconds(1)))));
  }
  if (const absl::Time held = replans_.HeldUntil(params.peer_name); held > now) {
    CountRefusal(Refusal::kJoinReplanHeld);
    return absl::ResourceExhaustedError(absl::StrCat(
        "peer '", params.peer_name, "' re-planned the swarm ", replans_.Offences(params.peer_name, now),
        " times recently (leaving, expiring or rejoining while placed): its joins are held back for another ",
        absl::FormatDuration(absl::Ceil(held - now, absl::Seconds(1)))));
  }
  // Once the swarm has trained here, a joiner cannot hold states of steps
  // it never reached (before that, peers restarting a stopped job name
  // what their disks hold: PickResumeStep).
  const int64_t reached = std::max(progress_.progress.step, grid_.resume_step);
  for (auto& [stage, states] : params.held) {
    if (reached == 0) break;
    std::vector<HeldState> kept;
    for (HeldState& h : states) {
      if (h.step > reached) {
        CountRefusal(Refusal::kHeldFutureStep);
        continue;
      }
      kept.push_back(std::move(h));
    }
    states = std::move(kept);
  }
  AQSWARM_ASSIGN_OR_RETURN(Member m, membership_.Admit(params, counters_.next_peer_id));
  const bool probe = options_.probe_reachability && m.reachability == v1::REACHABLE && !m.state_transfer_address.empty();
  if (probe) m.reachability = v1::PROBING;
  if (m.reachability == v1::NO_INBOUND) {
    AQSWARM_LOG(INFO) << "peer '" << m.name << "' says it accepts no connections: it is placed only where it "
                      << "opens its links itself";
  }
  if (options_.job.data().synthetic_tokens() == 0) {
    AQSWARM_RETURN_IF_ERROR(CheckDataIdentity(data_identity_, params.data, absl::StrCat("peer '", m.name, "'")));
    if (data_identity_.empty() && !params.data.empty()) {
      // The first peer with data fixes the job's identity for everyone after it.
      CoordinatorState::Change change;
      change.PutDataIdentity(params.data);
      AQSWARM_RETURN_IF_ERROR(state_->Commit(change));
      data_identity_ = params.data;
      AQSWARM_LOG(INFO) << "data identity fixed by peer '" << m.name << "': dataset " << params.data.dataset_hash
                        << ", tokenizer " << params.data.tokenizer_hash;
    }
  }
  std::vector<uint64_t> removed;
  if (old != nullptr) {
    // The same peer again (it proved it, or its lease ran out): its old incarnation is gone.
    AQSWARM_LOG(INFO) << "peer '" << m.name << "' rejoined; dropping its old id " << old->id;
    removed.push_back(old->id);
  }
  const UsedToken record{claims.token_id, m.name, claims.expiry_unix_s, m.certificate_sha256, m.session_token};
  AQSWARM_RETURN_IF_ERROR(ChangeMembersLocked(removed, m, &record));
  used_tokens_[{record.token_id, record.peer_name}] = record;
  AQSWARM_LOG(DEBUG) << "peer '" << m.name << "' joined as " << m.id;
  return JoinResult{m.id, m.session_token, m.lease_expiry, counters_.assignment_version,
                    probe ? m.state_transfer_address : ""};
}

absl::Status SwarmCoordinator::SetReachability(uint64_t peer_id, bool reachable, absl::string_view detail) {
  absl::MutexLock lock(&mu_);
  const Member* m = membership_.Find(peer_id);
  if (m == nullptr || m->reachability != v1::PROBING) return absl::OkStatus();
  Member updated = *m;
  updated.reachability = reachable ? v1::REACHABLE : v1::UNREACHABLE;
  if (reachable) {
    AQSWARM_LOG(DEBUG) << "peer '" << updated.name << "' is reachable at " << updated.state_transfer_address;
  } else {
    AQSWARM_LOG(WARNING) << "peer '" << updated.name << "' cannot be reached at " << updated.state_transfer_address
                         << " (" << detail << "): it is placed only where it opens its links itself (a "
                         << "single-pipeline job); to place it anywhere, forward its ports";
  }
  // Replacing the member re-plans when the grid has holes (a placeable standby).
  return ChangeMembersLocked({peer_id}, updated);
}

absl::StatusOr<HeartbeatResult> SwarmCoordinator::Heartbeat(uint64_t peer_id, absl::string_view session_token,
                                                            const PeerProgress* progress) {
  if (progress != nullptr) AQSWARM_RETURN_IF_ERROR(ValidateProgress(*progress));
  absl::MutexLock lock(&mu_);
  AQSWARM_ASSIGN_OR_RETURN(const Member* m, membership_.Authenticate(peer_id, session_token));
  HeartbeatResult r;
  r.lease_expiry = membership_.Renew(peer_id);
  if (progress != nullptr) {
    AQSWARM_RETURN_IF_ERROR(CheckMonotonicLocked(*m, *progress));
    AQSWARM_RETURN_IF_ERROR(RecordProgressLocked(*m, *progress, 0));
  }
  r.assignment_version = counters_.assignment_version;
  if (options_.probe_max_age > absl::ZeroDuration() && !m->state_transfer_address.empty()) {
    r.probe = ProbeTargetsLocked(peer_id);
  }
  return r;
}

std::vector<v1::Neighbor> SwarmCoordinator::ProbeTargetsLocked(uint64_t peer_id) {
  std::vector<v1::Neighbor> out;
  // Links from this peer that nobody measured or that went stale. Each
  // heartbeat looks at no more than kProbeScan members, resuming where this
  // peer's last look stopped (first look: after its own id, so peers spread
  // their probes over different targets): O(1) per heartbeat at any size.
  static constexpr size_t kProbeScan = 64;
  const absl::Time now = clock_->Now();
  const auto& all = membership_.members();
  auto cursor = probe_cursor_.try_emplace(peer_id, peer_id).first;
  auto start = all.upper_bound(cursor->second);
  for (size_t i = 0; i < std::min(all.size(), kProbeScan) &&
                     static_cast<int>(out.size()) < options_.probes_per_heartbeat;
       ++i) {
    if (start == all.end()) start = all.begin();
    const Member& to = (start++)->second;
    cursor->second = to.id;
    if (to.id == peer_id || to.state_transfer_address.empty() || to.reachability != v1::REACHABLE) continue;
    const LinkEstimate* e = links_.Measured(peer_id, to.id);
    if (e != nullptr && now - e->measured_at < options_.probe_max_age) continue;
    auto asked = probe_asked_.find({peer_id, to.id});
    if (asked != probe_asked_.end() && now - asked->second < options_.probe_retry) continue;
    probe_asked_[{peer_id, to.id}] = now;
    v1::Neighbor n;
    n.set_peer_id(to.id);
    n.set_peer_name(to.name);
    n.set_state_transfer_address(to.state_transfer_address);
    out.push_back(std::move(n));
  }
  return out;
}

absl::StatusOr<uint64_t> SwarmCoordinator::Leave(uint64_t peer_id, absl::string_view session_token) {
  absl::MutexLock lock(&mu_);
  AQSWARM_RETURN_IF_ERROR(membership_.Authenticate(peer_id, session_token).status());
  AQSWARM_RETURN_IF_ERROR(ChangeMembersLocked({peer_id}, std::nullopt));
  return counters_.assignment_version;
}

absl::Status SwarmCoordinator::ReportLinkProbe(uint64_t peer_id, absl::string_view session_token,
                                               uint64_t to_peer_id, double bandwidth, double rtt, bool passive) {
  if (passive) rtt = 0;  // replaced below; only the bandwidth was measured
  AQSWARM_RETURN_IF_ERROR(ValidateLinkEstimate(bandwidth, rtt));
  absl::MutexLock lock(&mu_);
  AQSWARM_RETURN_IF_ERROR(membership_.Authenticate(peer_id, session_token).status());
  AQSWARM_RETURN_IF_ERROR(AllowReportLocked(peer_id, clock_->Now()));
  if (to_peer_id == peer_id) return absl::InvalidArgumentError("to_peer_id is the reporting peer itself");
  if (membership_.Find(to_peer_id) == nullptr) {
    return absl::NotFoundError(absl::StrCat("to_peer_id ", to_peer_id, " is not a member"));
  }
  if (passive) rtt = links_.Get(peer_id, to_peer_id).rtt_seconds;
  links_.Report(peer_id, to_peer_id, bandwidth, rtt, clock_->Now());
  dirty_links_.insert({peer_id, to_peer_id});
  return MaybeFlushReportsLocked();
}

absl::Status SwarmCoordinator::ReportProgress(uint64_t peer_id, absl::string_view session_token,
                                              const PeerProgress& progress, int64_t checkpoint_step,
                                              const HeldStates* held) {
  if (held != nullptr) AQSWARM_RETURN_IF_ERROR(ValidateHeldStates(*held, planner_.num_stages()));
  AQSWARM_RETURN_IF_ERROR(ValidateProgress(progress));
  if (checkpoint_step < 0 || checkpoint_step > progress.step) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint_step ", checkpoint_step, " is outside [0, progress.step = ", progress.step, "]"));
  }
  absl::MutexLock lock(&mu_);
  AQSWARM_ASSIGN_OR_RETURN(const Member* m, membership_.Authenticate(peer_id, session_token));
  AQSWARM_RETURN_IF_ERROR(AllowReportLocked(peer_id, clock_->Now()));
  AQSWARM_RETURN_IF_ERROR(CheckMonotonicLocked(*m, progress));
  if (held != nullptr) {
    HeldStates kept = *held;
    KeepOwnStagesLocked(peer_id, &kept);
    CountHashDisagreementsLocked(peer_id, kept);
    if (kept != m->held) {
      membership_.SetHeld(peer_id, std::move(kept));
      dirty_members_.insert(peer_id);
    }
  }
  return RecordProgressLocked(*m, progress, checkpoint_step);
}

absl::Status SwarmCoordinator::AllowReportLocked(uint64_t peer_id, absl::Time now) {
  if (reports_.Allow(absl::StrCat(peer_id), now)) return absl::OkStatus();
  CountRefusal(Refusal::kReportRate);
  return absl::ResourceExhaustedError(
      absl::StrCat("peer ", peer_id, " reports more than ", options_.report_limit.per_second, "/s: slow down"));
}

int SwarmCoordinator::StrikesLocked(absl::string_view name, absl::Time now) const {
  auto it = strikes_.find(name);
  if (it == strikes_.end() || now - it->second.last >= options_.strike_decay) return 0;
  return it->second.strikes;
}

absl::StatusOr<BlameAnswer> SwarmCoordinator::ReportBlame(uint64_t peer_id, absl::string_view session_token,
                                                         const v1::Blame& blame) {
  if (blame.reason().size() > kMaxBlameReason) {
    return absl::InvalidArgumentError(
        absl::StrCat("blame.reason is ", blame.reason().size(), " bytes; at most ", kMaxBlameReason));
  }
  absl::MutexLock lock(&mu_);
  AQSWARM_ASSIGN_OR_RETURN(const Member* m, membership_.Authenticate(peer_id, session_token));
  const absl::Time now = clock_->Now();
  AQSWARM_RETURN_IF_ERROR(AllowReportLocked(peer_id, now));
  BlameAnswer answer;
  answer.plan_version = grid_.plan_version;
  // The accused must be the peer in the slot next to the reporter's, on the
  // link it names, under the plan both ran.
  const std::optional<std::pair<int, int>> pos = grid_.Find(peer_id);
  const int delta = blame.link() == v1::Blame::UPSTREAM ? -1 : blame.link() == v1::Blame::DOWNSTREAM ? 1 : 0;
  const int stage = pos.has_value() ? pos->first + delta : -1;
  const bool neighbour = pos.has_value() && delta != 0 && stage >= 0 && stage < grid_.num_stages &&
                         blame.peer_id() != 0 && grid_.at(stage, pos->second) == blame.peer_id();
  const Member* accused = neighbour ? membership_.Find(blame.peer_id()) : nullptr;
  if (blame.plan() != grid_.plan_version || accused == nullptr) {
    CountBlame("stale");
    AQSWARM_LOG(INFO) << "blame from '" << m->name << "' (plan " << blame.plan() << ", peer " << blame.peer_id()
                      << ") ignored: "
                      << (blame.plan() != grid_.plan_version ? "the plan moved on" : "not its neighbour");
    return answer;
  }
  if (blame_plan_ != grid_.plan_version || blames_.empty()) {
    blames_.clear();
    blame_plan_ = grid_.plan_version;
    blame_first_ = now;
  }
  BlameRecord record{peer_id, blame.peer_id(), blame.kind(), blame.reason()};
  auto mine = std::find_if(blames_.begin(), blames_.end(), [&](const BlameRecord& r) { return r.reporter == peer_id; });
  if (mine != blames_.end()) {
    *mine = std::move(record);
  } else {
    blames_.push_back(std::move(record));
  }
  CountBlame("recorded");
  AQSWARM_LOG(INFO) << "peer '" << m->name << "' blames '" << accused->name << "' ("
                    << v1::Blame::Kind_Name(blame.kind()) << ", " << blame.reason() << ") at step " << blame.step()
                    << " of plan " << blame.plan();
  answer.recorded = true;
  answer.strikes = StrikesLocked(accused->name, now);
  return answer;
}

absl::StatusOr<bool> SwarmCoordinator::SettleBlames() {
  absl::MutexLock lock(&mu_);
  if (blames_.empty()) return false;
  if (blame_plan_ != grid_.plan_version) {  // a re-plan came first (a lease ran out, a join)
    blames_.clear();
    return false;
  }
  const absl::Time now = clock_->Now();
  auto evidence = [](v1::Blame::Kind k) { return k == v1::Blame::REFUSED || k == v1::Blame::SILENT; };
  // Lost links alone accuse nobody: the peer at the other end may be dead,
  // and then its lease runs out within a lease of the loss and that re-plan
  // (ExpireLeases runs first) replaces it. Only if it still heartbeats then
  // does the plan restart with it.
  const bool any_evidence =
      std::any_of(blames_.begin(), blames_.end(), [&](const BlameRecord& b) { return evidence(b.kind); });
  if (now < blame_first_ + (any_evidence ? options_.blame_settle : std::max(options_.blame_settle, options_.lease))) {
    return false;
  }
  std::set<uint64_t> reported_evidence, struck;
  for (const BlameRecord& b : blames_) {
    if (evidence(b.kind)) reported_evidence.insert(b.reporter);
  }
  for (const BlameRecord& b : blames_) {
    // A peer that blames someone else under the same plan was waiting on
    // it, or refused its frame: the failure started further along.
    if (!evidence(b.kind) || reported_evidence.count(b.accused)) continue;
    if (membership_.Find(b.accused) != nullptr) struck.insert(b.accused);
  }
  std::vector<uint64_t> evict;
  for (uint64_t id : struck) {
    const Member* m = membership_.Find(id);
    StrikeRun& run = strikes_[m->name];
    if (run.strikes > 0 && now - run.last >= options_.strike_decay) run = StrikeRun{};
    run.strikes += 1;
    run.last = now;
    CountStrike();
    AQSWARM_LOG(WARNING) << "peer '" << m->name << "' struck for plan " << blame_plan_ << " (" << run.strikes << " of "
                         << options_.evict_strikes << ")";
    if (run.strikes >= options_.evict_strikes) evict.push_back(id);
  }
  blames_.clear();
  for (uint64_t id : evict) {
    const Member* m = membership_.Find(id);
    EvictionRun& e = evicted_[m->name];
    e.evictions += 1;
    absl::Duration hold = options_.evict_hold;
    for (int i = 1; i < e.evictions && hold < absl::Hours(24); ++i) hold *= 2;
    e.held_until = now + std::min(hold, absl::Hours(24));
    strikes_.erase(m->name);
    evictions_ += 1;
    CountEviction();
    AQSWARM_LOG(WARNING) << "peer '" << m->name << "' evicted: its joins are refused until "
                         << absl::FormatTime(e.held_until);
  }
  // Evicting re-plans (standbys fill the slots); otherwise the same grid
  // restarts, so the peer whose stage failed keeps its slot.
  AQSWARM_RETURN_IF_ERROR(ChangeMembersLocked(evict, std::nullopt, nullptr, nullptr, /*restart=*/evict.empty()));
  return true;
}

void SwarmCoordinator::RecordReplanCausesLocked(const std::vector<uint64_t>& removed,
                                                const std::optional<Member>& added) {
  const absl::Time now = clock_->Now();
  for (uint64_t id : removed) {
    const Member* m = membership_.Find(id);
    if (m == nullptr || !grid_.Find(id).has_value() || (added.has_value() && added->id == id)) continue;
    const int n = replans_.Record(m->name, now);
    if (n >= 2) {
      AQSWARM_LOG(WARNING) << "peer '" << m->name << "' re-planned the swarm " << n << " times recently: its joins "
                           << "are held back until " << absl::FormatTime(replans_.HeldUntil(m->name));
    }
  }
}

bool SwarmCoordinator::PlausibleProgressLocked(const Member& reporter, int64_t step) const {
  // Honest stages of one pipeline finish a step within one or two of each
  // other (the next step needs the commit of this one); their reports race.
  static constexpr int64_t kProgressSlack = 8;
  const int64_t last = options_.job.max_steps();
  if (last > 0 && step > last) return false;
  const auto pos = grid_.Find(reporter.id);
  if (!pos.has_value()) return step <= std::max(progress_.progress.step, grid_.resume_step);
  if (grid_.num_stages < 2) return true;  // replicas only: nothing in its pipeline to compare with
  int64_t backed = grid_.resume_step;
  for (int j = 0; j < grid_.num_stages; ++j) {
    if (j == pos->first) continue;
    const uint64_t id = grid_.at(j, pos->second);
    const Member* m = membership_.Find(id);
    if (m != nullptr && m->progress.plan_version == grid_.plan_version) backed = std::max(backed, m->progress.step);
    // What that stage claimed last, taken or not: two stages reporting the
    // same jump back each other (one stage alone cannot).
    if (auto c = claimed_steps_.find(id); c != claimed_steps_.end() && c->second.first == grid_.plan_version) {
      backed = std::max(backed, c->second.second);
    }
  }
  return step <= backed + kProgressSlack;
}

bool SwarmCoordinator::GridCompleteLocked() const {
  // Once a pipeline completed the job, the slots its peers left stay empty
  // and the others finish their last steps.
  const int64_t last = options_.job.max_steps();
  return grid_.complete() || (last > 0 && progress_.progress.step >= last);
}

bool SwarmCoordinator::AllFinishedLocked(const std::vector<uint64_t>& removed) const {
  const int64_t last = options_.job.max_steps();
  if (last == 0 || removed.empty()) return false;
  for (uint64_t id : removed) {
    const Member* m = membership_.Find(id);
    if (m == nullptr || m->progress.step < last || m->progress.plan_version != grid_.plan_version) return false;
  }
  return true;
}

absl::Status SwarmCoordinator::CheckMonotonicLocked(const Member& reporter, const PeerProgress& progress) const {
  const uint64_t plan = progress.plan_version == 0 ? grid_.plan_version : progress.plan_version;
  if (plan != grid_.plan_version || reporter.progress.plan_version != plan ||
      progress.step >= reporter.progress.step) {
    return absl::OkStatus();
  }
  CountRefusal(Refusal::kProgressBackward);
  return absl::FailedPreconditionError(absl::StrCat("progress step ", progress.step, " of peer ", reporter.id,
                                                    " is behind step ", reporter.progress.step,
                                                    " it already reported under plan ", plan,
                                                    ": progress only moves forward within a plan"));
}

void SwarmCoordinator::KeepOwnStagesLocked(uint64_t peer_id, HeldStates* held) const {
  std::set<uint32_t> allowed;
  if (const auto pos = grid_.Find(peer_id); pos.has_value()) {
    allowed.insert(static_cast<uint32_t>(pos->first));
    if (options_.mirror_checkpoints && grid_.num_stages > 1) {
      allowed.insert(static_cast<uint32_t>((pos->first + 1) % grid_.num_stages));
    }
  } else if (const Member* m = membership_.Find(peer_id)) {
    // A standby serves what it held when it joined (a restarted peer's disk), nothing new.
    for (const auto& [stage, states] : m->held) allowed.insert(stage);
  }
  for (auto it = held->begin(); it != held->end();) {
    if (allowed.count(it->first)) {
      ++it;
      continue;
    }
    CountRefusal(Refusal::kHeldForeignStage);
    it = held->erase(it);
  }
}

void SwarmCoordinator::CountHashDisagreementsLocked(uint64_t peer_id, const HeldStates& held) const {
  if (options_.job.dp().optimizer() == v1::DataParallelSpec::diloco && grid_.num_pipelines > 1) return;
  for (const auto& [stage, states] : held) {
    for (const HeldState& mine : states) {
      if (mine.sha256.empty()) continue;
      bool differs = false;
      for (const auto& [id, m] : membership_.members()) {
        if (id == peer_id || differs) continue;
        const HeldState* theirs = FindHeld(m.held, stage, mine.step);
        differs = theirs != nullptr && !theirs->sha256.empty() && theirs->sha256 != mine.sha256;
      }
      if (differs) {
        CountStateHashDisagreement();
        AQSWARM_LOG(WARNING) << "peer " << peer_id << " reports SHA-256 " << mine.sha256 << " for stage " << stage
                             << " at step " << mine.step << ", other holders another";
      }
    }
  }
}

std::string SwarmCoordinator::StateHashLocked(int stage, int64_t step) const {
  std::map<std::string, std::pair<int, uint64_t>> votes;  // hash -> (holders, lowest holder id)
  for (const auto& [id, m] : membership_.members()) {
    const HeldState* h = FindHeld(m.held, stage, step);
    if (h == nullptr || h->sha256.empty()) continue;
    const std::string& hash = h->sha256;
    auto [v, fresh] = votes.try_emplace(hash, 0, id);
    v->second.first += 1;
    v->second.second = std::min(v->second.second, id);
  }
  std::string best;
  std::pair<int, uint64_t> best_vote{0, 0};
  for (const auto& [hash, vote] : votes) {
    if (vote.first > best_vote.first || (vote.first == best_vote.first && vote.second < best_vote.second)) {
      best = hash;
      best_vote = vote;
    }
  }
  return best;
}

absl::Status SwarmCoordinator::FlushReports() {
  absl::MutexLock lock(&mu_);
  return FlushReportsLocked();
}

absl::Status SwarmCoordinator::MaybeFlushReportsLocked() {
  if (absl::Now() - last_report_flush_ < options_.report_persist_interval) return absl::OkStatus();
  return FlushReportsLocked();
}

absl::Status SwarmCoordinator::FlushReportsLocked() {
  last_report_flush_ = absl::Now();
  CoordinatorState::Change change;
  PruneUsedTokensLocked(&change);
  if (progress_dirty_) change.PutProgress(progress_);
  for (uint64_t id : dirty_members_) {
    if (const Member* m = membership_.Find(id)) change.PutMember(*m);
  }
  for (const auto& [from, to] : dirty_links_) {
    if (const LinkEstimate* e = links_.Measured(from, to);
        e != nullptr && membership_.Find(from) != nullptr && membership_.Find(to) != nullptr) {
      change.PutLink(from, to, *e);
    }
  }
  AQSWARM_RETURN_IF_ERROR(state_->Commit(change));
  progress_dirty_ = false;
  dirty_members_.clear();
  dirty_links_.clear();
  return absl::OkStatus();
}

void SwarmCoordinator::PruneUsedTokensLocked(CoordinatorState::Change* change) {
  const int64_t now_s = absl::ToUnixSeconds(clock_->Now());
  for (auto it = used_tokens_.begin(); it != used_tokens_.end();) {
    if (it->second.expiry_unix_s > now_s) {
      ++it;
      continue;
    }
    change->DeleteUsedToken(it->first.first, it->first.second);
    it = used_tokens_.erase(it);
  }
}

absl::Status SwarmCoordinator::RecordProgressLocked(const Member& reporter, const PeerProgress& progress,
                                                    int64_t checkpoint_step) {
  if (progress.plan_version > grid_.plan_version) {
    return absl::InvalidArgumentError(absl::StrCat("progress.plan_version ", progress.plan_version,
                                                   " is newer than the current plan ", grid_.plan_version));
  }
  if (progress.plan_version != 0 && progress.plan_version < grid_.plan_version) {
    // Sent before the peer saw the current plan: its steps are of a timeline
    // the re-plan may have rolled back. The peer counts as at the resume step
    // until it reports under this plan.
    return absl::OkStatus();
  }
  const bool plausible = PlausibleProgressLocked(reporter, progress.step);
  claimed_steps_[reporter.id] = {grid_.plan_version, progress.step};
  if (plausible) {
    PeerProgress recorded = progress;
    recorded.plan_version = grid_.plan_version;
    membership_.SetProgress(reporter.id, recorded);
    SwarmProgress next = progress_;
    if (progress.step > next.progress.step) next.progress.step = progress.step;
    if (progress.step >= next.progress.step && progress.loss > 0) next.progress.loss = progress.loss;
    next.checkpoint_step = std::max(next.checkpoint_step, checkpoint_step);
    next.progress.tokens_per_second = SwarmTokensPerSecondLocked();
    if (next.progress.step != progress_.progress.step || next.checkpoint_step != progress_.checkpoint_step) {
      progress_dirty_ = true;
    }
    progress_ = next;
  } else {
    CountRefusal(Refusal::kProgressAhead);  // ignored; the held states the caller applied stay
  }
  if (!progress_dirty_ && dirty_members_.empty()) return absl::OkStatus();
  return MaybeFlushReportsLocked();
}

double SwarmCoordinator::SwarmTokensPerSecondLocked() const {
  // Sum over pipelines of the last stage's report (the stage that sees every
  // token of its pipeline's batch); without a complete last stage, the best report.
  double sum = 0;
  const int last = grid_.num_stages - 1;
  bool any = false;
  for (int p = 0; p < grid_.num_pipelines; ++p) {
    if (const Member* m = membership_.Find(grid_.at(last, p))) {
      sum += m->progress.tokens_per_second;
      any = true;
    }
  }
  if (any) return sum;
  double best = 0;
  for (const auto& [id, m] : membership_.members()) best = std::max(best, m.progress.tokens_per_second);
  return best;
}

v1::Neighbor SwarmCoordinator::NeighborLocked(uint64_t peer, int stage, int pipeline, uint64_t generation) const {
  v1::Neighbor n;
  const Member* m = membership_.Find(peer);
  n.set_peer_id(peer);
  if (m != nullptr) {
    n.set_peer_name(m->name);
    n.set_stage_link_address(m->stage_link_address);
    n.set_gradient_exchange_address(m->gradient_exchange_address);
    n.set_state_transfer_address(m->state_transfer_address);
  }
  n.set_stage(stage);
  n.set_pipeline(pipeline);
  n.set_link_generation(generation);
  return n;
}

absl::StatusOr<v1::Assignment> SwarmCoordinator::GetAssignment(uint64_t peer_id,
                                                               absl::string_view session_token) const {
  absl::MutexLock lock(&mu_);
  AQSWARM_RETURN_IF_ERROR(membership_.Authenticate(peer_id, session_token).status());
  v1::Assignment a;
  a.set_version(counters_.assignment_version);
  a.set_peer_id(peer_id);
  a.set_num_stages(grid_.num_stages);
  a.set_num_pipelines(grid_.num_pipelines);
  a.set_grid_complete(GridCompleteLocked());
  a.set_resume_step(grid_.resume_step);
  a.set_plan_version(grid_.plan_version);
  a.set_checkpoint_step(progress_.checkpoint_step);
  const auto pos = grid_.Find(peer_id);
  if (!pos.has_value()) {
    a.set_role(v1::Assignment::STANDBY);
    return a;
  }
  const auto [j, p] = *pos;
  a.set_role(v1::Assignment::STAGE);
  a.set_stage(j);
  a.set_pipeline(p);
  if (!grid_.run_plan.empty()) {
    a.set_resume_step(grid_.RunResume(j, p));
    a.set_run_plan(grid_.RunPlan(p));
    a.set_dp_timeline(grid_.dp_timeline);
    a.set_heal(grid_.Heals(p));
    if (grid_.Heals(p)) a.set_start_step(grid_.RunStart(p));
  }
  // A link whose downstream others cannot dial is opened by the downstream
  // (reversed). A member being probed (one that rejoined in its slot) counts
  // as dialable until its probe says otherwise.
  auto dialable = [this](uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Member* m = membership_.Find(id);
    return m == nullptr || (m->reachability != v1::UNREACHABLE && m->reachability != v1::NO_INBOUND);
  };
  if (j + 1 < grid_.num_stages && grid_.at(j + 1, p) != 0) {
    *a.mutable_next() = NeighborLocked(grid_.at(j + 1, p), j + 1, p, grid_.forward_gen(j, p));
    a.mutable_next()->set_reversed(!dialable(grid_.at(j + 1, p)));
  }
  if (j > 0 && grid_.at(j - 1, p) != 0) {
    *a.mutable_previous() = NeighborLocked(grid_.at(j - 1, p), j - 1, p, grid_.forward_gen(j - 1, p));
    a.mutable_previous()->set_reversed(!dialable(peer_id));
  }
  for (int q = 0; q < grid_.num_pipelines; ++q) {
    if (q != p && grid_.at(j, q) != 0) {
      *a.add_replicas() = NeighborLocked(grid_.at(j, q), j, q, grid_.replica_generation[j]);
      if (!grid_.run_plan.empty()) a.mutable_replicas()->rbegin()->set_run_plan(grid_.RunPlan(q));
    }
  }
  if (grid_.Heals(p) && a.resume_step() > 0) {
    // Healing: the state of one peer of this stage in a pipeline that kept
    // running (DiLoCo replicas' states differ between outer steps: no vote).
    for (int q = 0; q < grid_.num_pipelines; ++q) {
      const Member* m = membership_.Find(grid_.at(j, q));
      if (q == p || m == nullptr || grid_.RunPlan(q) == grid_.RunPlan(p) || m->state_transfer_address.empty() ||
          m->reachability != v1::REACHABLE) {
        continue;
      }
      const HeldState* h = FindHeld(m->held, j, a.resume_step());
      if (h == nullptr) continue;
      *a.add_state_sources() = NeighborLocked(m->id, j, q, 0);
      a.set_state_sha256(h->sha256);
      break;
    }
  } else if (a.resume_step() > 0) {
    for (const auto& [id, m] : membership_.members()) {
      if (id == peer_id || m.state_transfer_address.empty() || m.reachability != v1::REACHABLE ||
          FindHeld(m.held, j, a.resume_step()) == nullptr) {
        continue;
      }
      const auto at = grid_.Find(id);
      *a.add_state_sources() = NeighborLocked(id, j, at.has_value() ? at->second : 0, 0);
    }
    a.set_state_sha256(StateHashLocked(j, a.resume_step()));
  }
  if (options_.mirror_checkpoints && grid_.num_stages > 1) {
    const int k = (j + 1) % grid_.num_stages;
    // The copy is fetched from (k, p) and served by this peer: both must be dialable.
    if (grid_.at(k, p) != 0 && dialable(grid_.at(k, p)) && dialable(peer_id)) {
      *a.mutable_mirror() = NeighborLocked(grid_.at(k, p), k, p, 0);
    }
  }
  return a;
}

uint64_t SwarmCoordinator::AwaitVersionAbove(uint64_t known, absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&version_mu_);
  while (published_version_ <= known) {
    if (version_changed_.WaitWithDeadline(&version_mu_, deadline)) break;  // timed out
  }
  return published_version_;
}

absl::StatusOr<std::vector<uint64_t>> SwarmCoordinator::ExpireLeases() {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> expired = membership_.Expired();
  if (expired.empty()) return expired;
  for (uint64_t id : expired) {
    AQSWARM_LOG(INFO) << "lease of peer " << id << " ('" << membership_.Find(id)->name << "') expired";
  }
  AQSWARM_RETURN_IF_ERROR(ChangeMembersLocked(expired, std::nullopt));
  return expired;
}

absl::StatusOr<std::vector<uint64_t>> SwarmCoordinator::RemoveRefusingSuspects(
    const std::function<bool(absl::string_view address)>& refuses) {
  std::vector<std::pair<uint64_t, std::string>> suspects;
  uint64_t plan = 0;
  {
    absl::MutexLock lock(&mu_);
    plan = grid_.plan_version;
    if (probed_plan_ != plan) {
      probed_.clear();
      probed_plan_ = plan;
    }
    if (blame_plan_ != plan) return std::vector<uint64_t>();
    for (const BlameRecord& b : blames_) {
      if (b.kind != v1::Blame::LINK_LOST || !probed_.insert(b.accused).second) continue;
      const Member* m = membership_.Find(b.accused);
      if (m != nullptr && !m->state_transfer_address.empty()) suspects.emplace_back(m->id, m->state_transfer_address);
    }
  }
  std::vector<uint64_t> gone;
  for (const auto& [id, address] : suspects) {
    if (refuses(address)) gone.push_back(id);
  }
  if (gone.empty()) return gone;
  absl::MutexLock lock(&mu_);
  if (grid_.plan_version != plan) return std::vector<uint64_t>();  // it moved on meanwhile: leases decide
  gone.erase(std::remove_if(gone.begin(), gone.end(), [&](uint64_t id) { return membership_.Find(id) == nullptr; }),
             gone.end());
  if (gone.empty()) return gone;
  for (uint64_t id : gone) {
    const Member* m = membership_.Find(id);
    AQSWARM_LOG(INFO) << "peer " << id << " ('" << m->name << "'): its neighbour lost their link and "
                      << m->state_transfer_address << " refuses connections: removed as gone";
  }
  AQSWARM_RETURN_IF_ERROR(ChangeMembersLocked(gone, std::nullopt));
  return gone;
}

absl::StatusOr<bool> SwarmCoordinator::ImprovePlan() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (options_.improve_interval <= absl::ZeroDuration() || now < next_improve_check_) return false;
  next_improve_check_ = now + options_.improve_interval;
  if (now < last_plan_change_ + options_.improve_hold || !grid_.complete()) return false;
  std::vector<PlannerPeer> peers;
  peers.reserve(membership_.size());
  for (const auto& [id, m] : membership_.members()) peers.push_back({id, m.seconds_per_layer, m.memory_bytes, m.reachability == v1::REACHABLE});
  uint64_t next_generation = counters_.next_generation;
  absl::StatusOr<std::optional<Improvement>> found = planner_.Improve(grid_, peers, links_, &next_generation);
  if (!found.ok()) {
    AQSWARM_LOG(WARNING) << "re-plan on measurements failed, keeping the plan: " << found.status();
    return false;
  }
  if (!found->has_value()) return false;
  const Improvement& better = **found;
  const double before = better.step_seconds_before, after = better.step_seconds_after;
  std::optional<int64_t> bound;
  const int64_t resume = ResumeStepLocked(better.grid, membership_, &bound);
  const int64_t rolled_back = std::max<int64_t>(0, progress_.progress.step - resume);
  const double move_seconds = better.migration_seconds + static_cast<double>(rolled_back) * before;
  const double saved_seconds = (before - after) * options_.improve_payback_steps;
  if (after > (1 - options_.improve_min_gain) * before || saved_seconds <= move_seconds) {
    AQSWARM_LOG(INFO) << absl::StrFormat(
        "a plan with %.3f s per step instead of %.3f s is not worth moving to (gain threshold %.0f%%; it would "
        "save %.1f s over %.0f steps, moving costs %.1f s: %.1f s of state transfers and %d steps rolled back)",
        after, before, 100 * options_.improve_min_gain, saved_seconds, options_.improve_payback_steps, move_seconds,
        better.migration_seconds, rolled_back);
    return false;
  }
  int moved = 0;
  for (size_t i = 0; i < grid_.slots.size(); ++i) moved += grid_.slots[i] != better.grid.slots[i];
  AQSWARM_LOG(INFO) << absl::StrFormat(
      "re-planning on measurements: %.3f s per step instead of %.3f s, %d slots change, resuming at step %d "
      "(%d steps rolled back, %.1f s of state transfers)",
      after, before, moved, resume, rolled_back, better.migration_seconds);
  const Replacement replacement{better.grid, next_generation};
  AQSWARM_RETURN_IF_ERROR(ChangeMembersLocked({}, std::nullopt, nullptr, &replacement));
  return true;
}

v1::StatusResponse SwarmCoordinator::GetStatus(bool details) const {
  absl::MutexLock lock(&mu_);
  v1::StatusResponse s;
  s.set_job_name(options_.job.name());
  s.set_swarm_id(membership_.options().swarm_id);
  s.set_num_stages(grid_.num_stages);
  s.set_num_pipelines(grid_.num_pipelines);
  s.set_assignment_version(counters_.assignment_version);
  s.set_grid_complete(GridCompleteLocked());
  s.set_step(progress_.progress.step);
  s.set_loss(progress_.progress.loss);
  s.set_tokens_per_second(SwarmTokensPerSecondLocked());
  s.set_checkpoint_step(progress_.checkpoint_step);
  s.set_evictions(evictions_);
  *s.mutable_job() = options_.job;
  s.mutable_job()->mutable_data()->set_dataset_hash(data_identity_.dataset_hash);
  s.mutable_job()->mutable_data()->set_tokenizer_hash(data_identity_.tokenizer_hash);
  std::unordered_map<uint64_t, std::pair<int, int>> position;
  for (int j = 0; j < grid_.num_stages; ++j) {
    for (int p = 0; p < grid_.num_pipelines; ++p) {
      if (grid_.at(j, p) != 0) position[grid_.at(j, p)] = {j, p};
    }
  }
  const absl::Time now = clock_->Now();
  for (const auto& [id, m] : membership_.members()) {
    v1::PeerStatus* ps = s.add_peers();
    if (details) {
      ps->set_peer_id(id);
      ps->set_peer_name(m.name);
    }
    auto it = position.find(id);
    if (it == position.end()) {
      ps->set_state(v1::PeerStatus::STANDBY);
      ps->set_stage(-1);
      ps->set_pipeline(-1);
    } else {
      ps->set_state(GridCompleteLocked() ? v1::PeerStatus::ACTIVE : v1::PeerStatus::WAITING);
      ps->set_stage(it->second.first);
      ps->set_pipeline(it->second.second);
    }
    if (!details) continue;  // the summary: counts by state and place only
    ps->set_lease_remaining_seconds(absl::ToDoubleSeconds(m.lease_expiry - now));
    ps->set_reachability(m.reachability);
    ps->set_strikes(StrikesLocked(m.name, now));
    for (const auto& [to, e] : links_.MeasuredFrom(id)) {
      v1::LinkSpeed* l = ps->add_links();
      l->set_to_peer_id(to);
      l->set_bandwidth_bytes_per_second(e.bandwidth_bytes_per_second);
      l->set_rtt_seconds(e.rtt_seconds);
    }
    ps->mutable_progress()->set_step(m.progress.step);
    ps->mutable_progress()->set_loss(m.progress.loss);
    ps->mutable_progress()->set_tokens_per_second(m.progress.tokens_per_second);
    ps->set_seconds_per_layer(m.seconds_per_layer);
    ps->set_memory_bytes(m.memory_bytes);
    ps->set_state_transfer_address(m.state_transfer_address);
    AddHeldTo(m.held, ps->mutable_held());
  }
  return s;
}

DataIdentity SwarmCoordinator::data_identity() const {
  absl::MutexLock lock(&mu_);
  return data_identity_;
}

uint64_t SwarmCoordinator::assignment_version() const {
  absl::MutexLock lock(&mu_);
  return counters_.assignment_version;
}

Grid SwarmCoordinator::grid() const {
  absl::MutexLock lock(&mu_);
  return grid_;
}

size_t SwarmCoordinator::num_members() const {
  absl::MutexLock lock(&mu_);
  return membership_.size();
}

}  // namespace aqswarm::coordinator
