// Client channels, from presets: what kind of peer a channel talks to
// decides its message limits, reconnect backoff and keepalive.
//
//   AQSWARM_ASSIGN_OR_RETURN(auto channel, rpc::MakeChannel(address, tls, rpc::ControlChannel()));
//   auto stub = v1::Coordinator::NewStub(channel);
#ifndef AQSWARM_RPC_CHANNEL_H_
#define AQSWARM_RPC_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "rpc/tls.h"

namespace aqswarm::rpc {

struct ChannelPreset {
  int max_receive_bytes = -1;  // -1: gRPC's default (4 MiB)
  int max_send_bytes = -1;     // -1: unlimited
  // Reconnect backoff bounds (0: gRPC's defaults, up to 2 minutes).
  int initial_reconnect_backoff_ms = 0;
  int max_reconnect_backoff_ms = 0;
  // Ping an idle connection every keepalive_ms and drop it when a ping goes
  // unanswered for keepalive_timeout_ms (0: no keepalive). Every preset
  // keeps connections alive, so a half-open connection (a vanished peer,
  // a NAT that dropped the mapping) fails its streams within
  // keepalive_ms + keepalive_timeout_ms instead of hiding for minutes.
  int keepalive_ms = 0;
  int keepalive_timeout_ms = 10000;
  // A TCP connection of its own instead of one shared with other channels
  // to the same address (links are shaped per connection).
  bool own_connection = false;
};

// The coordinator's clients: small messages; reconnect within 2 s once the
// coordinator is back; keepalive every 20 s (timeout 10 s), so an assignment
// watch on a dead connection ends within ~30 s.
ChannelPreset ControlChannel();
// State transfer: checkpoints in chunks of up to 64 MiB; keepalive 20 s / 10 s.
ChannelPreset BulkChannel();
// Stage links and the gradient exchange: frames up to kMaxFrameBytes, a
// connection of their own, a vanished peer found within ~20 s.
ChannelPreset LinkChannel();

// Largest frame on a stage link or the gradient exchange (gRPC's 4 MiB
// default is too small for FULL activation batches of real models).
inline constexpr int kMaxFrameBytes = 512 << 20;

// Errors: credentials from a bad TLS dir.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& target, const TlsOptions& tls,
                                                           const ChannelPreset& preset);

}  // namespace aqswarm::rpc

#endif  // AQSWARM_RPC_CHANNEL_H_
