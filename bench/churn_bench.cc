// `aqswarm bench churn`: what peer losses cost a real swarm on this machine.
//
// Two runs of the same job, one after the other, each from scratch: a real
// `aqswarm coordinator` and P x K + S real `aqswarm peer` daemons (each
// running its stage as a child process) on 127.0.0.1. After a warm-up
// (grid complete, `warmup_steps` trained) each run is measured for
// `seconds`: "undisturbed" as is, "churn" with a random placed peer
// SIGKILLed at Poisson times (mean gap `kill_every_s`) and a fresh peer
// started for each (so the standbys stay S). The bench polls Status and
// reads every daemon's event lines as they come (timestamped on arrival,
// at the poll interval's resolution).
//
// Per run, one JSON line (see RunChurnBench in bench.h for the fields).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <limits>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/certs.h"
#include "common/file_util.h"
#include "common/join_token.h"
#include "common/ports.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "proto/coordinator.grpc.pb.h"
#include "proto/event_json.h"

namespace aqswarm::bench {
namespace {

namespace fs = std::filesystem;

constexpr absl::Duration kPoll = absl::Milliseconds(250);

struct Peer {
  std::string name;
  std::unique_ptr<Subprocess> process;
  bool killed = false;
  std::optional<absl::Time> stage_started;  // its latest stage child
  int64_t resume_step = 0;                  // of its latest assignment: the state its next stage loads
  std::unique_ptr<std::ofstream> events;    // <run dir>/<name>.out: every event line it printed
};

struct StepSeen {
  absl::Time at;
  absl::Time stage_started;  // of the stage child that reported it
  int pipeline = 0;
  int stage = 0;
  int64_t step = 0;
  double loss = 0;
};

struct Kill {
  absl::Time at;
  double progress = 0;  // the swarm's progress (Progress()) when it happened
  int pipeline = 0;        // the killed peer's
  std::string peer;
};

struct RunResult {
  std::string name;
  double seconds = 0;
  // The swarm's progress over the measurement: the mean over pipelines of
  // the steps their last stage has completed on its current timeline (a
  // rollback lowers it), at the end less at the start.
  double steps = 0;
  double end_progress = 0;
  int64_t steps_skipped = 0;  // by healing last stages: progress does not count them
  std::vector<StepSeen> steps_seen;
  std::map<int64_t, std::vector<double>> val_losses;  // step -> the last stages' eval losses
  std::vector<Kill> kills;
  absl::Time start, end;
  double steps_per_s() const { return seconds > 0 ? steps / seconds : 0; }
};

class ChurnRun {
 public:
  ChurnRun(const ChurnBenchOptions& o, std::string name, fs::path dir, bool kills, const std::string& job_name,
           int num_stages, int num_pipelines)
      : o_(o), dir_(std::move(dir)), kills_(kills), job_name_(job_name), num_stages_(num_stages),
        num_pipelines_(num_pipelines) {
    result_.name = std::move(name);
    rng_.seed(static_cast<uint32_t>(o.seed));
  }

