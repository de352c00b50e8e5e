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
#include "absl/strings/string_view.h"
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
  // Accept clients' keepalive pings on idle connections (every 5 s at most;
  // every channel preset pings, rpc/channel.h). Default: on.
  bool accept_keepalive = true;
  // Synchronous server completion queues (0: gRPC's default).
  int num_completion_queues = 0;
  // The server pings a client connection idle for keepalive_ms and closes it
  // when a ping goes unanswered for keepalive_timeout_ms, so a vanished
  // client's streams and threads are freed. Default: 30 s / 10 s; 0: off.
  int keepalive_ms = 30000;
  int keepalive_timeout_ms = 10000;
  // A connection older than this is asked to go away (GOAWAY); its streams
  // get max_connection_age_grace_ms to finish before they are cancelled.
  // Only for servers whose clients re-open streams (the coordinator), never
  // for stage links. Default: 0 = no limit.
  int max_connection_age_ms = 0;
  int max_connection_age_grace_ms = 60000;
  // At most this many concurrent streams per client connection (0: gRPC's default).
  int max_concurrent_streams = 0;
  // At most this many threads serve calls (grpc::ResourceQuota); a call
  // beyond them is refused with RESOURCE_EXHAUSTED. Default: 0 = unlimited.
  int max_threads = 0;
};

// Whether `address` (HOST:PORT, [V6]:PORT or unix:PATH) can only be
// reached from this machine: 127.0.0.0/8, ::1, "localhost" or a unix
// socket. "0.0.0.0", "[::]", an empty host and any other host are not.
bool IsLoopbackAddress(absl::string_view address);

// The rule for every server that listens: plaintext only on loopback.
// OK when `tls` is on, when `address` is loopback (IsLoopbackAddress) or
// when `insecure` (the operator's explicit --insecure); otherwise
// FAILED_PRECONDITION naming the address and the two ways out (--tls_dir or
// --insecure). Call it with the listen flag before starting the server:
//
//   AQSWARM_RETURN_IF_ERROR(rpc::CheckListenSecurity(listen, tls.enabled(), insecure));
absl::Status CheckListenSecurity(absl::string_view address, bool tls, bool insecure);

struct StartedServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;  // the bound port
};

// Errors: credentials from a bad TLS dir; Unavailable "cannot listen on ..."
// when the address cannot be bound (in use, not ours).
absl::StatusOr<StartedServer> StartServer(const ServerOptions& options, const std::vector<grpc::Service*>& services);

}  // namespace aqswarm::rpc

#endif  // AQSWARM_RPC_SERVER_H_
