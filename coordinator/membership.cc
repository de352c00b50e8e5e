#include "coordinator/membership.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/join_token.h"
#include "common/status_macros.h"
#include "proto/held_states.h"

namespace aqswarm::coordinator {
namespace {

bool IsNameChar(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-'; }

bool IsHostname(absl::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  for (char c : host) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '-' && c != '_') return false;
  }
  return host.front() != '-' && host.front() != '.';
}

bool IsIpv6(absl::string_view host) {
  if (host.size() < 2 || host.size() > 45) return false;
  int colons = 0;
  for (char c : host) {
    if (c == ':') {
      ++colons;
    } else if (!absl::ascii_isxdigit(c) && c != '.') {
      return false;
    }
  }
  return colons >= 2;
}

}  // namespace

bool SameSecret(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(i < b.size() ? b[i] : 0);
  }
  return diff == 0;
}

absl::Status ValidateAddress(absl::string_view field, absl::string_view address) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " '", absl::CHexEscape(address.substr(0, 300)), "' is not HOST:PORT: ", why));
  };
  if (address.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is required (HOST:PORT)"));
  if (address.size() > 300) return bad("longer than 300 characters");
  absl::string_view host, port;
  if (address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) return bad("missing ']'");
    host = address.substr(1, close - 1);
    if (close + 1 >= address.size() || address[close + 1] != ':') return bad("missing ':PORT'");
    port = address.substr(close + 2);
    if (!IsIpv6(host)) return bad("malformed IPv6 address");
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) return bad("missing ':PORT'");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (!IsHostname(host)) return bad("malformed host");
  }
  uint32_t p = 0;
  if (port.empty() || port.size() > 5 || !absl::SimpleAtoi(port, &p) || p < 1 || p > 65535 ||
      !absl::ascii_isdigit(port.front())) {
    return bad("port must be 1..65535");
  }
  return absl::OkStatus();
}

absl::Status ValidateJoinParams(const JoinParams& params) {
  if (params.peer_name.empty()) return absl::InvalidArgumentError("peer_name is required");
  if (params.peer_name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("peer_name is longer than ", kMaxNameBytes, " bytes"));
  }
  for (char c : params.peer_name) {
    if (!IsNameChar(c)) {
      return absl::InvalidArgumentError(absl::StrCat("peer_name '", absl::CHexEscape(params.peer_name),
                                                     "' may only hold [A-Za-z0-9._-]"));
    }
  }
  if (params.peer_name == kAnyPeer) return absl::InvalidArgumentError("peer_name '*' is reserved");
  if (params.join_token.empty()) return absl::UnauthenticatedError("join_token is missing");
  if (params.join_token.size() > 1024) return absl::InvalidArgumentError("join_token is longer than 1024 bytes");
  if (params.previous_session_token.size() > 256) {
    return absl::InvalidArgumentError("previous_session_token is longer than 256 bytes");
  }
  AQSWARM_RETURN_IF_ERROR(ValidateAddress("stage_link_address", params.stage_link_address));
  if (!params.gradient_exchange_address.empty()) {
    AQSWARM_RETURN_IF_ERROR(ValidateAddress("gradient_exchange_address", params.gradient_exchange_address));
  }
  if (!params.state_transfer_address.empty()) {
    AQSWARM_RETURN_IF_ERROR(ValidateAddress("state_transfer_address", params.state_transfer_address));
  }
  if (!std::isfinite(params.seconds_per_layer) || params.seconds_per_layer < 0 ||
      params.seconds_per_layer > kMaxSecondsPerLayer) {
    return absl::InvalidArgumentError(absl::StrCat("seconds_per_layer ", params.seconds_per_layer,
                                                   " is outside [0, ", kMaxSecondsPerLayer, "]"));
  }
  AQSWARM_RETURN_IF_ERROR(ValidateHashHex(params.data.dataset_hash, "dataset_hash"));
  AQSWARM_RETURN_IF_ERROR(ValidateHashHex(params.data.tokenizer_hash, "tokenizer_hash"));
  if (params.memory_bytes > kMaxMemoryBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory_bytes ", params.memory_bytes, " is above ", kMaxMemoryBytes, " (1 PiB)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateProgress(const PeerProgress& p) {
  if (p.step < 0 || p.step > int64_t{1} << 40) {
    return absl::InvalidArgumentError(absl::StrCat("progress.step ", p.step, " is outside [0, 2^40]"));
  }
  if (!std::isfinite(p.loss) || p.loss < 0 || p.loss > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat("progress.loss ", p.loss, " is not finite in [0, 1e6]"));
  }
  if (!std::isfinite(p.tokens_per_second) || p.tokens_per_second < 0 || p.tokens_per_second > 1e12) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress.tokens_per_second ", p.tokens_per_second, " is not finite in [0, 1e12]"));
  }
  return absl::OkStatus();
}

