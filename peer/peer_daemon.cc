#include "peer/peer_daemon_impl.h"

#include <cmath>

#include "pipeline/dataset.h"
#include "pipeline/job_spec.h"
#include "rpc/server.h"

namespace aqswarm::peer {
namespace {

bool HasFixedPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return false;
  const std::string port = address.substr(colon + 1);
  return port.find_first_not_of("0123456789") == std::string::npos && std::stoi(port) > 0 &&
         std::stoi(port) < 65536;
}

std::string Host(const std::string& address) { return address.substr(0, address.rfind(':')); }

// The most bytes a fetched state of each stage may have: 16 float32 values
// per parameter (the parameters, AdamW's moments, the data-parallel
// optimizer's moments and error buffers, a delayed update and its previous
// parameters, a tied copy's state fit several times over) and 64 MiB of
// header and small tensors. A sender declaring more is refused before a
// byte is written.
std::vector<uint64_t> MaxStateBytes(const v1::JobSpec& job) {
  std::vector<uint64_t> out;
  if (job.stages() == 0 || job.stages() > 4096) return out;
  for (uint32_t k = 0; k < job.stages(); ++k) {
    const int64_t params = pipeline::StageParameterCount(job.model(), static_cast<int>(k), static_cast<int>(job.stages()));
    out.push_back(params > 0 ? static_cast<uint64_t>(params) * 16 * 4 + (64ull << 20) : 0);
  }
  return out;
}

}  // namespace

namespace daemon {

absl::Status PeerDaemonImpl::Init() {
  std::error_code ec;
  fs::create_directories(o_.work_dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create work dir ", o_.work_dir, ": ", ec.message()));
  if (o_.executable.empty()) o_.executable = SelfExecutable();
  if (o_.advertise.empty()) o_.advertise = o_.listen;
  if (o_.exchange_advertise.empty()) o_.exchange_advertise = o_.exchange_listen;
  if (o_.state_listen.empty()) o_.state_listen = Host(o_.listen) + ":0";
  StateKeeper::Options ko;
  ko.work_dir = o_.work_dir;
  ko.keep_checkpoints = o_.keep_checkpoints;
  ko.tls = o_.tls;
  ko.copy_wait = o_.link_timeout;
  ko.name = o_.name;
  keeper_ = std::make_unique<StateKeeper>(
      ko, [this](const v1::PeerEvent& e) { Event(e); }, [this] { return ReportProgress(); });
  AQSWARM_ASSIGN_OR_RETURN(
      state_server_, StateTransferServer::Start(
                         o_.state_listen, [this](const v1::StateRequest& r) { return keeper_->Serve(r); }, 1 << 20,
                         o_.tls));
  if (o_.state_advertise.empty()) {
    std::string host = Host(o_.state_listen);
    if (host == "0.0.0.0" || host == "[::]") host = Host(o_.advertise);
    o_.state_advertise = absl::StrCat(host, ":", state_server_->port());
  }
  client_ = o_.coordinator_client;
  if (client_ == nullptr) {
    AQSWARM_ASSIGN_OR_RETURN(client_, ConnectCoordinator(o_.coordinator, o_.tls));
  }
  if (!o_.identify_data) {
    o_.identify_data = [](const v1::DataSpec& d) { return pipeline::IdentifyData(pipeline::DataSourceFor(d)); };
  }
  launcher_ = o_.launcher;
  if (launcher_ == nullptr) launcher_ = ProcessStageLauncher(o_.executable, o_.work_dir);
  return absl::OkStatus();
}

absl::Status PeerDaemonImpl::Run() {
  PickOpenBlasCoreForChildren();  // the stage children's BLAS kernels (common/blas_kernels.h)
  absl::Status s = RunInner();
  StopChild();
  Stop();
  JoinThreads();
  if (Session().first != 0) {
    absl::Status ls = LeaveQuietly();
    v1::PeerEvent e;
    e.mutable_left()->set_peer_id(Session().first);
    e.mutable_left()->set_ok(ls.ok());
    Event(e);
  }
  return s;
}

absl::Status PeerDaemonImpl::RunInner() {
  AQSWARM_RETURN_IF_ERROR(Join());
  LinkProber::Options po;
  po.probe_bytes = o_.probe_bytes;
  po.uplink_mbps = o_.emulate_uplink_mbps;
  po.tls = o_.tls;
  po.name = o_.name;
  prober_ = std::make_unique<LinkProber>(po, client_.get(), [this] { return Session(); },
                                         [this](const v1::PeerEvent& e) { Event(e); });
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  watch_ = std::thread([this] { WatchLoop(); });
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
      Event(JobDone());
      return absl::OkStatus();
    }
    if (exit.has_value()) {
      ReapChild();
      if (*exit == 0) {
        Event(JobDone());
        return absl::OkStatus();
      }
      failed_at = absl::Now();
      v1::PeerEvent e;
      e.mutable_child_exit()->set_code(*exit);
      e.mutable_child_exit()->set_waiting_for_plan_s(absl::ToDoubleSeconds(ReplanWait()));
      Event(e);
      continue;
    }
    if (!rejoin && failed_at.has_value() && absl::Now() >= *failed_at + ReplanWait()) {
      v1::PeerEvent e;
      e.mutable_rejoin()->set_reason("no new plan after the stage failed");
      Event(e);
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
      v1::PeerEvent e;
      e.mutable_assignment_failed()->set_version(a->version());
      e.mutable_assignment_failed()->set_error(std::string(as.message()));
      Event(e);
      failed_at = absl::Now();  // rejoin unless a new plan comes
    }
  }
}

