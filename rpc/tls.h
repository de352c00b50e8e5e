// gRPC credentials from a TLS dir (layout in common/certs.h): mutual TLS where
// both ends present a certificate from the swarm CA, or plaintext when no TLS
// dir is configured (local runs and tests).
//
//   TlsOptions tls{.dir = "/etc/aqswarm/tls", .name = "peer-a"};
//   AQSWARM_ASSIGN_OR_RETURN(auto server_creds, MakeServerCredentials(tls));
//   builder.AddListeningPort("0.0.0.0:5001", server_creds, &port);
//   AQSWARM_ASSIGN_OR_RETURN(auto channel_creds, MakeChannelCredentials(tls));
//   auto channel = grpc::CreateCustomChannel("10.0.0.7:5001", channel_creds, args);
//   ApplyTlsChannelArgs(tls, &args);  // only does something with a target_name_override
//
// The server requires a client certificate and verifies it against ca.pem
// (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY); the client
// verifies the server against ca.pem and checks the dialed host against the
// server certificate's subjectAltName, so certificates must carry the IPs
// and names they are dialed by (`aqswarm certs issue --ip … --dns …`).
// Any certificate from the swarm CA is accepted: per-peer authorization is
// the coordinator's job (join tokens, common/join_token.h).
//
// Files are read and checked (key matches, chains to the CA, not expired)
// when credentials are made, so a bad dir fails at startup with the file
// name; a rotated certificate takes effect for servers/channels made later.
//
// Thread-safety: the functions are thread-safe.
#ifndef AQSWARM_RPC_TLS_H_
#define AQSWARM_RPC_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class ChannelArguments;
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace aqswarm::rpc {

struct TlsOptions {
  // TLS dir holding ca.pem, <name>.pem and <name>.key; empty = plaintext.
  // Default: "" (insecure).
  std::string dir;
  // This process's certificate name in `dir`. Required when `dir` is set.
  std::string name;
  // Host name the client expects in the server's certificate instead of the
  // dialed host. Only needed when the certificate lacks the dialed IP/name;
  // prefer issuing certificates with the right SAN. Default: "" (none).
  std::string target_name_override;

  bool enabled() const { return !dir.empty(); }
};

// SSL server credentials that require and verify a client certificate, or
// insecure credentials when `tls.dir` is empty.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsOptions& tls);

// SSL channel credentials presenting this process's certificate, or insecure
// credentials when `tls.dir` is empty.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsOptions& tls);

// Adds GRPC_SSL_TARGET_NAME_OVERRIDE_ARG when `tls.target_name_override` is
// set (and TLS is on); otherwise leaves `args` alone.
void ApplyTlsChannelArgs(const TlsOptions& tls, grpc::ChannelArguments* args);

// "mTLS (dir D, name N)" or "plaintext": for error messages and logs.
std::string DescribeTls(const TlsOptions& tls);

}  // namespace aqswarm::rpc

#endif  // AQSWARM_RPC_TLS_H_
