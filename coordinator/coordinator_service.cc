#include "coordinator/coordinator_service.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "coordinator/coordinator_metrics.h"
#include "rpc/server.h"
#include "rpc/status.h"

namespace aqswarm::coordinator {
namespace {

constexpr size_t kMaxSessionTokenBytes = 256;

// Checks the fields every post-Join call carries.
absl::Status CheckPeerRef(uint64_t peer_id, const std::string& session_token) {
  if (peer_id == 0) return absl::InvalidArgumentError("peer_id is required (from JoinResponse)");
  if (session_token.size() > kMaxSessionTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("session_token is longer than ", kMaxSessionTokenBytes, " bytes"));
  }
  return absl::OkStatus();
}

PeerProgress FromProto(const v1::Progress& p) {
  return {p.step(), p.loss(), p.tokens_per_second(), p.plan_version()};
}

// Shape only (stage range and step order: ValidateHeldStates).
absl::StatusOr<HeldStates> FromProto(const google::protobuf::RepeatedPtrField<v1::StageCheckpoints>& held) {
  if (held.size() > 4096) return absl::InvalidArgumentError("held: more than 4096 stages");
  HeldStates out;
  for (const v1::StageCheckpoints& h : held) {
    if (h.steps_size() > static_cast<int>(kMaxHeldStepsPerStage)) {
      return absl::InvalidArgumentError(
          absl::StrCat("held: stage ", h.stage(), " lists ", h.steps_size(), " steps, at most ", kMaxHeldStepsPerStage));
    }
    if (!out.emplace(h.stage(), std::vector<int64_t>(h.steps().begin(), h.steps().end())).second) {
      return absl::InvalidArgumentError(absl::StrCat("held: stage ", h.stage(), " is listed twice"));
    }
  }
  return out;
}

// The answer to a request: its status, counted when refused.
grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (!status.ok()) CountRejectedRequest(status.code());
  return rpc::ToGrpc(status);
}

}  // namespace

CoordinatorGrpcService::CoordinatorGrpcService(SwarmCoordinator* coordinator, absl::Duration watch_poll)
    : coordinator_(coordinator), watch_poll_(watch_poll) {}

