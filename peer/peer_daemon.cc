#include "peer/peer_daemon.h"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/blas_kernels.h"
#include "common/certs.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "peer/grpc_status.h"
#include "peer/stage_checkpoints.h"
#include "peer/stage_runner.h"
#include "peer/state_transfer.h"
#include "proto/coordinator.grpc.pb.h"

namespace aqswarm::peer {
namespace {

namespace fs = std::filesystem;

bool HasFixedPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return false;
  const std::string port = address.substr(colon + 1);
  return port.find_first_not_of("0123456789") == std::string::npos && std::stoi(port) > 0 &&
         std::stoi(port) < 65536;
}

std::string Host(const std::string& address) { return address.substr(0, address.rfind(':')); }

// The stage states under `root`/stage-<j> (the newest 64 of each stage).
std::vector<v1::StageCheckpoints> ListHeld(const fs::path& root) {
  std::vector<v1::StageCheckpoints> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    uint32_t stage = 0;
    if (!absl::StartsWith(name, "stage-") || !absl::SimpleAtoi(name.substr(6), &stage)) continue;
    std::vector<int64_t> steps = StageCheckpointSteps(entry.path().string());
    if (steps.empty()) continue;
    v1::StageCheckpoints h;
    h.set_stage(stage);
    for (size_t i = steps.size() > 64 ? steps.size() - 64 : 0; i < steps.size(); ++i) h.add_steps(steps[i]);
    out.push_back(std::move(h));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.stage() < b.stage(); });
  return out;
}

// What a running child was started for: a new plan or place restarts it.
struct RunKey {
  uint64_t plan_version = 0;
  uint32_t stage = 0, pipeline = 0;
  bool operator==(const RunKey& o) const {
    return plan_version == o.plan_version && stage == o.stage && pipeline == o.pipeline;
  }
};

// The checks an assignment from the network must pass before we act on it.
absl::Status ValidateAssignment(const v1::Assignment& a, const v1::JobSpec& job) {
  if (a.role() != v1::Assignment::STAGE) return absl::OkStatus();
  if (a.num_stages() != job.stages() || a.num_pipelines() != job.data_parallel()) {
    return absl::InvalidArgumentError(absl::StrCat("assignment grid ", a.num_stages(), "x", a.num_pipelines(),
                                                   " differs from the job's ", job.stages(), "x",
                                                   job.data_parallel()));
  }
  if (a.stage() >= a.num_stages() || a.pipeline() >= a.num_pipelines()) {
    return absl::InvalidArgumentError(absl::StrCat("assignment slot (stage ", a.stage(), ", pipeline ", a.pipeline(),
                                                   ") is outside the grid"));
  }
  if (a.resume_step() < 0) return absl::InvalidArgumentError("assignment resume_step < 0");
  if (!a.grid_complete()) return absl::OkStatus();
  if (a.stage() + 1 < a.num_stages() && a.next().stage_link_address().empty()) {
    return absl::InvalidArgumentError("complete grid but no address for the next stage");
  }
  for (const auto& r : a.replicas()) {
    if (r.pipeline() >= a.num_pipelines() || r.pipeline() == a.pipeline()) {
      return absl::InvalidArgumentError(absl::StrCat("replica with pipeline ", r.pipeline(), " is invalid"));
    }
  }
  if (a.num_pipelines() > 1 && a.replicas_size() + 1 != static_cast<int>(a.num_pipelines())) {
    return absl::InvalidArgumentError(absl::StrCat("complete grid but ", a.replicas_size(), " replicas for ",
                                                   a.num_pipelines(), " pipelines"));
  }
  return absl::OkStatus();
}

class PeerDaemonImpl final : public PeerDaemon {
 public:
  explicit PeerDaemonImpl(const PeerDaemonOptions& o) : o_(o) {}

  ~PeerDaemonImpl() override {
    Stop();
    JoinThreads();
  }

  absl::Status Init() {
    std::error_code ec;
    fs::create_directories(o_.work_dir, ec);
    if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create work dir ", o_.work_dir, ": ", ec.message()));
    if (o_.executable.empty()) o_.executable = SelfExecutable();
    if (o_.advertise.empty()) o_.advertise = o_.listen;
    if (o_.exchange_advertise.empty()) o_.exchange_advertise = o_.exchange_listen;
    if (o_.state_listen.empty()) o_.state_listen = Host(o_.listen) + ":0";
    AQSWARM_ASSIGN_OR_RETURN(
        state_server_, StateTransferServer::Start(
                           o_.state_listen, [this](const v1::StateRequest& r) { return ServeState(r); }, 1 << 20,
                           o_.tls));
    if (o_.state_advertise.empty()) {
      std::string host = Host(o_.state_listen);
      if (host == "0.0.0.0" || host == "[::]") host = Host(o_.advertise);
      o_.state_advertise = absl::StrCat(host, ":", state_server_->port());
    }
    AQSWARM_ASSIGN_OR_RETURN(auto creds, MakeChannelCredentials(o_.tls));
    grpc::ChannelArguments args;
    ApplyTlsChannelArgs(o_.tls, &args);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    stub_ = v1::Coordinator::NewStub(grpc::CreateCustomChannel(o_.coordinator, creds, args));
    return absl::OkStatus();
  }

