// `aqswarm bench swarmsim`: a swarm of N simulated peers under
// churn against the real coordinator: SwarmCoordinator behind its gRPC
// server on loopback, state in RocksDB (fsync'd, as deployed). The peers
// speak the real protocol over real sockets: Join, an assignment watch
// (WatchAssignment, callback API, one stream each), Heartbeat every lease/3,
// the link probes heartbeat answers ask for (ReportLinkProbe, with a seeded
// synthetic link of 10-400 Mbit/s), progress and held states from placed
// peers (ReportProgress), Leave. Only their training is simulated.
//
// Time: leases, join budgets and the peers' schedules run on a virtual clock
// (rpc::FakeClock) that moves by max(tick, the real time the tick took), so
// a coordinator that falls behind loses leases as it would live, and a fast
// one lets an hour of churn run in minutes. Latencies are real.
//
// Churn: the swarm first forms (N joins, paced by the coordinator's join
// budget), then for `virtual_seconds` departures and arrivals are Poisson:
// each live peer departs at `churn_per_peer_hour`, half of them killed (no
// Leave: the lease expires) and half leaving; arrivals come at the same
// total rate, so the swarm stays near N. Each membership change is measured
// on its own, from the call that makes it (Join, Leave, or the lease sweep
// that expires a killed peer) until every live peer's watch has delivered
// the new assignment version. The lease sweep also re-plans on measurements
// as the server's does (SwarmCoordinator::ImprovePlan, default interval,
// hold and gain threshold): `replans_on_measurements` counts those plans.
//   replan_seconds_p50/p99   that span (re-plan, commit, fan-out), real seconds
//   peers_moved_per_event    placed peers whose slot changed or who lost it
//   join_to_assignment_seconds_p99  Join sent -> the joiner's first assignment
//   heartbeat_p99_ms         Heartbeat latency, real
//   honest_leases_lost       live (not killed) peers the coordinator dropped
//   rss_mb                   this process's resident memory at the end
//                            (coordinator and simulated peers together)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/file_util.h"
#include "common/join_token.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/swarm_coordinator.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/channel.h"
#include "rpc/clock.h"

namespace aqswarm::bench {
namespace {

using SteadyClock = std::chrono::steady_clock;

double Since(SteadyClock::time_point t) { return std::chrono::duration<double>(SteadyClock::now() - t).count(); }

double ResidentMiB() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    double kib = 0;
    if (line.rfind("VmRSS:", 0) == 0 && absl::SimpleAtod(absl::StripAsciiWhitespace(line.substr(6, line.size() - 9)), &kib)) {
      return kib / 1024;
    }
  }
  return 0;
}

void Deadline(grpc::ClientContext* ctx, int seconds = 10) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

class Sim;

struct Slot {
  bool placed = false;
  uint32_t stage = 0, pipeline = 0;
  bool operator==(const Slot& o) const {
    return placed == o.placed && (!placed || (stage == o.stage && pipeline == o.pipeline));
  }
};

class Watch;

// One simulated peer. The driver thread owns everything but the fields the
// watch writes (marked), which Sim::mu_ guards.
struct SimPeer {
  int index = 0;  // in Sim::peers_
  std::string name;
  uint64_t id = 0;
  std::string session;
  enum class State { kWaiting, kLive, kGone } state = State::kWaiting;
  bool killed = false;       // gone without Leave: its lease runs out
  std::atomic<bool> departing{false};  // killed or leaving: its watch may end
  double next_heartbeat = 0;  // virtual seconds
  double next_progress = 0;
  SteadyClock::time_point join_sent;
  bool measured_join = false;  // its join happened after the swarm formed
  // Sim::mu_:
  uint64_t seen_version = 0;
  bool watching = false;
  bool first_seen = false;
  v1::Assignment last;
  std::unique_ptr<Watch> watch;
};

class Watch final : public grpc::ClientReadReactor<v1::Assignment> {
 public:
  Watch(Sim* sim, SimPeer* peer, v1::Coordinator::Stub* stub);
  void Cancel() { ctx_.TryCancel(); }
  // Returns once OnDone ran (the reactor may then be destroyed).
  void AwaitDone() {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(&done_));
  }
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& s) override;

 private:
  Sim* sim_;
  SimPeer* peer_;
  grpc::ClientContext ctx_;
  v1::WatchAssignmentRequest req_;
  v1::Assignment a_;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

