// `aqswarm stage --launch FILE` (one stage process: stage/stage_main.h) and
// `aqswarm pipeline` (a static local launcher of K x D stage processes on
// 127.0.0.1, without a coordinator; `aqswarm peer` is the swarm's launcher).
#include <poll.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/command.h"
#include "common/blas_kernels.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "pipeline/job_spec.h"
#include "proto/event_json.h"
#include "stage/pipeline_monitor.h"
#include "stage/stage_launch.h"
#include "stage/stage_main.h"

ABSL_DECLARE_FLAG(std::string, tls_dir);
ABSL_DECLARE_FLAG(std::string, name);
ABSL_DECLARE_FLAG(int32_t, metrics_port_base);  // cli/metrics_command.cc

ABSL_FLAG(std::string, job, "", "Path of the job spec (JSON, see proto/job.proto).");
ABSL_FLAG(int32_t, stages, 0, "Pipeline stages K (overrides the job's `stages` when > 0).");
ABSL_FLAG(int32_t, dp, 0, "Data-parallel pipelines D (overrides the job's `data_parallel` when > 0).");
ABSL_FLAG(std::string, launch, "", "The stage's launch: a StageLaunch as JSON (proto/stage.proto), written by "
                                   "`aqswarm pipeline` or `aqswarm peer`.");
ABSL_FLAG(int32_t, link_timeout_s, 120, "Bound in seconds on every wait for a neighbour.");
ABSL_FLAG(std::string, out_dir, "", "Run directory: job.json, stage logs, stores, metrics.csv "
                                    "(default runs/<job name>).");
ABSL_FLAG(bool, keep_stores, false, "Keep the stages' message stores after the run.");

namespace aqswarm::cli {
namespace {

absl::StatusOr<v1::JobSpec> LoadJobFromFlags() {
  const std::string path = absl::GetFlag(FLAGS_job);
  if (path.empty()) return absl::InvalidArgumentError("--job is required");
  auto job = pipeline::LoadJobSpec(path);  // defaults applied, validated
  if (!job.ok()) return job.status();
  if (absl::GetFlag(FLAGS_stages) <= 0 && absl::GetFlag(FLAGS_dp) <= 0) return job;
  if (absl::GetFlag(FLAGS_stages) > 0) job->set_stages(absl::GetFlag(FLAGS_stages));
  if (absl::GetFlag(FLAGS_dp) > 0) job->set_data_parallel(absl::GetFlag(FLAGS_dp));
  AQSWARM_RETURN_IF_ERROR(pipeline::ValidateJobSpec(*job));  // the grid the flags give
  return job;
}

int Fail(const char* cmd, const absl::Status& s) {
  std::cerr << "aqswarm " << cmd << ": " << s.message() << "\n";
  return 1;
}

int RunStage(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("stage", absl::InvalidArgumentError("unexpected argument " + args[0]));
  return stage::RunStageProcess(absl::GetFlag(FLAGS_launch));
}

volatile sig_atomic_t g_interrupted = 0;
void OnInterrupt(int) { g_interrupted = 1; }

std::string Tail(const std::string& path, size_t max_lines) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  std::string l;
  while (std::getline(in, l)) lines.push_back(l);
  const size_t from = lines.size() > max_lines ? lines.size() - max_lines : 0;
  return absl::StrJoin(lines.begin() + from, lines.end(), "\n");
}

// Waits until every child has printed its first line, which must be the
// stage's listening event, all by `deadline`, and returns those events. On
// failure *failed is the child that exited first or printed something else,
// or the first one still silent at the deadline. Lines a
// child printed after its listening line are appended to (*rest)[i].
absl::StatusOr<std::vector<v1::ListeningEvent>> AwaitListening(const std::vector<std::unique_ptr<Subprocess>>& children,
                                                            absl::Time deadline, int* failed,
                                                            std::vector<std::vector<std::string>>* rest) {
  const int n = static_cast<int>(children.size());
  std::vector<v1::ListeningEvent> ready(n);
  std::vector<bool> got(n, false);
  for (int left = n; left > 0;) {
    std::vector<pollfd> fds;
    std::vector<int> index;
    for (int i = 0; i < n; ++i) {
      if (got[i]) continue;
      fds.push_back({children[i]->stdout_fd(), POLLIN, 0});
      index.push_back(i);
    }
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0 || g_interrupted) {
      *failed = index[0];
      return ms <= 0 ? absl::DeadlineExceededError("no listening line in time") : absl::CancelledError("interrupted");
    }
    ::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(ms, 1000)));
    for (size_t j = 0; j < fds.size(); ++j) {
      if (fds[j].revents == 0) continue;
      const int i = index[j];
      std::vector<std::string> lines;
      if (!children[i]->DrainLines(&lines).ok()) {  // end of output
        *failed = i;
        return absl::UnavailableError("it exited before listening");
      }
      if (lines.empty()) continue;
      absl::StatusOr<v1::StageEvent> ev = events::ParseStageEvent(lines[0]);
      if (!ev.ok() || !ev->has_listening()) {
        *failed = i;
        return absl::InvalidArgumentError(absl::StrCat("its first line is not the listening event: ", lines[0]));
      }
      ready[i] = ev->listening();
      got[i] = true;
      --left;
      (*rest)[i].insert((*rest)[i].end(), lines.begin() + 1, lines.end());
    }
  }
  return ready;
}

