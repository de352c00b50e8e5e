#include "rpc/server.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"

namespace aqswarm::rpc {

absl::StatusOr<StartedServer> StartServer(const ServerOptions& options, const std::vector<grpc::Service*>& services) {
  if (options.listen.empty()) return absl::InvalidArgumentError("a server needs an address to listen on");
  AQSWARM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> creds, MakeServerCredentials(options.tls));
  StartedServer s;
  grpc::ServerBuilder b;
  b.AddListeningPort(options.listen, creds, &s.port);
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use fails to bind, not shared
  b.SetMaxReceiveMessageSize(options.max_receive_bytes);
  if (options.max_send_bytes >= 0) b.SetMaxSendMessageSize(options.max_send_bytes);
  if (options.accept_keepalive) {
    b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  }
  if (options.num_completion_queues > 0) {
    b.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, options.num_completion_queues);
  }
  for (grpc::Service* service : services) b.RegisterService(service);
  s.server = b.BuildAndStart();
  if (s.server == nullptr || s.port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  return s;
}

}  // namespace aqswarm::rpc