class Sim {
 public:
  Sim(const SwarmsimOptions& o, int n) : o_(o), n_(n), rng_(o.seed * 1000003 + n) {}
  absl::Status Run(std::ostream& out);

  void Delivered(SimPeer* p, const v1::Assignment& a) {
    absl::MutexLock l(&mu_);
    p->seen_version = std::max(p->seen_version, a.version());
    p->last = a;
    if (!p->first_seen) {
      p->first_seen = true;
      if (p->measured_join) join_to_assignment_.push_back(Since(p->join_sent));
    }
  }
  void WatchEnded(SimPeer* p, const grpc::Status& s) {
    absl::MutexLock l(&mu_);
    p->watching = false;
    if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED && !p->departing) ++watch_errors_;
  }

 private:
  absl::Status Start();
  void Stop();
  double Now() const { return absl::ToDoubleSeconds(clock_.Now() - t0_); }
  v1::Coordinator::Stub* WatchStub(size_t index);
  absl::Status TryJoin(SimPeer* p, bool* throttled);
  absl::Status Depart(SimPeer* p, bool kill);
  // Blocks until every live, watching peer has seen `version` (or 60 s).
  bool AwaitDelivered(uint64_t version);
  std::map<uint64_t, Slot> Placement();
  void MeasureChange(SteadyClock::time_point from, const std::map<uint64_t, Slot>& before);
  void Heartbeats();
  void Progress();
  absl::Status Sweep();
  std::vector<SimPeer*> Live();

  const SwarmsimOptions& o_;
  const int n_;
  std::mt19937_64 rng_;
  rpc::FakeClock clock_;
  absl::Time t0_ = clock_.Now();
  std::string dir_;
  std::unique_ptr<coordinator::CoordinatorServer> server_;
  coordinator::SwarmCoordinator* coord_ = nullptr;
  std::string target_;
  std::string token_;
  std::unique_ptr<v1::Coordinator::Stub> control_;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> watch_stubs_;  // one connection per 32 watches
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> hb_stubs_;     // one per heartbeat thread
  std::vector<std::unique_ptr<SimPeer>> peers_;
  bool measuring_ = false;

  absl::Mutex mu_;
  std::vector<double> join_to_assignment_ ABSL_GUARDED_BY(mu_);
  int64_t watch_errors_ ABSL_GUARDED_BY(mu_) = 0;

  // Driver thread only.
  std::vector<double> replan_s_, heartbeat_ms_;
  std::vector<int> moved_;
  int64_t events_ = 0, joins_ = 0, leaves_ = 0, kills_ = 0, improvements_ = 0, undelivered_ = 0;
  int64_t honest_lost_ = 0, heartbeat_errors_ = 0, report_errors_ = 0, probes_ = 0, throttled_ = 0;
  std::string first_error_;
  std::map<uint64_t, std::pair<double, int64_t>> plan_start_;  // plan -> (virtual start, resume step)
};

Watch::Watch(Sim* sim, SimPeer* peer, v1::Coordinator::Stub* stub) : sim_(sim), peer_(peer) {
  req_.set_peer_id(peer->id);
  req_.set_session_token(peer->session);
  stub->async()->WatchAssignment(&ctx_, &req_, this);
  StartRead(&a_);
  StartCall();
}

void Watch::OnReadDone(bool ok) {
  if (!ok) return;  // OnDone follows
  sim_->Delivered(peer_, a_);
  StartRead(&a_);
}

void Watch::OnDone(const grpc::Status& s) {
  sim_->WatchEnded(peer_, s);
  absl::MutexLock l(&mu_);
  done_ = true;
}