  absl::StatusOr<RunResult> Run() {
    fs::create_directories(dir_);
    AQSWARM_RETURN_IF_ERROR(StartCoordinator());
    AQSWARM_ASSIGN_OR_RETURN(const std::string secret, LoadJoinSecret((dir_ / "coord" / kJoinSecretFile).string()));
    AQSWARM_ASSIGN_OR_RETURN(token_, IssueJoinToken(secret, job_name_, kAnyPeer, absl::ToUnixSeconds(absl::Now()) + 86400));
    AQSWARM_ASSIGN_OR_RETURN(const v1::StatusResponse first, Status());
    const int placed = static_cast<int>(first.num_stages() * first.num_pipelines());
    for (int i = 0; i < placed + o_.standbys; ++i) AQSWARM_RETURN_IF_ERROR(StartPeer());

    // Warm-up: the grid formed and trained a few steps.
    const absl::Time warm_deadline = absl::Now() + absl::Seconds(o_.warmup_timeout_s);
    v1::StatusResponse st;
    while (true) {
      AQSWARM_ASSIGN_OR_RETURN(st, Poll());
      if (st.grid_complete() && st.step() >= o_.warmup_steps) break;
      if (absl::Now() > warm_deadline) {
        return absl::DeadlineExceededError(absl::StrCat(result_.name, ": the swarm did not train ", o_.warmup_steps,
                                                        " steps within ", o_.warmup_timeout_s, " s; see ",
                                                        dir_.string()));
      }
      absl::SleepFor(kPoll);  // poll interval
    }
    result_.start = absl::Now();
    const double start_progress = Progress();
    const absl::Time end = result_.start + absl::Seconds(o_.seconds);
    std::exponential_distribution<double> gap(1.0 / std::max(1e-3, o_.kill_every_s));
    absl::Time next_kill = result_.start + absl::Seconds(gap(rng_));
    while (absl::Now() < end) {
      AQSWARM_ASSIGN_OR_RETURN(st, Poll());
      if (kills_ && absl::Now() >= next_kill) {
        AQSWARM_RETURN_IF_ERROR(KillOne(st));
        next_kill += absl::Seconds(gap(rng_));
      }
      absl::SleepFor(kPoll);  // poll interval
    }
    result_.end = absl::Now();
    result_.seconds = absl::ToDoubleSeconds(result_.end - result_.start);
    result_.end_progress = Progress();
    result_.steps = result_.end_progress - start_progress;
    for (auto& p : peers_) p.process.reset();  // SIGKILL + reap (stages die with their daemons)
    coordinator_.reset();
    return std::move(result_);
  }

 private:
  absl::Status StartCoordinator() {
    std::vector<std::string> argv = {SelfExecutable(), "coordinator", "--job=" + o_.job, "--listen=127.0.0.1:0",
                                     "--state_dir=" + (dir_ / "coord").string(),
                                     absl::StrCat("--lease_s=", o_.lease_s),
                                     absl::StrCat("--fault_domains=", o_.fault_domains ? "true" : "false")};
    AQSWARM_ASSIGN_OR_RETURN(coordinator_,
                             Subprocess::Spawn(argv, {.capture_stdout = true,
                                                      .stderr_path = (dir_ / "coordinator.err").string()}));
    std::string line;
    AQSWARM_RETURN_IF_ERROR(coordinator_->ReadLine(&line, absl::Seconds(60)));
    absl::StatusOr<v1::CoordinatorEvent> e = events::ParseCoordinatorEvent(line);
    if (!e.ok() || !e->has_listening()) {
      return absl::InternalError(absl::StrCat("the coordinator did not start: '", line, "'; see ",
                                              (dir_ / "coordinator.err").string()));
    }
    coordinator_port_ = static_cast<int>(e->listening().port());
    stub_ = v1::Coordinator::NewStub(grpc::CreateChannel(Target(), grpc::InsecureChannelCredentials()));
    return absl::OkStatus();
  }

  absl::Status StartPeer() {
    Peer p;
    p.name = absl::StrCat("p", ++peer_count_);
    const int listen = FreeLoopbackPort(ports_);
    ports_.insert(listen);
    const int exchange = FreeLoopbackPort(ports_);
    ports_.insert(exchange);
    std::vector<std::string> argv = {SelfExecutable(), "peer", "--coordinator=" + Target(), "--join_token=" + token_,
                                     "--name=" + p.name, absl::StrCat("--listen=127.0.0.1:", listen),
                                     absl::StrCat("--exchange_listen=127.0.0.1:", exchange),
                                     "--work_dir=" + (dir_ / p.name).string(),
                                     absl::StrCat("--link_timeout_s=", o_.link_timeout_s)};
    AQSWARM_ASSIGN_OR_RETURN(p.process, Subprocess::Spawn(argv, {.capture_stdout = true,
                                                                 .stderr_path = (dir_ / (p.name + ".err")).string()}));
    p.events = std::make_unique<std::ofstream>(dir_ / (p.name + ".out"));
    peers_.push_back(std::move(p));
    return absl::OkStatus();
  }