// The stage names whom it blames for its end: the coordinator counts the
// strike and restarts the plan (this peer keeps its slot: the daemon waits
// for that plan as after any failure of its stage).
void PeerDaemonImpl::ReportBlame(const v1::Blame& blame) {
  v1::BlameReport req;
  const auto [id, token] = Session();
  req.set_peer_id(id);
  req.set_session_token(token);
  *req.mutable_blame() = blame;
  absl::StatusOr<v1::BlameResponse> r = client_->ReportBlame(req);
  v1::PeerEvent e;
  v1::BlameReportedEvent& b = *e.mutable_blame_reported();
  *b.mutable_blame() = blame;
  if (r.ok()) {
    b.set_outcome(v1::BlameResponse::Outcome_Name(r->outcome()));
    b.set_strikes(r->strikes());
  } else {
    b.set_error(std::string(r.status().message()));
    AQSWARM_LOG(WARNING) << "peer " << o_.name << ": reporting blame failed: " << r.status();
  }
  Event(e);
}

absl::Status PeerDaemonImpl::Apply(const v1::Assignment& a, std::optional<absl::Time>* failed_at) {
  {
    v1::PeerEvent e;
    v1::AssignmentEvent& ae = *e.mutable_assignment();
    ae.set_version(a.version());
    ae.set_plan(a.plan_version());
    ae.set_role(a.role() == v1::Assignment::STAGE ? "stage" : "standby");
    ae.set_stage(a.stage());
    ae.set_pipeline(a.pipeline());
    ae.set_resume_step(a.resume_step());
    ae.set_grid_complete(a.grid_complete());
    Event(e);
  }
  prober_->SetNextPeer(a.role() == v1::Assignment::STAGE && a.has_next() ? a.next().peer_id() : 0);
  keeper_->SetMaxStateBytes(MaxStateBytes(job_));
  if (keeper_->Follow(a)) {
    // A new plan restarts everyone at its resume step: that is where it
    // restarts us, until our child reports (a mirror copy's report resends it).
    absl::MutexLock l(&mu_);
    last_progress_.set_step(std::max(a.resume_step(), a.start_step()));
    last_progress_.set_plan_version(a.plan_version());
  }
  v1::Neighbor self;
  self.set_peer_id(Session().first);
  self.set_peer_name(o_.tls.name);
  self.set_gradient_exchange_address(o_.exchange_advertise);
  const AssignmentAction action =
      DecideAssignment(a, {started_for_, child_ != nullptr, child_ == nullptr && failed_at->has_value()});
  if (action == AssignmentAction::kKeepRunning) {
    // Same run: keep training. Under fault domains a re-plan of another
    // pipeline may have moved a replica: the child learns where.
    report_plan_ = a.plan_version();
    if (a.dp_timeline() > 0) {
      v1::StageLaunch patch;
      *patch.mutable_replicas() = StageLaunchFor(a, v1::StageLaunch(), o_.work_dir, self, "").replicas();
      std::string key = patch.SerializeAsString();
      if (key != sent_replicas_) {
        const absl::Status s = child_->SendReplicas(patch);
        if (!s.ok()) AQSWARM_LOG(WARNING) << "peer " << o_.name << ": replica patch not delivered: " << s;
        sent_replicas_ = std::move(key);
      }
    }
    return absl::OkStatus();
  }
  if (action == AssignmentAction::kWaitForNextPlan) return absl::OkStatus();  // our stage failed under this plan
  StopChild();
  failed_at->reset();
  if (action == AssignmentAction::kStop) return absl::OkStatus();
  AQSWARM_ASSIGN_OR_RETURN(std::string init, keeper_->Prepare(a));
  v1::StageLaunch base;
  *base.mutable_job() = job_;
  base.set_listen(o_.listen);
  base.set_exchange_listen(o_.exchange_listen);
  base.set_metrics_listen(o_.metrics_listen);
  base.mutable_tls()->set_dir(o_.tls.dir);
  if (!o_.tls.dir.empty()) base.mutable_tls()->set_name(o_.tls.name);
  base.mutable_tls()->set_insecure(o_.insecure);
  base.set_keep_checkpoints(static_cast<uint32_t>(std::max(1, o_.keep_checkpoints)));
  base.mutable_link_timeout()->set_seconds(std::max<int64_t>(1, absl::ToInt64Seconds(o_.link_timeout)));
  base.set_adaptive_link_deadline(o_.adaptive_link_deadline);
  base.set_uplink_mbps(o_.emulate_uplink_mbps);
  base.set_die_with_parent(true);
  {
    absl::MutexLock l(&mu_);
    child_exit_.reset();
  }
  StageChildCallbacks callbacks;
  report_plan_ = a.plan_version();
  callbacks.on_event = [this](const v1::StageEvent& e) { OnChildEvent(e, report_plan_); };
  callbacks.on_exit = [this](int code) {
    absl::MutexLock l(&mu_);
    child_exit_ = code;
  };
  const v1::StageLaunch launch = StageLaunchFor(a, std::move(base), o_.work_dir, self, init);
  {
    v1::StageLaunch sent;
    *sent.mutable_replicas() = launch.replicas();
    sent_replicas_ = sent.SerializeAsString();
  }
  AQSWARM_ASSIGN_OR_RETURN(child_, launcher_->Launch(launch, std::move(callbacks)));
  started_for_ = RunKeyOf(a);
  {
    v1::PeerEvent e;
    e.mutable_stage_started()->set_stage(a.stage());
    e.mutable_stage_started()->set_pipeline(a.pipeline());
    e.mutable_stage_started()->set_start_step(launch.start_step());
    e.mutable_stage_started()->set_pid(child_->pid());
    Event(e);
  }
  return absl::OkStatus();
}

