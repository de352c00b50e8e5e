#include "rpc/channel.h"

#include <algorithm>

#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"

namespace aqswarm::rpc {

ChannelPreset ControlChannel() {
  ChannelPreset p;
  p.initial_reconnect_backoff_ms = 200;
  p.max_reconnect_backoff_ms = 2000;
  p.keepalive_ms = 20000;
  p.keepalive_timeout_ms = 10000;
  return p;
}

ChannelPreset BulkChannel() {
  ChannelPreset p;
  p.max_receive_bytes = 64 << 20;
  p.keepalive_ms = 20000;
  p.keepalive_timeout_ms = 10000;
  return p;
}

ChannelPreset LinkChannel() {
  ChannelPreset p;
  p.max_receive_bytes = kMaxFrameBytes;
  p.max_send_bytes = kMaxFrameBytes;
  p.keepalive_ms = 10000;
  p.keepalive_timeout_ms = 10000;
  p.own_connection = true;
  return p;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& target, const TlsOptions& tls,
                                                           const ChannelPreset& preset) {
  AQSWARM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds, MakeChannelCredentials(tls));
  grpc::ChannelArguments args;
  if (preset.max_receive_bytes >= 0) args.SetMaxReceiveMessageSize(preset.max_receive_bytes);
  if (preset.max_send_bytes >= 0) args.SetMaxSendMessageSize(preset.max_send_bytes);
  if (preset.initial_reconnect_backoff_ms > 0) {
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, preset.initial_reconnect_backoff_ms);
  }
  if (preset.max_reconnect_backoff_ms > 0) args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, preset.max_reconnect_backoff_ms);
  if (preset.keepalive_ms > 0) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, preset.keepalive_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, std::max(1, preset.keepalive_timeout_ms));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  }
  if (preset.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  ApplyTlsChannelArgs(tls, &args);
  return grpc::CreateCustomChannel(target, creds, args);
}

}  // namespace aqswarm::rpc