Membership::Membership(MembershipOptions options, const rpc::Clock* clock)
    : options_(std::move(options)), clock_(clock) {}

absl::StatusOr<JoinClaims> Membership::CheckToken(const MembershipOptions& options, const JoinParams& params,
                                                  absl::Time now) {
  absl::StatusOr<JoinClaims> claims =
      VerifyJoinToken(options.join_secret, params.join_token, absl::ToUnixSeconds(now));
  if (!claims.ok()) {
    // A malformed token is as bad as a forged one: the caller is not admitted.
    if (absl::IsInvalidArgument(claims.status())) return absl::UnauthenticatedError(claims.status().message());
    return claims.status();
  }
  AQSWARM_RETURN_IF_ERROR(CheckJoinClaims(*claims, options.swarm_id, params.peer_name));
  return claims;
}

absl::StatusOr<Member> Membership::Admit(const JoinParams& params, uint64_t id) const {
  AQSWARM_RETURN_IF_ERROR(ValidateJoinParams(params));
  const absl::Time now = clock_->Now();
  AQSWARM_RETURN_IF_ERROR(CheckToken(options_, params, now).status());
  const bool rejoin = FindByName(params.peer_name) != nullptr;
  if (!rejoin && static_cast<int64_t>(members_.size()) >= options_.max_members) {
    return absl::FailedPreconditionError(absl::StrCat("the swarm is full (", options_.max_members, " peers)"));
  }
  AQSWARM_ASSIGN_OR_RETURN(std::string random, GenerateJoinSecret());
  Member m;
  m.id = id;
  m.name = params.peer_name;
  m.session_token = absl::BytesToHexString(random.substr(0, 16));
  m.stage_link_address = params.stage_link_address;
  m.gradient_exchange_address = params.gradient_exchange_address;
  m.state_transfer_address = params.state_transfer_address;
  m.seconds_per_layer = params.seconds_per_layer;
  m.memory_bytes = params.memory_bytes;
  m.held = params.held;
  m.certificate_sha256 = params.certificate_sha256;
  m.reachability = params.no_inbound ? v1::NO_INBOUND : v1::REACHABLE;
  m.joined_at = now;
  m.lease_expiry = now + options_.lease;
  return m;
}

void Membership::Add(Member member) {
  by_name_[member.name] = member.id;
  const uint64_t id = member.id;
  members_[id] = std::move(member);
}

void Membership::Remove(uint64_t id) {
  auto it = members_.find(id);
  if (it == members_.end()) return;
  auto n = by_name_.find(it->second.name);
  if (n != by_name_.end() && n->second == id) by_name_.erase(n);
  members_.erase(it);
}

absl::StatusOr<const Member*> Membership::Authenticate(uint64_t id, absl::string_view session_token) const {
  auto it = members_.find(id);
  if (it == members_.end()) {
    return absl::NotFoundError(absl::StrCat("peer ", id, " is not a member (never joined, left, or its lease "
                                            "expired): join again"));
  }
  if (!SameSecret(it->second.session_token, session_token)) {
    return absl::UnauthenticatedError(absl::StrCat("wrong session_token for peer ", id));
  }
  return &it->second;
}

void Membership::SetProgress(uint64_t id, const PeerProgress& progress) { members_.at(id).progress = progress; }

void Membership::SetHeld(uint64_t id, HeldStates held) { members_.at(id).held = std::move(held); }