void PeerDaemonImpl::OnChildEvent(const v1::StageEvent& e, uint64_t plan) {
  Event(events::FromStage(e));
  if (e.has_error() && e.error().has_blame()) {
    // Under the plan the child's run is in now (a kept run outlives plans).
    v1::Blame b = e.error().blame();
    b.set_plan(plan);
    ReportBlame(b);
  }
  if (e.has_done()) {
    absl::MutexLock l(&mu_);
    job_done_ = true;
  }
  if (!e.has_step()) return;
  const v1::StepEvent& step = e.step();
  v1::Progress p;
  p.set_step(int64_t{step.step()} + 1);
  p.set_loss(step.loss());
  p.set_tokens_per_second(step.step_seconds() > 0 ? step.tokens() / step.step_seconds() : 0.0);
  p.set_plan_version(plan);
  const int64_t every = std::max<uint32_t>(1, job_.checkpoint_every_steps());
  if (p.step() % every == 0 || (step.has_dp() && step.dp().kind() == "outer")) keeper_->Checkpointed(p.step());
  ReportProgress(p);
  if (step.has_down_busy()) prober_->ObserveForwardLink(step.down_busy().bytes(), step.down_busy().seconds());
}

void PeerDaemonImpl::ReapChild() {
  child_.reset();
  absl::MutexLock l(&mu_);
  child_exit_.reset();
}

// SIGTERM, then SIGKILL after stop_grace; always reaps.
void PeerDaemonImpl::StopChild() {
  if (child_ == nullptr) return;
  const int64_t pid = child_->pid();
  const absl::Time start = absl::Now();
  if (child_->Stop(o_.stop_grace)) {
    AQSWARM_LOG(INFO) << "peer " << o_.name << ": stage pid " << pid << " stopped on SIGTERM in "
                      << absl::FormatDuration(absl::Now() - start);
  } else {
    AQSWARM_LOG(WARNING) << "peer " << o_.name << ": stage pid " << pid << " did not stop within the "
                         << absl::FormatDuration(o_.stop_grace) << " grace after SIGTERM: killed (SIGKILL)";
  }
  ReapChild();
  v1::PeerEvent e;
  e.mutable_stage_stopped();
  Event(e);
}

void PeerDaemonImpl::JoinThreads() {
  if (heartbeat_.joinable()) heartbeat_.join();
  if (watch_.joinable()) watch_.join();
  prober_.reset();
  if (keeper_ != nullptr) keeper_->Stop();
}

}  // namespace daemon


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
  // Plaintext only on loopback unless the operator said --insecure: the
  // StageLink, GradientExchange and StateTransfer servers (the last defaults
  // to --listen's host).
  for (const std::string& listen :
       {options.listen, options.exchange_listen,
        options.state_listen.empty() ? options.listen : options.state_listen}) {
    if (listen.empty()) continue;
    AQSWARM_RETURN_IF_ERROR(rpc::CheckListenSecurity(listen, options.tls.enabled(), options.insecure));
  }
  if (options.keep_checkpoints < 2) return absl::InvalidArgumentError("--keep_checkpoints must be >= 2");
  if (!(options.emulate_uplink_mbps >= 0 && options.emulate_uplink_mbps <= 1e6) ||
      (options.emulate_uplink_mbps > 0 && options.emulate_uplink_mbps < 0.001)) {
    return absl::InvalidArgumentError("--emulate_uplink_mbps must be 0 or in [0.001, 1000000]");
  }
  if (options.probe_bytes > kMaxProbeBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--probe_bytes must be at most ", kMaxProbeBytes));
  }
  if (options.tls.enabled() && options.tls.name.empty()) {
    return absl::InvalidArgumentError("TLS needs this peer's certificate name");
  }
  auto d = std::make_unique<daemon::PeerDaemonImpl>(options);
  AQSWARM_RETURN_IF_ERROR(d->Init());
  return std::unique_ptr<PeerDaemon>(std::move(d));
}

}  // namespace aqswarm::peer
