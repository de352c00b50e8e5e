// Membership: who is in the swarm, admitted by join token, kept by leases.
//
//   Membership members({.swarm_id = "demo", .join_secret = secret,
//                       .lease = absl::Seconds(10)}, &clock);
//   AQSWARM_ASSIGN_OR_RETURN(Member m, members.Admit(params, /*id=*/7));
//   ...persist m...
//   members.Add(m);
//   AQSWARM_ASSIGN_OR_RETURN(Member* me, members.Authenticate(7, session));
//   members.Renew(7);                         // heartbeat
//   for (uint64_t id : members.Expired()) ... // lease_expiry <= now
//
// Admit() only checks and builds the record; Add()/Remove() change the set.
// The caller (SwarmCoordinator) persists a change before applying it, so the
// in-memory set never runs ahead of the state dir.
//
// Validation of the request shape (names, addresses, numbers) happens at the
// service boundary (ValidateJoinParams, also used here); Admit() checks the
// token: VerifyJoinToken (UNAUTHENTICATED: bad signature or expired,
// INVALID_ARGUMENT: malformed) then CheckJoinClaims (PERMISSION_DENIED).
//
// Thread-safety: not thread-safe; SwarmCoordinator serialises access.
#ifndef AQSWARM_COORDINATOR_MEMBERSHIP_H_
#define AQSWARM_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/data_identity.h"
#include "common/join_token.h"
#include "proto/coordinator.pb.h"
#include "rpc/clock.h"

namespace aqswarm::coordinator {

struct PeerProgress {
  int64_t step = 0;
  double loss = 0;
  double tokens_per_second = 0;
  uint64_t plan_version = 0;  // the plan whose run completed `step`; 0: not given (current)
};

// One stage state (checkpoint) a peer holds and serves.
struct HeldState {
  // A state of `step` steps completed (HeldState{8}: its hash not reported).
  HeldState(int64_t step = 0, std::string sha256 = "") : step(step), sha256(std::move(sha256)) {}
  int64_t step;
  std::string sha256;  // 64 lowercase hex digits of its file; "": not reported
  bool operator==(const HeldState& o) const { return step == o.step && sha256 == o.sha256; }
  bool operator!=(const HeldState& o) const { return !(*this == o); }
};
// Stage -> the states a peer holds, steps ascending, unique.
using HeldStates = std::map<uint32_t, std::vector<HeldState>>;
inline constexpr size_t kMaxHeldStepsPerStage = 64;
// The state of `stage` at `step` in `held`, or null.
const HeldState* FindHeld(const HeldStates& held, uint32_t stage, int64_t step);
// From the wire or a state dir (either form, proto/held_states.h): shape
// only (a stage listed twice, more than 4096 stages or
// kMaxHeldStepsPerStage states refused; ranges and order are
// ValidateHeldStates').
absl::StatusOr<HeldStates> HeldStatesFromProto(const google::protobuf::RepeatedPtrField<v1::StageCheckpoints>& held);
// Appends `held` as StageCheckpoints records.
void AddHeldTo(const HeldStates& held, google::protobuf::RepeatedPtrField<v1::StageCheckpoints>* out);

struct JoinParams {
  std::string peer_name;
  std::string join_token;
  std::string stage_link_address;
  std::string gradient_exchange_address;  // may be empty
  std::string state_transfer_address;     // may be empty
  double seconds_per_layer = 0;           // 0 = unknown
  uint64_t memory_bytes = 0;              // 0 = unknown (unlimited)
  HeldStates held;                        // states it already holds (a restarted peer)
  std::string held_job_name;              // the job `held` belongs to
  DataIdentity data;                      // hashes of its local copy of the job's data
  // The session token of this name's previous membership (a rejoin proves
  // itself with it); "" on a first join.
  std::string previous_session_token;
  // SHA-256 (hex) of the caller's TLS client certificate; "" without TLS.
  std::string certificate_sha256;
  // The peer says it cannot accept connections (JoinRequest.no_inbound).
  bool no_inbound = false;
};

struct Member {
  uint64_t id = 0;
  std::string name;
  std::string session_token;  // random, 32 hex digits; proves later calls come from this peer
  std::string stage_link_address;
  std::string gradient_exchange_address;
  std::string state_transfer_address;
  double seconds_per_layer = 0;
  uint64_t memory_bytes = 0;
  absl::Time joined_at;
  absl::Time lease_expiry;
  PeerProgress progress;  // latest reported (not persisted)
  HeldStates held;        // latest reported (persisted)
  std::string certificate_sha256;  // of the client certificate it joined with ("" without TLS; persisted)
  // Whether others can dial it (persisted); only REACHABLE members are placed.
  v1::Reachability reachability = v1::REACHABLE;
};

// Limits on what a peer may claim; beyond them a request is INVALID_ARGUMENT.
inline constexpr double kMaxSecondsPerLayer = 3600;
inline constexpr uint64_t kMaxMemoryBytes = uint64_t{1} << 50;  // 1 PiB
inline constexpr size_t kMaxNameBytes = 128;

// INVALID_ARGUMENT naming the field unless `address` is HOST:PORT with a
// hostname, dotted IPv4 or [IPv6] host and a port in 1..65535.
absl::Status ValidateAddress(absl::string_view field, absl::string_view address);
// Name (1-128 of [A-Za-z0-9._-]), token present, addresses, numbers.
absl::Status ValidateJoinParams(const JoinParams& params);
// Finite, non-negative, below generous ceilings.
absl::Status ValidateProgress(const PeerProgress& progress);
// Stages < num_stages, steps >= 0 and ascending without repeats, at most
// kMaxHeldStepsPerStage per stage, each sha256 "" or 64 lowercase hex digits.
absl::Status ValidateHeldStates(const HeldStates& held, int num_stages);
// Equal secrets, compared in constant time in the length of `expected`.
bool SameSecret(absl::string_view expected, absl::string_view given);

struct MembershipOptions {
  // Swarm id the join tokens must name. Required.
  std::string swarm_id;
  // HMAC key of the join tokens (common/join_token.h). Required.
  std::string join_secret;
  // A peer that does not heartbeat for this long is removed. Default: 10 s.
  absl::Duration lease = absl::Seconds(10);
  // Admit() fails with FAILED_PRECONDITION beyond this many members. Default: 100000.
  int64_t max_members = 100000;
};

class Membership {
 public:
  // `clock` is not owned and must outlive this.
  Membership(MembershipOptions options, const rpc::Clock* clock);

