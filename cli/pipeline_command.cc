// `aqswarm stage` (one stage process; its command line is peer/stage_command.h)
// and `aqswarm pipeline` (a static local launcher of K x D stage processes on
// 127.0.0.1, without a coordinator; `aqswarm peer` is the swarm's launcher).
#include <poll.h>
#include <sys/prctl.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/command.h"
#include "common/blas_kernels.h"
#include "common/file_util.h"
#include "common/malloc_tuning.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "absl/flags/reflection.h"
#include "peer/stage_command.h"
#include "peer/stage_runner.h"
#include "rpc/server.h"
#include "proto/event_json.h"
#include "pipeline/job_spec.h"

ABSL_DECLARE_FLAG(std::string, tls_dir);
ABSL_DECLARE_FLAG(std::string, name);
ABSL_DECLARE_FLAG(int32_t, metrics_port_base);  // cli/metrics_command.cc

ABSL_FLAG(std::string, job, "", "Path of the job spec (JSON, see proto/job.proto).");
ABSL_FLAG(int32_t, stages, 0, "Pipeline stages K (overrides the job's `stages` when > 0).");
ABSL_FLAG(int32_t, dp, 0, "Data-parallel pipelines D (overrides the job's `data_parallel` when > 0).");
ABSL_FLAG(int32_t, stage, 0, "Which stage this process runs (0-based).");
ABSL_FLAG(int32_t, pipeline_index, 0, "Which pipeline (data-parallel replica) this stage belongs to.");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "Address the StageLink server binds (stages > 0).");
ABSL_FLAG(std::string, next, "", "HOST:PORT of the next stage (all but the last stage; or --peers_on_stdin).");
ABSL_FLAG(std::string, previous, "", "HOST:PORT of the previous stage's StageLink server, dialed with --dial_previous.");
ABSL_FLAG(bool, dial_previous, false,
          "Open the link from the previous stage by dialing it at --previous (this stage cannot accept connections: "
          "a reversed link, set by `aqswarm peer` from the assignment).");
ABSL_FLAG(bool, accept_next, false,
          "Accept the link to the next stage on --listen instead of dialing --next (the next stage cannot accept "
          "connections and dials this one).");
ABSL_FLAG(bool, peers_on_stdin, false,
          "After the listening line, read the neighbours' addresses on stdin: {\"next\": \"HOST:PORT\", "
          "\"replicas\": [...]} (both as needed; what `aqswarm pipeline` sends, so that it can start the stages "
          "in parallel).");
ABSL_FLAG(std::string, store_dir, "", "Directory of this stage's AQ-SGD message store.");
ABSL_FLAG(uint64_t, generation, 1, "AQ-SGD link generation (both ends of a link must agree).");
ABSL_FLAG(uint64_t, next_generation, 0, "Generation of the link to stage+1 when it differs (0 = --generation).");
ABSL_FLAG(uint64_t, previous_generation, 0, "Generation of the link from stage-1 when it differs (0 = --generation).");
ABSL_FLAG(std::string, exchange_listen, "", "Address the GradientExchange server binds (default: --listen's host, any port).");
ABSL_FLAG(std::string, replicas, "", "GradientExchange addresses of the stage's replicas, comma-separated, indexed by "
                                     "pipeline (default with data parallelism: read {\"replicas\": [...]} on stdin).");
ABSL_FLAG(uint64_t, replica_generation, 0, "Generation of the stage's data-parallel group.");
ABSL_FLAG(uint64_t, plan, 0, "Swarm plan version of this run (set by `aqswarm peer`; neighbours of older plans "
                             "are stale incarnations).");
ABSL_FLAG(bool, die_with_parent, false, "Exit when the parent process dies (set by `aqswarm peer` for its stage).");
ABSL_FLAG(int64_t, start_step, 0, "Steps already completed: training starts at this global step.");
ABSL_FLAG(std::string, init_checkpoint, "", "Stage state to load first (holding --start_step completed steps).");
ABSL_FLAG(std::string, checkpoint_dir, "", "Write the stage state here every job checkpoint_every_steps (state-<steps>.ckpt).");
ABSL_FLAG(int32_t, keep_checkpoints, 4, "Newest checkpoints kept in --checkpoint_dir.");
ABSL_FLAG(int32_t, link_timeout_s, 120, "Bound in seconds on every wait for a neighbour.");
ABSL_FLAG(int32_t, uplink_kbps, 0,
          "Emulated uplink in kbit/s for everything this stage sends (0: the job's shaping; `aqswarm peer "
          "--emulate_uplink_mbps` sets it).");
