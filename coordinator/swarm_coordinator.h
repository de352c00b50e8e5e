// SwarmCoordinator: the coordinator's domain logic behind the gRPC service
// (coordinator_service.h), with no gRPC in it. It ties together Membership
// (tokens, leases), LinkMatrix (probes), Planner (grid) and CoordinatorState
// (durability), and publishes a swarm-wide assignment version.
//
//   SwarmCoordinatorOptions o;
//   o.job = job;  o.join_secret = secret;  o.state.dir = "/var/aqswarm/coord";
//   o.clock = &fake_clock;                      // tests; default: rpc::RealClock
//   AQSWARM_ASSIGN_OR_RETURN(auto coord, SwarmCoordinator::Create(std::move(o)));
//   AQSWARM_ASSIGN_OR_RETURN(JoinResult j, coord->Join(params));
//   AQSWARM_ASSIGN_OR_RETURN(v1::Assignment a, coord->GetAssignment(j.peer_id, j.session_token));
//   coord->ExpireLeases();                      // a background thread calls this
//
// Contract:
//   - Every membership change (join, leave, expiry, rejoin under the same
//     name) re-plans (Planner::Replan), is committed to the state dir in ONE
//     atomic batch (members, grid, counters), and only then applied in memory;
//     it bumps the assignment version and wakes AwaitVersionAbove().
//     A failed commit leaves memory unchanged and returns the error.
//     Peers that leave (or expire) having completed the job's max_steps
//     under the current plan do not re-plan: their slots stay empty, so the
//     peers still finishing the last steps keep training.
//   - Heartbeats touch memory only (leases are not persisted per heartbeat).
//     Reports (progress, held states, link probes) change memory at once; what
//     they changed is committed in one batch at most once per
//     report_persist_interval (the first report after a quiet spell commits
//     at once, later ones wait for the next report or FlushReports(), which
//     the server calls every interval), so a flood of reports costs at most
//     one fsync per interval.
//   - Joins (finding "slot takeover"): a join under a name whose lease is
//     live is ALREADY_EXISTS unless the joiner proves it is that member again:
//     JoinParams::previous_session_token equals the member's session token,
//     or under TLS its client certificate is the one the member joined with
//     (certificate_sha256). A join token is single use per peer name: its
//     nonce and the name are persisted (tokens/ in the state dir) until the
//     token expires, and a second join with the same token under the same
//     name is PERMISSION_DENIED unless it proves itself the same way (the
//     previous session token of the last join with that token, or the same
//     certificate). So an honest peer rejoins after its lease ran out or
//     after a crash (TLS: same certificate) without a fresh token; a copied
//     token cannot take over a name. A wildcard token (explicit
//     `certs token --any_peer`) admits each name once. Joins are rate
//     limited per name (join_limit_per_name) and in total (join_limit);
//     over the limit: RESOURCE_EXHAUSTED. Tokens are checked before either
//     limit is charged, so callers without a valid token cannot use up an
//     honest name's budget. A name whose departures (leave, expiry, a
//     rejoin replacing its placed member) keep re-planning the swarm has its
//     joins held back with doubling delays (replan_backoff), so one flapping
//     or hostile peer cannot roll everyone back every few seconds.
//   - Reports: per peer at most report_limit (RESOURCE_EXHAUSTED beyond).
//     Progress is monotonic within a plan: a step below one the peer
//     already reported under the same plan is FAILED_PRECONDITION (nothing
//     of the report is applied); a re-plan sets every placed peer to its
//     resume step under the new plan, so no single report drags the next
//     resume step below the current one. `held` is kept only for the
//     peer's own stage and its mirror stage (others are dropped and
//     counted); a joiner's held states past the swarm's step are dropped.
//     A step the swarm cannot back (past max_steps, or more than
//     kProgressSlack past every other stage of the reporter's pipeline) is
//     ignored and counted (progress_ahead); the report's held states are kept.
//     Each held state's SHA-256 is kept; Assignment.state_sha256 is the hash
//     most holders of the resume state report (ties: the longest-standing
//     holder), and holders that disagree are counted (not under DiLoCo
//     with replicas, whose replicas differ between outer steps).
//   - Blame: ReportBlame keeps a placed peer's report against the peer in
//     the neighbouring slot of its pipeline under the current plan;
//     SettleBlames strikes, then restarts the same grid (a new plan version,
//     no slot changes) or evicts at evict_strikes (the name's joins are then
//     PERMISSION_DENIED for evict_hold). In memory only.
//   - Restart: Create() on a state dir that holds a job resumes it (the given
//     job must be equal: FAILED_PRECONDITION otherwise) with the same members,
//     session tokens, grid, generations and assignment version; every lease
//     is extended to at least now + restart_grace so peers can reconnect.
//   - Only authenticated peers (peer id + session token) see link and
//     exchange addresses (GetAssignment). GetStatus() carries only each
//     peer's StateTransfer address and the states it serves there (a
//     read-only service behind the same mTLS as the coordinator), which is
//     what `aqswarm export --coordinator` fetches a live model from.
//   - Data identity: a peer whose data hashes (JoinParams::data) differ from
//     the job's is refused with FAILED_PRECONDITION naming the hashes. The
//     job's hashes are DataSpec.dataset_hash / tokenizer_hash; when the job
//     names none, the first admitted peer that reports hashes fixes them for
//     the job (persisted). Jobs on synthetic data skip the check.
//
// Thread-safety: thread-safe; one mutex. Re-planning (a bounded solve over at
// most PlannerOptions::max_candidates peers) runs under it.
#ifndef AQSWARM_COORDINATOR_SWARM_COORDINATOR_H_
#define AQSWARM_COORDINATOR_SWARM_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/clock.h"
#include "coordinator/coordinator_state.h"
#include "coordinator/link_matrix.h"
#include "coordinator/membership.h"
#include "coordinator/planner.h"
#include "coordinator/rate_limiter.h"
#include "proto/coordinator.pb.h"
#include "proto/job.pb.h"

