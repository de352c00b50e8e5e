// The Coordinator gRPC service (proto/coordinator.proto): a thin `final`
// layer over SwarmCoordinator that validates every request, converts
// between protos and domain types and maps absl::Status to grpc::Status
// code for code. CoordinatorServer owns the service, the grpc::Server and the
// lease-expiry thread.
//
//   AQSWARM_ASSIGN_OR_RETURN(auto coord, SwarmCoordinator::Create(std::move(options)));
//   CoordinatorServerOptions so;
//   so.listen = "127.0.0.1:0";
//   so.tls = {tls_dir, "coordinator"};      // default: plaintext
//   AQSWARM_ASSIGN_OR_RETURN(auto server, CoordinatorServer::Start(std::move(coord), so));
//   int port = server->port();
//   ...
//   server->Shutdown();                     // also done by the destructor
//
// WatchAssignment runs on the sync API: each stream holds one server thread
// and waits on the coordinator's version condition variable (its own mutex,
// not the coordinator's) in bounded slices (`watch_poll`), checking for
// cancellation and shutdown between them; it reads the assignment only when
// the version moved. One watch per peer: a second watch by the same
// (authenticated) peer cancels the first.
//
// Identity under TLS: a Join's client certificate must name the peer (its
// subject CN or a subjectAltName equals peer_name), else PERMISSION_DENIED
// naming both; the certificate's SHA-256 goes with the join (a rejoin with the
// same certificate proves it is the same peer). Status details (peer names,
// addresses, links, held states) go to an admin only: under TLS a client
// whose certificate names one of `admin_names`, without TLS a loopback
// caller; everyone else gets the summary (SwarmCoordinator::GetStatus).
// Refused joins are logged at most once per 10 s per cause, with the count.
//
// Thread-safety: thread-safe.
#ifndef AQSWARM_COORDINATOR_COORDINATOR_SERVICE_H_
#define AQSWARM_COORDINATOR_COORDINATOR_SERVICE_H_

#include <atomic>
#include <memory>
#include <string>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/rate_limiter.h"
#include "coordinator/swarm_coordinator.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/tls.h"

namespace aqswarm::coordinator {

class CoordinatorGrpcService final : public v1::Coordinator::Service {
 public:
  // `coordinator` is not owned and must outlive the service.
  // Joiners the coordinator waits to probe (SwarmCoordinatorOptions::
  // probe_reachability) get one StateTransfer.Probe, dialed with
  // `probe_tls`, before their Join returns; an answer within
  // `probe_timeout` makes them REACHABLE, anything else UNREACHABLE.
  CoordinatorGrpcService(SwarmCoordinator* coordinator, absl::Duration watch_poll,
                         std::vector<std::string> admin_names = {"admin"}, rpc::TlsOptions probe_tls = {},
                         absl::Duration probe_timeout = absl::Seconds(3));
  // Ends running WatchAssignment streams (within one watch_poll).
  void BeginShutdown() { shutting_down_ = true; }

  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* req, v1::JoinResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override;
  grpc::Status Leave(grpc::ServerContext* ctx, const v1::LeaveRequest* req, v1::LeaveResponse* resp) override;
  grpc::Status WatchAssignment(grpc::ServerContext* ctx, const v1::WatchAssignmentRequest* req,
                               grpc::ServerWriter<v1::Assignment>* writer) override;
  grpc::Status ReportLinkProbe(grpc::ServerContext* ctx, const v1::LinkProbeReport* req,
                               v1::ReportResponse* resp) override;
  grpc::Status ReportBlame(grpc::ServerContext* ctx, const v1::BlameReport* req, v1::BlameResponse* resp) override;
  grpc::Status ReportProgress(grpc::ServerContext* ctx, const v1::ProgressReport* req,
                              v1::ReportResponse* resp) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req, v1::StatusResponse* resp) override;

 private:
  bool IsAdmin(const grpc::ServerContext& ctx) const;

  SwarmCoordinator* const coordinator_;
  const absl::Duration watch_poll_;
  const std::vector<std::string> admin_names_;
  const rpc::TlsOptions probe_tls_;
  const absl::Duration probe_timeout_;
  std::atomic<bool> shutting_down_{false};
  LogLimiter refused_joins_log_{absl::Seconds(10)};
  // The live watch of each peer: its context and a sequence number.
  absl::Mutex watch_mu_;
  std::map<uint64_t, std::pair<grpc::ServerContext*, uint64_t>> watches_ ABSL_GUARDED_BY(watch_mu_);
  uint64_t next_watch_ ABSL_GUARDED_BY(watch_mu_) = 0;
};

struct CoordinatorServerOptions {
  // Address to bind; port 0 picks a free one (see port()). Default: "127.0.0.1:0".
  std::string listen = "127.0.0.1:0";
  // Mutual TLS (rpc/tls.h). Default: plaintext.
  rpc::TlsOptions tls;
  // Real time between two lease sweeps (SwarmCoordinator::ExpireLeases, then
  // ImprovePlan; both read the injected clock). Default: 200 ms.
  absl::Duration expiry_interval = absl::Milliseconds(200);
  // Longest a WatchAssignment stream waits before re-checking cancellation. Default: 250 ms.
  absl::Duration watch_poll = absl::Milliseconds(250);
  // gRPC sync-server completion queues (each polls on its own thread). Default: 0 = gRPC's default.
  int num_completion_queues = 0;
  // Certificate names (CN or SAN) whose Status calls get every detail under
  // TLS. Default: {"admin"}.
  std::vector<std::string> admin_names = {"admin"};
  // At most this many threads serve calls (each assignment watch holds one);
  // beyond: RESOURCE_EXHAUSTED. Default: 4096.
  int max_threads = 4096;
  // Reports deferred by SwarmCoordinator are committed this often
  // (FlushReports). Default: 1 s.
  absl::Duration persist_interval = absl::Seconds(1);
  // Bound on a joiner's reachability probe (when the coordinator probes,
  // SwarmCoordinatorOptions::probe_reachability). Default: 3 s.
  absl::Duration reachability_timeout = absl::Seconds(3);
};

class CoordinatorServer {
 public:
  // UNAVAILABLE when `listen` cannot be bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(std::unique_ptr<SwarmCoordinator> coordinator,
                                                                  const CoordinatorServerOptions& options);
  ~CoordinatorServer();

  int port() const { return port_; }
  SwarmCoordinator* coordinator() const { return coordinator_.get(); }
  // Stops serving (in-flight streams end within watch_poll) and joins the
  // expiry thread. Idempotent.
  void Shutdown();

 private:
  CoordinatorServer() = default;
  void ExpiryLoop();

  CoordinatorServerOptions options_;
  std::unique_ptr<SwarmCoordinator> coordinator_;
  std::unique_ptr<CoordinatorGrpcService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::thread expiry_thread_;
  absl::Mutex mu_;
  absl::CondVar stop_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ = false;
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_COORDINATOR_SERVICE_H_
