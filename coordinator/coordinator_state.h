// CoordinatorState: the coordinator's durable state in a StateStore
// (RocksDB, WAL fsync per commit), so a coordinator restarted on the same
// state dir resumes the same job, members, grid and assignment version.
//
//   AQSWARM_ASSIGN_OR_RETURN(auto state, CoordinatorState::Open({.dir = "/var/aqswarm/coord"}));
//   AQSWARM_ASSIGN_OR_RETURN(PersistedState s, state->Load());   // empty on first start
//   CoordinatorState::Change change;
//   change.PutMember(member);
//   change.PutCounters({.assignment_version = 8, .next_peer_id = 12, .next_generation = 30});
//   AQSWARM_RETURN_IF_ERROR(state->Commit(change));               // atomic + durable
//
// Layout (keys; values typed by StateStore, protos from proto/coordinator.proto):
//   job                              string   serialized v1::JobSpec
//   counters/assignment_version      uint64
//   counters/next_peer_id            uint64
//   counters/next_generation         uint64
//   members/<peer id, 20 digits>     string   serialized v1::MemberRecord (held states as
//                                             HeldState records; older dirs' parallel lists read too)
//   grid                             string   serialized v1::GridRecord
//   links/<from id>/<to id>          string   serialized v1::LinkRecord (measured links)
//   progress/step, progress/checkpoint_step   int64
//   progress/loss, progress/tokens_per_second double
//   data_identity                    string   "<dataset hash>/<tokenizer hash>" fixed by the first peer
//   tokens/<token id>/<peer name>    string   serialized v1::UsedTokenRecord (older dirs: the text
//                                             "<expiry unix s>|<certificate sha256>|<session token>"):
//                                             a join token used by that name (single use; kept
//                                             until the token expires, see SwarmCoordinator)
// Lease expiries are stored as of the last membership change, not per
// heartbeat (that would be an fsync per heartbeat); a restarted coordinator
// extends every lease by a grace period instead (SwarmCoordinator).
//
// Thread-safety: thread-safe (StateStore is); Change is a plain value.
#ifndef AQSWARM_COORDINATOR_COORDINATOR_STATE_H_
#define AQSWARM_COORDINATOR_COORDINATOR_STATE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/link_matrix.h"
#include "coordinator/membership.h"
#include "coordinator/planner.h"
#include "proto/job.pb.h"
#include "storage/state_store.h"

namespace aqswarm::coordinator {

struct Counters {
  uint64_t assignment_version = 0;
  uint64_t next_peer_id = 1;
  uint64_t next_generation = 1;
};

struct SwarmProgress {
  PeerProgress progress;     // swarm step (max reported under the current plan; a re-plan lowers it to
                             // its resume step), its loss, tokens/s
  int64_t checkpoint_step = 0;
};

struct LinkRow {
  uint64_t from = 0, to = 0;
  LinkEstimate estimate;
};

// A join token's nonce used by one peer name, and what a later join with the
// same token must prove to be that peer again (its last session token, or
// under TLS the same certificate).
struct UsedToken {
  std::string token_id;  // the token's nonce (JoinClaims::token_id)
  std::string peer_name;
  int64_t expiry_unix_s = 0;  // the token's expiry: the record is dropped after it
  std::string certificate_sha256;  // "" without TLS
  std::string session_token;       // the session the last join with this token got
};

struct PersistedState {
  std::optional<v1::JobSpec> job;  // nullopt: a fresh state dir
  Counters counters;
  std::vector<Member> members;     // by id
  std::optional<Grid> grid;
  SwarmProgress progress;
  std::vector<LinkRow> links;      // between members only
  std::optional<DataIdentity> data_identity;  // fixed by the first peer with data
  std::vector<UsedToken> used_tokens;
};

class CoordinatorState {
 public:
  struct Options {
    // State directory; created if missing. Required.
    std::string dir;
    // fsync every commit. Default: true (false only for tests and benches).
    bool sync = true;
  };

  class Change {
   public:
    void PutJob(const v1::JobSpec& job);
    void PutCounters(const Counters& counters);
    void PutMember(const Member& member);
    // Also deletes the links measured from it.
    void DeleteMember(uint64_t id);
    void PutLink(uint64_t from, uint64_t to, const LinkEstimate& estimate);
    void PutGrid(const Grid& grid);
    void PutProgress(const SwarmProgress& progress);
    void PutDataIdentity(const DataIdentity& identity);
    void PutUsedToken(const UsedToken& used);
    void DeleteUsedToken(const std::string& token_id, const std::string& peer_name);
    bool empty() const { return batch_.empty(); }

   private:
    friend class CoordinatorState;
    storage::StateStore::Batch batch_;
  };

  static absl::StatusOr<std::unique_ptr<CoordinatorState>> Open(const Options& options);

  // Everything stored; DataLoss naming the key when a record is corrupt.
  absl::StatusOr<PersistedState> Load() const;
  absl::Status Commit(const Change& change);

 private:
  explicit CoordinatorState(std::unique_ptr<storage::StateStore> store) : store_(std::move(store)) {}
  std::unique_ptr<storage::StateStore> store_;
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_COORDINATOR_STATE_H_