namespace aqswarm::coordinator {

struct SwarmCoordinatorOptions {
  // The job every peer trains. Required: stages >= 1, data_parallel >= 1.
  v1::JobSpec job;
  // Swarm id join tokens must name. Default: job.name().
  std::string swarm_id;
  // HMAC key for join tokens (common/join_token.h). Required.
  std::string join_secret;
  // Lease a heartbeat renews. Default: 10 s.
  absl::Duration lease = absl::Seconds(10);
  // On restart every lease is extended to at least now + this. Default: 0 = `lease`.
  absl::Duration restart_grace = absl::ZeroDuration();
  // Join fails with FAILED_PRECONDITION beyond this many members. Default: 100000.
  int64_t max_members = 100000;
  // Assumed link for pairs nobody probed.
  LinkEstimate link_guess;
  // Heartbeat answers ask a peer to probe up to `probes_per_heartbeat` peers
  // whose link from it is unmeasured or older than `probe_max_age` (a peer
  // is not asked about the same link again within `probe_retry`).
  // probe_max_age 0 = no probing.
  absl::Duration probe_max_age = absl::Minutes(10);
  int probes_per_heartbeat = 2;
  absl::Duration probe_retry = absl::Minutes(1);
  // Placed peer (stage j, pipeline p) copies the state of (j + 1 mod K, p)
  // after each checkpoint (Assignment.mirror), so a stage that loses every
  // replica resumes from a copy instead of step 0. Costs one stage state per
  // checkpoint interval on that link. Default: off.
  bool mirror_checkpoints = false;
  // Fault domains (DiLoCo jobs with data_parallel >= 2): a re-plan that
  // leaves every peer of a pipeline in place keeps that pipeline running
  // (Assignment.run_plan unchanged: no restart, no rollback, its DP group
  // named by the swarm's timeline). The other pipelines restart from the
  // newest step whose state the kept pipelines' peers hold for every stage,
  // not behind the last outer step they reported, on the parameters the
  // replicas share (Assignment.heal). Without such a step, or with no
  // pipeline kept, the whole swarm restarts as without them. Default: off.
  bool fault_domains = false;
  // Whether others can dial a joiner is checked before it is placed: a
  // joiner with a StateTransfer address that did not say no_inbound waits as
  // PROBING (a standby the planner skips) until SetReachability reports the
  // probe's answer (CoordinatorGrpcService probes it after the join). Off:
  // joiners are REACHABLE unless they say no_inbound. Default: off.
  bool probe_reachability = false;
  PlannerOptions planner;
  // Re-planning on measurements (ImprovePlan): at most once per
  // `improve_interval` (clock time; 0 = never) and not within `improve_hold`
  // of the last plan change, a complete grid is re-solved on the links
  // measured since and the standbys that joined since (Planner::Improve).
  // The new grid is adopted when its predicted step time is at least
  // `improve_min_gain` (a fraction) below the current one's AND the seconds
  // it saves over `improve_payback_steps` steps exceed what the move costs:
  // the state transfers plus the steps rolled back to its resume step.
  // The hold and the gain threshold are the hysteresis: a plan is never
  // changed back and forth on measurement noise.
  absl::Duration improve_interval = absl::Minutes(1);
  absl::Duration improve_hold = absl::Minutes(10);
  double improve_min_gain = 0.2;
  double improve_payback_steps = 500;
  // Joins per peer name (default: 3 at once, one more per ~3 s) and of all
  // names together (default: 40 at once, 20/s).
  RateLimit join_limit_per_name{1.0 / 3, 3};
  RateLimit join_limit{20, 40};
  // A peer name whose placed member left, expired or was replaced by its
  // own rejoin, and so re-planned the swarm: its second such re-plan within
  // `decay` holds its joins back for `first` (RESOURCE_EXHAUSTED), each
  // later one doubles the hold up to `most` (default: 10 s, 5 min, 30 min).
  BackoffPolicy replan_backoff;
  // Blame (ReportBlame, see the banner): the reports of one plan are
  // settled together `blame_settle` after its first; a name that reaches
  // `evict_strikes` strikes is evicted, and a name without a strike for
  // `strike_decay` starts over. An evicted name's joins are refused for
  // `evict_hold`, doubling with each later eviction of it, up to a day.
  absl::Duration blame_settle = absl::Seconds(2);
  int evict_strikes = 3;
  absl::Duration strike_decay = absl::Minutes(30);
  absl::Duration evict_hold = absl::Minutes(10);
  // Progress and link-probe reports per peer (default: 100 at once, 50/s).
  RateLimit report_limit{50, 100};
  // Reports are committed at most this often (real time). Default: 1 s.
  absl::Duration report_persist_interval = absl::Seconds(1);
  // Where the state lives. `state.dir` is required.
  CoordinatorState::Options state;
  // Not owned; must outlive the coordinator. Default: rpc::RealClock::Get().
  const rpc::Clock* clock = nullptr;
};

struct JoinResult {
  uint64_t peer_id = 0;
  std::string session_token;
  absl::Time lease_expiry;
  uint64_t assignment_version = 0;
  // The joiner waits as PROBING: probe its StateTransfer server at this
  // address, then call SetReachability ("" = no probe needed).
  std::string probe_address;
};

// The longest Blame.reason accepted (reasons are short names such as
// "activation_nonfinite").
inline constexpr size_t kMaxBlameReason = 64;

struct BlameAnswer {
  bool recorded = false;  // false: stale (an older plan, or not the reporter's neighbour)
  int strikes = 0;        // the accused's strikes so far
  uint64_t plan_version = 0;
};

struct HeartbeatResult {
  absl::Time lease_expiry;
  uint64_t assignment_version = 0;
  std::vector<v1::Neighbor> probe;  // peers to probe (see probe_max_age)
};

// The most steps completed, at most `bound` (none: unbounded), at which every
// stage of `grid` has a state held by some member of `members` (step 0 always
// qualifies: the initialisation is seeded).
int64_t PickResumeStep(const Grid& grid, const Membership& members, std::optional<int64_t> bound);

class SwarmCoordinator {
 public:
  static absl::StatusOr<std::unique_ptr<SwarmCoordinator>> Create(SwarmCoordinatorOptions options);
  // Persists what reports changed (FlushReports).
  ~SwarmCoordinator();

