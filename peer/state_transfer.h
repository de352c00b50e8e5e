// StateTransfer: serve a stage's checkpoint bytes to a joiner, and fetch them;
// and the timed transfers peers probe each other's links with.
//
//   // live replica: a kept state file, streamed from disk chunk by chunk
//   StateTransferServer server(listen, [&](const v1::StateRequest& r) -> absl::StatusOr<StateSnapshot> {
//     return StateSnapshot{.step = step, .path = "/work/checkpoints/stage-1/state-40.ckpt"};
//   });
//   // joiner: into a file (written atomically), checked against the digest its holders reported
//   AQSWARM_ASSIGN_OR_RETURN(FetchedState f, FetchStateToFile("10.0.0.5:7003", request, path,
//                                                             {.expected_sha256 = a.state_sha256()}));
//   // or into memory
//   AQSWARM_ASSIGN_OR_RETURN(StateSnapshot s, FetchState("10.0.0.5:7003", request, options));
//
//   AQSWARM_ASSIGN_OR_RETURN(LinkProbeResult p, ProbeLink("10.0.0.5:7003", {}));
//
// Bounds. The server streams from the file (one chunk in memory per fetch)
// and serves at most `max_concurrent_fetches` at once; one more is refused
// with RESOURCE_EXHAUSTED. The client checks everything the network sends
// before using it: chunk offsets contiguous, the declared total constant,
// under `max_bytes` and never exceeded, the stream complete, the XXH3
// checksum of the assembled bytes and, when given, their SHA-256. Its buffer
// (or file) grows with the data that arrived, never with what the sender
// declared.
//
// Metrics (stage/stage_metrics.h): every refusal counts
// aqswarm_peer_state_transfer_refused_total{reason}: busy (server: too many
// fetches), too_large (declared total over the bound), bad_chunk (offset,
// size, step or total inconsistent), checksum, sha256_mismatch, truncated.
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

// What the server streams: the file at `path` when set (opened per fetch;
// a file replaced or removed meanwhile is streamed as it was when opened),
// else `bytes`.
struct StateSnapshot {
  std::string bytes;
  uint64_t step = 0;
  std::string path;
};

using StateProvider = std::function<absl::StatusOr<StateSnapshot>(const v1::StateRequest&)>;

class StateTransferServer {
 public:
  // Serves Fetch on `listen` (e.g. "127.0.0.1:0"); chunks of `chunk_bytes`;
  // at most `max_concurrent_fetches` (>= 1) at once.
  static absl::StatusOr<std::unique_ptr<StateTransferServer>> Start(const std::string& listen,
                                                                    StateProvider provider,
                                                                    size_t chunk_bytes = 1 << 20,
                                                                    const rpc::TlsOptions& tls = {},
                                                                    int max_concurrent_fetches = 2);
  // Fetches refused because `max_concurrent_fetches` were under way.
  uint64_t refused_busy() const;
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
  // Refuse a state declared (or sent) larger than this. Default: 8 GiB.
  uint64_t max_bytes = 8ull << 30;
  // SHA-256 (hex) the assembled bytes must have; empty: not checked. A
  // mismatch is DATA_LOSS naming both digests.
  std::string expected_sha256;
  // Bound on the whole transfer. Default: 10 min.
  absl::Duration timeout = absl::Minutes(10);
  // Mutual TLS to the server. Default: plaintext.
  rpc::TlsOptions tls;
};

absl::StatusOr<StateSnapshot> FetchState(const std::string& target, const v1::StateRequest& request,
                                         const FetchOptions& options = {});

struct FetchedState {
  uint64_t step = 0;
  uint64_t bytes = 0;
  std::string sha256;  // of what was written
};

// Fetches into `path`: written to a temporary file beside it as chunks
// arrive, published atomically (fsync, rename, directory fsync) once every
// check passed; on any failure nothing is left at `path` or beside it.
absl::StatusOr<FetchedState> FetchStateToFile(const std::string& target, const v1::StateRequest& request,
                                              const std::string& path, const FetchOptions& options = {});

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
  // > 0: this end's uplink is emulated at this many Mbit/s (as the stage's
  // link shaping does): a transfer counts as taking at least its bytes at
  // that rate. Default: 0 (the real link).
  double uplink_mbps = 0;
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
