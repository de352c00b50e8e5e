// One conversion between gRPC and absl statuses (the codes are the same
// numbers in both).
//
//   return rpc::ToGrpc(coordinator->Join(...));                   // a service method
//   AQSWARM_RETURN_IF_ERROR(rpc::FromGrpc(stub->Leave(&ctx, req, &resp), "leave"));  // a client
#ifndef AQSWARM_RPC_STATUS_H_
#define AQSWARM_RPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace aqswarm::rpc {

// OK stays OK; otherwise the same code with "<what>: <message>" (just the
// message when `what` is empty).
absl::Status FromGrpc(const grpc::Status& s, absl::string_view what = "");

// The same code and message.
grpc::Status ToGrpc(const absl::Status& s);

}  // namespace aqswarm::rpc

#endif  // AQSWARM_RPC_STATUS_H_
