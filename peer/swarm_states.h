// One consistent model from a live swarm: the newest step for which every
// stage's state is served by some peer (Status lists each peer's
// StateTransfer address and held states), fetched stage by stage.
// `aqswarm export --coordinator` writes it as a Hugging Face directory.
//
//   AQSWARM_ASSIGN_OR_RETURN(auto client, ConnectCoordinator("10.0.0.2:7000", tls));
//   AQSWARM_ASSIGN_OR_RETURN(SwarmModel m, FetchSwarmModel(*client, {.tls = tls}, "/tmp/states"));
//   // m.job, m.step, m.stage_files[k] = "/tmp/states/stage-<k>.safetensors"
#ifndef AQSWARM_PEER_SWARM_STATES_H_
#define AQSWARM_PEER_SWARM_STATES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "peer/coordinator_client.h"
#include "peer/state_transfer.h"
#include "proto/coordinator.pb.h"
#include "proto/job.pb.h"

namespace aqswarm::peer {

struct SwarmStateSources {
  int64_t step = 0;
  // [stage]: StateTransfer addresses of the peers that serve that stage's
  // state of `step`, by peer id.
  std::vector<std::vector<std::string>> addresses;
  // [stage][i]: the SHA-256 the peer at addresses[stage][i] reported for that
  // state ("" = not reported); a fetch must match it.
  std::vector<std::vector<std::string>> sha256;
};

// The newest step >= 1 every stage of status.job() has a served state of.
// FailedPrecondition naming each stage's served steps when there is none.
absl::StatusOr<SwarmStateSources> PickSwarmStateSources(const v1::StatusResponse& status);

struct SwarmModel {
  v1::JobSpec job;
  int64_t step = 0;
  std::vector<std::string> stage_files;  // [stage]: a stage checkpoint (pipeline/stage_io.h)
};

// Asks `coordinator` for its status, picks a step and fetches every stage's
// state of it into `dir` (created). A source that dropped the step meanwhile
// (peers keep only their newest states), or whose bytes do not have the
// SHA-256 it reported, is skipped for the next; when every
// source of a stage failed, a fresh status is asked for, up to `attempts`
// times.
absl::StatusOr<SwarmModel> FetchSwarmModel(CoordinatorClient& coordinator, const FetchOptions& options,
                                           const std::string& dir, int attempts = 3);

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_SWARM_STATES_H_
