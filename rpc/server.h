// Starting a gRPC server the one way every aqswarm server starts: bound to
// its own port (never shared with another process: SO_REUSEPORT off, so a
// port in use fails with "cannot listen"), with a bounded message size and
// the keepalive policy its clients use.
//
//   rpc::ServerOptions o;
//   o.listen = "0.0.0.0:7000";  o.tls = tls;  o.max_receive_bytes = 1 << 20;
//   AQSWARM_ASSIGN_OR_RETURN(rpc::StartedServer s, rpc::StartServer(o, {&service}));
//   report(s.port);   // the bound port (o.listen may say :0)
#ifndef AQSWARM_RPC_SERVER_H_
#define AQSWARM_RPC_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "rpc/tls.h"

namespace grpc {
class Service;
}  // namespace grpc

namespace aqswarm::rpc {

struct ServerOptions {
  // HOST:PORT; port 0 picks a free one. Required.
  std::string listen;
  // Mutual TLS, or plaintext when tls.dir is empty. Default: plaintext.
  TlsOptions tls;
  // Largest message accepted / sent (bytes). Default: 1 MiB in, gRPC's
  // default out.
  int max_receive_bytes = 1 << 20;
  int max_send_bytes = -1;
  // Accept clients' keepalive pings on idle connections (every 5 s at most):
  // long-lived streams whose clients detect a vanished server. Default: off.
  bool accept_keepalive = false;
  // Synchronous server completion queues (0: gRPC's default).
  int num_completion_queues = 0;
};

struct StartedServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;  // the bound port
};

// Errors: credentials from a bad TLS dir; Unavailable "cannot listen on ..."
// when the address cannot be bound (in use, not ours).
absl::StatusOr<StartedServer> StartServer(const ServerOptions& options, const std::vector<grpc::Service*>& services);

}  // namespace aqswarm::rpc

#endif  // AQSWARM_RPC_SERVER_H_