absl::Status Sim::Start() {
  dir_ = absl::StrCat(o_.dir.empty() ? (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp") : o_.dir,
                      "/aqswarm-swarmsim-", getpid(), "-", n_);
  aqswarm::RemoveTree(dir_).IgnoreError();
  coordinator::SwarmCoordinatorOptions co;
  co.job.set_name("swarmsim");
  co.job.set_stages(o_.stages);
  co.job.set_data_parallel(o_.data_parallel);
  co.swarm_id = "swarmsim";
  AQSWARM_ASSIGN_OR_RETURN(co.join_secret, GenerateJoinSecret());
  co.lease = absl::Seconds(o_.lease_seconds);
  co.state.dir = dir_;
  co.state.sync = true;  // as deployed: every membership change fsync'd
  co.clock = &clock_;
  co.report_persist_interval = absl::ZeroDuration();  // the driver flushes once per tick
  const std::string secret = co.join_secret;
  AQSWARM_ASSIGN_OR_RETURN(auto coord, coordinator::SwarmCoordinator::Create(co));
  coordinator::CoordinatorServerOptions so;
  so.expiry_interval = absl::Hours(24);  // the driver sweeps leases itself, once per tick
  so.persist_interval = absl::Hours(24);
  AQSWARM_ASSIGN_OR_RETURN(server_, coordinator::CoordinatorServer::Start(std::move(coord), so));
  coord_ = server_->coordinator();
  target_ = absl::StrCat("127.0.0.1:", server_->port());
  AQSWARM_ASSIGN_OR_RETURN(token_, IssueJoinToken(secret, "swarmsim", kAnyPeer,
                                                  absl::ToUnixSeconds(clock_.Now()) + 100 * 24 * 3600));
  auto channel = [&] {
    rpc::ChannelPreset own = rpc::ControlChannel();
    own.own_connection = true;
    return *rpc::MakeChannel(target_, {}, own);
  };
  control_ = v1::Coordinator::NewStub(channel());
  for (int t = 0; t < o_.client_threads; ++t) hb_stubs_.push_back(v1::Coordinator::NewStub(channel()));
  return absl::OkStatus();
}

v1::Coordinator::Stub* Sim::WatchStub(size_t index) {
  while (watch_stubs_.size() <= index / 32) {
    rpc::ChannelPreset own = rpc::ControlChannel();
    own.own_connection = true;
    watch_stubs_.push_back(v1::Coordinator::NewStub(*rpc::MakeChannel(target_, {}, own)));
  }
  return watch_stubs_[index / 32].get();
}

std::vector<SimPeer*> Sim::Live() {
  std::vector<SimPeer*> live;
  for (auto& p : peers_) {
    if (p->state == SimPeer::State::kLive && !p->killed) live.push_back(p.get());
  }
  return live;
}

std::map<uint64_t, Slot> Sim::Placement() {
  std::map<uint64_t, Slot> out;
  absl::MutexLock l(&mu_);
  for (auto& p : peers_) {
    if (p->state != SimPeer::State::kLive || p->killed || !p->first_seen) continue;
    Slot s;
    s.placed = p->last.role() == v1::Assignment::STAGE;
    s.stage = p->last.stage();
    s.pipeline = p->last.pipeline();
    out[p->id] = s;
  }
  return out;
}

bool Sim::AwaitDelivered(uint64_t version) {
  std::vector<SimPeer*> live = Live();
  absl::MutexLock l(&mu_);
  auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (SimPeer* p : live) {
      if (p->watching && p->seen_version < version) return false;
    }
    return true;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(60));
}

void Sim::MeasureChange(SteadyClock::time_point from, const std::map<uint64_t, Slot>& before) {
  const uint64_t version = coord_->AwaitVersionAbove(0, absl::ZeroDuration());  // the published version
  if (!AwaitDelivered(version)) ++undelivered_;
  if (!measuring_) return;
  ++events_;
  replan_s_.push_back(Since(from));
  const std::map<uint64_t, Slot> after = Placement();
  int moved = 0;
  for (const auto& [id, slot] : before) {
    auto it = after.find(id);
    if (slot.placed && it != after.end() && !(it->second == slot)) ++moved;
  }
  moved_.push_back(moved);
}