  // Errors: see Membership::Admit (UNAUTHENTICATED, PERMISSION_DENIED,
  // INVALID_ARGUMENT, FAILED_PRECONDITION) and the state dir's;
  // RESOURCE_EXHAUSTED over a join limit; ALREADY_EXISTS for a live name
  // without proof; PERMISSION_DENIED for a used token without proof (see
  // the banner).
  absl::StatusOr<JoinResult> Join(const JoinParams& params);
  // The answer to a PROBING member's reachability probe (JoinResult::
  // probe_address): REACHABLE or UNREACHABLE (placed only where it opens
  // its links itself: PlannerPeer::reachable); a re-plan when the grid has
  // holes. A member that is not PROBING (gone, rejoined, or already
  // answered) is left as it is.
  absl::Status SetReachability(uint64_t peer_id, bool reachable, absl::string_view detail);
  // NOT_FOUND (unknown id), UNAUTHENTICATED (wrong session), INVALID_ARGUMENT (progress).
  absl::StatusOr<HeartbeatResult> Heartbeat(uint64_t peer_id, absl::string_view session_token,
                                            const PeerProgress* progress = nullptr);
  // Returns the new assignment version.
  absl::StatusOr<uint64_t> Leave(uint64_t peer_id, absl::string_view session_token);
  // `passive`: bandwidth from real traffic; the RTT of the last probe (or
  // the guess) is kept.
  absl::Status ReportLinkProbe(uint64_t peer_id, absl::string_view session_token, uint64_t to_peer_id,
                               double bandwidth_bytes_per_second, double rtt_seconds, bool passive = false);
  // `held` (optional) replaces the stage states the peer holds.
  // Errors: as Heartbeat; RESOURCE_EXHAUSTED over report_limit;
  // FAILED_PRECONDITION for progress behind the peer's own under this plan.
  absl::Status ReportProgress(uint64_t peer_id, absl::string_view session_token, const PeerProgress& progress,
                              int64_t checkpoint_step, const HeldStates* held = nullptr);
  // A placed peer's stage ended blaming a neighbour (v1::Blame, as its
  // stage printed it). Kept when it names the peer in the neighbouring slot
  // of the reporter's pipeline under the current plan; settled by
  // SettleBlames. Errors: as Heartbeat; RESOURCE_EXHAUSTED over report_limit;
  // INVALID_ARGUMENT for a reason longer than kMaxBlameReason.
  absl::StatusOr<BlameAnswer> ReportBlame(uint64_t peer_id, absl::string_view session_token, const v1::Blame& blame);
  // Once blame_settle has passed since the current plan's first blame
  // report (a lease, when every report is a lost link): a strike against each accused the evidence (REFUSED, SILENT)
  // points to that reported no evidence itself under the plan, then an
  // eviction of the names at evict_strikes (a re-plan: standbys fill their
  // slots) or else a restart of the plan (same grid, every placed peer
  // keeps its slot and restarts at the resume step). True when a new plan
  // was published. The server calls it with ExpireLeases.
  absl::StatusOr<bool> SettleBlames();
  // Persists what reports changed since the last call (progress, held
  // states, link probes) in one commit.
  absl::Status FlushReports();
  absl::StatusOr<v1::Assignment> GetAssignment(uint64_t peer_id, absl::string_view session_token) const;

