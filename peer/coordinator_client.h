// A peer's session with the coordinator, behind an interface: the gRPC
// client here, and an in-process fake for tests of the peer daemon
// (peer/fake_coordinator.h). Every call is bounded; errors keep the
// coordinator's status code (NOT_FOUND: it forgot us; UNAUTHENTICATED: a bad
// token or session; UNAVAILABLE / DEADLINE_EXCEEDED: unreachable).
//
//   AQSWARM_ASSIGN_OR_RETURN(auto client, ConnectCoordinator("10.0.0.1:7000", tls));
//   AQSWARM_ASSIGN_OR_RETURN(v1::JoinResponse joined, client->Join(request));
//   client->WatchAssignment(watch, [&](const v1::Assignment& a) { ... });  // until the stream ends
//
// Thread-safety: every method may be called from any thread.
#ifndef AQSWARM_PEER_COORDINATOR_CLIENT_H_
#define AQSWARM_PEER_COORDINATOR_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/coordinator.pb.h"
#include "rpc/tls.h"

namespace aqswarm::peer {

class CoordinatorClient {
 public:
  virtual ~CoordinatorClient() = default;
  // Waits (up to 10 s) for a coordinator that is still starting.
  virtual absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request) = 0;
  virtual absl::Status Leave(const v1::LeaveRequest& request) = 0;
  virtual absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request,
                                                          absl::Duration timeout) = 0;
  virtual absl::Status ReportProgress(const v1::ProgressReport& request) = 0;
  virtual absl::Status ReportLinkProbe(const v1::LinkProbeReport& request) = 0;
  virtual absl::StatusOr<v1::BlameResponse> ReportBlame(const v1::BlameReport& request) = 0;
  // The swarm's public view: the job (with its data identity), peers, progress.
  virtual absl::StatusOr<v1::StatusResponse> Status() = 0;
  // Hands every assignment the coordinator streams to `on_assignment` until
  // the stream ends, and returns how it ended. After CancelWatch() it
  // returns Cancelled at once, now and for every later call.
  virtual absl::Status WatchAssignment(const v1::WatchAssignmentRequest& request,
                                       const std::function<void(const v1::Assignment&)>& on_assignment) = 0;
  virtual void CancelWatch() = 0;
};

// The gRPC client of the coordinator at `address` (rpc::ControlChannel).
// Errors: credentials from a bad TLS dir.
absl::StatusOr<std::unique_ptr<CoordinatorClient>> ConnectCoordinator(const std::string& address,
                                                                      const rpc::TlsOptions& tls);

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_COORDINATOR_CLIENT_H_