absl::Status Sim::TryJoin(SimPeer* p, bool* throttled) {
  *throttled = false;
  v1::JoinRequest req;
  req.set_peer_name(p->name);
  req.set_join_token(token_);
  const int i = p->index;
  req.set_stage_link_address(absl::StrCat("10.", i / 65536 % 256, ".", i / 256 % 256, ".", i % 256, ":7001"));
  req.set_state_transfer_address(absl::StrCat("10.", i / 65536 % 256, ".", i / 256 % 256, ".", i % 256, ":7002"));
  // Compute spread over 2x (volunteer GPUs differ).
  std::uniform_real_distribution<double> speed(0.01, 0.02);
  req.set_seconds_per_layer(speed(rng_));
  v1::JoinResponse resp;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  const std::map<uint64_t, Slot> before = Placement();
  p->join_sent = SteadyClock::now();
  p->measured_join = measuring_;
  grpc::Status s = control_->Join(&ctx, req, &resp);
  if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
    *throttled = true;
    return absl::OkStatus();
  }
  if (!s.ok()) return absl::InternalError(absl::StrCat("join of ", p->name, ": ", s.error_message()));
  p->id = resp.peer_id();
  p->session = resp.session_token();
  p->state = SimPeer::State::kLive;
  std::uniform_real_distribution<double> phase(0, o_.lease_seconds / 3);
  p->next_heartbeat = Now() + phase(rng_);
  p->next_progress = Now() + 5 * phase(rng_) / (o_.lease_seconds / 3);
  {
    absl::MutexLock l(&mu_);
    p->watching = true;
  }
  p->watch = std::make_unique<Watch>(this, p, WatchStub(p->index));
  ++joins_;
  MeasureChange(p->join_sent, before);
  return absl::OkStatus();
}

absl::Status Sim::Depart(SimPeer* p, bool kill) {
  p->departing = true;
  if (kill) {
    // Its process is gone: no Leave, no more heartbeats; its watch's
    // connection drops. The lease sweep finds it (Sweep measures that).
    p->killed = true;
    p->watch->Cancel();
    ++kills_;
    return absl::OkStatus();
  }
  const std::map<uint64_t, Slot> before = Placement();
  const SteadyClock::time_point from = SteadyClock::now();
  v1::LeaveRequest req;
  req.set_peer_id(p->id);
  req.set_session_token(p->session);
  v1::LeaveResponse resp;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status s = control_->Leave(&ctx, req, &resp);
  if (!s.ok()) return absl::InternalError(absl::StrCat("leave of ", p->name, ": ", s.error_message()));
  p->state = SimPeer::State::kGone;
  p->watch->Cancel();
  ++leaves_;
  MeasureChange(from, before);
  return absl::OkStatus();
}

void Sim::Heartbeats() {
  const double now = Now();
  std::vector<SimPeer*> due;
  for (SimPeer* p : Live()) {
    if (p->next_heartbeat <= now) due.push_back(p);
  }
  const int threads = std::max(1, std::min<int>(o_.client_threads, due.size()));
  struct Result {
    std::vector<double> ms;
    std::vector<SimPeer*> lost;
    int64_t errors = 0, probes = 0;
    std::string first_error;
  };
  std::vector<Result> results(threads);
  std::vector<std::thread> workers;
  const uint64_t seed = o_.seed;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      Result& r = results[t];
      v1::Coordinator::Stub* stub = hb_stubs_[t].get();
      for (size_t i = t; i < due.size(); i += threads) {
        SimPeer* p = due[i];
        v1::HeartbeatRequest req;
        req.set_peer_id(p->id);
        req.set_session_token(p->session);
        v1::HeartbeatResponse resp;
        grpc::ClientContext ctx;
        Deadline(&ctx, 5);
        const SteadyClock::time_point sent = SteadyClock::now();
        grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
        if (!s.ok()) {
          ++r.errors;
          if (s.error_code() == grpc::StatusCode::NOT_FOUND) r.lost.push_back(p);
          if (r.first_error.empty()) r.first_error = absl::StrCat("heartbeat: ", s.error_message());
          continue;
        }
        r.ms.push_back(Since(sent) * 1000);
        for (const v1::Neighbor& to : resp.probe()) {
          // A seeded link per ordered pair: 10-400 Mbit/s, 5-150 ms.
          std::mt19937_64 link(seed ^ (p->id * 0x9e3779b97f4a7c15ULL) ^ (to.peer_id() * 0xc2b2ae3d27d4eb4fULL));
          const double mbit = 10 * std::pow(40.0, std::uniform_real_distribution<double>(0, 1)(link));
          v1::LinkProbeReport probe;
          probe.set_peer_id(p->id);
          probe.set_session_token(p->session);
          probe.set_to_peer_id(to.peer_id());
          probe.set_bandwidth_bytes_per_second(mbit * 125000);
          probe.set_rtt_seconds(std::uniform_real_distribution<double>(0.005, 0.150)(link));
          v1::ReportResponse pr;
          grpc::ClientContext pctx;
          Deadline(&pctx, 5);
          grpc::Status ps = stub->ReportLinkProbe(&pctx, probe, &pr);
          ++r.probes;
          if (!ps.ok() && r.first_error.empty()) r.first_error = absl::StrCat("probe: ", ps.error_message());
        }
      }
    });
  }
  for (auto& w : workers) w.join();
  for (SimPeer* p : due) p->next_heartbeat += o_.lease_seconds / 3;
  for (Result& r : results) {
    heartbeat_ms_.insert(heartbeat_ms_.end(), r.ms.begin(), r.ms.end());
    heartbeat_errors_ += r.errors;
    probes_ += r.probes;
    if (first_error_.empty()) first_error_ = r.first_error;
    for (SimPeer* p : r.lost) {
      // The coordinator dropped a peer that kept its schedule.
      ++honest_lost_;
      p->departing = true;
      p->state = SimPeer::State::kGone;
      p->watch->Cancel();
    }
  }
}