// Stops every child: SIGTERM, then SIGKILL whatever is still running after a
// grace period (the Subprocess destructor reaps).
void StopAll(std::vector<std::unique_ptr<Subprocess>>& children) {
  for (auto& c : children) {
    if (c != nullptr) c->Signal(SIGTERM);
  }
  for (auto& c : children) {
    if (c != nullptr && !c->Wait(absl::Seconds(10)).ok()) c->Signal(SIGKILL);
  }
}

// One `aqswarm pipeline` run: the job and its layout under <out_dir>.
// Children are indexed pipeline-major, i = pipeline * k + stage.
struct PipelineRun {
  v1::JobSpec job;
  std::filesystem::path out;
  int k = 1, d = 1;
  int n() const { return k * d; }
  std::string Name(int i) const { return absl::StrCat("p", i / k, "-s", i % k); }
  std::string Log(int i) const { return (out / absl::StrCat("stage-", Name(i), ".log")).string(); }
  std::filesystem::path Store(int i) const { return out / ("store-" + Name(i)); }
};

// Loads the job, makes the run directory (fresh stores: generation 1) and
// writes the effective job to <out_dir>/job.json.
absl::StatusOr<PipelineRun> PrepareRun() {
  PipelineRun run;
  AQSWARM_ASSIGN_OR_RETURN(run.job, LoadJobFromFlags());
  if (!absl::GetFlag(FLAGS_tls_dir).empty() && absl::GetFlag(FLAGS_name).empty()) {
    return absl::InvalidArgumentError("--tls_dir needs --name (the certificate the stages use)");
  }
  run.k = static_cast<int>(run.job.stages());
  run.d = static_cast<int>(run.job.data_parallel());
  namespace fs = std::filesystem;
  run.out = absl::GetFlag(FLAGS_out_dir).empty() ? fs::path("runs") / run.job.name()
                                                 : fs::path(absl::GetFlag(FLAGS_out_dir));
  std::error_code ec;
  fs::create_directories(run.out, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create ", run.out.string()));
  for (int i = 0; i < run.n(); ++i) AQSWARM_RETURN_IF_ERROR(RemoveTree(run.Store(i)));
  // Pipeline 0's stages keep their final state for `aqswarm export`
  // (<out_dir>/checkpoints/stage-<k>/state-<steps>.ckpt; replicas are
  // identical). Without rollback here, a job that leaves
  // checkpoint_every_steps at 0 (= every step) writes the first and the
  // final state only.
  if (run.job.checkpoint_every_steps() == 0) run.job.set_checkpoint_every_steps(1000000);
  std::ofstream((run.out / "job.json").string()) << pipeline::JobSpecJson(run.job);
  return run;
}

// Child i's launch: its neighbours come on stdin once every stage listens.
v1::StageLaunch LaunchOf(const PipelineRun& run, int i) {
  const int p = i / run.k, s = i % run.k;
  v1::StageLaunch l;
  *l.mutable_job() = run.job;
  l.set_stage(s);
  l.set_pipeline(p);
  l.set_store_dir(run.Store(i).string());
  l.mutable_link_timeout()->set_seconds(absl::GetFlag(FLAGS_link_timeout_s));
  l.set_neighbors_on_stdin(true);
  if (p == 0) {
    l.set_checkpoint_dir((run.out / "checkpoints" / absl::StrCat("stage-", s)).string());
    l.set_keep_checkpoints(1);
  }
  if (absl::GetFlag(FLAGS_metrics_port_base) > 0) {
    l.set_metrics_listen(absl::StrCat("127.0.0.1:", absl::GetFlag(FLAGS_metrics_port_base) + i));
  }
  if (!absl::GetFlag(FLAGS_tls_dir).empty()) {
    l.mutable_tls()->set_dir(absl::GetFlag(FLAGS_tls_dir));
    l.mutable_tls()->set_name(absl::GetFlag(FLAGS_name));
  }
  return l;
}

// Starts all stages at once (each spends seconds loading libraries and
// building its model), each from <out_dir>/launch-<p>-<s>.json.
absl::Status SpawnStages(const PipelineRun& run, std::vector<std::unique_ptr<Subprocess>>* children) {
  const std::string self = SelfExecutable();
  PickOpenBlasCoreForChildren();  // the stages' BLAS kernels (common/blas_kernels.h)
  children->resize(run.n());
  for (int i = 0; i < run.n(); ++i) {
    std::error_code ec;
    std::filesystem::remove(run.Log(i), ec);
    const std::string launch = (run.out / absl::StrCat("launch-", run.Name(i), ".json")).string();
    AQSWARM_RETURN_IF_ERROR(stage::WriteStageLaunch(launch, LaunchOf(run, i)));
    const SubprocessOptions so{.capture_stdout = true, .stderr_path = run.Log(i), .pipe_stdin = true};
    AQSWARM_ASSIGN_OR_RETURN((*children)[i], Subprocess::Spawn({self, "stage", "--launch=" + launch}, so));
  }
  return absl::OkStatus();
}

// Child i's neighbour patch (proto/stage.proto): stage+1's StageLink port,
// every replica's GradientExchange port.
v1::StageLaunch NeighborPatch(const PipelineRun& run, int i, const std::vector<v1::ListeningEvent>& ready) {
  const int s = i % run.k;
  v1::StageLaunch patch;
  if (s + 1 < run.k) patch.mutable_next()->set_stage_link_address(absl::StrCat("127.0.0.1:", ready[i + 1].port()));
  for (int r = 0; r < run.d && run.d > 1; ++r) {
    v1::Neighbor& n = *patch.add_replicas();
    n.set_pipeline(r);
    n.set_stage(s);
    n.set_gradient_exchange_address(absl::StrCat("127.0.0.1:", ready[r * run.k + s].exchange_port()));
  }
  return patch;
}

// Waits for every stage's listening line, then tells each its neighbours.
// False (the reason printed) when a stage did not start.
bool ConnectStages(const PipelineRun& run, std::vector<std::unique_ptr<Subprocess>>& children,
                   std::vector<std::vector<std::string>>* pending) {
  int failed = 0;
  absl::StatusOr<std::vector<v1::ListeningEvent>> ready =
      AwaitListening(children, absl::Now() + absl::Seconds(300), &failed, pending);
  if (absl::IsCancelled(ready.status())) {
    std::cerr << "aqswarm pipeline: interrupted, stopping the stages\n";
  } else if (!ready.ok()) {
    std::cerr << "aqswarm pipeline: stage " << run.Name(failed) << " did not start (" << ready.status().message()
              << "):\n" << Tail(run.Log(failed), 20) << "\n";
  }
  if (!ready.ok()) return false;
  for (int i = 0; i < run.n(); ++i) {
    absl::Status ws = children[i]->WriteStdin(stage::StageLaunchJson(NeighborPatch(run, i, *ready)) + "\n");
    if (!ws.ok()) {
      std::cerr << "aqswarm pipeline: stage " << run.Name(i) << " exited before it got its neighbours ("
                << ws.message() << "):\n" << Tail(run.Log(i), 20) << "\n";
      return false;
    }
  }
  return true;
}

// Reads every stage's events into the monitor until all are done; false
// when a stage failed, the replicas or tied copies diverged, or the run was
// interrupted.
bool MonitorStages(const PipelineRun& run, std::vector<std::unique_ptr<Subprocess>>& children,
                   std::vector<std::vector<std::string>>& pending, stage::PipelineMonitor& monitor) {
  while (monitor.done() < run.n()) {
    if (g_interrupted) {
      std::cerr << "aqswarm pipeline: interrupted, stopping the stages\n";
      return false;
    }
    std::vector<pollfd> fds;
    for (auto& c : children) fds.push_back({c->stdout_fd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), 500);
    for (int i = 0; i < run.n(); ++i) {
      std::vector<std::string> lines;
      lines.swap(pending[i]);
      absl::Status st = children[i]->DrainLines(&lines);
      bool failed = false;
      if (absl::IsOutOfRange(st) && !children[i]->exited()) {
        auto code = children[i]->Wait(absl::Seconds(30));
        if (!code.ok() || *code != 0) {
          std::cerr << "aqswarm pipeline: stage " << run.Name(i) << " failed (exit " << (code.ok() ? *code : -1)
                    << "):\n" << Tail(run.Log(i), 20) << "\n";
          failed = true;
        }
      }
      for (const auto& line : lines) {
        if (absl::Status ms = monitor.OnLine(i, line); !ms.ok()) {
          std::cerr << "aqswarm pipeline: " << ms.message() << "\n";
          failed = true;
        }
      }
      if (failed) return false;
    }
  }
  return true;
}

// Waits for every stage to exit (stopping them first after a failure) and
// removes the stores unless --keep_stores. The run's exit code.
int FinishRun(const PipelineRun& run, std::vector<std::unique_ptr<Subprocess>>& children, bool failed) {
  if (failed) {
    for (auto& c : children) c->Signal(SIGTERM);
  }
  int rc = failed ? 1 : 0;
  for (int i = 0; i < run.n(); ++i) {
    auto code = children[i]->Wait(absl::Seconds(failed ? 10 : 60));
    if (!code.ok()) {
      children[i]->Signal(SIGKILL);
      rc = 1;
    } else if (*code != 0 && !failed) {
      std::cerr << "aqswarm pipeline: stage " << run.Name(i) << " exited with " << *code << "\n";
      rc = 1;
    }
  }
  if (!absl::GetFlag(FLAGS_keep_stores)) {
    for (int i = 0; i < run.n(); ++i) {
      if (absl::Status st = RemoveTree(run.Store(i)); !st.ok()) std::cerr << st << "\n";
    }
  }
  return rc;
}

int RunPipeline(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("pipeline", absl::InvalidArgumentError("unexpected argument " + args[0]));
  absl::StatusOr<PipelineRun> run = PrepareRun();
  if (!run.ok()) return Fail("pipeline", run.status());
  signal(SIGINT, OnInterrupt);
  signal(SIGTERM, OnInterrupt);
  signal(SIGPIPE, SIG_IGN);
  std::vector<std::unique_ptr<Subprocess>> children;
  if (absl::Status s = SpawnStages(*run, &children); !s.ok()) return Fail("pipeline", s);  // the destructors stop them
  std::vector<std::vector<std::string>> pending(run->n());  // lines read past the listening line
  if (!ConnectStages(*run, children, &pending)) {
    StopAll(children);
    return 1;
  }
  std::cout << "aqswarm pipeline: " << run->k << " stages x " << run->d << " pipelines running ("
            << run->job.compression().ShortDebugString()
            << (run->d > 1 ? "; dp " + run->job.dp().ShortDebugString() : "") << "); logs and metrics in "
            << run->out.string() << "\n";
  stage::PipelineMonitor monitor(run->job, run->out.string());
  const bool ok = MonitorStages(*run, children, pending, monitor);
  const int rc = FinishRun(*run, children, !ok);
  if (rc == 0) monitor.PrintSummary();
  return rc;
}

}  // namespace

std::vector<Command> PipelineCommands() {
  return {
      {"pipeline",
       "Train a job on K local stage processes joined by StageLink over 127.0.0.1.",
       "Prints per step: loss, tokens/s, MB sent per link (forward/backward); writes\n"
       "<out_dir>/metrics.csv, <out_dir>/events.jsonl (every stage's JSON lines), one log per stage\n"
       "and each stage's final state in <out_dir>/checkpoints/stage-<k>/ (`aqswarm export --run <out_dir>`).",
       {"job", "stages", "dp", "out_dir", "keep_stores", "link_timeout_s", "tls_dir", "name", "metrics_port_base"},
       RunPipeline},
      {"stage",
       "Run one pipeline stage from its launch (what `aqswarm pipeline` and `aqswarm peer` start; prints JSON "
       "event lines).",
       "example: aqswarm stage --launch run/launch-p0-s1.json\n"
       "The launch is a StageLaunch as JSON (proto/stage.proto); the events are proto/events.proto (StageEvent).",
       {"launch"},
       RunStage},
  };
}

}  // namespace aqswarm::cli