const HeldState* FindHeld(const HeldStates& held, uint32_t stage, int64_t step) {
  auto s = held.find(stage);
  if (s == held.end()) return nullptr;
  auto at = std::lower_bound(s->second.begin(), s->second.end(), step,
                             [](const HeldState& h, int64_t x) { return h.step < x; });
  return at == s->second.end() || at->step != step ? nullptr : &*at;
}

absl::StatusOr<HeldStates> HeldStatesFromProto(const google::protobuf::RepeatedPtrField<v1::StageCheckpoints>& held) {
  if (held.size() > 4096) return absl::InvalidArgumentError("held: more than 4096 stages");
  HeldStates out;
  for (const v1::StageCheckpoints& c : held) {
    const int n = std::max(c.states_size(), c.legacy_steps_size());
    if (n > static_cast<int>(kMaxHeldStepsPerStage)) {
      return absl::InvalidArgumentError(
          absl::StrCat("held: stage ", c.stage(), " lists ", n, " states, at most ", kMaxHeldStepsPerStage));
    }
    AQSWARM_ASSIGN_OR_RETURN(const std::vector<v1::HeldState> states, v1::HeldStatesOf(c));
    std::vector<HeldState> list;
    for (const v1::HeldState& h : states) list.push_back({h.step(), h.sha256()});
    if (!out.emplace(c.stage(), std::move(list)).second) {
      return absl::InvalidArgumentError(absl::StrCat("held: stage ", c.stage(), " is listed twice"));
    }
  }
  return out;
}

void AddHeldTo(const HeldStates& held, google::protobuf::RepeatedPtrField<v1::StageCheckpoints>* out) {
  for (const auto& [stage, states] : held) {
    v1::StageCheckpoints& c = *out->Add();
    c.set_stage(stage);
    for (const HeldState& h : states) {
      v1::HeldState& r = *c.add_states();
      r.set_step(h.step);
      r.set_sha256(h.sha256);
    }
  }
}

absl::Status ValidateHeldStates(const HeldStates& held, int num_stages) {
  for (const auto& [stage, states] : held) {
    if (stage >= static_cast<uint32_t>(num_stages)) {
      return absl::InvalidArgumentError(absl::StrCat("held state of stage ", stage, " but the job has ", num_stages,
                                                     " stages"));
    }
    if (states.size() > kMaxHeldStepsPerStage) {
      return absl::InvalidArgumentError(absl::StrCat("held states of stage ", stage, ": ", states.size(),
                                                     " steps, at most ", kMaxHeldStepsPerStage));
    }
    for (size_t i = 0; i < states.size(); ++i) {
      if (states[i].step < 0 || (i > 0 && states[i].step <= states[i - 1].step)) {
        return absl::InvalidArgumentError(
            absl::StrCat("held states of stage ", stage, ": steps must be >= 0 and strictly ascending"));
      }
      const std::string& h = states[i].sha256;
      if (h.empty()) continue;
      bool hex = h.size() == 64;
      for (char c : h) hex = hex && (absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f'));
      if (!hex) {
        return absl::InvalidArgumentError(absl::StrCat("held state of stage ", stage, ": sha256 '",
                                                       absl::CHexEscape(h.substr(0, 80)),
                                                       "' is not 64 lowercase hex digits"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Time Membership::Renew(uint64_t id) {
  Member& m = members_.at(id);
  m.lease_expiry = std::max(m.lease_expiry, clock_->Now() + options_.lease);
  return m.lease_expiry;
}

std::vector<uint64_t> Membership::Expired() const {
  const absl::Time now = clock_->Now();
  std::vector<uint64_t> out;
  for (const auto& [id, m] : members_) {
    if (m.lease_expiry <= now) out.push_back(id);
  }
  return out;
}

void Membership::ExtendAllLeases(absl::Duration grace) {
  const absl::Time floor = clock_->Now() + grace;
  for (auto& [id, m] : members_) m.lease_expiry = std::max(m.lease_expiry, floor);
}

const Member* Membership::Find(uint64_t id) const {
  auto it = members_.find(id);
  return it == members_.end() ? nullptr : &it->second;
}

const Member* Membership::FindByName(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : Find(it->second);
}

}  // namespace aqswarm::coordinator
