#include "coordinator/coordinator_service.h"

#include <arpa/inet.h>
#include <openssl/sha.h>

#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "coordinator/connect_probe.h"
#include "coordinator/coordinator_metrics.h"
#include "proto/state.grpc.pb.h"
#include "rpc/channel.h"
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


// Who called, as TLS says: not `tls` without an authenticated client certificate.
struct Caller {
  bool tls = false;
  std::vector<std::string> names;  // subject CN and subjectAltNames
  std::string certificate_sha256;  // of the PEM the client presented
};

Caller CallerOf(const grpc::ServerContext& ctx) {
  Caller c;
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return c;
  c.tls = true;
  for (const grpc::string_ref& v : auth->FindPropertyValues("x509_common_name")) {
    c.names.emplace_back(v.data(), v.size());
  }
  // subjectAltNames other than IP addresses (a certificate's IP says where
  // it is dialed, not who it is).
  for (const grpc::string_ref& v : auth->FindPropertyValues("x509_subject_alternative_name")) {
    std::string name(v.data(), v.size());
    in6_addr ip;
    if (inet_pton(AF_INET, name.c_str(), &ip) != 1 && inet_pton(AF_INET6, name.c_str(), &ip) != 1) {
      c.names.push_back(std::move(name));
    }
  }
  const std::vector<grpc::string_ref> pem = auth->FindPropertyValues("x509_pem_cert");
  if (!pem.empty()) {
    unsigned char digest[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const unsigned char*>(pem.front().data()), pem.front().size(), digest);
    c.certificate_sha256 = absl::BytesToHexString(
        absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
  }
  return c;
}

// ctx.peer() is "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000" or "unix:...".
bool FromLoopback(const grpc::ServerContext& ctx) {
  const std::string peer_text = ctx.peer();
  absl::string_view peer = peer_text;
  if (absl::ConsumePrefix(&peer, "ipv4:") || absl::ConsumePrefix(&peer, "ipv6:")) {
    return rpc::IsLoopbackAddress(peer);
  }
  return absl::StartsWith(peer, "unix:");
}

// The answer to a request: its status, counted when refused.
grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (!status.ok()) CountRejectedRequest(status.code());
  return rpc::ToGrpc(status);
}

}  // namespace

CoordinatorGrpcService::CoordinatorGrpcService(SwarmCoordinator* coordinator, absl::Duration watch_poll,
                                               std::vector<std::string> admin_names, rpc::TlsOptions probe_tls,
                                               absl::Duration probe_timeout)
    : coordinator_(coordinator),
      watch_poll_(watch_poll),
      admin_names_(std::move(admin_names)),
      probe_tls_(std::move(probe_tls)),
      probe_timeout_(probe_timeout) {}

bool CoordinatorGrpcService::IsAdmin(const grpc::ServerContext& ctx) const {
  const Caller caller = CallerOf(ctx);
  if (!caller.tls) return FromLoopback(ctx);
  for (const std::string& n : caller.names) {
    if (std::find(admin_names_.begin(), admin_names_.end(), n) != admin_names_.end()) return true;
  }
  return false;
}

namespace {

// Whether a StateTransfer server answers one empty Probe at `address` within `timeout`.
absl::Status ProbeReachable(const std::string& address, const rpc::TlsOptions& tls, absl::Duration timeout) {
  AQSWARM_ASSIGN_OR_RETURN(auto channel, rpc::MakeChannel(address, tls, rpc::ControlChannel()));
  auto stub = v1::StateTransfer::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  v1::ProbeResponse resp;
  return rpc::FromGrpc(stub->Probe(&ctx, v1::ProbeRequest(), &resp), absl::StrCat("reachability probe of ", address));
}

}  // namespace