  std::string Target() const { return absl::StrCat("127.0.0.1:", coordinator_port_); }

  double Progress() const {
    double sum = 0;
    for (const auto& [pipeline, done] : completed_) {
      const auto skipped = skipped_.find(pipeline);
      sum += static_cast<double>(done - (skipped == skipped_.end() ? 0 : skipped->second));
    }
    return sum / num_pipelines_;
  }

  absl::StatusOr<v1::StatusResponse> Status() {
    v1::StatusResponse st;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Status s = stub_->Status(&ctx, v1::StatusRequest(), &st);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("Status: ", s.error_message()));
    return st;
  }

  // Reads the daemons' new event lines, then Status.
  absl::StatusOr<v1::StatusResponse> Poll() {
    const absl::Time now = absl::Now();
    for (Peer& p : peers_) {
      std::vector<std::string> lines;
      (void)p.process->DrainLines(&lines);  // a killed daemon's pipe ends: what it printed is read
      for (const std::string& line : lines) {
        *p.events << line << "\n";
        absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
        if (!e.ok()) continue;
        if (e->has_assignment()) p.resume_step = e->assignment().resume_step();
        if (e->has_stage_started()) {
          p.stage_started = now;
          // A healing pipeline (--fault_domains) starts past the state it
          // loads: the steps between were skipped, not trained.
          const v1::StageStartedEvent& started = e->stage_started();
          if (static_cast<int>(started.stage()) == num_stages_ - 1 && started.start_step() > p.resume_step) {
            skipped_[started.pipeline()] += started.start_step() - p.resume_step;
            result_.steps_skipped += started.start_step() - p.resume_step;
          }
        }
        if (!e->has_stage()) continue;
        if (e->stage().has_step()) {
          const v1::StepEvent& s = e->stage().step();
          result_.steps_seen.push_back({now, p.stage_started.value_or(absl::InfinitePast()),
                                        static_cast<int>(s.pipeline()), static_cast<int>(s.stage()),
                                        static_cast<int64_t>(s.step()), s.loss()});
          if (static_cast<int>(s.stage()) == num_stages_ - 1) {
            int64_t& done = completed_[s.pipeline()];
            if (int64_t{s.step()} + 1 < done) skipped_.erase(s.pipeline());  // rolled back: below what it skipped
            done = int64_t{s.step()} + 1;
          }
        }
        if (e->stage().has_eval() && static_cast<int>(e->stage().eval().stage()) == num_stages_ - 1 &&
            !e->stage().eval().val_loss_not_finite()) {
          result_.val_losses[e->stage().eval().step()].push_back(e->stage().eval().val_loss());
        }
      }
    }
    return Status();
  }

  absl::Status KillOne(const v1::StatusResponse& st) {
    std::vector<const v1::PeerStatus*> placed;
    for (const v1::PeerStatus& p : st.peers()) {
      if (p.state() == v1::PeerStatus::ACTIVE) placed.push_back(&p);
    }
    if (placed.empty()) return absl::OkStatus();  // the grid is still re-forming: the next gap
    const v1::PeerStatus& victim = *placed[std::uniform_int_distribution<size_t>(0, placed.size() - 1)(rng_)];
    for (Peer& p : peers_) {
      if (p.name != victim.peer_name() || p.killed) continue;
      p.process->Signal(SIGKILL);  // its stage dies with it (--die_with_parent)
      p.killed = true;
      result_.kills.push_back({absl::Now(), Progress(), victim.pipeline(), p.name});
      return StartPeer();  // a fresh peer arrives for each loss
    }
    return absl::OkStatus();
  }