void Sim::Progress() {
  // Placed peers train 1 step per virtual second from their plan's resume
  // step, checkpoint every 10 steps and report every 5 s what they hold.
  const double now = Now();
  for (SimPeer* p : Live()) {
    if (p->next_progress > now) continue;
    p->next_progress += 5;
    v1::Assignment a;
    {
      absl::MutexLock l(&mu_);
      a = p->last;
    }
    if (a.role() != v1::Assignment::STAGE) continue;
    auto [it, fresh] = plan_start_.try_emplace(a.plan_version(), now, a.resume_step());
    const int64_t step = it->second.second + static_cast<int64_t>(now - it->second.first);
    const int64_t checkpoint = step / 10 * 10;
    v1::ProgressReport req;
    req.set_peer_id(p->id);
    req.set_session_token(p->session);
    req.mutable_progress()->set_step(step);
    req.mutable_progress()->set_plan_version(a.plan_version());
    req.mutable_progress()->set_loss(10.0 / (1 + step / 100.0));
    if (checkpoint > 0) {
      // It keeps its newest 4 states (as a daemon's --keep_checkpoints does).
      req.set_checkpoint_step(checkpoint);
      req.set_has_held(true);
      v1::StageCheckpoints* h = req.add_held();
      h->set_stage(a.stage());
      for (int64_t kept = std::max<int64_t>(10, checkpoint - 30); kept <= checkpoint; kept += 10) {
        v1::HeldState& state = *h->add_states();
        state.set_step(kept);
        state.set_sha256(Sha256Hex(absl::StrCat("stage ", a.stage(), " step ", kept)));
      }
    }
    v1::ReportResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx, 5);
    grpc::Status s = control_->ReportProgress(&ctx, req, &resp);
    if (!s.ok()) {
      // A report racing a re-plan is refused (stale plan): not an error of the coordinator.
      if (s.error_code() != grpc::StatusCode::FAILED_PRECONDITION) {
        ++report_errors_;
        if (first_error_.empty()) first_error_ = absl::StrCat("progress: ", s.error_message());
      }
    }
  }
}

absl::Status Sim::Sweep() {
  const std::map<uint64_t, Slot> before = Placement();
  const SteadyClock::time_point from = SteadyClock::now();
  AQSWARM_ASSIGN_OR_RETURN(std::vector<uint64_t> expired, coord_->ExpireLeases());
  AQSWARM_RETURN_IF_ERROR(coord_->FlushReports());
  if (expired.empty()) {
    // As the server's sweep does: a re-plan on measurements when it pays.
    AQSWARM_ASSIGN_OR_RETURN(const bool improved, coord_->ImprovePlan());
    if (improved) {
      ++improvements_;
      MeasureChange(from, before);
    }
    return absl::OkStatus();
  }
  for (uint64_t id : expired) {
    for (auto& p : peers_) {
      if (p->id != id || p->state != SimPeer::State::kLive) continue;
      if (!p->killed) {
        ++honest_lost_;
        p->departing = true;
        p->watch->Cancel();
      }
      p->state = SimPeer::State::kGone;
    }
  }
  MeasureChange(from, before);
  return absl::OkStatus();
}