  int state_port() const override { return state_server_->port(); }

  void Stop() override {
    absl::MutexLock l(&mu_);
    stop_ = true;
    if (watch_ctx_ != nullptr) watch_ctx_->TryCancel();
  }

  absl::Status Run() override {
    PickOpenBlasCoreForChildren();  // the stage children's BLAS kernels (common/blas_kernels.h)
    absl::Status s = RunInner();
    StopChild();
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
      if (watch_ctx_ != nullptr) watch_ctx_->TryCancel();
    }
    JoinThreads();
    if (Session().first != 0) {
      absl::Status ls = LeaveQuietly();
      Event(absl::StrFormat(R"({"event":"left","peer_id":%d,"ok":%s})", Session().first, ls.ok() ? "true" : "false"));
    }
    return s;
  }

 private:
  absl::Status RunInner() {
    AQSWARM_RETURN_IF_ERROR(Join());
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
    watch_ = std::thread([this] { WatchLoop(); });
    prober_ = std::thread([this] { ProbeLoop(); });
    mirror_ = std::thread([this] { MirrorLoop(); });
    uint64_t applied_version = 0;
    std::optional<absl::Time> failed_at;
    while (true) {
      const absl::Duration wait =
          failed_at.has_value() ? std::max(absl::ZeroDuration(), *failed_at + ReplanWait() - absl::Now())
                                : absl::Seconds(30);
      mu_.LockWhenWithTimeout(absl::Condition(
                                  +[](PeerDaemonImpl* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) {
                                    return d->stop_ || d->rejoin_ || d->job_done_ || d->child_exit_.has_value() ||
                                           (d->latest_.has_value() && d->latest_->version() != d->applied_);
                                  },
                                  this),
                              wait);
      const bool stop = stop_, rejoin = rejoin_, done = job_done_;
      std::optional<int> exit = child_exit_;
      std::optional<v1::Assignment> a = latest_;
      mu_.Unlock();
      if (stop) return absl::OkStatus();
      if (done) {  // the stage said so; its exit follows (bounded by StopChild)
        StopChild();
        Event(R"({"event":"job_done"})");
        return absl::OkStatus();
      }
      if (exit.has_value()) {
        ReapChild();
        if (*exit == 0) {
          Event(R"({"event":"job_done"})");
          return absl::OkStatus();
        }
        failed_at = absl::Now();
        Event(absl::StrFormat(R"({"event":"child_exit","code":%d,"waiting_for_plan_s":%.1f})", *exit,
                              absl::ToDoubleSeconds(ReplanWait())));
        continue;
      }
      if (!rejoin && failed_at.has_value() && absl::Now() >= *failed_at + ReplanWait()) {
        Event(R"({"event":"rejoin","reason":"no new plan after the stage failed"})");
        (void)LeaveQuietly();
        MarkRejoin();
        continue;
      }
      if (rejoin) {
        StopChild();
        failed_at.reset();
        AQSWARM_RETURN_IF_ERROR(Join());
        continue;
      }
      if (!a.has_value() || a->version() == applied_version) continue;
      applied_version = a->version();
      {
        absl::MutexLock l(&mu_);
        applied_ = applied_version;
      }
      absl::Status as = Apply(*a, &failed_at);
      if (!as.ok()) {
        AQSWARM_LOG(WARNING) << "peer " << o_.name << ": cannot run assignment v" << a->version() << ": " << as;
        Event(absl::StrFormat(R"({"event":"assignment_failed","version":%d,"error":%s})", a->version(),
                              nlohmann::json(std::string(as.message())).dump()));
        failed_at = absl::Now();  // rejoin unless a new plan comes
      }
    }
  }

  absl::Duration ReplanWait() {
    absl::MutexLock l(&mu_);
    return o_.replan_wait > absl::ZeroDuration() ? o_.replan_wait : 2 * lease_ + absl::Seconds(5);
  }

  std::pair<uint64_t, std::string> Session() {
    absl::MutexLock l(&mu_);
    return {peer_id_, session_};
  }

  void MarkRejoin() {
    absl::MutexLock l(&mu_);
    rejoin_ = true;
  }

  void Event(const std::string& line) {
    if (o_.report) o_.report(line);
  }

  // ---- coordinator ------------------------------------------------------

  absl::Status Join() {
    const absl::Time deadline = absl::Now() + o_.join_timeout;
    absl::Duration backoff = absl::Milliseconds(200);
    v1::JoinRequest req;
    req.set_peer_name(o_.name);
    req.set_join_token(o_.join_token);
    req.set_stage_link_address(o_.advertise);
    req.set_gradient_exchange_address(o_.exchange_advertise);
    req.set_state_transfer_address(o_.state_advertise);
    req.set_seconds_per_layer(o_.seconds_per_layer);
    req.set_memory_bytes(o_.memory_bytes);
    // States on disk from an earlier run count for that run's job only.
    const std::optional<v1::JobSpec> previous = ReadPreviousJob();
    if (previous.has_value()) {
      req.set_held_job_name(previous->name());
      for (v1::StageCheckpoints& h : ListHeld(fs::path(o_.work_dir) / "checkpoints")) *req.add_held() = std::move(h);
    }
    while (true) {
      v1::JoinResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      ctx.set_wait_for_ready(true);
      absl::Status s = FromGrpc(stub_->Join(&ctx, req, &resp), absl::StrCat("join ", o_.coordinator));
      if (s.ok()) {
        if (previous.has_value() && !google::protobuf::util::MessageDifferencer::Equals(*previous, resp.job())) {
          // Another job (or the same name with other settings): its states must not be served.
          AQSWARM_RETURN_IF_ERROR(RemoveTree(fs::path(o_.work_dir) / "checkpoints"));
          Event(R"({"event":"stale_states_removed","reason":"the work dir held states of another job"})");
        }
        AQSWARM_RETURN_IF_ERROR(WriteJob(resp.job()));
        absl::MutexLock l(&mu_);
        peer_id_ = resp.peer_id();
        session_ = resp.session_token();
        lease_ = absl::Seconds(std::max(0.5, resp.lease_seconds()));
        rejoin_ = false;
        latest_.reset();
        applied_ = 0;
        Event(absl::StrFormat(R"({"event":"joined","peer_id":%d,"lease_s":%.1f,"state_port":%d})", peer_id_,
                              resp.lease_seconds(), state_server_->port()));
        return absl::OkStatus();
      }
      // Refusals are final; an unreachable coordinator is retried.
      if (!absl::IsUnavailable(s) && !absl::IsDeadlineExceeded(s)) return s;
      if (absl::Now() + backoff > deadline) {
        return absl::UnavailableError(absl::StrCat("coordinator ", o_.coordinator, " unreachable for ",
                                                   absl::FormatDuration(o_.join_timeout), ": ", s.message()));
      }
      absl::MutexLock l(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), backoff)) return absl::CancelledError("stopped");
      backoff = std::min(backoff * 2, absl::Seconds(2));
    }
  }

  absl::Status LeaveQuietly() {
    v1::LeaveRequest req;
    const auto [id, session] = Session();
    req.set_peer_id(id);
    req.set_session_token(session);
    v1::LeaveResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return FromGrpc(stub_->Leave(&ctx, req, &resp), "leave");
  }

  // The job of this work dir's last run (job.json), if any and readable.
  std::optional<v1::JobSpec> ReadPreviousJob() const {
    std::ifstream in(fs::path(o_.work_dir) / "job.json");
    if (!in) return std::nullopt;
    std::stringstream buf;
    buf << in.rdbuf();
    v1::JobSpec job;
    if (!google::protobuf::util::JsonStringToMessage(buf.str(), &job).ok()) return std::nullopt;
    return job;
  }

  absl::Status WriteJob(const v1::JobSpec& job) {
    if (job_.name().empty()) job_ = job;  // set before the threads start; the job never changes
    std::string json;
    google::protobuf::util::JsonPrintOptions jo;
    jo.preserve_proto_field_names = true;
    if (!google::protobuf::util::MessageToJsonString(job, &json, jo).ok()) {
      return absl::InternalError("cannot print the job spec");
    }
    return WriteFileAtomically((fs::path(o_.work_dir) / "job.json").string(), json + "\n", 0644);
  }

  void HeartbeatLoop() {
    while (true) {
      v1::HeartbeatRequest req;
      absl::Duration period;
      {
        absl::MutexLock l(&mu_);
        period = lease_ / 3;
        if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) return;
        if (rejoin_) continue;
        req.set_peer_id(peer_id_);
        req.set_session_token(session_);
      }
      v1::HeartbeatResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(period));
      grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
      if (s.ok() && resp.probe_size() > 0 && o_.probe_bytes > 0) {
        absl::MutexLock l(&mu_);
        for (const v1::Neighbor& n : resp.probe()) {
          const bool queued = std::any_of(probes_.begin(), probes_.end(),
                                          [&](const v1::Neighbor& q) { return q.peer_id() == n.peer_id(); });
          if (!queued && probes_.size() < 64 && !n.state_transfer_address().empty()) probes_.push_back(n);
        }
      }
      if ((s.error_code() == grpc::StatusCode::NOT_FOUND || s.error_code() == grpc::StatusCode::UNAUTHENTICATED) &&
          Session().second == req.session_token()) {
        AQSWARM_LOG(WARNING) << "peer " << o_.name << ": the coordinator no longer knows us (" << s.error_message()
                             << "); joining again";
        MarkRejoin();
      }
    }
  }

  void WatchLoop() {
    absl::Duration backoff = absl::Milliseconds(200);
    while (true) {
      grpc::ClientContext ctx;
      v1::WatchAssignmentRequest req;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(
            +[](PeerDaemonImpl* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) { return d->stop_ || !d->rejoin_; },
            this));
        if (stop_) return;
        req.set_peer_id(peer_id_);
        req.set_session_token(session_);
        watch_ctx_ = &ctx;
      }
      ctx.set_wait_for_ready(true);
      auto reader = stub_->WatchAssignment(&ctx, req);
      v1::Assignment a;
      while (reader->Read(&a)) {
        backoff = absl::Milliseconds(200);
        absl::Status v = ValidateAssignment(a, job_);
        absl::MutexLock l(&mu_);
        if (!v.ok()) {
          AQSWARM_LOG(WARNING) << "peer " << o_.name << ": ignoring assignment v" << a.version() << ": " << v;
          continue;
        }
        if (a.peer_id() == peer_id_ && (!latest_.has_value() || a.version() > latest_->version())) latest_ = a;
      }
      grpc::Status s = reader->Finish();
      absl::MutexLock l(&mu_);
      watch_ctx_ = nullptr;
      if (stop_) return;
      if (s.error_code() == grpc::StatusCode::NOT_FOUND || s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
        if (session_ == req.session_token()) rejoin_ = true;  // else we already joined again
        continue;
      }
      mu_.AwaitWithTimeout(absl::Condition(&stop_), backoff);
      backoff = std::min(backoff * 2, absl::Seconds(2));
    }
  }

  // With the stage states held now; no argument: the last progress again
  // (after a mirror copy landed). Returns whether the coordinator took it.
  // Reports go one at a time, so the coordinator takes them in the order
  // their held lists were read: the child's step reports and the mirror's
  // run on two threads, and a step report read before a mirror copy landed
  // would otherwise replace the copy's report and hide that state from a
  // re-plan.
  bool ReportProgress(std::optional<v1::Progress> progress = std::nullopt) {
    absl::MutexLock serial(&report_mu_);
    v1::ProgressReport req;
    {
      absl::MutexLock l(&mu_);
      if (progress.has_value()) last_progress_ = *progress;
      req.set_peer_id(peer_id_);
      req.set_session_token(session_);
      *req.mutable_progress() = last_progress_;
    }
    req.set_has_held(true);
    for (v1::StageCheckpoints& h : ListHeld(fs::path(o_.work_dir) / "checkpoints")) *req.add_held() = std::move(h);
    v1::ReportResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Status s = stub_->ReportProgress(&ctx, req, &resp);
    if (!s.ok()) {
      AQSWARM_LOG(DEBUG) << "progress report failed: " << s.error_message();
    }
    return s.ok();
  }

  // ---- probes and mirrors ------------------------------------------------

  // Probes the peers heartbeat answers asked for, one at a time.
  void ProbeLoop() {
    while (true) {
      v1::Neighbor target;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(
            +[](PeerDaemonImpl* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) { return d->stop_ || !d->probes_.empty(); },
            this));
        if (stop_) return;
        target = probes_.front();
      }
      ProbeOptions po;
      po.payload_bytes = o_.probe_bytes;
      po.tls = o_.tls;
      po.timeout = absl::Seconds(10);
      absl::StatusOr<LinkProbeResult> r = ProbeLink(target.state_transfer_address(), po);
      {
        absl::MutexLock l(&mu_);
        probes_.pop_front();
      }
      if (!r.ok()) {
        AQSWARM_LOG(INFO) << "peer " << o_.name << ": probe of " << target.peer_name() << " failed: " << r.status();
        continue;
      }
      v1::LinkProbeReport req;
      {
        absl::MutexLock l(&mu_);
        req.set_peer_id(peer_id_);
        req.set_session_token(session_);
      }
      req.set_to_peer_id(target.peer_id());
      req.set_bandwidth_bytes_per_second(r->bandwidth_bytes_per_second);
      req.set_rtt_seconds(r->rtt_seconds);
      v1::ReportResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      const absl::Status s = FromGrpc(stub_->ReportLinkProbe(&ctx, req, &resp), "report link probe");
      Event(absl::StrFormat(R"({"event":"link_probe","to":%d,"mbit_s":%.1f,"rtt_ms":%.2f,"reported":%s})",
                            target.peer_id(), r->bandwidth_bytes_per_second * 8 / 1e6, r->rtt_seconds * 1e3,
                            s.ok() ? "true" : "false"));
    }
  }

  // Every kPassiveInterval, the forward link's send rate while busy (from
  // the stage's cumulative counters) becomes a passive ReportLinkProbe.
  void MaybeReportPassive(uint64_t bytes, double seconds) {
    static constexpr absl::Duration kPassiveInterval = absl::Seconds(20);
    v1::LinkProbeReport req;
    {
      absl::MutexLock l(&mu_);
      const absl::Time now = absl::Now();
      if (next_peer_ == 0) return;
      if (!passive_at_.has_value() || bytes < passive_bytes_ || seconds < passive_seconds_) {  // a new child
        passive_at_ = now;
        passive_bytes_ = bytes;
        passive_seconds_ = seconds;
        return;
      }
      const double db = static_cast<double>(bytes - passive_bytes_), ds = seconds - passive_seconds_;
      if (now - *passive_at_ < kPassiveInterval || db < (256 << 10) || ds <= 0) return;
      passive_at_ = now;
      passive_bytes_ = bytes;
      passive_seconds_ = seconds;
      req.set_peer_id(peer_id_);
      req.set_session_token(session_);
      req.set_to_peer_id(next_peer_);
      req.set_bandwidth_bytes_per_second(db / ds);
      req.set_passive(true);
    }
    v1::ReportResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const absl::Status s = FromGrpc(stub_->ReportLinkProbe(&ctx, req, &resp), "report passive link measurement");
    Event(absl::StrFormat(R"({"event":"link_passive","to":%d,"mbit_s":%.1f,"reported":%s})", req.to_peer_id(),
                          req.bandwidth_bytes_per_second() * 8 / 1e6, s.ok() ? "true" : "false"));
  }

  // Copies the mirrored peer's state after each of our checkpoints.
  void MirrorLoop() {
    while (true) {
      v1::Neighbor target;
      int64_t want = 0;
      uint64_t plan = 0;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(
            +[](PeerDaemonImpl* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) {
              return d->stop_ || (d->mirror_target_.has_value() && d->mirror_want_ > d->mirror_done_);
            },
            this));
        if (stop_) return;
        target = *mirror_target_;
        want = mirror_want_;
        plan = plan_;
        mirror_copying_ = want;
      }
      UpdatePins();
      const absl::Status s = CopyMirror(target, want, plan);
      {
        absl::MutexLock l(&mu_);
        mirror_done_ = std::max(mirror_done_, want);  // on failure too: the next checkpoint tries again
        mirror_copying_ = 0;
        if (s.ok() && plan_ == plan) mirror_landed_ = want;
      }
      UpdatePins();
      if (s.ok()) {
        // Logged once the coordinator knows of the copy (or the report
        // failed): only then can a re-plan resume from it.
        const bool reported = ReportProgress();
        Event(absl::StrFormat(R"({"event":"mirrored","stage":%d,"step":%d,"from":"%s","reported":%s})", target.stage(),
                              want, target.peer_name(), reported ? "true" : "false"));
      } else if (!absl::IsCancelled(s)) {
        AQSWARM_LOG(WARNING) << "peer " << o_.name << ": no copy of stage " << target.stage() << " at step " << want
                             << ": " << s;
      }
    }
  }

  // Pins in our own stage's checkpoint dir (peer/stage_checkpoints.h) the
  // steps of the newest mirror copy that landed, of the copy under way and
  // of the one wanted next: the child prunes its states to the newest few,
  // and a copy is of use to a re-plan only beside our own state of its step.
  void UpdatePins() {
    absl::MutexLock serial(&pins_mu_);
    std::string dir;
    std::vector<int64_t> steps;
    {
      absl::MutexLock l(&mu_);
      if (own_stage_.has_value()) dir = CheckpointDir(*own_stage_).string();
      if (mirror_target_.has_value()) {
        for (int64_t s : {mirror_landed_, mirror_copying_, mirror_want_ > mirror_done_ ? mirror_want_ : 0}) {
          if (s > 0) steps.push_back(s);
        }
      }
    }
    std::sort(steps.begin(), steps.end());
    steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
    if (pins_dir_ != dir) {  // we moved to another stage (or none)
      if (!pins_dir_.empty()) {
        const absl::Status s = WriteStageCheckpointPins(pins_dir_, {});
        if (!s.ok()) AQSWARM_LOG(WARNING) << "peer " << o_.name << ": " << s;
      }
      pins_dir_ = dir;
      pinned_.reset();  // unknown there (a file of an earlier run): written below
    }
    if (dir.empty() || steps == pinned_) return;
    const absl::Status s = WriteStageCheckpointPins(dir, steps);
    if (!s.ok()) {
      AQSWARM_LOG(WARNING) << "peer " << o_.name << ": cannot pin the states of mirrored steps: " << s;
      return;
    }
    pinned_ = std::move(steps);
  }

  absl::Status CopyMirror(const v1::Neighbor& target, int64_t step, uint64_t plan) {
    // The mirrored peer completes the same step at about the same time; until
    // it has, it answers NOT_FOUND.
    const absl::Time deadline = absl::Now() + o_.link_timeout;
    while (true) {
      absl::StatusOr<uint64_t> s = FetchStageState(target.state_transfer_address(), target.stage(), step);
      if (s.ok()) {
        const std::string dir = CheckpointDir(target.stage()).string();
        absl::MutexLock l(&mu_);
        if (plan_ != plan) {  // a re-plan pruned while we fetched: this state may be from its abandoned timeline
          std::error_code ec;
          fs::remove(StageCheckpointPath(dir, step), ec);
          return absl::CancelledError("the plan changed");
        }
        PruneStageCheckpoints(dir, std::numeric_limits<int64_t>::max(), o_.keep_checkpoints);
        return absl::OkStatus();
      }
      if (!absl::IsNotFound(s.status()) || absl::Now() > deadline) return s.status();
      absl::MutexLock l(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(200))) return absl::CancelledError("stopped");
      if (plan_ != plan) return absl::CancelledError("the plan changed");
    }
  }

  // ---- stage state --------------------------------------------------------

  fs::path CheckpointDir(uint32_t stage) const {
    return fs::path(o_.work_dir) / "checkpoints" / absl::StrCat("stage-", stage);
  }

  absl::StatusOr<StateSnapshot> ServeState(const v1::StateRequest& r) {
    if (r.job_name() != job_.name()) {
      return absl::FailedPreconditionError(absl::StrCat("this peer trains job '", job_.name(), "', not '",
                                                        r.job_name(), "'"));
    }
    const std::string dir = CheckpointDir(r.stage()).string();
    int64_t step = r.step();
    if (step == 0) {  // the newest
      const std::vector<int64_t> kept = StageCheckpointSteps(dir);
      if (kept.empty()) return absl::NotFoundError(absl::StrCat("no state of stage ", r.stage(), " here"));
      step = kept.back();
    }
    std::ifstream in(StageCheckpointPath(dir, step), std::ios::binary);
    if (!in) {
      return absl::NotFoundError(absl::StrCat("no state of stage ", r.stage(), " at step ", step,
                                              " here (only the newest ", o_.keep_checkpoints, " are kept)"));
    }
    std::ostringstream buf;
    buf << in.rdbuf();
    return StateSnapshot{buf.str(), static_cast<uint64_t>(step)};
  }

  // The state the child starts from: "" for step 0, else a local file
  // (kept, or fetched from a replica).
  // Fetches `stage`'s state after `step` steps from `address` into this
  // peer's checkpoint dir; returns its size in bytes.
  absl::StatusOr<uint64_t> FetchStageState(const std::string& address, uint32_t stage, int64_t step) {
    v1::StateRequest req;
    req.set_job_name(job_.name());
    req.set_stage(stage);
    req.set_step(step);
    FetchOptions fo;
    fo.tls = o_.tls;
    fo.timeout = absl::Minutes(5);
    AQSWARM_ASSIGN_OR_RETURN(StateSnapshot s, FetchState(address, req, fo));
    if (s.step != static_cast<uint64_t>(step)) {
      return absl::DataLossError(absl::StrCat("asked for step ", step, ", got step ", s.step));
    }
    const fs::path dir = CheckpointDir(stage);
    std::error_code ec;
    fs::create_directories(dir, ec);
    AQSWARM_RETURN_IF_ERROR(WriteFileAtomically(StageCheckpointPath(dir.string(), step), s.bytes, 0644));
    return s.bytes.size();
  }

  absl::StatusOr<std::string> PrepareState(const v1::Assignment& a) {
    const std::string want = StageCheckpointPath(CheckpointDir(a.stage()).string(), a.resume_step());
    std::error_code ec;
    if (fs::exists(want, ec)) return want;
    if (a.resume_step() == 0) return std::string();
    std::vector<std::string> tried;
    std::vector<v1::Neighbor> sources(a.state_sources().begin(), a.state_sources().end());
    sources.insert(sources.end(), a.replicas().begin(), a.replicas().end());
    for (const auto& r : sources) {
      if (r.state_transfer_address().empty()) continue;
      absl::StatusOr<uint64_t> bytes = FetchStageState(r.state_transfer_address(), a.stage(), a.resume_step());
      if (!bytes.ok()) {
        tried.push_back(absl::StrCat(r.peer_name(), ": ", bytes.status().message()));
        continue;
      }
      Event(absl::StrFormat(R"({"event":"state_fetched","stage":%d,"step":%d,"from":"%s","bytes":%d})", a.stage(),
                            a.resume_step(), r.peer_name(), *bytes));
      return want;
    }
    return absl::NotFoundError(absl::StrCat("no state of stage ", a.stage(), " at step ", a.resume_step(),
                                            ": not kept here and no holder or replica served it [",
                                            absl::StrJoin(tried, "; "), "]"));
  }

  // ---- the child --------------------------------------------------------

  absl::Status Apply(const v1::Assignment& a, std::optional<absl::Time>* failed_at) {
    const bool run = a.role() == v1::Assignment::STAGE && a.grid_complete();
    const RunKey key{a.plan_version(), a.stage(), a.pipeline()};
    Event(absl::StrFormat(
        R"({"event":"assignment","version":%d,"plan":%d,"role":"%s","stage":%d,"pipeline":%d,"resume_step":%d,"grid_complete":%s})",
        a.version(), a.plan_version(), a.role() == v1::Assignment::STAGE ? "stage" : "standby", a.stage(),
        a.pipeline(), a.resume_step(), a.grid_complete() ? "true" : "false"));
    {
      absl::MutexLock l(&mu_);
      next_peer_ = a.role() == v1::Assignment::STAGE && a.has_next() ? a.next().peer_id() : 0;
      passive_at_.reset();
      const std::optional<uint32_t> mirrored_before =
          mirror_target_.has_value() ? std::optional<uint32_t>(mirror_target_->stage()) : std::nullopt;
      if (a.has_mirror() && !a.mirror().state_transfer_address().empty()) {
        mirror_target_ = a.mirror();
      } else {
        mirror_target_.reset();
      }
      if (!mirror_target_.has_value() || mirrored_before != mirror_target_->stage()) mirror_landed_ = 0;
      own_stage_ = a.role() == v1::Assignment::STAGE ? std::optional<uint32_t>(a.stage()) : std::nullopt;
      if (a.plan_version() != plan_) {
        // A new plan restarts everyone at resume_step: states past it are
        // from the abandoned timeline, and pending mirror copies with them.
        plan_ = a.plan_version();
        // Where this plan restarts us, until our child reports (a mirror
        // copy's report resends it).
        last_progress_.set_step(a.resume_step());
        last_progress_.set_plan_version(a.plan_version());
        mirror_want_ = std::min(mirror_want_, a.resume_step());
        mirror_done_ = std::min(mirror_done_, a.resume_step());
        if (mirror_landed_ > a.resume_step()) mirror_landed_ = 0;
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(fs::path(o_.work_dir) / "checkpoints", ec)) {
          PruneStageCheckpoints(entry.path().string(), a.resume_step(), o_.keep_checkpoints);
        }
      }
    }
    UpdatePins();
    if (run && child_ != nullptr && running_ == key) return absl::OkStatus();  // same plan: keep training
    if (run && child_ == nullptr && running_ == key && failed_at->has_value()) {
      return absl::OkStatus();  // our stage failed under this plan: wait for the next one
    }
    StopChild();
    failed_at->reset();
    if (!run) return absl::OkStatus();
    AQSWARM_ASSIGN_OR_RETURN(std::string init, PrepareState(a));
    std::vector<std::string> argv = {
        o_.executable,
        "stage",
        absl::StrCat("--job=", (fs::path(o_.work_dir) / "job.json").string()),
        absl::StrCat("--stage=", a.stage()),
        absl::StrCat("--pipeline_index=", a.pipeline()),
        absl::StrCat("--listen=", o_.listen),
        absl::StrCat("--store_dir=", (fs::path(o_.work_dir) / "store").string()),
        absl::StrCat("--start_step=", a.resume_step()),
        absl::StrCat("--plan=", a.plan_version()),
        "--die_with_parent",
        absl::StrCat("--checkpoint_dir=", CheckpointDir(a.stage()).string()),
        absl::StrCat("--keep_checkpoints=", o_.keep_checkpoints),
        absl::StrCat("--link_timeout_s=", std::max<int64_t>(1, absl::ToInt64Seconds(o_.link_timeout))),
    };
    if (!init.empty()) argv.push_back(absl::StrCat("--init_checkpoint=", init));
    if (a.has_next()) {
      argv.push_back(absl::StrCat("--next=", a.next().stage_link_address()));
      argv.push_back(absl::StrCat("--next_generation=", a.next().link_generation()));
    }
    if (a.has_previous()) argv.push_back(absl::StrCat("--previous_generation=", a.previous().link_generation()));
    if (a.num_pipelines() > 1) {
      std::vector<std::string> replicas(a.num_pipelines());
      replicas[a.pipeline()] = o_.exchange_advertise;
      uint64_t generation = 0;
      for (const auto& r : a.replicas()) {
        replicas[r.pipeline()] = r.gradient_exchange_address();
        generation = r.link_generation();
      }
      argv.push_back(absl::StrCat("--exchange_listen=", o_.exchange_listen));
      argv.push_back(absl::StrCat("--replicas=", absl::StrJoin(replicas, ",")));
      argv.push_back(absl::StrCat("--replica_generation=", generation));
    }
    if (!o_.metrics_listen.empty()) argv.push_back(absl::StrCat("--metrics_listen=", o_.metrics_listen));
    if (o_.tls.enabled()) {
      argv.push_back(absl::StrCat("--tls_dir=", o_.tls.dir));
      argv.push_back(absl::StrCat("--name=", o_.tls.name));
    }
    SubprocessOptions so;
    so.stderr_path = (fs::path(o_.work_dir) / "stage.log").string();
    AQSWARM_ASSIGN_OR_RETURN(child_, Subprocess::Spawn(argv, so));
    running_ = key;
    {
      absl::MutexLock l(&mu_);
      child_exit_.reset();
    }
    Event(absl::StrFormat(R"({"event":"stage_started","stage":%d,"pipeline":%d,"start_step":%d,"pid":%d})", a.stage(),
                          a.pipeline(), a.resume_step(), child_->pid()));
    reader_ = std::thread([this, child = child_.get(), plan = a.plan_version()] { ReadChild(child, plan); });
    return absl::OkStatus();
  }

  // Owns the child's stdout and its exit; posts the exit code. `plan`: the
  // plan the child runs under (its step reports say so).
  void ReadChild(Subprocess* child, uint64_t plan) {
    std::string line;
    while (true) {
      absl::Status s = child->ReadLine(&line, absl::Hours(24));
      if (absl::IsOutOfRange(s) || (!s.ok() && !absl::IsDeadlineExceeded(s))) break;
      if (!s.ok()) continue;
      Event(line);
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("event", "") == "done") {
        absl::MutexLock l(&mu_);
        job_done_ = true;
      }
      if (j.is_object() && j.value("event", "") == "step") {
        const double secs = j.value("step_seconds", 0.0);
        v1::Progress p;
        p.set_step(j.value("step", int64_t{0}) + 1);
        p.set_loss(j.value("loss", 0.0));
        p.set_tokens_per_second(secs > 0 ? j.value("tokens", 0.0) / secs : 0.0);
        p.set_plan_version(plan);
        const int64_t every = std::max<uint32_t>(1, job_.checkpoint_every_steps());
        if (p.step() % every == 0) {
          {
            absl::MutexLock l(&mu_);
            mirror_want_ = std::max(mirror_want_, p.step());
          }
          UpdatePins();
        }
        ReportProgress(p);
        if (j.contains("down_busy_bytes")) {
          MaybeReportPassive(j.value("down_busy_bytes", uint64_t{0}), j.value("down_busy_seconds", 0.0));
        }
      }
    }
    absl::StatusOr<int> code = child->Wait(absl::Hours(24));
    absl::MutexLock l(&mu_);
    child_exit_ = code.ok() ? *code : 255;
  }

  void ReapChild() {
    if (reader_.joinable()) reader_.join();
    child_.reset();
    absl::MutexLock l(&mu_);
    child_exit_.reset();
  }

  // SIGTERM, then SIGKILL after stop_grace; always reaps.
  void StopChild() {
    if (child_ == nullptr) return;
    child_->Signal(SIGTERM);
    {
      absl::MutexLock l(&mu_);
      if (!mu_.AwaitWithTimeout(absl::Condition(
                                    +[](PeerDaemonImpl* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) {
                                      return d->child_exit_.has_value();
                                    },
                                    this),
                                o_.stop_grace)) {
        child_->Signal(SIGKILL);
      }
    }
    ReapChild();
    Event(R"({"event":"stage_stopped"})");
  }

  void JoinThreads() {
    if (heartbeat_.joinable()) heartbeat_.join();
    if (watch_.joinable()) watch_.join();
    if (prober_.joinable()) prober_.join();
    if (mirror_.joinable()) mirror_.join();
  }

  PeerDaemonOptions o_;
  std::unique_ptr<StateTransferServer> state_server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  v1::JobSpec job_;  // from Join; read by the watch thread after Join
  std::thread heartbeat_, watch_, reader_, prober_, mirror_;
  std::unique_ptr<Subprocess> child_;
  RunKey running_;

  absl::Mutex report_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one ReportProgress at a time
  absl::Mutex pins_mu_ ABSL_ACQUIRED_BEFORE(mu_);    // one UpdatePins at a time
  std::string pins_dir_ ABSL_GUARDED_BY(pins_mu_);   // where UpdatePins last wrote
  std::optional<std::vector<int64_t>> pinned_ ABSL_GUARDED_BY(pins_mu_);  // what pins_dir_ holds
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool rejoin_ ABSL_GUARDED_BY(mu_) = false;
  bool job_done_ ABSL_GUARDED_BY(mu_) = false;  // the child printed {"event":"done"}
  uint64_t peer_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::string session_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::Seconds(10);
  std::optional<v1::Assignment> latest_ ABSL_GUARDED_BY(mu_);
  uint64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<int> child_exit_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* watch_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  v1::Progress last_progress_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::Neighbor> probes_ ABSL_GUARDED_BY(mu_);  // peers to probe
  std::optional<v1::Neighbor> mirror_target_ ABSL_GUARDED_BY(mu_);
  int64_t mirror_want_ ABSL_GUARDED_BY(mu_) = 0;  // step whose copy is wanted
  int64_t mirror_done_ ABSL_GUARDED_BY(mu_) = 0;  // newest step copied
  int64_t mirror_copying_ ABSL_GUARDED_BY(mu_) = 0;  // step of the copy under way (0: none)
  int64_t mirror_landed_ ABSL_GUARDED_BY(mu_) = 0;   // newest step copied successfully (0: none)
  std::optional<uint32_t> own_stage_ ABSL_GUARDED_BY(mu_);  // the stage we run (none: standby)
  uint64_t plan_ ABSL_GUARDED_BY(mu_) = 0;        // plan of the last assignment applied
  uint64_t next_peer_ ABSL_GUARDED_BY(mu_) = 0;   // our forward link's far end (0: none)
  std::optional<absl::Time> passive_at_ ABSL_GUARDED_BY(mu_);  // last passive measurement window start
  uint64_t passive_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  double passive_seconds_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PeerDaemon>> PeerDaemon::Create(const PeerDaemonOptions& options) {
  auto need = [](const std::string& v, const char* flag) -> absl::Status {
    return v.empty() ? absl::InvalidArgumentError(absl::StrCat(flag, " is required")) : absl::OkStatus();
  };
  AQSWARM_RETURN_IF_ERROR(need(options.coordinator, "--coordinator"));
  AQSWARM_RETURN_IF_ERROR(need(options.join_token, "--join_token"));
  AQSWARM_RETURN_IF_ERROR(need(options.name, "--name"));
  AQSWARM_RETURN_IF_ERROR(need(options.work_dir, "--work_dir"));
  for (const auto& [value, flag] : {std::pair{options.listen, "--listen"}, {options.exchange_listen, "--exchange_listen"}}) {
    if (!HasFixedPort(value)) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " must be HOST:PORT with a fixed port, got '", value, "'"));
    }
  }
  for (const auto& [value, flag] :
       {std::pair{options.advertise.empty() ? options.listen : options.advertise, "--advertise"},
        {options.exchange_advertise.empty() ? options.exchange_listen : options.exchange_advertise,
         "--exchange_advertise"}}) {
    if (absl::StartsWith(value, "0.0.0.0:") || absl::StartsWith(value, "[::]:")) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " is needed: '", value,
                                                     "' binds every interface but is no address to dial"));
    }
  }
  if (options.keep_checkpoints < 2) return absl::InvalidArgumentError("--keep_checkpoints must be >= 2");
  if (options.probe_bytes > kMaxProbeBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--probe_bytes must be at most ", kMaxProbeBytes));
  }
  if (options.tls.enabled() && options.tls.name.empty()) {
    return absl::InvalidArgumentError("TLS needs this peer's certificate name");
  }
  auto d = std::make_unique<PeerDaemonImpl>(options);
  AQSWARM_RETURN_IF_ERROR(d->Init());
  return std::unique_ptr<PeerDaemon>(std::move(d));
}

}  // namespace aqswarm::peer
