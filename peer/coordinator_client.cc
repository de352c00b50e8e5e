#include "peer/coordinator_client.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/channel.h"
#include "rpc/status.h"

namespace aqswarm::peer {
namespace {

void SetTimeout(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
}

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  GrpcCoordinatorClient(std::string address, std::shared_ptr<grpc::Channel> channel)
      : address_(std::move(address)), stub_(v1::Coordinator::NewStub(channel)) {}

  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request) override {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, absl::Seconds(10));
    ctx.set_wait_for_ready(true);
    v1::JoinResponse resp;
    AQSWARM_RETURN_IF_ERROR(rpc::FromGrpc(stub_->Join(&ctx, request, &resp), absl::StrCat("join ", address_)));
    return resp;
  }

  absl::StatusOr<v1::StatusResponse> Status() override {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, absl::Seconds(10));
    ctx.set_wait_for_ready(true);
    v1::StatusResponse resp;
    AQSWARM_RETURN_IF_ERROR(
        rpc::FromGrpc(stub_->Status(&ctx, v1::StatusRequest(), &resp), absl::StrCat("status ", address_)));
    return resp;
  }

  absl::Status Leave(const v1::LeaveRequest& request) override {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, absl::Seconds(5));
    v1::LeaveResponse resp;
    return rpc::FromGrpc(stub_->Leave(&ctx, request, &resp), "leave");
  }

  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request,
                                                  absl::Duration timeout) override {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, timeout);
    v1::HeartbeatResponse resp;
    AQSWARM_RETURN_IF_ERROR(rpc::FromGrpc(stub_->Heartbeat(&ctx, request, &resp), "heartbeat"));
    return resp;
  }

  absl::Status ReportProgress(const v1::ProgressReport& request) override {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, absl::Seconds(5));
    v1::ReportResponse resp;
    return rpc::FromGrpc(stub_->ReportProgress(&ctx, request, &resp), "report progress");
  }

  absl::Status ReportLinkProbe(const v1::LinkProbeReport& request) override {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, absl::Seconds(5));
    v1::ReportResponse resp;
    return rpc::FromGrpc(stub_->ReportLinkProbe(&ctx, request, &resp), "report link probe");
  }

  absl::StatusOr<v1::BlameResponse> ReportBlame(const v1::BlameReport& request) override {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, absl::Seconds(5));
    v1::BlameResponse resp;
    AQSWARM_RETURN_IF_ERROR(rpc::FromGrpc(stub_->ReportBlame(&ctx, request, &resp), "report blame"));
    return resp;
  }

  absl::Status WatchAssignment(const v1::WatchAssignmentRequest& request,
                               const std::function<void(const v1::Assignment&)>& on_assignment) override {
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    {
      absl::MutexLock l(&mu_);
      if (cancelled_) return absl::CancelledError("the assignment watch was cancelled");
      watch_ = &ctx;
    }
    auto reader = stub_->WatchAssignment(&ctx, request);
    v1::Assignment a;
    while (reader->Read(&a)) on_assignment(a);
    const absl::Status s = rpc::FromGrpc(reader->Finish(), "watch assignment");
    absl::MutexLock l(&mu_);
    watch_ = nullptr;
    return cancelled_ ? absl::CancelledError("the assignment watch was cancelled") : s;
  }

  void CancelWatch() override {
    absl::MutexLock l(&mu_);
    cancelled_ = true;
    if (watch_ != nullptr) watch_->TryCancel();
  }

 private:
  const std::string address_;
  const std::unique_ptr<v1::Coordinator::Stub> stub_;
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* watch_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorClient>> ConnectCoordinator(const std::string& address,
                                                                      const rpc::TlsOptions& tls) {
  AQSWARM_ASSIGN_OR_RETURN(auto channel, rpc::MakeChannel(address, tls, rpc::ControlChannel()));
  return std::make_unique<GrpcCoordinatorClient>(address, std::move(channel));
}

}  // namespace aqswarm::peer