grpc::Status CoordinatorGrpcService::Join(grpc::ServerContext* ctx, const v1::JoinRequest* req,
                                          v1::JoinResponse* resp) {
  JoinParams p;
  p.peer_name = req->peer_name();
  p.join_token = req->join_token();
  p.stage_link_address = req->stage_link_address();
  p.gradient_exchange_address = req->gradient_exchange_address();
  p.state_transfer_address = req->state_transfer_address();
  p.seconds_per_layer = req->seconds_per_layer();
  p.memory_bytes = req->memory_bytes();
  absl::StatusOr<HeldStates> held = HeldStatesFromProto(req->held());
  if (!held.ok()) return ToGrpcStatus(held.status());
  p.held = *std::move(held);
  p.held_job_name = req->held_job_name();
  p.data = {req->dataset_hash(), req->tokenizer_hash()};
  p.previous_session_token = req->previous_session_token();
  p.no_inbound = req->no_inbound();
  auto refuse = [&](const absl::Status& s) {
    const std::string cause = absl::StatusCodeToString(s.code());
    if (const int64_t n = refused_joins_log_.Admit(cause, absl::Now()); n > 0) {
      AQSWARM_LOG(WARNING) << "join of '" << absl::CHexEscape(p.peer_name.substr(0, kMaxNameBytes))
                           << "' refused: " << s << " (" << n << " " << cause
                           << " refusals since the last such line)";
    }
    return ToGrpcStatus(s);
  };
  // Shape first, so a malformed request is INVALID_ARGUMENT whatever its token.
  if (absl::Status s = ValidateJoinParams(p); !s.ok()) return refuse(s);
  const Caller caller = CallerOf(*ctx);
  if (caller.tls) {
    if (std::find(caller.names.begin(), caller.names.end(), p.peer_name) == caller.names.end()) {
      CountRefusal(Refusal::kJoinCertificateName);
      return refuse(absl::PermissionDeniedError(
          absl::StrCat("peer_name '", p.peer_name, "' is not a name of the client certificate (",
                       caller.names.empty() ? "none" : absl::StrJoin(caller.names, ", "),
                       "): join under the name your certificate was issued for")));
    }
    p.certificate_sha256 = caller.certificate_sha256;
  }
  absl::StatusOr<JoinResult> r = coordinator_->Join(p);
  if (!r.ok()) return refuse(r.status());
  if (!r->probe_address.empty()) {
    // After the join (its token checked): one dial to the address the peer
    // gave, which other peers would dial.
    const absl::Status reached = ProbeReachable(r->probe_address, probe_tls_, probe_timeout_);
    if (absl::Status s = coordinator_->SetReachability(r->peer_id, reached.ok(), reached.message()); !s.ok()) {
      AQSWARM_LOG(WARNING) << "recording whether peer '" << p.peer_name << "' is reachable failed: " << s;
    }
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
  absl::StatusOr<v1::Assignment> a = coordinator_->GetAssignment(req->peer_id(), req->session_token());
  if (!a.ok()) return ToGrpcStatus(a.status());
  // Authenticated: this stream replaces the peer's earlier one.
  uint64_t me;
  {
    absl::MutexLock l(&watch_mu_);
    me = ++next_watch_;
    auto [it, fresh] = watches_.try_emplace(req->peer_id(), ctx, me);
    if (!fresh) {
      it->second.first->TryCancel();
      it->second = {ctx, me};
      CountRefusal(Refusal::kWatchSuperseded);
    }
  }
  auto superseded = [&] {
    absl::MutexLock l(&watch_mu_);
    auto it = watches_.find(req->peer_id());
    return it == watches_.end() || it->second.second != me;
  };
  grpc::Status result = grpc::Status::OK;
  uint64_t sent = 0;
  bool first = true;
  while (true) {
    if (ctx->IsCancelled() || superseded()) {
      result = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled, or replaced by a newer watch of this peer");
      break;
    }
    if (shutting_down_) {
      result = grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down");
      break;
    }
    if (!first) {
      a = coordinator_->GetAssignment(req->peer_id(), req->session_token());
      if (!a.ok()) {  // left or expired: NOT_FOUND ends the stream
        result = ToGrpcStatus(a.status());
        break;
      }
    }
    if (first || a->version() > sent) {
      if (!writer->Write(*a)) {
        result = grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
        break;
      }
      sent = a->version();
      first = false;
    }
    // Only the version moving (or a slice ending) wakes us; the assignment
    // is read again only when it moved.
    while (coordinator_->AwaitVersionAbove(sent, watch_poll_) <= sent) {
      if (ctx->IsCancelled() || shutting_down_ || superseded()) break;
    }
  }
  absl::MutexLock l(&watch_mu_);
  auto it = watches_.find(req->peer_id());
  if (it != watches_.end() && it->second.second == me) watches_.erase(it);
  return result;
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
    absl::StatusOr<HeldStates> h = HeldStatesFromProto(req->held());
    if (!h.ok()) return ToGrpcStatus(h.status());
    held = *std::move(h);
  }
  return ToGrpcStatus(coordinator_->ReportProgress(req->peer_id(), req->session_token(), FromProto(req->progress()),
                                                   req->checkpoint_step(), held.has_value() ? &*held : nullptr));
}

