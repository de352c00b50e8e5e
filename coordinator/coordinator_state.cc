#include "coordinator/coordinator_state.h"

#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "proto/coordinator.pb.h"
#include "proto/job_format.h"

namespace aqswarm::coordinator {
namespace {

using storage::StateKey;
using storage::StateStore;

const StateKey<std::string> kJob("job");
const StateKey<uint64_t> kVersion("counters/assignment_version");
const StateKey<uint64_t> kNextPeerId("counters/next_peer_id");
const StateKey<uint64_t> kNextGeneration("counters/next_generation");
const StateKey<std::string> kGrid("grid");
const StateKey<int64_t> kStep("progress/step");
const StateKey<int64_t> kCheckpointStep("progress/checkpoint_step");
const StateKey<double> kLoss("progress/loss");
const StateKey<double> kTokensPerSecond("progress/tokens_per_second");
const StateKey<std::string> kDataIdentity("data_identity");
constexpr char kMembersPrefix[] = "members/";
constexpr char kLinksPrefix[] = "links/";
constexpr char kTokensPrefix[] = "tokens/";

std::string MemberKey(uint64_t id) { return absl::StrFormat("%s%020d", kMembersPrefix, id); }
std::string LinksFromPrefix(uint64_t from) { return absl::StrFormat("%s%020d/", kLinksPrefix, from); }
std::string TokenKey(const std::string& id, const std::string& name) {
  return absl::StrCat(kTokensPrefix, id, "/", name);
}
std::string LinkKey(uint64_t from, uint64_t to) { return absl::StrFormat("%s%020d", LinksFromPrefix(from), to); }

// Missing keys read as `fallback`; other errors propagate.
template <typename T>
absl::StatusOr<T> GetOr(const StateStore& store, const StateKey<T>& key, T fallback) {
  absl::StatusOr<T> v = store.Get(key);
  if (absl::IsNotFound(v.status())) return fallback;
  return v;
}

}  // namespace

void CoordinatorState::Change::PutJob(const v1::JobSpec& job) { batch_.Put(kJob, job.SerializeAsString()); }

void CoordinatorState::Change::PutCounters(const Counters& c) {
  batch_.Put(kVersion, c.assignment_version);
  batch_.Put(kNextPeerId, c.next_peer_id);
  batch_.Put(kNextGeneration, c.next_generation);
}

void CoordinatorState::Change::PutMember(const Member& m) {
  v1::MemberRecord r;
  r.set_peer_id(m.id);
  r.set_peer_name(m.name);
  r.set_session_token(m.session_token);
  r.set_stage_link_address(m.stage_link_address);
  r.set_gradient_exchange_address(m.gradient_exchange_address);
  r.set_state_transfer_address(m.state_transfer_address);
  r.set_seconds_per_layer(m.seconds_per_layer);
  r.set_memory_bytes(m.memory_bytes);
  r.set_joined_unix_ms(absl::ToUnixMillis(m.joined_at));
  r.set_lease_expiry_unix_ms(absl::ToUnixMillis(m.lease_expiry));
  r.set_certificate_sha256(m.certificate_sha256);
  r.set_reachability(m.reachability);
  AddHeldTo(m.held, r.mutable_held());
  batch_.Put(StateKey<std::string>(MemberKey(m.id)), r.SerializeAsString());
}

void CoordinatorState::Change::DeleteMember(uint64_t id) {
  batch_.Delete(MemberKey(id));
  batch_.DeletePrefix(LinksFromPrefix(id));
}

void CoordinatorState::Change::PutLink(uint64_t from, uint64_t to, const LinkEstimate& e) {
  v1::LinkRecord r;
  r.set_from_peer_id(from);
  r.set_to_peer_id(to);
  r.set_bandwidth_bytes_per_second(e.bandwidth_bytes_per_second);
  r.set_rtt_seconds(e.rtt_seconds);
  if (e.measured_at != absl::InfinitePast()) r.set_measured_unix_ms(absl::ToUnixMillis(e.measured_at));
  batch_.Put(StateKey<std::string>(LinkKey(from, to)), r.SerializeAsString());
}

void CoordinatorState::Change::PutGrid(const Grid& g) {
  v1::GridRecord r;
  r.set_num_stages(g.num_stages);
  r.set_num_pipelines(g.num_pipelines);
  for (uint64_t s : g.slots) r.add_slots(s);
  for (uint64_t s : g.forward_generation) r.add_forward_generation(s);
  for (uint64_t s : g.replica_generation) r.add_replica_generation(s);
  r.set_plan_version(g.plan_version);
  r.set_resume_step(g.resume_step);
  for (uint64_t v : g.run_plan) r.add_run_plan(v);
  for (int64_t v : g.run_resume) r.add_run_resume(v);
  for (bool v : g.heal) r.add_heal(v);
  for (int64_t v : g.run_start) r.add_run_start(v);
  r.set_dp_timeline(g.dp_timeline);
  batch_.Put(kGrid, r.SerializeAsString());
}

void CoordinatorState::Change::PutProgress(const SwarmProgress& p) {
  batch_.Put(kStep, p.progress.step);
  batch_.Put(kLoss, p.progress.loss);
  batch_.Put(kTokensPerSecond, p.progress.tokens_per_second);
  batch_.Put(kCheckpointStep, p.checkpoint_step);
}

void CoordinatorState::Change::PutDataIdentity(const DataIdentity& d) {
  batch_.Put(kDataIdentity, absl::StrCat(d.dataset_hash, "/", d.tokenizer_hash));
}

void CoordinatorState::Change::PutUsedToken(const UsedToken& u) {
  v1::UsedTokenRecord r;
  r.set_expiry_unix_s(u.expiry_unix_s);
  r.set_certificate_sha256(u.certificate_sha256);
  r.set_session_token(u.session_token);
  batch_.Put(StateKey<std::string>(TokenKey(u.token_id, u.peer_name)), r.SerializeAsString());
}

void CoordinatorState::Change::DeleteUsedToken(const std::string& token_id, const std::string& peer_name) {
  batch_.Delete(TokenKey(token_id, peer_name));
}

absl::StatusOr<std::unique_ptr<CoordinatorState>> CoordinatorState::Open(const Options& options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("coordinator state dir is required");
  AQSWARM_ASSIGN_OR_RETURN(auto store, StateStore::Open({options.dir, options.sync}));
  return std::unique_ptr<CoordinatorState>(new CoordinatorState(std::move(store)));
}

absl::Status CoordinatorState::Commit(const Change& change) {
  if (change.empty()) return absl::OkStatus();
  return store_->Commit(change.batch_);
}

absl::StatusOr<PersistedState> CoordinatorState::Load() const {
  PersistedState s;
  absl::StatusOr<std::string> job = store_->Get(kJob);
  if (job.ok()) {
    v1::JobSpec spec;
    if (!spec.ParseFromString(*job)) return absl::DataLossError("coordinator state: key 'job' is corrupt");
    if (absl::Status s = job_format::UpgradeStoredJob(&spec); !s.ok()) {
      return absl::DataLossError(absl::StrCat("coordinator state: key 'job': ", s.message()));
    }
    s.job = std::move(spec);
  } else if (!absl::IsNotFound(job.status())) {
    return job.status();
  }
  AQSWARM_ASSIGN_OR_RETURN(s.counters.assignment_version, GetOr(*store_, kVersion, uint64_t{0}));
  AQSWARM_ASSIGN_OR_RETURN(s.counters.next_peer_id, GetOr(*store_, kNextPeerId, uint64_t{1}));
  AQSWARM_ASSIGN_OR_RETURN(s.counters.next_generation, GetOr(*store_, kNextGeneration, uint64_t{1}));
  AQSWARM_ASSIGN_OR_RETURN(s.progress.progress.step, GetOr(*store_, kStep, int64_t{0}));
  AQSWARM_ASSIGN_OR_RETURN(s.progress.progress.loss, GetOr(*store_, kLoss, 0.0));
  AQSWARM_ASSIGN_OR_RETURN(s.progress.progress.tokens_per_second, GetOr(*store_, kTokensPerSecond, 0.0));
  AQSWARM_ASSIGN_OR_RETURN(s.progress.checkpoint_step, GetOr(*store_, kCheckpointStep, int64_t{0}));
  AQSWARM_ASSIGN_OR_RETURN(std::string identity, GetOr(*store_, kDataIdentity, std::string()));
  if (!identity.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(identity, '/');
    if (parts.size() != 2 || !ValidateHashHex(parts[0], "dataset").ok() ||
        !ValidateHashHex(parts[1], "tokenizer").ok()) {
      return absl::DataLossError("coordinator state: key 'data_identity' is corrupt");
    }
    s.data_identity = DataIdentity{parts[0], parts[1]};
  }

  AQSWARM_ASSIGN_OR_RETURN(auto members, store_->Scan(kMembersPrefix));
  for (const auto& [key, tagged] : members) {
    AQSWARM_ASSIGN_OR_RETURN(std::string raw, StateStore::Untag<std::string>(key, tagged));
    v1::MemberRecord r;
    if (!r.ParseFromString(raw) || r.peer_id() == 0 || key != MemberKey(r.peer_id())) {
      return absl::DataLossError(absl::StrCat("coordinator state: member record '", key, "' is corrupt"));
    }
    Member m;
    m.id = r.peer_id();
    m.name = r.peer_name();
    m.session_token = r.session_token();
    m.stage_link_address = r.stage_link_address();
    m.gradient_exchange_address = r.gradient_exchange_address();
    m.state_transfer_address = r.state_transfer_address();
    m.seconds_per_layer = r.seconds_per_layer();
    m.memory_bytes = r.memory_bytes();
    m.joined_at = absl::FromUnixMillis(r.joined_unix_ms());
    m.lease_expiry = absl::FromUnixMillis(r.lease_expiry_unix_ms());
    m.certificate_sha256 = r.certificate_sha256();
    // Records from before reachability existed: those peers were placed, so reachable.
    m.reachability = r.reachability() == v1::REACHABILITY_UNSPECIFIED ? v1::REACHABLE : r.reachability();
    absl::StatusOr<HeldStates> held = HeldStatesFromProto(r.held());
    if (!held.ok()) {
      return absl::DataLossError(absl::StrCat("coordinator state: member record '", key, "': ", held.status().message()));
    }
    m.held = *std::move(held);
    s.members.push_back(std::move(m));
  }

  std::set<uint64_t> member_ids;
  for (const Member& m : s.members) member_ids.insert(m.id);
  AQSWARM_ASSIGN_OR_RETURN(auto links, store_->Scan(kLinksPrefix));
  for (const auto& [key, tagged] : links) {
    AQSWARM_ASSIGN_OR_RETURN(std::string raw, StateStore::Untag<std::string>(key, tagged));
    v1::LinkRecord r;
    if (!r.ParseFromString(raw) || key != LinkKey(r.from_peer_id(), r.to_peer_id()) ||
        !ValidateLinkEstimate(r.bandwidth_bytes_per_second(), r.rtt_seconds()).ok()) {
      return absl::DataLossError(absl::StrCat("coordinator state: link record '", key, "' is corrupt"));
    }
    // Links to a member that has since gone are dropped (only links *from* a
    // removed member are deleted with it).
    if (!member_ids.count(r.from_peer_id()) || !member_ids.count(r.to_peer_id())) continue;
    LinkEstimate e{r.bandwidth_bytes_per_second(), r.rtt_seconds(), true,
                   r.measured_unix_ms() != 0 ? absl::FromUnixMillis(r.measured_unix_ms()) : absl::InfinitePast()};
    s.links.push_back({r.from_peer_id(), r.to_peer_id(), e});
  }

  AQSWARM_ASSIGN_OR_RETURN(auto tokens, store_->Scan(kTokensPrefix));
  for (const auto& [key, tagged] : tokens) {
    AQSWARM_ASSIGN_OR_RETURN(std::string raw, StateStore::Untag<std::string>(key, tagged));
    const std::vector<std::string> id_name = absl::StrSplit(key.substr(sizeof(kTokensPrefix) - 1), absl::MaxSplits('/', 1));
    UsedToken u;
    bool ok = id_name.size() == 2;
    if (ok && !raw.empty() && (absl::ascii_isdigit(static_cast<unsigned char>(raw[0])) || raw[0] == '-')) {
      // Older builds' text, "<expiry>|<certificate sha256>|<session token>"
      // (a UsedTokenRecord never starts with a digit or '-': its first byte
      // is a field tag).
      const std::vector<std::string> fields = absl::StrSplit(raw, absl::MaxSplits('|', 2));
      ok = fields.size() == 3 && absl::SimpleAtoi(fields[0], &u.expiry_unix_s);
      if (ok) {
        u.certificate_sha256 = fields[1];
        u.session_token = fields[2];
      }
    } else if (ok) {
      v1::UsedTokenRecord r;
      ok = r.ParseFromString(raw);
      u.expiry_unix_s = r.expiry_unix_s();
      u.certificate_sha256 = r.certificate_sha256();
      u.session_token = r.session_token();
    }
    if (!ok) return absl::DataLossError(absl::StrCat("coordinator state: used token record '", key, "' is corrupt"));
    u.token_id = id_name[0];
    u.peer_name = id_name[1];
    s.used_tokens.push_back(std::move(u));
  }

  absl::StatusOr<std::string> grid = store_->Get(kGrid);
  if (grid.ok()) {
    v1::GridRecord r;
    const size_t S = r.ParseFromString(*grid) ? r.num_stages() : 0, P = r.num_pipelines();
    if (S == 0 || P == 0 || S > 4096 || P > 4096 || size_t(r.slots_size()) != S * P ||
        size_t(r.forward_generation_size()) != (S - 1) * P || size_t(r.replica_generation_size()) != S ||
        (r.run_plan_size() != 0 && size_t(r.run_plan_size()) != P) ||
        size_t(r.run_resume_size()) != (r.run_plan_size() == 0 ? 0 : S * P) || r.heal_size() != r.run_plan_size() ||
        r.run_start_size() != r.run_plan_size()) {
      return absl::DataLossError("coordinator state: key 'grid' is corrupt");
    }
    Grid g = Grid::Empty(static_cast<int>(S), static_cast<int>(P));
    g.slots.assign(r.slots().begin(), r.slots().end());
    g.forward_generation.assign(r.forward_generation().begin(), r.forward_generation().end());
    g.replica_generation.assign(r.replica_generation().begin(), r.replica_generation().end());
    g.plan_version = r.plan_version();
    g.resume_step = r.resume_step();
    g.run_plan.assign(r.run_plan().begin(), r.run_plan().end());
    g.run_resume.assign(r.run_resume().begin(), r.run_resume().end());
    g.heal.assign(r.heal().begin(), r.heal().end());
    g.run_start.assign(r.run_start().begin(), r.run_start().end());
    g.dp_timeline = r.dp_timeline();
    s.grid = std::move(g);
  } else if (!absl::IsNotFound(grid.status())) {
    return grid.status();
  }
  return s;
}

}  // namespace aqswarm::coordinator