  // Checks `params` and the join token; returns the member to Add() (with a
  // fresh session token and a lease from now) without adding it.
  absl::StatusOr<Member> Admit(const JoinParams& params, uint64_t id) const;
  // The token check of Admit alone (no state read): its claims, or
  // UNAUTHENTICATED / PERMISSION_DENIED as Admit.
  static absl::StatusOr<JoinClaims> CheckToken(const MembershipOptions& options, const JoinParams& params,
                                               absl::Time now);
  void Add(Member member);
  void Remove(uint64_t id);

  // NOT_FOUND for an unknown id, UNAUTHENTICATED for a wrong session token
  // (compared in constant time).
  absl::StatusOr<const Member*> Authenticate(uint64_t id, absl::string_view session_token) const;
  // Records the latest progress a member reported. The id must exist.
  void SetProgress(uint64_t id, const PeerProgress& progress);
  // Records the stage states a member holds. The id must exist.
  void SetHeld(uint64_t id, HeldStates held);
  // Extends the lease to now + lease; returns the new expiry. The id must exist.
  absl::Time Renew(uint64_t id);
  // Members whose lease expired (expiry <= now), by id.
  std::vector<uint64_t> Expired() const;
  // After a coordinator restart: every lease is extended to at least
  // now + grace, so peers have time to reconnect.
  void ExtendAllLeases(absl::Duration grace);

  const Member* Find(uint64_t id) const;
  // The member with this name, or nullptr.
  const Member* FindByName(absl::string_view name) const;
  const std::map<uint64_t, Member>& members() const { return members_; }
  size_t size() const { return members_.size(); }
  const MembershipOptions& options() const { return options_; }

 private:
  const MembershipOptions options_;
  const rpc::Clock* const clock_;
  std::map<uint64_t, Member> members_;
  std::map<std::string, uint64_t, std::less<>> by_name_;
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_MEMBERSHIP_H_
