#include "rpc/tls.h"

#include "absl/strings/str_cat.h"
#include "common/certs.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace aqswarm::rpc {
namespace {

absl::StatusOr<TlsFiles> Load(const TlsOptions& tls) {
  if (tls.name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS dir ", tls.dir, " is set but no certificate name: which <name>.pem is this process?"));
  }
  return LoadTlsFiles(tls.dir, tls.name);
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  AQSWARM_ASSIGN_OR_RETURN(TlsFiles files, Load(tls));
  grpc::SslServerCredentialsOptions options(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = files.ca_cert_pem;
  options.pem_key_cert_pairs.push_back({files.key_pem, files.cert_pem});
  auto creds = grpc::SslServerCredentials(options);
  if (creds == nullptr) return absl::InternalError(absl::StrCat("gRPC refused the server TLS material in ", tls.dir));
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  AQSWARM_ASSIGN_OR_RETURN(TlsFiles files, Load(tls));
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = files.ca_cert_pem;
  options.pem_private_key = files.key_pem;
  options.pem_cert_chain = files.cert_pem;
  auto creds = grpc::SslCredentials(options);
  if (creds == nullptr) return absl::InternalError(absl::StrCat("gRPC refused the client TLS material in ", tls.dir));
  return creds;
}

void ApplyTlsChannelArgs(const TlsOptions& tls, grpc::ChannelArguments* args) {
  if (tls.enabled() && !tls.target_name_override.empty()) {
    args->SetSslTargetNameOverride(tls.target_name_override);
  }
}

std::string DescribeTls(const TlsOptions& tls) {
  if (!tls.enabled()) return "plaintext";
  return absl::StrCat("mTLS (dir ", tls.dir, ", name ", tls.name, ")");
}

}  // namespace aqswarm::rpc