ABSL_FLAG(std::string, previous_peer, "", "Peer (certificate) name of stage-1: under mTLS only it may open the link "
          "(set by `aqswarm peer`; empty = any certificate of the swarm CA).");
ABSL_FLAG(std::string, next_peer, "", "Peer (certificate) name of stage+1: under mTLS the link must reach it.");
ABSL_FLAG(std::string, replica_peers, "", "Peer (certificate) names of the stage's replicas, comma-separated, by "
          "pipeline: under mTLS a GradientExchange chunk of rank r must come from replica r's certificate.");
ABSL_FLAG(std::string, out_dir, "", "Run directory: job.json, stage logs, stores, metrics.csv "
                                    "(default runs/<job name>).");
ABSL_FLAG(bool, keep_stores, false, "Keep the stages' message stores after the run.");

namespace aqswarm::cli {
namespace {

absl::StatusOr<v1::JobSpec> LoadJobFromFlags() {
  const std::string path = absl::GetFlag(FLAGS_job);
  if (path.empty()) return absl::InvalidArgumentError("--job is required");
  auto job = pipeline::LoadJobSpec(path);
  if (!job.ok()) return job.status();
  if (absl::GetFlag(FLAGS_stages) > 0) job->set_stages(absl::GetFlag(FLAGS_stages));
  if (absl::GetFlag(FLAGS_dp) > 0) job->set_data_parallel(absl::GetFlag(FLAGS_dp));
  absl::Status s = pipeline::ValidateJobSpec(*job);
  if (!s.ok()) return s;
  return job;
}

int Fail(const char* cmd, const absl::Status& s) {
  std::cerr << "aqswarm " << cmd << ": " << s.message() << "\n";
  return 1;
}

// Reads one {"next": ..., "replicas": [...]} line from stdin and hands the
// addresses to the runner: "next" when `want_next`, "replicas" when `dp`.
absl::Status ReadPeersFromStdin(peer::StageRunner& runner, bool want_next, bool dp, absl::Duration timeout) {
  std::string line;
  absl::Status rs = ReadLineFromFd(0, &line, timeout);
  if (!rs.ok()) return absl::InvalidArgumentError(absl::StrCat("no neighbour addresses on stdin: ", rs.message()));
  nlohmann::json msg = nlohmann::json::parse(line, nullptr, false);
  if (!msg.is_object()) return absl::InvalidArgumentError(absl::StrCat("stdin: not a JSON object: ", line));
  if (want_next) {
    if (!msg.contains("next") || !msg["next"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("stdin: expected {\"next\": \"HOST:PORT\"}: ", line));
    }
    AQSWARM_RETURN_IF_ERROR(runner.SetNext(msg["next"].get<std::string>()));
  }
  if (dp) {
    if (!msg.contains("replicas") || !msg["replicas"].is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("expected {\"replicas\": [...]} on stdin for data parallelism: ",
                                                     line));
    }
    std::vector<std::string> replicas;
    for (const auto& a : msg["replicas"]) {
      if (!a.is_string()) return absl::InvalidArgumentError("replica addresses must be strings");
      replicas.push_back(a.get<std::string>());
    }
    AQSWARM_RETURN_IF_ERROR(runner.SetReplicas(replicas));
  }
  return absl::OkStatus();
}

// The stage command as its flags set it (the flags are the CLI's; the
// struct, peer/stage_command.h, is the one mapping to the runner's options).
absl::StatusOr<peer::StageCommand> StageCommandFromFlags() {
  std::vector<std::string> args;
  for (const std::string& name : peer::StageCommand::FlagNames()) {
    const absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
    if (f == nullptr) return absl::InternalError(absl::StrCat("aqswarm stage declares no flag --", name));
    args.push_back(absl::StrCat("--", name, "=", f->CurrentValue()));
  }
  return peer::StageCommand::FromArgs(args);
}

int RunStage(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("stage", absl::InvalidArgumentError("unexpected argument " + args[0]));
  absl::StatusOr<peer::StageCommand> cmd = StageCommandFromFlags();
  if (!cmd.ok()) return Fail("stage", cmd.status());
  if (cmd->die_with_parent) {
    const pid_t parent = getppid();
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) return Fail("stage", absl::AbortedError("the parent process is gone"));
  }
  if (cmd->start_step < 0) return Fail("stage", absl::InvalidArgumentError("--start_step must be >= 0"));
  if (cmd->uplink_kbps < 0) return Fail("stage", absl::InvalidArgumentError("--uplink_kbps must be >= 0"));
  auto job = LoadJobFromFlags();
  if (!job.ok()) return Fail("stage", job.status());
  KeepFreedMemoryForReuse();  // no fresh zeroed pages every micro-batch (common/malloc_tuning.h)
  if (cmd->stage + 1 < static_cast<int>(job->stages()) && cmd->next.empty() && !cmd->peers_on_stdin &&
      !cmd->accept_next) {
    return Fail("stage", absl::InvalidArgumentError(
                             "a stage before the last needs --next (or --peers_on_stdin, or --accept_next)"));
  }
  if (cmd->stage > 0 && cmd->dial_previous && cmd->previous.empty()) {
    return Fail("stage", absl::InvalidArgumentError("--dial_previous needs --previous (the previous stage's address)"));
  }
  peer::StageRunnerOptions o = peer::StageRunnerOptionsFor(*cmd, *job);
  if (o.tls.enabled() && o.tls.name.empty()) {
    return Fail("stage", absl::InvalidArgumentError("--tls_dir needs --name (this process's certificate)"));
  }
  for (const std::string& listen : {o.listen, o.exchange_listen}) {
    if (listen.empty()) continue;
    if (absl::Status s = rpc::CheckListenSecurity(listen, o.tls.enabled(), cmd->insecure); !s.ok()) {
      return Fail("stage", s);
    }
  }
  std::mutex out_mu;
  auto print = [&](const v1::StageEvent& e) {
    const std::string line = events::ToJsonLine(e);
    std::lock_guard<std::mutex> l(out_mu);
    std::fprintf(stdout, "%s\n", line.c_str());
    std::fflush(stdout);
  };
  o.report = print;
  auto metrics = StartMetricsFromFlags();  // --metrics_listen
  if (!metrics.ok()) return Fail("stage", metrics.status());
  auto runner = peer::StageRunner::Create(o);
  if (!runner.ok()) return Fail("stage", runner.status());
  {
    v1::StageEvent e;
    v1::ListeningEvent& l = *e.mutable_listening();
    l.set_stage(o.stage);
    l.set_pipeline(o.pipeline);
    l.set_port((*runner)->port());
    l.set_exchange_port((*runner)->exchange_port());
    l.set_metrics_port(*metrics ? (**metrics).port() : 0);
    print(e);
  }
  const bool last = o.stage + 1 == static_cast<int>(job->stages());
  const bool dp = job->data_parallel() > 1;
  if (cmd->peers_on_stdin) {
    // The launcher answers once every stage listens, e.g.
    //   {"next": "127.0.0.1:7001", "replicas": ["127.0.0.1:7101", "127.0.0.1:7102"]}
    absl::Status ps = ReadPeersFromStdin(**runner, /*want_next=*/!last && !cmd->accept_next, dp, o.link_timeout);
    if (!ps.ok()) return Fail("stage", ps);
  } else if (dp && !cmd->replicas.empty()) {
    absl::Status cs = (*runner)->SetReplicas(cmd->replicas);
    if (!cs.ok()) return Fail("stage", cs);
  } else if (dp) {
    // The launcher (or an operator) answers with the replicas' addresses:
    //   {"replicas": ["127.0.0.1:7001", "127.0.0.1:7002"]}
    absl::Status ps = ReadPeersFromStdin(**runner, /*want_next=*/false, dp, o.link_timeout);
    if (!ps.ok()) return Fail("stage", ps);
  }
  absl::Status s = (*runner)->Run();
  if (!s.ok()) {
    v1::StageEvent e;
    e.mutable_error()->set_stage(o.stage);
    e.mutable_error()->set_code(absl::StatusCodeToString(s.code()));
    e.mutable_error()->set_message(std::string(s.message()));
    print(e);
    return Fail("stage", s);
  }
  v1::StageEvent e;
  e.mutable_done()->set_stage(o.stage);
  print(e);
  return 0;
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
// stage's listening event, all by `deadline`, and returns those events. On failure *failed is the child that exited first or printed
// something else, or the first one still silent at the deadline. Lines a
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

int RunPipeline(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("pipeline", absl::InvalidArgumentError("unexpected argument " + args[0]));
  auto job = LoadJobFromFlags();
  if (!job.ok()) return Fail("pipeline", job.status());
  if (!absl::GetFlag(FLAGS_tls_dir).empty() && absl::GetFlag(FLAGS_name).empty()) {
    return Fail("pipeline", absl::InvalidArgumentError("--tls_dir needs --name (the certificate the stages use)"));
  }
  const int k = job->stages(), d = job->data_parallel(), n = k * d;
  namespace fs = std::filesystem;
  const fs::path out = absl::GetFlag(FLAGS_out_dir).empty() ? fs::path("runs") / job->name()
                                                            : fs::path(absl::GetFlag(FLAGS_out_dir));
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return Fail("pipeline", absl::PermissionDeniedError(absl::StrCat("cannot create ", out.string())));
  auto name = [](int p, int s) { return absl::StrCat("p", p, "-s", s); };
  for (int p = 0; p < d; ++p) {
    for (int s = 0; s < k; ++s) {  // fresh: generation 1
      if (absl::Status st = RemoveTree(out / ("store-" + name(p, s))); !st.ok()) return Fail("pipeline", st);
    }
  }
  // Pipeline 0's stages keep their final state for `aqswarm export`
  // (<out_dir>/checkpoints/stage-<k>/state-<steps>.ckpt; replicas are
  // identical). Without rollback here, a job that leaves
  // checkpoint_every_steps at 0 (= every step) writes the first and the
  // final state only.
  if (job->checkpoint_every_steps() == 0) job->set_checkpoint_every_steps(1000000);
  const std::string job_path = (out / "job.json").string();
  std::ofstream(job_path) << pipeline::JobSpecJson(*job);

  signal(SIGINT, OnInterrupt);
  signal(SIGTERM, OnInterrupt);
  signal(SIGPIPE, SIG_IGN);
  const std::string self = SelfExecutable();
  // children[p * k + s]. All stages start at once (each spends seconds
  // loading libraries and building its model); each one reports the ports it
  // listens on, and once all have, each learns its neighbours' addresses on
  // stdin (--peers_on_stdin).
  PickOpenBlasCoreForChildren();  // the stages' BLAS kernels (common/blas_kernels.h)
  std::vector<std::unique_ptr<Subprocess>> children(n);
  std::vector<std::vector<std::string>> pending(n);  // lines read past the listening line
  auto log_of = [&](int i) { return (out / absl::StrCat("stage-", name(i / k, i % k), ".log")).string(); };
  for (int i = 0; i < n; ++i) {
    const int p = i / k, s = i % k;
    fs::remove(log_of(i), ec);
    peer::StageCommand c;
    c.job = job_path;
    c.stage = s;
    c.pipeline = p;
    c.store_dir = (out / ("store-" + name(p, s))).string();
    c.link_timeout_s = absl::GetFlag(FLAGS_link_timeout_s);
    c.peers_on_stdin = true;
    if (p == 0) {
      c.checkpoint_dir = (out / "checkpoints" / absl::StrCat("stage-", s)).string();
      c.keep_checkpoints = 1;
    }
    if (absl::GetFlag(FLAGS_metrics_port_base) > 0) {
      c.metrics_listen = absl::StrCat("127.0.0.1:", absl::GetFlag(FLAGS_metrics_port_base) + i);
    }
    if (!absl::GetFlag(FLAGS_tls_dir).empty()) {
      c.tls_dir = absl::GetFlag(FLAGS_tls_dir);
      c.name = absl::GetFlag(FLAGS_name);
    }
    auto child =
        Subprocess::Spawn(c.ToArgv(self), {.capture_stdout = true, .stderr_path = log_of(i), .pipe_stdin = true});
    if (!child.ok()) return Fail("pipeline", child.status());  // the destructors stop those already started
    children[i] = std::move(*child);
  }
  std::vector<int> port(n, 0), exchange_port(n, 0);
  {
    int failed = 0;
    absl::StatusOr<std::vector<v1::ListeningEvent>> ready =
        AwaitListening(children, absl::Now() + absl::Seconds(300), &failed, &pending);
    if (absl::IsCancelled(ready.status())) {
      std::cerr << "aqswarm pipeline: interrupted, stopping the stages\n";
    } else if (!ready.ok()) {
      std::cerr << "aqswarm pipeline: stage " << name(failed / k, failed % k) << " did not start ("
                << ready.status().message() << "):\n" << Tail(log_of(failed), 20) << "\n";
    }
    if (!ready.ok()) {
      StopAll(children);
      return 1;
    }
    for (int i = 0; i < n; ++i) {
      port[i] = static_cast<int>((*ready)[i].port());
      exchange_port[i] = static_cast<int>((*ready)[i].exchange_port());
    }
  }
  for (int i = 0; i < n; ++i) {  // tell every stage where its neighbours are
    const int p = i / k, s = i % k;
    nlohmann::json msg = nlohmann::json::object();
    if (s + 1 < k) msg["next"] = absl::StrCat("127.0.0.1:", port[i + 1]);
    for (int r = 0; r < d && d > 1; ++r) msg["replicas"].push_back(absl::StrCat("127.0.0.1:", exchange_port[r * k + s]));
    absl::Status ws = children[i]->WriteStdin(msg.dump() + "\n");
    if (!ws.ok()) {
      std::cerr << "aqswarm pipeline: stage " << name(p, s) << " exited before it got its neighbours (" << ws.message()
                << "):\n" << Tail(log_of(i), 20) << "\n";
      StopAll(children);
      return 1;
    }
  }
  std::cout << "aqswarm pipeline: " << k << " stages x " << d << " pipelines running ("
            << job->compression().ShortDebugString() << (d > 1 ? "; dp " + job->dp().ShortDebugString() : "")
            << "); logs and metrics in " << out.string() << "\n";

  // Every stage's JSON progress line, verbatim (per-stage compute/wait/bytes).
  std::ofstream events(out / "events.jsonl");
  std::ofstream csv(out / "metrics.csv");
  csv << "step,epoch,loss,val_loss,step_seconds,tokens_per_second";
  for (int l = 0; l + 1 < k; ++l) csv << ",fw_bytes_link" << l << ",bw_bytes_link" << l;
  if (d > 1) {
    for (int s = 0; s < k; ++s) csv << ",dp_bytes_stage" << s;
  }
  csv << "\n";
  std::map<int64_t, std::map<int, v1::StepEvent>> steps;  // step -> child index -> event
  std::map<int64_t, double> val;
  // Data parallelism over the run: encoded bytes every stage of pipeline 0
  // sent to its replicas, and what a float32 all-reduce would have sent.
  double dp_run_bytes = 0, dp_run_raw = 0;
  int done = 0;
  bool failed = false;
  while (done < n && !failed) {
    if (g_interrupted) {
      std::cerr << "aqswarm pipeline: interrupted, stopping the stages\n";
      for (auto& c : children) c->Signal(SIGTERM);
      failed = true;
      break;
    }
    std::vector<pollfd> fds;
    for (auto& c : children) fds.push_back({c->stdout_fd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), 500);
    for (int i = 0; i < n && !failed; ++i) {
      std::vector<std::string> lines;
      lines.swap(pending[i]);
      absl::Status st = children[i]->DrainLines(&lines);
      if (absl::IsOutOfRange(st) && !children[i]->exited()) {
        auto code = children[i]->Wait(absl::Seconds(30));
        if (!code.ok() || *code != 0) {
          std::cerr << "aqswarm pipeline: stage " << name(i / k, i % k) << " failed (exit "
                    << (code.ok() ? *code : -1) << "):\n" << Tail(log_of(i), 20) << "\n";
          failed = true;
        }
      }
      for (const auto& line : lines) {
        absl::StatusOr<v1::StageEvent> ev = events::ParseStageEvent(line);
        if (!ev.ok()) continue;
        events << line << "\n";
        if (ev->has_done()) ++done;
        if (ev->has_eval() && i == 0) {
          val[ev->eval().step()] = ev->eval().val_loss();
          std::printf("  eval  step %5lld  val_loss %.4f\n", static_cast<long long>(ev->eval().step()),
                      ev->eval().val_loss());
        }
        if (!ev->has_step()) continue;
        const int64_t step = ev->step().step();
        auto& row = steps[step];
        row[i] = ev->step();
        if (static_cast<int>(row.size()) < n) continue;
        // Every replica of a stage must hold bit-identical weights (diloco:
        // its anchors, identical at every step), except after quantized_adam's
        // local steps (dp.max_local_steps), which move each replica on its
        // own until the next sync.
        const bool qadam = job->dp().optimizer() == v1::DataParallelSpec::quantized_adam;
        for (int s = 0; s < k && d > 1; ++s) {
          if (qadam && row[s].dp().kind() == "local") continue;
          for (int p = 1; p < d; ++p) {
            if (row[p * k + s].dp().param_hash() != row[s].dp().param_hash()) {
              std::cerr << "aqswarm pipeline: replicas of stage " << s << " diverged at step " << step << "\n";
              failed = true;
            }
          }
        }
        // Tied embeddings across stages: every pipeline's first and last stage
        // hold the same matrix.
        for (int p = 0; p < d && k > 1; ++p) {
          if (row[p * k].tied_hash() != row[p * k + k - 1].tied_hash()) {
            std::cerr << "aqswarm pipeline: the tied embedding copies of pipeline " << p << " diverged at step "
                      << step << "\n";
            failed = true;
          }
        }
        double loss = 0, secs = 0, tokens = 0, fw_total = 0, raw_total = 0;
        for (int p = 0; p < d; ++p) {
          const v1::StepEvent& s0 = row[p * k];
          loss += s0.loss() / d;
          secs = std::max(secs, s0.step_seconds());
          tokens += s0.tokens();
        }
        const double tps = tokens / std::max(secs, 1e-9);
        std::string links;
        csv << step << "," << row[0].epoch() << "," << loss << ",," << secs << "," << tps;
        for (int l = 0; l + 1 < k; ++l) {
          const double fw = row[l].fw_bytes(), bw = row[l + 1].bw_bytes();
          csv << "," << fw << "," << bw;
          absl::StrAppendFormat(&links, "  link%d %.2f/%.2f MB", l, fw / 1e6, bw / 1e6);
          fw_total += row[l].sender().payload_bytes();
          raw_total += row[l].sender().raw_bytes();
        }
        if (d > 1) {
          double dp = 0;
          for (int s = 0; s < k; ++s) {
            csv << "," << row[s].dp().bytes();
            dp += row[s].dp().bytes();
            dp_run_raw += row[s].dp().raw_bytes();
          }
          dp_run_bytes += dp;
          absl::StrAppendFormat(&links, "  dp %.2f MB/replica", dp / 1e6);
        }
        csv << "\n";
        csv.flush();
        std::printf("step %5lld  epoch %lld  loss %.4f%s  %8.0f tok/s  %.2f s%s%s%s%s\n", static_cast<long long>(step),
                    static_cast<long long>(row[0].epoch()), loss, std::isfinite(loss) ? "" : " (not finite)", tps,
                    secs, links.c_str(),
                    raw_total > 0 ? absl::StrFormat("  fw ratio %.1fx", raw_total / std::max(fw_total, 1.0)).c_str()
                                  : "",
                    d > 1 ? "  replicas identical" : "", row[0].tied_hash().empty() ? "" : "  tied copies identical");
        std::fflush(stdout);
        steps.erase(step);
      }
    }
  }
  if (failed) {
    for (auto& c : children) c->Signal(SIGTERM);
  }
  int rc = failed ? 1 : 0;
  for (int i = 0; i < n; ++i) {
    auto code = children[i]->Wait(absl::Seconds(failed ? 10 : 60));
    if (!code.ok()) {
      children[i]->Signal(SIGKILL);
      rc = 1;
    } else if (*code != 0 && !failed) {
      std::cerr << "aqswarm pipeline: stage " << name(i / k, i % k) << " exited with " << *code << "\n";
      rc = 1;
    }
  }
  if (!absl::GetFlag(FLAGS_keep_stores)) {
    for (int p = 0; p < d; ++p) {
      for (int s = 0; s < k; ++s) {
        if (absl::Status st = RemoveTree(out / ("store-" + name(p, s))); !st.ok()) std::cerr << st << "\n";
      }
    }
  }
  if (rc == 0) {
    if (!val.empty()) std::printf("final val_loss %.4f\n", val.rbegin()->second);
    if (d > 1) {
      std::printf("data parallelism: %.2f MB sent per replica over the run (a float32 all-reduce: %.2f MB, %.1fx)\n",
                  dp_run_bytes / 1e6, dp_run_raw / 1e6, dp_run_raw / std::max(dp_run_bytes, 1.0));
    }
    std::cout << "metrics: " << (out / "metrics.csv").string() << "\n";
  }
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
       "Run one pipeline stage (used by `aqswarm pipeline` and `aqswarm peer`; prints JSON event lines).",
       "Its command line is peer/stage_command.h; its events are proto/events.proto (StageEvent).",
       peer::StageCommand::FlagNames(),
       RunStage},
  };
}

}  // namespace aqswarm::cli