  const ChurnBenchOptions& o_;
  const fs::path dir_;
  const bool kills_;
  const std::string job_name_;
  const int num_stages_;
  const int num_pipelines_;
  std::mt19937_64 rng_;
  std::unique_ptr<Subprocess> coordinator_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  int coordinator_port_ = 0;
  std::string token_;
  std::vector<Peer> peers_;
  std::set<int> ports_;
  int peer_count_ = 0;
  std::map<uint32_t, int64_t> completed_;  // pipeline -> steps its last stage completed (current timeline)
  std::map<uint32_t, int64_t> skipped_;    // pipeline -> steps of it a heal skipped (not trained) since

  RunResult result_;
};

// Steps each pipeline redid: a last-stage step event at or below the
// highest that pipeline's last stage had reported. Counted as healthy when
// the pipeline is not the one the latest kill before it hit.
int64_t HealthyStepsRedone(const RunResult& r, int num_stages) {
  std::map<int, int64_t> highest;
  int64_t redone = 0;
  size_t k = 0;
  std::optional<int> hit;
  for (const StepSeen& s : r.steps_seen) {
    while (k < r.kills.size() && r.kills[k].at <= s.at) hit = r.kills[k++].pipeline;
    if (s.stage != num_stages - 1) continue;
    auto [it, fresh] = highest.try_emplace(s.pipeline, s.step);
    if (fresh) continue;
    if (s.step <= it->second && (!hit.has_value() || *hit != s.pipeline)) ++redone;
    it->second = std::max(it->second, s.step);
  }
  return redone;
}

// Per kill: seconds until the hit pipeline reported a step from a stage
// child started after the kill (its new or restarted stages train again).
std::vector<double> AffectedRecoverySeconds(const RunResult& r) {
  std::vector<double> out;
  for (const Kill& k : r.kills) {
    for (const StepSeen& s : r.steps_seen) {
      if (s.at > k.at && s.pipeline == k.pipeline && s.stage_started > k.at) {
        out.push_back(absl::ToDoubleSeconds(s.at - k.at));
        break;
      }
    }
  }
  return out;
}

// The mean of the last stages' losses at `step` (evals: val losses; else
// training losses of the steps in (step - 4, step]).
std::optional<double> LossAt(const RunResult& r, int64_t step, bool val, int num_stages) {
  std::vector<double> v;
  if (val) {
    auto it = r.val_losses.find(step);
    if (it != r.val_losses.end()) v = it->second;
  } else {
    for (const StepSeen& s : r.steps_seen) {
      if (s.stage == num_stages - 1 && s.step > step - 4 && s.step <= step) v.push_back(s.loss);
    }
  }
  if (v.empty()) return std::nullopt;
  double sum = 0;
  for (double x : v) sum += x;
  return sum / static_cast<double>(v.size());
}

nlohmann::json Spread(const std::vector<double>& v) {
  return {{"n", v.size()}, {"p50", Percentile(v, 0.5)}, {"p99", Percentile(v, 0.99)}};
}

}  // namespace