  // Blocks until the assignment version exceeds `known` or `timeout` passes
  // (real time); returns the current version. Does not take the
  // coordinator's mutex (a mutex of its own), so waiting watchers cost the
  // other calls nothing.
  uint64_t AwaitVersionAbove(uint64_t known, absl::Duration timeout) const;
  // Removes every member whose lease expired by the clock; returns their ids.
  absl::StatusOr<std::vector<uint64_t>> ExpireLeases();
  // A peer whose neighbour reported their link lost under the current plan
  // (ReportBlame, LINK_LOST) is asked once per plan, off the lock, whether
  // its process is gone: `refuses(state_transfer_address)` (the daemon's
  // own server; connect_probe.h). Those that refuse are removed as an
  // expired lease would remove them, so a killed peer is replaced without
  // waiting out its lease; a peer that is alive, stopped, or cannot be
  // reached from here keeps its lease. Returns the ids removed. The server
  // calls it with ExpireLeases.
  absl::StatusOr<std::vector<uint64_t>> RemoveRefusingSuspects(
      const std::function<bool(absl::string_view address)>& refuses);
  // Re-plans on measurements when it pays (see SwarmCoordinatorOptions::
  // improve_*); true when a new plan was committed and published. The
  // server calls it with ExpireLeases; it returns at once between intervals.
  absl::StatusOr<bool> ImprovePlan();