grpc::Status CoordinatorGrpcService::Join(grpc::ServerContext*, const v1::JoinRequest* req, v1::JoinResponse* resp) {
  JoinParams p;
  p.peer_name = req->peer_name();
  p.join_token = req->join_token();
  p.stage_link_address = req->stage_link_address();
  p.gradient_exchange_address = req->gradient_exchange_address();
  p.state_transfer_address = req->state_transfer_address();
  p.seconds_per_layer = req->seconds_per_layer();
  p.memory_bytes = req->memory_bytes();
  absl::StatusOr<HeldStates> held = FromProto(req->held());
  if (!held.ok()) return ToGrpcStatus(held.status());
  p.held = *std::move(held);
  p.held_job_name = req->held_job_name();
  p.data = {req->dataset_hash(), req->tokenizer_hash()};
  // Shape first, so a malformed request is INVALID_ARGUMENT whatever its token.
  if (absl::Status s = ValidateJoinParams(p); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<JoinResult> r = coordinator_->Join(p);
  if (!r.ok()) {
    AQSWARM_LOG(INFO) << "join of '" << p.peer_name << "' refused: " << r.status();
    return ToGrpcStatus(r.status());
  }
  resp->set_peer_id(r->peer_id);
  resp->set_session_token(r->session_token);
  resp->set_lease_seconds(absl::ToDoubleSeconds(coordinator_->options().lease));
  resp->set_lease_expiry_unix_ms(absl::ToUnixMillis(r->lease_expiry));
  *resp->mutable_job() = coordinator_->job();
  resp->set_assignment_version(r->assignment_version);
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpcService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                               v1::HeartbeatResponse* resp) {
  if (absl::Status s = CheckPeerRef(req->peer_id(), req->session_token()); !s.ok()) return ToGrpcStatus(s);
  PeerProgress progress;
  if (req->has_progress()) progress = FromProto(req->progress());
  absl::StatusOr<HeartbeatResult> r =
      coordinator_->Heartbeat(req->peer_id(), req->session_token(), req->has_progress() ? &progress : nullptr);
  if (!r.ok()) return ToGrpcStatus(r.status());
  CountHeartbeat();
  resp->set_lease_expiry_unix_ms(absl::ToUnixMillis(r->lease_expiry));
  resp->set_assignment_version(r->assignment_version);
  for (v1::Neighbor& n : r->probe) *resp->add_probe() = std::move(n);
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpcService::Leave(grpc::ServerContext*, const v1::LeaveRequest* req,
                                           v1::LeaveResponse* resp) {
  if (absl::Status s = CheckPeerRef(req->peer_id(), req->session_token()); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<uint64_t> v = coordinator_->Leave(req->peer_id(), req->session_token());
  if (!v.ok()) return ToGrpcStatus(v.status());
  resp->set_assignment_version(*v);
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpcService::WatchAssignment(grpc::ServerContext* ctx, const v1::WatchAssignmentRequest* req,
                                                     grpc::ServerWriter<v1::Assignment>* writer) {
  if (absl::Status s = CheckPeerRef(req->peer_id(), req->session_token()); !s.ok()) return ToGrpcStatus(s);
  uint64_t sent = 0;
  bool first = true;
  while (!ctx->IsCancelled() && !shutting_down_) {
    absl::StatusOr<v1::Assignment> a = coordinator_->GetAssignment(req->peer_id(), req->session_token());
    if (!a.ok()) return ToGrpcStatus(a.status());  // left or expired: NOT_FOUND ends the stream
    if (first || a->version() > sent) {
      if (!writer->Write(*a)) return grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
      sent = a->version();
      first = false;
    }
    coordinator_->AwaitVersionAbove(sent, watch_poll_);
  }
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, ctx->IsCancelled() ? "cancelled" : "coordinator shutting down");
}

grpc::Status CoordinatorGrpcService::ReportLinkProbe(grpc::ServerContext*, const v1::LinkProbeReport* req,
                                                     v1::ReportResponse*) {
  if (absl::Status s = CheckPeerRef(req->peer_id(), req->session_token()); !s.ok()) return ToGrpcStatus(s);
  if (req->to_peer_id() == 0) return ToGrpcStatus(absl::InvalidArgumentError("to_peer_id is required"));
  return ToGrpcStatus(coordinator_->ReportLinkProbe(req->peer_id(), req->session_token(), req->to_peer_id(),
                                                    req->bandwidth_bytes_per_second(), req->rtt_seconds(),
                                                    req->passive()));
}

grpc::Status CoordinatorGrpcService::ReportProgress(grpc::ServerContext*, const v1::ProgressReport* req,
                                                    v1::ReportResponse*) {
  if (absl::Status s = CheckPeerRef(req->peer_id(), req->session_token()); !s.ok()) return ToGrpcStatus(s);
  if (!req->has_progress()) return ToGrpcStatus(absl::InvalidArgumentError("progress is required"));
  std::optional<HeldStates> held;
  if (req->has_held()) {
    absl::StatusOr<HeldStates> h = FromProto(req->held());
    if (!h.ok()) return ToGrpcStatus(h.status());
    held = *std::move(h);
  }
  return ToGrpcStatus(coordinator_->ReportProgress(req->peer_id(), req->session_token(), FromProto(req->progress()),
                                                   req->checkpoint_step(), held.has_value() ? &*held : nullptr));
}

grpc::Status CoordinatorGrpcService::Status(grpc::ServerContext*, const v1::StatusRequest*,
                                            v1::StatusResponse* resp) {
  *resp = coordinator_->GetStatus();
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    std::unique_ptr<SwarmCoordinator> coordinator, const CoordinatorServerOptions& options) {
  if (coordinator == nullptr) return absl::InvalidArgumentError("coordinator is required");
  if (options.expiry_interval <= absl::ZeroDuration() || options.watch_poll <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("expiry_interval and watch_poll must be positive");
  }
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  s->options_ = options;
  s->coordinator_ = std::move(coordinator);
  s->service_ = std::make_unique<CoordinatorGrpcService>(s->coordinator_.get(), options.watch_poll);
  rpc::ServerOptions so;
  so.listen = options.listen;
  so.tls = options.tls;
  so.max_receive_bytes = 1 << 20;  // every request is small
  so.accept_keepalive = true;      // peers' assignment watches are long-lived
  so.num_completion_queues = options.num_completion_queues;
  AQSWARM_ASSIGN_OR_RETURN(rpc::StartedServer started, rpc::StartServer(so, {s->service_.get()}));
  s->server_ = std::move(started.server);
  s->port_ = started.port;
  CoordinatorServer* raw = s.get();
  s->expiry_thread_ = std::thread([raw] { raw->ExpiryLoop(); });
  return s;
}

void CoordinatorServer::ExpiryLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    stop_cv_.WaitWithTimeout(&mu_, options_.expiry_interval);
    if (stopping_) break;
    mu_.Unlock();
    absl::StatusOr<std::vector<uint64_t>> expired = coordinator_->ExpireLeases();
    if (!expired.ok()) {
      AQSWARM_LOG(ERROR) << "lease sweep failed (will retry): " << expired.status();
    }
    if (expired.ok()) CountLeaseExpiries(expired->size());
    mu_.Lock();
  }
}

void CoordinatorServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  service_->BeginShutdown();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    stop_cv_.Signal();
  }
  if (expiry_thread_.joinable()) expiry_thread_.join();
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

}  // namespace aqswarm::coordinator