grpc::Status CoordinatorGrpcService::ReportBlame(grpc::ServerContext*, const v1::BlameReport* req,
                                                 v1::BlameResponse* resp) {
  if (absl::Status s = CheckPeerRef(req->peer_id(), req->session_token()); !s.ok()) return ToGrpcStatus(s);
  if (!req->has_blame()) return ToGrpcStatus(absl::InvalidArgumentError("blame is required"));
  absl::StatusOr<BlameAnswer> a = coordinator_->ReportBlame(req->peer_id(), req->session_token(), req->blame());
  if (!a.ok()) return ToGrpcStatus(a.status());
  resp->set_outcome(a->recorded ? v1::BlameResponse::RECORDED : v1::BlameResponse::STALE);
  resp->set_strikes(static_cast<uint32_t>(a->strikes));
  resp->set_plan_version(a->plan_version);
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpcService::Status(grpc::ServerContext* ctx, const v1::StatusRequest*,
                                            v1::StatusResponse* resp) {
  *resp = coordinator_->GetStatus(IsAdmin(*ctx));
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
  s->service_ =
      std::make_unique<CoordinatorGrpcService>(s->coordinator_.get(), options.watch_poll, options.admin_names,
                                               options.tls, options.reachability_timeout);
  rpc::ServerOptions so;
  so.listen = options.listen;
  so.tls = options.tls;
  so.max_receive_bytes = 1 << 20;  // every request is small
  so.accept_keepalive = true;      // peers' assignment watches are long-lived
  so.num_completion_queues = options.num_completion_queues;
  so.max_threads = options.max_threads;
  so.max_concurrent_streams = 64;                // one peer: a watch and a few unary calls
  so.max_connection_age_ms = 30 * 60 * 1000;     // watches re-open on a fresh connection
  so.max_connection_age_grace_ms = 60 * 1000;
  AQSWARM_ASSIGN_OR_RETURN(rpc::StartedServer started, rpc::StartServer(so, {s->service_.get()}));
  s->server_ = std::move(started.server);
  s->port_ = started.port;
  CoordinatorServer* raw = s.get();
  s->expiry_thread_ = std::thread([raw] { raw->ExpiryLoop(); });
  return s;
}

void CoordinatorServer::ExpiryLoop() {
  absl::Time last_flush = absl::Now();
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
    absl::StatusOr<std::vector<uint64_t>> gone = coordinator_->RemoveRefusingSuspects(
        [](absl::string_view address) { return ConnectRefused(address, absl::Milliseconds(500)); });
    if (!gone.ok()) {
      AQSWARM_LOG(ERROR) << "removing peers whose link was lost failed (will retry): " << gone.status();
    }
    if (gone.ok()) CountLeaseExpiries(gone->size());  // the lease they would have lost
    if (absl::StatusOr<bool> settled = coordinator_->SettleBlames(); !settled.ok()) {
      AQSWARM_LOG(ERROR) << "settling blame reports failed (will retry): " << settled.status();
    }
    if (absl::StatusOr<bool> improved = coordinator_->ImprovePlan(); !improved.ok()) {
      AQSWARM_LOG(ERROR) << "re-plan on measurements failed (will retry): " << improved.status();
    }
    if (absl::Now() - last_flush >= options_.persist_interval) {
      if (absl::Status f = coordinator_->FlushReports(); !f.ok()) {
        AQSWARM_LOG(ERROR) << "persisting reports failed (will retry): " << f;
      }
      last_flush = absl::Now();
    }
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
  if (absl::Status f = coordinator_->FlushReports(); !f.ok()) {
    AQSWARM_LOG(ERROR) << "persisting reports at shutdown failed: " << f;
  }
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

}  // namespace aqswarm::coordinator