absl::Status RunChurnBench(const ChurnBenchOptions& options, std::ostream& out) {
  if (options.job.empty()) return absl::InvalidArgumentError("--job is required");
  if (!(options.seconds >= 1 && options.seconds <= 86400)) {
    return absl::InvalidArgumentError("--churn_seconds must be in [1, 86400]");
  }
  if (!(options.kill_every_s >= 1)) return absl::InvalidArgumentError("--kill_every_s must be at least 1");
  if (options.standbys < 0 || options.standbys > 64) return absl::InvalidArgumentError("--standbys must be in [0, 64]");
  if (!(options.lease_s >= 1 && options.lease_s <= 600)) return absl::InvalidArgumentError("--lease_s must be in [1, 600]");
  std::ifstream in(options.job);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the job '", options.job, "'"));
  const nlohmann::json job = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (job.is_discarded() || !job.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("'", options.job, "' is not a JSON job"));
  }
  const std::string job_name = job.value("name", std::string());
  const int stages = job.value("stages", 1), pipelines = job.value("dataParallel", 1);
  if (job_name.empty() || stages < 2 || pipelines < 2) {
    return absl::InvalidArgumentError(absl::StrCat("'", options.job, "' needs a name, stages >= 2 and dataParallel >= 2 ",
                                                   "(a grid whose pipelines can lose a peer each)"));
  }
  std::string root = options.out_dir;
  if (root.empty()) {
    AQSWARM_ASSIGN_OR_RETURN(root, MakeTempDir("", "aqswarm-churn-"));
  }
  std::vector<RunResult> runs;
  for (const auto& [name, kills] : {std::pair<const char*, bool>{"undisturbed", false}, {"churn", true}}) {
    ChurnRun run(options, name, fs::path(root) / name, kills, job_name, stages, pipelines);
    AQSWARM_ASSIGN_OR_RETURN(RunResult r, run.Run());
    runs.push_back(std::move(r));
  }
  const RunResult& base = runs[0];
  const double base_rate = base.steps_per_s();
  // Equal steps for the loss comparison: the newest eval both runs have,
  // else the fewer steps either reached.
  std::optional<int64_t> eval_step;
  for (auto it = base.val_losses.rbegin(); it != base.val_losses.rend() && !eval_step; ++it) {
    if (runs[1].val_losses.count(it->first)) eval_step = it->first;
  }
  int64_t train_step = std::numeric_limits<int64_t>::max();
  for (const RunResult& r : runs) {
    int64_t top = 0;
    for (const StepSeen& s : r.steps_seen) top = std::max(top, s.step);
    train_step = std::min(train_step, top);
  }
  const int64_t at = eval_step.value_or(train_step);
  const std::optional<double> base_loss = LossAt(base, at, eval_step.has_value(), stages);
  for (const RunResult& r : runs) {
    // Per kill, over the time until the next (or the end): the seconds the
    // swarm would have needed at the undisturbed rate for the progress it
    // did not make.
    std::vector<double> lost;
    for (size_t i = 0; i < r.kills.size(); ++i) {
      const bool last = i + 1 == r.kills.size();
      const absl::Time until = last ? r.end : r.kills[i + 1].at;
      const double made = (last ? r.end_progress : r.kills[i + 1].progress) - r.kills[i].progress;
      const double window = absl::ToDoubleSeconds(until - r.kills[i].at);
      lost.push_back(base_rate > 0 ? std::clamp(window - made / base_rate, 0.0, window) : 0.0);
    }
    const std::optional<double> loss = LossAt(r, at, eval_step.has_value(), stages);
    nlohmann::json row = {{"bench", "churn"},
                          {"run", r.name},
                          {"grid", absl::StrCat(stages, "x", pipelines)},
                          {"standbys", options.standbys},
                          {"lease_s", options.lease_s},
                          {"fault_domains", options.fault_domains},
                          {"kill_every_s", r.kills.empty() ? 0.0 : options.kill_every_s},
                          {"seconds", r.seconds},
                          {"events", r.kills.size()},
                          {"steps", r.steps},
                          {"steps_per_s", r.steps_per_s()},
                          {"throughput_ratio_vs_undisturbed", base_rate > 0 ? r.steps_per_s() / base_rate : 0},
                          {"swarm_seconds_lost_per_event", Spread(lost)},
                          {"healthy_steps_redone", HealthyStepsRedone(r, stages)},
                          {"steps_skipped", r.steps_skipped},
                          {"affected_pipeline_recovery_s", Spread(AffectedRecoverySeconds(r))},
                          {"loss_kind", eval_step.has_value() ? "val" : "train"},
                          {"loss_at_step", at},
                          {"loss", loss.has_value() ? nlohmann::json(*loss) : nlohmann::json()},
                          {"final_loss_vs_undisturbed", loss.has_value() && base_loss.has_value() && *base_loss > 0
                                                            ? nlohmann::json(*loss / *base_loss)
                                                            : nlohmann::json()},
                          {"dir", (fs::path(root) / r.name).string()}};
    out << row.dump() << "\n" << std::flush;
  }
  if (options.out_dir.empty()) RemoveTree(root).IgnoreError();
  return absl::OkStatus();
}

}  // namespace aqswarm::bench