  // The swarm's status. `details`: every peer with its addresses, links and
  // held states (for an admin); otherwise the summary only (job, step, loss,
  // tokens/s, counts: one PeerStatus per member carrying only its state,
  // stage and pipeline).
  v1::StatusResponse GetStatus(bool details = true) const;
  uint64_t assignment_version() const;
  Grid grid() const;
  size_t num_members() const;
  const v1::JobSpec& job() const { return options_.job; }
  // The data identity peers are checked against (empty: not known yet).
  DataIdentity data_identity() const;
  const SwarmCoordinatorOptions& options() const { return options_; }

 private:
  SwarmCoordinator(SwarmCoordinatorOptions options, std::unique_ptr<CoordinatorState> state);
  absl::Status Restore(const PersistedState& persisted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A grid to adopt instead of re-planning (ImprovePlan), with the
  // generation counter its new generations came from.
  struct Replacement {
    Grid grid;
    uint64_t next_generation = 0;
  };
  // Re-plans (or takes `replacement`), commits, applies, bumps the version
  // (see the banner).
  // `restart`: a new plan on the same grid even when nothing changed (every
  // placed peer restarts at the resume step: SettleBlames).
  absl::Status ChangeMembersLocked(const std::vector<uint64_t>& removed, const std::optional<Member>& added,
                                   const UsedToken* used = nullptr, const Replacement* replacement = nullptr,
                                   bool restart = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED (counted) when `peer_id` is over report_limit.
  absl::Status AllowReportLocked(uint64_t peer_id, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The strikes `name` holds at `now` (0 once strike_decay passed since its last).
  int StrikesLocked(absl::string_view name, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The step every placed peer of `grid` would restart from with `live` as
  // the members (see ChangeMembersLocked); `bound` gets the fewest steps a
  // peer that keeps a place has completed.
  // Fault domains (SwarmCoordinatorOptions::fault_domains) on: the job
  // qualifies (DiLoCo, data_parallel >= 2).
  bool FaultDomainsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A re-plan (`grid`, its plan version bumped, its run fields grid_'s) that
  // keeps every peer of some pipeline in place: sets the other pipelines'
  // run fields so they heal from the kept ones; false (grid untouched) when
  // none is kept or no state to heal from qualifies.
  bool KeepPipelinesLocked(Grid* grid, const std::unordered_set<uint64_t>& gone) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t ResumeStepLocked(const Grid& grid, const Membership& live, std::optional<int64_t>* bound) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a re-plan against the name of each placed member in `removed`
  // (not a member replaced by its own update, `added` with the same id).
  void RecordReplanCausesLocked(const std::vector<uint64_t>& removed, const std::optional<Member>& added)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether every one of `removed` completed the job's last step (max_steps)
  // under the current plan: such peers leave no work behind.
  bool AllFinishedLocked(const std::vector<uint64_t>& removed) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The grid is whole, or the job's last step is reached (the slots that
  // finished peers left stay empty): what assignments and Status say.
  bool GridCompleteLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `step`, reported by `reporter`, is one the swarm can back: not
  // past the job's max_steps; for a placed peer of a pipeline with more
  // stages, at most kProgressSlack past the most another stage of that
  // pipeline reported or claimed under this plan (a stage cannot finish a
  // step the stage before it has not run); for a standby, not past the
  // swarm's step.
  bool PlausibleProgressLocked(const Member& reporter, int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION (counted) when `progress` is behind what `reporter`
  // reported under the same plan.
  absl::Status CheckMonotonicLocked(const Member& reporter, const PeerProgress& progress) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `held` limited to the stages `peer_id` may hold (its own, its mirror).
  void KeepOwnStagesLocked(uint64_t peer_id, HeldStates* held) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts each (stage, step) of `held` another member reports another hash
  // for. Not under DiLoCo with replicas: its replicas differ between outer
  // steps (their own inner steps and AdamW moments), so their states do too.
  void CountHashDisagreementsLocked(uint64_t peer_id, const HeldStates& held) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The SHA-256 most members report for stage `stage` at `step` ("" if none).
  std::string StateHashLocked(int stage, int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FlushReports under mu_; the Maybe form only when report_persist_interval passed since the last.
  absl::Status FlushReportsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status MaybeFlushReportsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops used-token records whose token expired.
  void PruneUsedTokensLocked(CoordinatorState::Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RecordProgressLocked(const Member& reporter, const PeerProgress& progress, int64_t checkpoint_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Neighbor NeighborLocked(uint64_t peer, int stage, int pipeline, uint64_t generation) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  double SwarmTokensPerSecondLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Up to probes_per_heartbeat peers whose link from `peer_id` is unmeasured
  // or stale (see SwarmCoordinatorOptions::probe_max_age).
  std::vector<v1::Neighbor> ProbeTargetsLocked(uint64_t peer_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SwarmCoordinatorOptions options_;
  const MembershipOptions membership_options_;
  const rpc::Clock* const clock_;
  RateLimiter join_per_name_;
  RateLimiter join_all_;
  Backoff replans_;  // by peer name
  // Blame reports of plan `blame_plan_` (one per reporter), the first at
  // `blame_first_`; strikes and evictions by peer name (memory only: a
  // restarted coordinator starts them over).
  struct BlameRecord {
    uint64_t reporter = 0;
    uint64_t accused = 0;
    v1::Blame::Kind kind = v1::Blame::KIND_UNSPECIFIED;
    std::string reason;
  };
  struct StrikeRun {
    int strikes = 0;
    absl::Time last;
  };
  struct EvictionRun {
    int evictions = 0;
    absl::Time held_until;
  };
  uint64_t blame_plan_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time blame_first_ ABSL_GUARDED_BY(mu_);
  std::vector<BlameRecord> blames_ ABSL_GUARDED_BY(mu_);
  // Accused members of plan `probed_plan_` already asked RemoveRefusingSuspects' question.
  uint64_t probed_plan_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint64_t> probed_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, StrikeRun, std::less<>> strikes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, EvictionRun, std::less<>> evicted_ ABSL_GUARDED_BY(mu_);
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  RateLimiter reports_;
  const Planner planner_;
  std::unique_ptr<CoordinatorState> state_;

  // The assignment version as published to watchers (AwaitVersionAbove).
  mutable absl::Mutex version_mu_;  // taken after mu_, never before
  mutable absl::CondVar version_changed_;
  uint64_t published_version_ ABSL_GUARDED_BY(version_mu_) = 0;

  mutable absl::Mutex mu_;
  Membership membership_ ABSL_GUARDED_BY(mu_);
  LinkMatrix links_ ABSL_GUARDED_BY(mu_);
  // ImprovePlan's schedule: the next check, and when the grid last changed.
  absl::Time next_improve_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_plan_change_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  Grid grid_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
  SwarmProgress progress_ ABSL_GUARDED_BY(mu_);
  DataIdentity data_identity_ ABSL_GUARDED_BY(mu_);
  // When a peer was last asked to probe a link (from, to): not persisted.
  std::map<std::pair<uint64_t, uint64_t>, absl::Time> probe_asked_ ABSL_GUARDED_BY(mu_);
  // Per peer: the member id its last probe scan stopped at.
  std::map<uint64_t, uint64_t> probe_cursor_ ABSL_GUARDED_BY(mu_);
  // (token id, peer name) -> the join it admitted (persisted under tokens/).
  std::map<std::pair<std::string, std::string>, UsedToken> used_tokens_ ABSL_GUARDED_BY(mu_);
  // Changed by reports since the last FlushReports().
  bool progress_dirty_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_report_flush_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::set<uint64_t> dirty_members_ ABSL_GUARDED_BY(mu_);
  // Member id -> (plan, step) of its last progress report, taken or not
  // (PlausibleProgressLocked). In memory only.
  std::map<uint64_t, std::pair<uint64_t, int64_t>> claimed_steps_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<uint64_t, uint64_t>> dirty_links_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_SWARM_COORDINATOR_H_
