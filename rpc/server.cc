#include "rpc/server.h"

#include <arpa/inet.h>

#include "absl/strings/match.h"
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
  if (options.keepalive_ms > 0) {
    b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, options.keepalive_ms);
    b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, std::max(1, options.keepalive_timeout_ms));
  }
  if (options.max_connection_age_ms > 0) {
    b.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, options.max_connection_age_ms);
    b.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, std::max(0, options.max_connection_age_grace_ms));
  }
  if (options.max_concurrent_streams > 0) {
    b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  }
  if (options.max_threads > 0) {
    grpc::ResourceQuota quota("aqswarm-server");
    quota.SetMaxThreads(options.max_threads);
    b.SetResourceQuota(quota);
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

bool IsLoopbackAddress(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) return true;
  absl::string_view host;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) return false;
    host = address.substr(1, close - 1);
  } else {
    const size_t colon = address.rfind(':');
    host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  }
  if (host == "localhost") return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

absl::Status CheckListenSecurity(absl::string_view address, bool tls, bool insecure) {
  if (tls || insecure || IsLoopbackAddress(address)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to serve plaintext on ", address,
      ", which other machines can reach: give --tls_dir (mutual TLS, `aqswarm certs`), listen on a loopback "
      "address (127.0.0.1), or pass --insecure to accept unauthenticated, unencrypted traffic"));
}

}  // namespace aqswarm::rpc
