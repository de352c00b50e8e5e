// StateTransfer: serve a stage's checkpoint bytes to a joiner, and fetch them;
// and the timed transfers peers probe each other's links with.
//
//   // live replica
//   StateTransferServer server(listen, [&](const v1::StateRequest& r) -> absl::StatusOr<StateSnapshot> {
//     ... return StateSnapshot{bytes, step};   // e.g. a SaveCheckpoint() taken between steps
//   });
//   // joiner
//   AQSWARM_ASSIGN_OR_RETURN(StateSnapshot s, FetchState("10.0.0.5:7003", request, options));
//
//   AQSWARM_ASSIGN_OR_RETURN(LinkProbeResult p, ProbeLink("10.0.0.5:7003", {}));
//
// The client checks everything the network sends before using it: chunk
// offsets contiguous, total size constant and under `max_bytes`, the stream
// complete, and the XXH3 checksum of the assembled bytes.
#ifndef AQSWARM_PEER_STATE_TRANSFER_H_
#define AQSWARM_PEER_STATE_TRANSFER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/tls.h"
#include "proto/state.grpc.pb.h"

namespace aqswarm::peer {

struct StateSnapshot {
  std::string bytes;
  uint64_t step = 0;
};

using StateProvider = std::function<absl::StatusOr<StateSnapshot>(const v1::StateRequest&)>;

class StateTransferServer {
 public:
  // Serves Fetch on `listen` (e.g. "127.0.0.1:0"); chunks of `chunk_bytes`.
  static absl::StatusOr<std::unique_ptr<StateTransferServer>> Start(const std::string& listen,
                                                                    StateProvider provider,
                                                                    size_t chunk_bytes = 1 << 20,
                                                                    const rpc::TlsOptions& tls = {});
  ~StateTransferServer();
  int port() const { return port_; }

 private:
  class Service;
  StateTransferServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

struct FetchOptions {
  // Refuse state larger than this. Default: 8 GiB.
  uint64_t max_bytes = 8ull << 30;
  // Bound on the whole transfer. Default: 10 min.
  absl::Duration timeout = absl::Minutes(10);
  // Mutual TLS to the server. Default: plaintext.
  rpc::TlsOptions tls;
};

absl::StatusOr<StateSnapshot> FetchState(const std::string& target, const v1::StateRequest& request,
                                         const FetchOptions& options = {});

// Largest probe payload (under gRPC's default 4 MiB message limit).
inline constexpr size_t kMaxProbeBytes = 3 << 20;

struct ProbeOptions {
  // Bytes sent per timed transfer, in [1, kMaxProbeBytes]. Default: 1 MiB.
  size_t payload_bytes = 1 << 20;
  // RTT = the least of `rounds` empty calls; bandwidth from the fastest of
  // `rounds` transfers. Default: 3.
  int rounds = 3;
  // Bound on the whole probe. Default: 30 s.
  absl::Duration timeout = absl::Seconds(30);
  rpc::TlsOptions tls;
};

struct LinkProbeResult {
  double bandwidth_bytes_per_second = 0;  // this peer -> target
  double rtt_seconds = 0;
};

// Times calls to the target's StateTransfer.Probe over one warmed-up
// channel: bandwidth = payload / (transfer time - RTT). Short transfers
// under-estimate fast links (TCP slow start, per-call overhead); the
// coordinator only needs their order of magnitude for placement.
absl::StatusOr<LinkProbeResult> ProbeLink(const std::string& target, const ProbeOptions& options = {});

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_STATE_TRANSFER_H_
