// gRPC status -> absl::Status with context, for the peer's clients.
#ifndef AQSWARM_PEER_GRPC_STATUS_H_
#define AQSWARM_PEER_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace aqswarm::peer {

// OK stays OK; otherwise the same code with "<what>: <message>".
inline absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat(what, ": ", s.error_message()));
}

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_GRPC_STATUS_H_