void Sim::Stop() {
  for (auto& p : peers_) {
    if (p->watch != nullptr) p->watch->Cancel();
  }
  for (auto& p : peers_) {
    if (p->watch != nullptr) p->watch->AwaitDone();
  }
  if (server_ != nullptr) server_->Shutdown();
  server_.reset();
  aqswarm::RemoveTree(dir_).IgnoreError();
}

absl::Status Sim::Run(std::ostream& out) {
  absl::Status started = Start();
  if (!started.ok()) {
    Stop();
    return started;
  }
  const SteadyClock::time_point wall0 = SteadyClock::now();
  std::vector<SimPeer*> waiting;
  auto add_peer = [&] {
    peers_.push_back(std::make_unique<SimPeer>());
    peers_.back()->index = static_cast<int>(peers_.size() - 1);
    peers_.back()->name = absl::StrCat("sim-", peers_.size() - 1);
    waiting.push_back(peers_.back().get());
  };
  for (int i = 0; i < n_; ++i) add_peer();
  const double rate = o_.churn_per_peer_hour / 3600;  // departures per live peer per virtual second
  double formed_at = -1, end_at = -1;
  double last_tick = o_.tick_seconds;  // virtual seconds the previous tick took
  absl::Status result;
  while (result.ok()) {
    const SteadyClock::time_point tick_start = SteadyClock::now();
    const double now = Now();
    if (formed_at < 0 && waiting.empty()) {
      formed_at = now;
      end_at = now + o_.virtual_seconds;
      measuring_ = true;
    }
    if (end_at >= 0 && now >= end_at) break;
    if (measuring_) {
      // Departures, then arrivals at the same total rate.
      std::vector<SimPeer*> live = Live();
      std::poisson_distribution<int> departures(live.size() * rate * last_tick);
      for (int k = departures(rng_); k > 0 && !live.empty() && result.ok(); --k) {
        const size_t pick = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng_);
        SimPeer* p = live[pick];
        live.erase(live.begin() + pick);
        result = Depart(p, std::bernoulli_distribution(o_.kill_fraction)(rng_));
      }
      std::poisson_distribution<int> arrivals(n_ * rate * last_tick);
      for (int k = arrivals(rng_); k > 0; --k) add_peer();
    }
    // Joins in arrival order until the join budget says wait.
    while (result.ok() && !waiting.empty()) {
      bool throttled = false;
      result = TryJoin(waiting.front(), &throttled);
      if (throttled) {
        ++throttled_;
        break;
      }
      waiting.erase(waiting.begin());
    }
    if (!result.ok()) break;
    // Watches that ended under a live peer re-open (as a daemon's would).
    for (size_t i = 0; i < peers_.size(); ++i) {
      SimPeer* p = peers_[i].get();
      if (p->state != SimPeer::State::kLive || p->killed) continue;
      {
        absl::MutexLock l(&mu_);
        if (p->watching) continue;
        p->watching = true;
      }
      p->watch->AwaitDone();
      p->watch = std::make_unique<Watch>(this, p, WatchStub(i));
    }
    Heartbeats();
    Progress();
    result = Sweep();
    // Virtual time moves by the tick, or by the real time the tick took.
    last_tick = std::max(o_.tick_seconds, Since(tick_start));
    clock_.Advance(absl::Seconds(last_tick));
  }
  const double wall = Since(wall0);
  const size_t live_at_end = Live().size();
  const double rss = ResidentMiB();
  int64_t watch_errors;
  std::vector<double> joins;
  {
    absl::MutexLock l(&mu_);
    watch_errors = watch_errors_;
    joins = join_to_assignment_;
  }
  // Honest peers the coordinator no longer lists.
  const v1::StatusResponse status = coord_->GetStatus();
  std::set<uint64_t> listed;
  for (const auto& p : status.peers()) listed.insert(p.peer_id());
  int64_t missing = 0;
  for (SimPeer* p : Live()) missing += listed.count(p->id) == 0;
  Stop();
  if (!result.ok()) return result;
  double moved_mean = 0;
  for (int m : moved_) moved_mean += m;
  moved_mean /= std::max<size_t>(1, moved_.size());
  const int moved_max = moved_.empty() ? 0 : *std::max_element(moved_.begin(), moved_.end());
  out << absl::StrFormat(
      "{\"bench\":\"swarmsim\",\"peers\":%d,\"grid\":\"%dx%d\",\"lease_s\":%g,\"churn_per_peer_hour\":%g,"
      "\"kill_fraction\":%g,\"seed\":%d,\"formed_virtual_s\":%.1f,\"virtual_seconds\":%g,\"wall_seconds\":%.1f,"
      "\"live_at_end\":%d,\"events\":%d,\"joins\":%d,\"leaves\":%d,\"kills\":%d,\"replans_on_measurements\":%d,"
      "\"replan_seconds_p50\":%.4f,"
      "\"replan_seconds_p99\":%.4f,\"replan_seconds_max\":%.4f,\"peers_moved_per_event\":%.3f,"
      "\"peers_moved_max\":%d,\"join_to_assignment_seconds_p99\":%.4f,\"joins_throttled\":%d,"
      "\"heartbeats\":%d,\"heartbeat_p50_ms\":%.3f,\"heartbeat_p99_ms\":%.3f,\"heartbeat_errors\":%d,"
      "\"probes\":%d,\"report_errors\":%d,\"watch_errors\":%d,\"undelivered\":%d,\"honest_leases_lost\":%d,"
      "\"rss_mb\":%.0f}\n",
      n_, o_.stages, o_.data_parallel, o_.lease_seconds, o_.churn_per_peer_hour, o_.kill_fraction, o_.seed,
      formed_at, o_.virtual_seconds, wall, live_at_end, events_, joins_, leaves_, kills_, improvements_,
      Percentile(replan_s_, 0.5),
      Percentile(replan_s_, 0.99), replan_s_.empty() ? 0 : *std::max_element(replan_s_.begin(), replan_s_.end()),
      moved_mean, moved_max, Percentile(joins, 0.99), throttled_, heartbeat_ms_.size(),
      Percentile(heartbeat_ms_, 0.5), Percentile(heartbeat_ms_, 0.99), heartbeat_errors_, probes_, report_errors_,
      watch_errors, undelivered_, honest_lost_ + missing, rss);
  if (!first_error_.empty()) out << "  first error: " << first_error_ << "\n";
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSwarmsimBench(const SwarmsimOptions& options, std::ostream& out) {
  if (options.virtual_seconds <= 0 || options.virtual_seconds > 30 * 24 * 3600) {
    return absl::InvalidArgumentError("swarmsim: virtual seconds must be in (0, 30 days]");
  }
  if (options.tick_seconds <= 0 || options.tick_seconds > options.lease_seconds / 3) {
    return absl::InvalidArgumentError("swarmsim: the tick must be in (0, lease/3]");
  }
  if (options.churn_per_peer_hour < 0 || options.churn_per_peer_hour > 3600) {
    return absl::InvalidArgumentError("swarmsim: churn per peer-hour must be in [0, 3600]");
  }
  if (options.kill_fraction < 0 || options.kill_fraction > 1) {
    return absl::InvalidArgumentError("swarmsim: the kill fraction must be in [0, 1]");
  }
  if (options.stages < 1 || options.data_parallel < 1 || options.stages * options.data_parallel > 4096) {
    return absl::InvalidArgumentError("swarmsim: the grid must have 1..4096 slots");
  }
  if (options.client_threads < 1 || options.client_threads > 64) {
    return absl::InvalidArgumentError("swarmsim: client threads must be in [1, 64]");
  }
  std::vector<int> sizes;
  for (absl::string_view s : absl::StrSplit(options.sizes, ',', absl::SkipEmpty())) {
    int n;
    if (!absl::SimpleAtoi(s, &n) || n < 1 || n > 10000) {
      return absl::InvalidArgumentError(absl::StrCat("swarmsim: bad peer count '", s, "' (1..10000)"));
    }
    sizes.push_back(n);
  }
  if (sizes.empty()) return absl::InvalidArgumentError("swarmsim: no peer counts");
  for (int n : sizes) {
    Sim sim(options, n);
    AQSWARM_RETURN_IF_ERROR(sim.Run(out));
    out.flush();
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::bench
