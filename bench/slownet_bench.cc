// `aqswarm bench slownet`: the AQ-SGD paper's Table 2 (throughput of a GPT
// pipeline as the links get slower) reproduced as ratios on local processes.
//
// Cells are real runs of `aqswarm pipeline` (this executable) on a fresh run
// directory: K stage processes (x D pipelines for the grid) on 127.0.0.1,
// links shaped in user space by the job's `shaping` (a FIFO wire per link
// direction, stage/link_transport.h; the DP GradientExchange too). By default
// (sweep) one run holds every bandwidth of a mode: the job's
// shaping.bandwidth_schedule_mbps gives step g the g % n-th bandwidth (or a
// rotated order that spreads QuantizedAdam's periodic refresh steps evenly
// over the cells: SweepCellCycle in bench.h), so
// the cells of one mode -- its compute-only cell, every ratio's baseline,
// included -- interleave step by step and meet the same machine load (the
// 2 cores' speed drifts over seconds to minutes); each step still ends with
// a flush, so a step at one rate inherits nothing from the step before.
//
// Timing: the synthetic corpus holds `steps_per_epoch` steps, so AQ-SGD's
// FULL epoch (every sample unseen on the link) is epoch 0; the first
// `skip_steps` steps of an AQ-SGD cell (process start, epoch 0, and a little
// more; `grid_skip_steps` with D > 1) and the first `plain_skip_steps` of an
// fp32 or DirectQ cell (process start: they keep no per-sample state) are
// dropped. With repeats > 1 the table runs as whole passes, and a cell's
// samples/s = samples per step / the MEDIAN of the step_seconds (stage 0's
// step time, the pipeline's period in steady state) of its timed steps in
// ALL passes, pooled. Within a pass the modes run one after the other, in an
// order that rotates from pass to pass, and every other pass cycles the
// bandwidths in reverse. Every cell, the compute-only ones included, is
// measured the same way in the same runs.
// Why the pooled median and not the best pass: a shared machine's speed
// moves within seconds and drifts over minutes (scripts/bench_slownet.sh's
// speed probe shows how much), so a compute-bound cell's best of a few
// passes would pick its luckiest minute while a link-bound cell's passes
// hardly differ; ratios between the two kinds (achieved / compute-only
// limit) would be biased low, and comparisons of two compute-bound cells
// (AQ-SGD vs DirectQ) would come down to which one got the quiet minute.
// The pooled median estimates both under the same, typical, machine;
// samples_per_s_passes keeps each pass's own median. docs/METHODOLOGY.md
// describes the report built on these cells (scripts/slownet_report).
//
// CPU: every stage reports its process CPU time per step (all threads);
// cpu_ms_per_sample sums them over the stages in the window, and
// cpu_limit = cores * 1000 / cpu_ms_per_sample is what the machine's cores
// could do if they were never idle (a bound no pipeline reaches: it ignores
// the dependencies between stages).
//
// BLAS: OpenBLAS picks its kernels by CPU model, and one it does not know
// (e.g. a Xeon newer than the installed OpenBLAS) gets the generic Prescott
// (SSE3) kernels; the bench, like `aqswarm pipeline` and
// `aqswarm peer`, runs its stages with OPENBLAS_CORETYPE set to a matching
// kernel set then (common/blas_kernels.h); the core in use is in the JSON
// (blas_core).
//
// Limits per cell:
//   compute-only   samples/s of the SAME mode and grid with unshaped links:
//                  loopback moves ~1 GB/s, so the residual transfer time is
//                  printed (loopback_ms_per_step) and is < 1% of a step; it
//                  keeps the mode's own encode / decode / store work, which is
//                  compute, not communication.
//   link-bound     each link direction is shaped on its own (the sender's
//                  token bucket), so a step cannot be shorter than the busiest
//                  direction's bytes * 8 / bandwidth; with D > 1 the DP
//                  exchange of the stage that sends most is also counted in
//                  the max (it uses its own shaped connections):
//                    link_limit = samples_per_step * B / (8 * max(bytes per step
//                                 over link directions and DP senders)).
//   schedule link  what the cell's schedule (job.schedule, pipeline/
//                  step_schedule.h) allows when only the links cost time:
//                  every step ends with a flush (last backward, global-norm
//                  commit, optimizer step), and a micro-batch is forwarded
//                  only once it fully arrived (store-and-forward over K-1
//                  links). With t_fw, t_bw = bytes per micro-batch * 8 / B on
//                  the busiest link, LinkBoundStepTime replays the stages'
//                  op sequences with zero compute:
//                    gpipe: (M + K - 2) * (t_fw + t_bw)
//                    adaptive or 1f1b with enough in flight (W_0 >= the
//                    round trip 2 (K-1) transfers; 1f1b not much more):
//                                        (M - 1) * max(t_fw, t_bw)
//                                        + (K - 1) * (t_fw + t_bw)
//                  (the bound of any schedule that flushes every step),
//                  [+ DP bytes * 8 / B, D > 1; with delayed DP updates
//                  the exchange runs beside the next step: the max of the two];
//                  schedule_link_limit = samples_per_step / that.
//   compute + DP   a synchronous DP exchange cannot overlap compute: stage 0
//                  runs the step's last backward, its exchange starts after
//                  it, and the next step's first forward needs its result, so
//                  compute_dp_limit = samples_per_step / (samples_per_step /
//                  compute-only + stage 0's DP bytes * 8 / B) (= compute-only
//                  with D = 1, unshaped, or delayed updates).
//   achieved / min(limits) then says how well compute and communication
//   overlap (1.0 = perfect; 0.5 = fully serialised at the crossover); it is
//   given against the plain limits (ach_wire: compute-only and the wire
//   bound) and the schedule-aware ones (ach_sched: compute + DP and the
//   schedule link limit).
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "bench/bench.h"
#include "common/blas_kernels.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "nlohmann/json.hpp"
#include "pipeline/job_spec.h"
#include "pipeline/step_schedule.h"
#include "proto/job_format.h"
#include "stage/pipeline_monitor.h"

namespace aqswarm::bench {
namespace {

namespace fs = std::filesystem;

// One column of the table: link compression (+ optional DP optimizer).
struct Mode {
  std::string link = "fp32";  // fp32 | directq | aqsgd
  int fw_bits = 0, bw_bits = 0;
  std::string dp_optimizer = "adamw";  // adamw | quantized_adam
  int dp_bits = 0;
  bool delayed_update = false;        // "+dpu": job.dp.delayed_update
  std::string schedule = "adaptive";  // job.schedule
  int in_flight = 0;                  // job.schedule_in_flight (0 = the schedule's default)
  std::string store = "rocksdb";      // aqsgd: job.compression.store
  bool streamed = false;              // aqsgd: job.compression.resident_bytes = 0
  std::string Name() const {
    std::string s = link == "fp32" ? "fp32" : absl::StrFormat("%s fw%dbw%d", link, fw_bits, bw_bits);
    if (store != "rocksdb") absl::StrAppend(&s, " ", store);
    if (streamed) absl::StrAppend(&s, " streamed");
    if (dp_optimizer == "quantized_adam") absl::StrAppendFormat(&s, " +qadam%d", dp_bits);
    if (delayed_update) absl::StrAppend(&s, " +dpu");
    if (schedule != "adaptive" || in_flight != 0) absl::StrAppend(&s, " ", ScheduleName());
    return s;
  }
  std::string ScheduleName() const { return in_flight > 0 ? absl::StrCat(schedule, "/", in_flight) : schedule; }
};

// "fp32", "directq:3:6", "aqsgd:4:8" (or "aqsgd:4:8:memory": m(xi) in RAM
// instead of RocksDB; "aqsgd:4:8:streamed": rows read from and written to
// RocksDB every micro-batch instead of kept resident), any of them with
// "+qadam4" and/or "+dpu" (delayed DP updates), then
// optionally "@adaptive" (the default), "@1f1b", "@gpipe", or "@1f1b/W" /
// The job's schedule that JSON names `name` ("adaptive", "1f1b", "gpipe");
// UNSPECIFIED when none does.
v1::JobSpec::Schedule::Value ScheduleNamed(absl::string_view name) {
  const auto* v = job_format::FindJobEnumValue(v1::JobSpec::Schedule::Value_descriptor(), name);
  return v == nullptr ? v1::JobSpec::Schedule::UNSPECIFIED : static_cast<v1::JobSpec::Schedule::Value>(v->number());
}

// "@adaptive/W" (W micro-batches in flight at stage 0).
absl::StatusOr<Mode> ParseMode(absl::string_view text) {
  Mode m;
  if (size_t at = text.find('@'); at != absl::string_view::npos) {
    absl::string_view sched = text.substr(at + 1);
    text = text.substr(0, at);
    std::vector<absl::string_view> parts = absl::StrSplit(sched, absl::MaxSplits('/', 1));
    m.schedule = std::string(parts[0]);
    if (ScheduleNamed(m.schedule) == v1::JobSpec::Schedule::UNSPECIFIED ||
        (parts.size() == 2 &&
         !(m.schedule != "gpipe" && absl::SimpleAtoi(parts[1], &m.in_flight) && m.in_flight >= 1))) {
      return absl::InvalidArgumentError(absl::StrCat("bad schedule in mode '", text, "@", sched,
                                                     "' (want @gpipe, @1f1b, @adaptive, @1f1b/W or @adaptive/W)"));
    }
  }
  std::vector<std::string> plus = absl::StrSplit(text, '+');
  if (plus.size() > 3) return absl::InvalidArgumentError(absl::StrCat("bad mode '", text, "'"));
  for (size_t i = 1; i < plus.size(); ++i) {
    absl::string_view q = plus[i];
    if (q == "dpu" && !m.delayed_update) {
      m.delayed_update = true;
      continue;
    }
    if (m.dp_optimizer == "quantized_adam" || !absl::ConsumePrefix(&q, "qadam") ||
        !absl::SimpleAtoi(q, &m.dp_bits) || m.dp_bits < 1 || m.dp_bits > 8) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad DP option '+", plus[i], "' in mode '", text, "' (want +qadamBITS and/or +dpu)"));
    }
    m.dp_optimizer = "quantized_adam";
  }
  std::vector<std::string> parts = absl::StrSplit(plus[0], ':');
  m.link = parts[0];
  if (m.link == "fp32") {
    if (parts.size() != 1) return absl::InvalidArgumentError(absl::StrCat("fp32 takes no bits: '", text, "'"));
    m.fw_bits = 32;
    m.bw_bits = 32;
    return m;
  }
  if (m.link == "aqsgd" && parts.size() == 4 && (parts[3] == "memory" || parts[3] == "rocksdb")) {
    m.store = parts[3];
    parts.pop_back();
  } else if (m.link == "aqsgd" && parts.size() == 4 && parts[3] == "streamed") {
    m.streamed = true;
    parts.pop_back();
  }
  if ((m.link != "directq" && m.link != "aqsgd") || parts.size() != 3 || !absl::SimpleAtoi(parts[1], &m.fw_bits) ||
      !absl::SimpleAtoi(parts[2], &m.bw_bits) || m.fw_bits < 1 || m.fw_bits > 8 || m.bw_bits < 1 ||
      m.bw_bits > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad mode '", text,
                     "' (want fp32, directq:FW:BW or aqsgd:FW:BW[:memory|:streamed], optionally +qadamBITS, +dpu)"));
  }
  return m;
}

absl::StatusOr<std::vector<Mode>> ParseModes(const std::string& list) {
  std::vector<Mode> out;
  for (absl::string_view t : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    auto m = ParseMode(absl::StripAsciiWhitespace(t));
    if (!m.ok()) return m.status();
    out.push_back(*m);
  }
  return out;
}

// Bandwidths in Mbit/s, 0 = unshaped, always first (it is every mode's
// compute-only limit and the ratios' baseline).
absl::StatusOr<std::vector<double>> ParseBandwidths(const std::string& list) {
  std::vector<double> out = {0};
  for (absl::string_view t : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    t = absl::StripAsciiWhitespace(t);
    double v = 0;
    if (t == "unshaped" || t == "0") continue;
    if (!absl::SimpleAtod(t, &v) || !(v > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("bad bandwidth '", t, "' (Mbit/s > 0, or 'unshaped')"));
    }
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  }
  std::sort(out.begin() + 1, out.end(), std::greater<double>());
  return out;
}

struct Cell {
  int stages = 0, dp = 1;
  Mode mode;
  double bandwidth_mbps = 0;
  // Measured.
  int steps_timed = 0;
  int64_t first_epoch = 0;
  double samples_per_step = 0;   // all pipelines together
  double step_seconds = 0;       // mean over the window
  double samples_per_s = 0;
  double max_dir_bytes_per_step = 0;  // busiest link direction (one pipeline)
  double fw_bytes_per_step = 0, bw_bytes_per_step = 0;  // busiest link, each direction
  double dp_bytes_per_step = 0;       // busiest DP sender (bytes it sent)
  double dp_stage0_bytes_per_step = 0;  // stage 0's DP exchange (the last to start in a step)
  double wall_seconds = 0;
  std::vector<double> passes;  // samples/s of every pass (its own median)
  std::vector<double> step_seconds_list;  // the timed steps of every pass (stage 0), pooled
  double cpu_seconds_per_step = 0;        // all stages (and pipelines)
  std::vector<double> cpu_by_stage;       // per step, summed over pipelines
  std::vector<double> cpu_passes;         // cpu_seconds_per_step of every pass
  // Per step, all stages (getrusage): kernel CPU, minor faults, voluntary and
  // involuntary context switches.
  double sys_seconds_per_step = 0, minor_faults_per_step = 0, ctx_switches_per_step = 0,
         invol_ctx_switches_per_step = 0;
  // Derived.
  double ratio_vs_fp32_unshaped = NAN;
  double compute_limit = NAN, link_limit = NAN, achieved_vs_limit = NAN;
  double schedule_link_limit = NAN, achieved_vs_schedule = NAN;
  double compute_dp_limit = NAN;  // compute-only + stage 0's synchronous DP exchange
  std::string run_dir;
  int interleaved = 1;  // bandwidths interleaved step by step in its runs (sweep)
};

std::string Grid(const Cell& c) { return absl::StrCat(c.dp, "x", c.stages); }

double Median(std::vector<double> v) {  // v non-empty
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

std::vector<int> SweepCellCycle(int n, int period, int first) {
  std::vector<int> base;
  // (The job takes at most 1024 schedule entries: beyond that, plainly.)
  if (period <= 1 || std::gcd(n, period) == 1 || int64_t{n} * std::lcm(n, period) > 1024) {
    for (int k = 0; k < n; ++k) base.push_back(k);
    return base;  // any n consecutive steps hold every cell once
  }
  const int block = std::lcm(n, period);
  for (int b = 0; b < n; ++b) {
    for (int j = 0; j < block; ++j) base.push_back((j + b) % n);
  }
  const int size = static_cast<int>(base.size());
  std::vector<int> cycle(size);
  for (int g = 0; g < size; ++g) cycle[g] = base[((g - first) % size + size) % size];
  return cycle;
}

namespace {

// Runs the cells `run` (one mode and grid, one cell per bandwidth) as one
// `aqswarm pipeline` run on a fresh directory: with several, the job's
// shaping.bandwidth_schedule_mbps interleaves them step by step (step g runs
// cell SweepCellCycle(...)[g % size], mostly run[g % n]), so every bandwidth
// meets the same machine load;
// then splits metrics.csv and the stages' step lines by step.
absl::Status RunCells(const SlownetBenchOptions& o, const fs::path& root, std::vector<Cell>* run) {
  Cell& c0 = run->front();
  const int n_bw = static_cast<int>(run->size());
  // With D > 1 the sample plan deals each epoch's permutation round-robin to
  // the pipelines, so a pipeline meets samples it has never sent on its link
  // in every epoch (fraction ~ (1 - 1/D)^epoch): AQ-SGD sends those FULL.
  // The grid therefore drops more epochs before timing.
  const int skip = c0.mode.link != "aqsgd" ? o.plain_skip_steps : c0.dp > 1 ? o.grid_skip_steps : o.skip_steps;
  const int64_t per_pipeline_step = int64_t{o.micro_batch_size} * o.micro_batches;
  // Exactly steps_per_epoch steps per shard, plus a few validation samples.
  const double val_fraction = 0.02;
  const int64_t train = per_pipeline_step * c0.dp * o.steps_per_epoch;
  const auto samples = static_cast<int64_t>(std::ceil((train + 1) / (1.0 - val_fraction))) + 1;
  std::string name = absl::StrFormat(
      "slownet-%s-%s-%s", Grid(c0), c0.mode.Name(),
      n_bw > 1 ? "sweep" : c0.bandwidth_mbps > 0 ? absl::StrCat(c0.bandwidth_mbps, "mbps") : "unshaped");
  for (char& ch : name) {
    if (ch == ' ' || ch == '+' || ch == '/') ch = '_';
  }
  const fs::path dir = root / name;
  std::error_code ec;
  aqswarm::RemoveTree(dir).IgnoreError();
  fs::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir.string()));
  const int total_steps = skip + o.steps * n_bw;

  nlohmann::json job;
  job["name"] = name;
  job["seed"] = 1;
  job["model"] = {{"vocabSize", o.vocab_size}, {"seqLen", o.seq_len}, {"dModel", o.d_model},
                  {"nLayer", o.n_layer},       {"nHead", o.n_head}};
  job["data"] = {{"syntheticTokens", samples * o.seq_len + 1}, {"validationFraction", val_fraction}};
  job["optimizer"] = {{"lr", 1e-4}, {"gradClip", 1.0}};
  job["microBatchSize"] = o.micro_batch_size;
  job["microBatchesPerStep"] = o.micro_batches;
  job["maxSteps"] = total_steps;
  job["epochs"] = total_steps / o.steps_per_epoch + 2;
  job["compression"] = {{"mode", c0.mode.link}, {"warmupEpochs", 0}, {"mPrecision", "fp16"}, {"store", c0.mode.store}};
  if (c0.mode.streamed) job["compression"]["residentBytes"] = 0;
  if (c0.mode.link != "fp32") {
    job["compression"]["fwBits"] = c0.mode.fw_bits;
    job["compression"]["bwBits"] = c0.mode.bw_bits;
  }
  job["shaping"] = {{"latencyMs", o.latency_ms}};
  if (n_bw == 1) job["shaping"]["bandwidthMbps"] = c0.bandwidth_mbps;
  job["stages"] = c0.stages;
  job["dataParallel"] = c0.dp;
  job["schedule"] = c0.mode.schedule;
  if (c0.mode.in_flight > 0) job["scheduleInFlight"] = c0.mode.in_flight;
  job["threads"] = o.threads;
  job["evalEverySteps"] = 0;
  job["evalBatches"] = 1;
  if (c0.dp > 1) {
    job["dp"] = {{"optimizer", c0.mode.dp_optimizer}};
    if (c0.mode.dp_optimizer == "quantized_adam") {
      job["dp"]["bits"] = c0.mode.dp_bits;
      // Plain AdamW steps first: keep them inside the skipped steps.
      job["dp"]["warmupSteps"] = std::max(1, skip - 1);
    }
    if (c0.mode.delayed_update) job["dp"]["delayedUpdate"] = true;
  }
  // Which cell each step runs (see SweepCellCycle); the job's schedule repeats
  // it. QuantizedAdam's variance refresh period comes from the job's own
  // defaults.
  std::vector<int> cycle(1, 0);
  if (n_bw > 1) {
    AQSWARM_ASSIGN_OR_RETURN(const v1::JobSpec spec, pipeline::ParseJobSpec(job.dump()));
    const int period = c0.dp > 1 && spec.dp().optimizer() == v1::DataParallelSpec::quantized_adam
                           ? static_cast<int>(spec.dp().variance_refresh_steps())
                           : 0;
    cycle = SweepCellCycle(n_bw, period, skip);
    std::vector<double> schedule;
    for (int k : cycle) schedule.push_back((*run)[k].bandwidth_mbps);
    job["shaping"]["bandwidthScheduleMbps"] = schedule;
  }
  auto cell_of = [&cycle](int64_t step) { return cycle[step % static_cast<int64_t>(cycle.size())]; };
  const fs::path job_path = dir / "job.json";
  std::ofstream(job_path) << job.dump(2) << "\n";

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> argv = {o.executable, "pipeline", "--job=" + job_path.string(),
                                   "--out_dir=" + (dir / "run").string()};
  auto child = Subprocess::Spawn(argv, {.capture_stdout = true, .stderr_path = (dir / "pipeline.err").string()});
  if (!child.ok()) return child.status();
  std::ofstream log(dir / "pipeline.out");
  std::string line;
  const auto deadline = absl::Now() + absl::Seconds(o.cell_timeout_s * n_bw);
  while (true) {
    absl::Status s = (*child)->ReadLine(&line, std::max(deadline - absl::Now(), absl::Seconds(1)));
    if (absl::IsOutOfRange(s)) break;
    if (!s.ok()) {
      (*child)->Signal(SIGTERM);
      (void)(*child)->Wait(absl::Seconds(15));
      return absl::DeadlineExceededError(absl::StrCat(name, ": no result within ", o.cell_timeout_s * n_bw, " s (",
                                                      s.message(), "); see ", dir.string()));
    }
    log << line << "\n";
    log.flush();
  }
  auto code = (*child)->Wait(absl::Seconds(60));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!code.ok() || *code != 0) {
    std::ifstream err(dir / "pipeline.err");
    std::stringstream ss;
    ss << err.rdbuf();
    return absl::InternalError(absl::StrCat(name, ": aqswarm pipeline failed (exit ", code.ok() ? *code : -1,
                                            "): ", ss.str().substr(0, 2000)));
  }

  // Per cell (k = cell_of(step)), accumulated over its timed steps.
  struct Acc {
    std::vector<double> secs;
    std::vector<double> fw, bw, dpb;
    std::vector<double> cpu_by_stage;
    double sys = 0, minflt = 0, ctx = 0, ictx = 0;  // per step, all stages
    int64_t first_epoch = -1;
  };
  std::vector<Acc> acc(n_bw);
  for (Acc& a : acc) {
    a.fw.assign(c0.stages - 1, 0);
    a.bw.assign(c0.stages - 1, 0);
    a.dpb.assign(c0.stages, 0);
    a.cpu_by_stage.assign(c0.stages, 0);
  }
  // The run's steps through the launcher's own reader (stage/pipeline_monitor.h):
  // per step every stage's event, the step's time the slowest pipeline's.
  AQSWARM_ASSIGN_OR_RETURN(const v1::JobSpec spec, pipeline::ParseJobSpec(job.dump()));
  absl::StatusOr<std::unique_ptr<stage::PipelineMonitor>> replay =
      stage::PipelineMonitor::Replay(spec, (dir / "run" / "events.jsonl").string());
  if (!replay.ok()) return absl::DataLossError(absl::StrCat(name, ": ", replay.status().message()));
  int64_t timed = 0;
  for (const std::vector<v1::StepEvent>& row : (*replay)->steps()) {
    const int64_t step = row[0].step();
    if (step < skip || step >= total_steps) continue;
    ++timed;
    const int k = cell_of(step);
    Acc& a = acc[k];
    if (a.first_epoch < 0) a.first_epoch = row[0].epoch();
    double secs = 0;
    for (int p = 0; p < c0.dp; ++p) secs = std::max(secs, row[p * c0.stages].step_seconds());
    a.secs.push_back(secs);
    for (int l = 0; l + 1 < c0.stages; ++l) {
      a.fw[l] += static_cast<double>(row[l].fw_bytes());
      a.bw[l] += static_cast<double>(row[l + 1].bw_bytes());
    }
    for (int s = 0; s < c0.stages && c0.dp > 1; ++s) a.dpb[s] += static_cast<double>(row[s].dp().bytes());
  }
  if (timed != total_steps - skip) {
    return absl::DataLossError(absl::StrCat(name, ": ", timed, " complete steps after the first ", skip,
                                            " in events.jsonl, want ", total_steps - skip));
  }
  for (int k = 0; k < n_bw; ++k) {
    if (acc[k].secs.empty()) {
      return absl::DataLossError(absl::StrCat(name, ": no step of ", (*run)[k].bandwidth_mbps, " Mbit/s after the first ",
                                              skip, " in events.jsonl"));
    }
  }
  // CPU time of every stage process over the timed steps, at the step's bandwidth.
  for (const std::vector<v1::StepEvent>& row : (*replay)->steps()) {
    const int64_t step = row[0].step();
    if (step < skip || step >= total_steps) continue;
    const int k = cell_of(step);
    const double want = (*run)[k].bandwidth_mbps;
    const double per = 1.0 / acc[k].secs.size();
    for (const v1::StepEvent& e : row) {
      const int stage = static_cast<int>(e.stage());
      if (std::fabs(e.bandwidth_mbps() - want) > 1e-9 * std::max(1.0, want)) {
        return absl::DataLossError(absl::StrCat(name, ": step ", step, " of stage ", stage, " ran at ",
                                                e.bandwidth_mbps(), " Mbit/s, want ", want));
      }
      acc[k].cpu_by_stage[stage] += e.cpu_seconds() * per;
      acc[k].sys += e.sys_seconds() * per;
      acc[k].minflt += e.minor_faults() * per;
      acc[k].ctx += e.ctx_switches() * per;
      acc[k].ictx += e.invol_ctx_switches() * per;
    }
  }
  for (int k = 0; k < n_bw; ++k) {
    Cell* c = &(*run)[k];
    const Acc& a = acc[k];
    const double n = a.secs.size();
    // (Measured fields start from zero: `c` may hold an earlier pass.)
    c->run_dir = dir.string();
    c->interleaved = n_bw;
    c->wall_seconds = wall / n_bw;
    c->first_epoch = a.first_epoch;
    c->steps_timed = static_cast<int>(n);
    c->samples_per_step = static_cast<double>(per_pipeline_step) * c->dp;
    c->max_dir_bytes_per_step = c->fw_bytes_per_step = c->bw_bytes_per_step = 0;
    c->step_seconds_list = a.secs;
    c->step_seconds = Median(a.secs);
    c->samples_per_s = c->samples_per_step / c->step_seconds;
    c->cpu_by_stage = a.cpu_by_stage;
    c->cpu_seconds_per_step = 0;
    for (double v : c->cpu_by_stage) c->cpu_seconds_per_step += v;
    c->cpu_passes = {c->cpu_seconds_per_step};
    c->sys_seconds_per_step = a.sys;
    c->minor_faults_per_step = a.minflt;
    c->ctx_switches_per_step = a.ctx;
    c->invol_ctx_switches_per_step = a.ictx;
    for (int l = 0; l + 1 < c->stages; ++l) {
      if (std::max(a.fw[l], a.bw[l]) / n > c->max_dir_bytes_per_step) {
        c->max_dir_bytes_per_step = std::max(a.fw[l], a.bw[l]) / n;
        c->fw_bytes_per_step = a.fw[l] / n;
        c->bw_bytes_per_step = a.bw[l] / n;
      }
    }
    c->dp_bytes_per_step = *std::max_element(a.dpb.begin(), a.dpb.end()) / n;
    c->dp_stage0_bytes_per_step = a.dpb.empty() ? 0 : a.dpb[0] / n;
  }
  return absl::OkStatus();
}

// Adds one pass's measurement `run` to `pooled` (a planned cell, or the
// passes so far): the timed steps are pooled and samples/s is their median;
// bytes and CPU per step are averaged over every timed step of every pass.
void PoolPass(const Cell& run, Cell* pooled) {
  if (pooled->passes.empty()) {
    *pooled = run;
    pooled->passes = {run.samples_per_s};
    return;
  }
  const double n0 = pooled->steps_timed, n1 = run.steps_timed, n = n0 + n1;
  auto mix = [&](double a, double b) { return (a * n0 + b * n1) / n; };
  pooled->passes.push_back(run.samples_per_s);
  pooled->step_seconds_list.insert(pooled->step_seconds_list.end(), run.step_seconds_list.begin(),
                                   run.step_seconds_list.end());
  pooled->step_seconds = Median(pooled->step_seconds_list);
  pooled->samples_per_s = pooled->samples_per_step / pooled->step_seconds;
  pooled->max_dir_bytes_per_step = mix(pooled->max_dir_bytes_per_step, run.max_dir_bytes_per_step);
  pooled->fw_bytes_per_step = mix(pooled->fw_bytes_per_step, run.fw_bytes_per_step);
  pooled->bw_bytes_per_step = mix(pooled->bw_bytes_per_step, run.bw_bytes_per_step);
  pooled->dp_bytes_per_step = mix(pooled->dp_bytes_per_step, run.dp_bytes_per_step);
  pooled->dp_stage0_bytes_per_step = mix(pooled->dp_stage0_bytes_per_step, run.dp_stage0_bytes_per_step);
  pooled->cpu_seconds_per_step = mix(pooled->cpu_seconds_per_step, run.cpu_seconds_per_step);
  pooled->cpu_passes.push_back(run.cpu_seconds_per_step);
  pooled->sys_seconds_per_step = mix(pooled->sys_seconds_per_step, run.sys_seconds_per_step);
  pooled->minor_faults_per_step = mix(pooled->minor_faults_per_step, run.minor_faults_per_step);
  pooled->ctx_switches_per_step = mix(pooled->ctx_switches_per_step, run.ctx_switches_per_step);
  pooled->invol_ctx_switches_per_step = mix(pooled->invol_ctx_switches_per_step, run.invol_ctx_switches_per_step);
  for (size_t s = 0; s < pooled->cpu_by_stage.size() && s < run.cpu_by_stage.size(); ++s) {
    pooled->cpu_by_stage[s] = mix(pooled->cpu_by_stage[s], run.cpu_by_stage[s]);
  }
  pooled->first_epoch = std::min(pooled->first_epoch, run.first_epoch);
  pooled->steps_timed += run.steps_timed;
  pooled->wall_seconds += run.wall_seconds;
  pooled->run_dir = run.run_dir;  // the last pass's (each pass reuses the directory)
}

int Cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

std::string Fmt(double v, const char* f = "%.2f") { return std::isfinite(v) ? absl::StrFormat(f, v) : "-"; }

nlohmann::json CellJson(const SlownetBenchOptions& o, const Cell& c, const std::string& blas_core, int cores) {
  auto num = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
  const double per_sample = c.samples_per_step > 0 ? c.dp / c.samples_per_step : 0;  // per pipeline sample
  return {{"bench", "slownet"},
          {"grid", Grid(c)},
          {"stages", c.stages},
          {"dp", c.dp},
          {"mode", c.mode.link},
          {"label", c.mode.Name()},
          {"fw_bits", c.mode.fw_bits},
          {"bw_bits", c.mode.bw_bits},
          {"dp_optimizer", c.dp > 1 ? c.mode.dp_optimizer : "none"},
          {"dp_bits", c.dp > 1 && c.mode.dp_optimizer == "quantized_adam" ? c.mode.dp_bits : 32},
          {"dp_delayed_update", c.dp > 1 && c.mode.delayed_update},
          {"bandwidth_mbps", c.bandwidth_mbps},
          {"samples_per_s", num(c.samples_per_s)},
          {"ratio_vs_fp32_unshaped", num(c.ratio_vs_fp32_unshaped)},
          {"compute_limit_samples_per_s", num(c.compute_limit)},
          {"link_limit_samples_per_s", num(c.link_limit)},
          {"achieved_vs_min_limits", num(c.achieved_vs_limit)},
          {"schedule", c.mode.ScheduleName()},
          {"schedule_link_limit_samples_per_s", num(c.schedule_link_limit)},
          {"compute_dp_limit_samples_per_s", num(c.compute_dp_limit)},
          {"achieved_vs_min_schedule_limits", num(c.achieved_vs_schedule)},
          {"step_seconds", num(c.step_seconds)},
          {"steps_timed", c.steps_timed},
          {"first_timed_epoch", c.first_epoch},
          {"fw_bytes_per_sample", c.fw_bytes_per_step * per_sample},
          {"bw_bytes_per_sample", c.bw_bytes_per_step * per_sample},
          {"dp_bytes_per_step", c.dp_bytes_per_step},
          {"dp_stage0_bytes_per_step", c.dp_stage0_bytes_per_step},
          {"loopback_ms_per_step", (c.max_dir_bytes_per_step + c.dp_bytes_per_step) / 1.2e9 * 1e3},
          {"wall_seconds", c.wall_seconds},
          {"samples_per_s_passes", c.passes},
          {"step_seconds_window", c.step_seconds_list},
          {"cpu_ms_per_sample", num(c.cpu_seconds_per_step / c.samples_per_step * 1e3)},
          {"cpu_ms_per_sample_by_stage", [&] {
             std::vector<double> v;
             for (double x : c.cpu_by_stage) v.push_back(x / c.samples_per_step * 1e3);
             return v;
           }()},
          {"cpu_ms_per_sample_passes", [&] {
             std::vector<double> v;
             for (double x : c.cpu_passes) v.push_back(x / c.samples_per_step * 1e3);
             return v;
           }()},
          {"sys_cpu_ms_per_sample", num(c.sys_seconds_per_step / c.samples_per_step * 1e3)},
          {"minor_faults_per_sample", num(c.minor_faults_per_step / c.samples_per_step)},
          {"ctx_switches_per_sample", num(c.ctx_switches_per_step / c.samples_per_step)},
          {"invol_ctx_switches_per_sample", num(c.invol_ctx_switches_per_step / c.samples_per_step)},
          {"cpu_limit_samples_per_s", num(cores * c.samples_per_step / c.cpu_seconds_per_step)},
          {"cores", cores},
          {"blas_core", blas_core},
          {"model",
           {{"vocab", o.vocab_size}, {"seq_len", o.seq_len}, {"d_model", o.d_model}, {"n_layer", o.n_layer},
            {"n_head", o.n_head}, {"micro_batch", o.micro_batch_size}, {"micro_batches", o.micro_batches},
            {"threads", o.threads}}},
          {"skip_steps", c.mode.link != "aqsgd" ? o.plain_skip_steps : c.dp > 1 ? o.grid_skip_steps : o.skip_steps},
          {"interleaved_bandwidths", c.interleaved},
          {"run_dir", c.run_dir}};
}

}  // namespace

absl::Status RunSlownetBench(const SlownetBenchOptions& o, std::ostream& out) {
  if (o.stages < 2) return absl::InvalidArgumentError("slownet: stages must be >= 2 (links are what we measure)");
  if (o.steps < 1 || o.skip_steps < 0 || o.plain_skip_steps < 0 || o.grid_skip_steps < 0 || o.steps_per_epoch < 1) {
    return absl::InvalidArgumentError("slownet: steps >= 1, skip steps >= 0, steps_per_epoch >= 1");
  }
  if (o.skip_steps < o.steps_per_epoch) {
    std::cerr << "slownet: warning: skip_steps < steps_per_epoch, AQ-SGD's FULL epoch 0 is inside the window\n";
  }
  auto bandwidths = ParseBandwidths(o.bandwidths);
  if (!bandwidths.ok()) return bandwidths.status();
  auto modes = ParseModes(o.modes);
  if (!modes.ok()) return modes.status();
  std::vector<double> grid_bandwidths;
  std::vector<Mode> grid_modes;
  if (o.grid) {
    auto gb = ParseBandwidths(o.grid_bandwidths);
    if (!gb.ok()) return gb.status();
    grid_bandwidths = *gb;
    auto gm = ParseModes(o.grid_modes);
    if (!gm.ok()) return gm.status();
    grid_modes = *gm;
  }

  std::error_code ec;
  fs::path root;
  bool remove_root = false;
  if (!o.out_dir.empty()) {
    root = o.out_dir;
  } else {
    const char* tmp = std::getenv("TMPDIR");
    root = fs::path(tmp && *tmp ? tmp : "/tmp") / absl::StrCat("aqswarm-slownet-", ::getpid());
    remove_root = true;
  }
  fs::create_directories(root, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create ", root.string()));

  // Run a private copy of this executable: the shared build directory may be
  // relinked while the table runs (/proc/self/exe then names a deleted file).
  SlownetBenchOptions opts = o;
  const fs::path exe = root / "aqswarm-slownet-exe";
  fs::copy_file(SelfExecutable(), exe, fs::copy_options::overwrite_existing, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot copy ", SelfExecutable(), " to ", exe.string(), ": ", ec.message()));
  opts.executable = exe.string();

  std::string blas_core = PickOpenBlasCoreForChildren();  // inherited by the pipelines and their stages
  if (blas_core.empty()) blas_core = "none (no OpenBLAS)";
  const int cores = Cores();
  std::vector<Cell> cells;  // mode-major (the JSON's order)
  // Run order (sweep, the default): group by group, one run per mode with
  // every bandwidth of the group interleaved step by step, the modes
  // starting one later from pass to pass. Without sweep: bandwidth by
  // bandwidth, the modes of one bandwidth back to back (rotating likewise),
  // every other pass slowest link first.
  struct Group {
    size_t first;
    int modes, bandwidths;
  };
  std::vector<Group> groups;
  auto plan = [&](int dp, const std::vector<Mode>& ms, const std::vector<double>& bws) {
    groups.push_back({cells.size(), static_cast<int>(ms.size()), static_cast<int>(bws.size())});
    for (const Mode& m : ms) {
      for (double b : bws) {
        Cell c;
        c.stages = o.stages;
        c.dp = dp;
        c.mode = m;
        c.bandwidth_mbps = b;
        cells.push_back(c);
      }
    }
  };
  plan(1, *modes, *bandwidths);
  if (o.grid) plan(o.grid_dp, grid_modes, grid_bandwidths);

  const auto start = std::chrono::steady_clock::now();
  // Repeats run as whole passes over the table (the machine's load drifts
  // over minutes; a pass spreads it over every cell); every pass counts
  // (PoolPass).
  int done = 0;
  for (int r = 0; r < std::max(1, o.repeats); ++r) {
    // Runs of this pass, in order; each is a list of cells (indices into
    // `cells`) that run as one pipeline run: with sweep, one run per mode
    // holding every bandwidth of its group (interleaved step by step, in
    // reverse order every other pass); else one run per cell, the modes of
    // one bandwidth back to back.
    std::vector<std::vector<size_t>> runs;
    for (const Group& g : groups) {
      if (o.sweep) {
        for (int k = 0; k < g.modes; ++k) {
          std::vector<size_t>& run = runs.emplace_back();
          for (int b = 0; b < g.bandwidths; ++b) run.push_back(g.first + ((k + r) % g.modes) * g.bandwidths + b);
          if (r % 2 == 1) std::reverse(run.begin(), run.end());
        }
        continue;
      }
      for (int b = 0; b < g.bandwidths; ++b) {
        for (int k = 0; k < g.modes; ++k) runs.push_back({g.first + ((k + r) % g.modes) * g.bandwidths + b});
      }
    }
    if (r % 2 == 1 && !o.sweep) std::reverse(runs.begin(), runs.end());
    for (const std::vector<size_t>& run : runs) {
      std::vector<Cell> measured;
      for (size_t i : run) measured.push_back(cells[i]);
      absl::Status s = RunCells(opts, root, &measured);
      if (!s.ok()) return s;
      for (size_t k = 0; k < run.size(); ++k) {
        const Cell& c = measured[k];
        std::cerr << absl::StrFormat(
            "slownet [pass %d, %2d/%d] %s %-22s %8s Mbit/s  %9.1f samples/s  (%d steps, %.1f s)\n", r + 1, ++done,
            static_cast<int>(cells.size()) * std::max(1, o.repeats), Grid(c), c.mode.Name(),
            c.bandwidth_mbps > 0 ? absl::StrCat(c.bandwidth_mbps) : "unshaped", c.samples_per_s, c.steps_timed,
            c.wall_seconds);
        PoolPass(c, &cells[run[k]]);
      }
    }
  }

  // Baselines and limits.
  auto find = [&](int dp, const std::string& mode_name, double b) -> const Cell* {
    for (const Cell& c : cells) {
      if (c.dp == dp && c.mode.Name() == mode_name && c.bandwidth_mbps == b) return &c;
    }
    return nullptr;
  };
  for (Cell& c : cells) {
    const Cell* base = find(c.dp, Mode().Name(), 0);
    if (base == nullptr) base = find(1, Mode().Name(), 0);
    if (base != nullptr) c.ratio_vs_fp32_unshaped = c.samples_per_s / base->samples_per_s;
    const Cell* own = find(c.dp, c.mode.Name(), 0);
    if (own != nullptr) c.compute_limit = own->samples_per_s;
    const double busiest = std::max(c.max_dir_bytes_per_step, c.dp_bytes_per_step);
    c.link_limit = c.bandwidth_mbps > 0 && busiest > 0 ? c.samples_per_step * c.bandwidth_mbps * 1e6 / (8 * busiest)
                                                       : INFINITY;
    c.achieved_vs_limit = c.samples_per_s / std::min(c.compute_limit, c.link_limit);
    if (c.bandwidth_mbps > 0) {
      const double bps = c.bandwidth_mbps * 1e6 / 8;  // bytes per second
      v1::JobSpec job;
      job.set_schedule(ScheduleNamed(c.mode.schedule));
      job.set_schedule_in_flight(c.mode.in_flight);
      job.set_stages(c.stages);
      job.set_micro_batches_per_step(o.micro_batches);
      const pipeline::StepSchedule sched = pipeline::StepScheduleFromJob(job).value();  // ParseMode checked it
      const double m = o.micro_batches;
      const double links = pipeline::LinkBoundStepTime(sched, c.fw_bytes_per_step / m / bps, c.bw_bytes_per_step / m / bps);
      // A synchronous exchange follows the flush; a delayed one runs beside
      // the next step on its own connections.
      const double dp = c.dp_bytes_per_step / bps;
      const double t = c.mode.delayed_update ? std::max(links, dp) : links + dp;
      c.schedule_link_limit = t > 0 ? c.samples_per_step / t : INFINITY;
      // Stage 0 runs the step's last backward, so its synchronous exchange
      // starts when every other stage's work is done, and no stage has work
      // of the next step before it ends (all of it sent after the last
      // replica is ready: its scatter chunks and its reduced chunk): it adds
      // its wire time to the compute-only step.
      const double tail = c.dp > 1 && !c.mode.delayed_update ? c.dp_stage0_bytes_per_step / bps : 0;
      c.compute_dp_limit = c.samples_per_step / (c.samples_per_step / c.compute_limit + tail);
    } else {
      c.schedule_link_limit = INFINITY;
      c.compute_dp_limit = c.compute_limit;
    }
    c.achieved_vs_schedule = c.samples_per_s / std::min(c.compute_dp_limit, c.schedule_link_limit);
  }

  if (o.json) {
    for (const Cell& c : cells) out << CellJson(o, c, blas_core, cores).dump() << "\n";
  } else {
    out << absl::StrFormat("aqswarm bench slownet: %d stages, GPT vocab %d seq %d d_model %d layers %d heads %d, "
                           "micro-batch %d x %d per step, %d thread(s)/stage; %d timed steps after %d\n",
                           o.stages, o.vocab_size, o.seq_len, o.d_model, o.n_layer, o.n_head, o.micro_batch_size,
                           o.micro_batches, o.threads, o.steps, o.skip_steps);
    out << absl::StrFormat("OpenBLAS kernels: %s; %d cores\n", blas_core, cores);
    out << absl::StrFormat("%-5s %-22s %9s %10s %7s %10s %10s %10s %10s %8s %9s %9s %9s %8s %8s\n", "grid", "mode",
                           "Mbit/s", "samples/s", "ratio", "compute", "compute+dp", "wire_lim", "sched_lim", "ach_wire",
                           "ach_sched",
                           "fwB/samp", "bwB/samp", "cpu_ms/s", "cpu_lim");
    for (const Cell& c : cells) {
      const double per_sample = c.dp / c.samples_per_step;
      out << absl::StrFormat("%-5s %-22s %9s %10.1f %7s %10s %10s %10s %10s %8s %9s %9.0f %9.0f %8.3f %8.0f\n", Grid(c),
                             c.mode.Name(),
                             c.bandwidth_mbps > 0 ? absl::StrCat(c.bandwidth_mbps) : "unshaped", c.samples_per_s,
                             Fmt(c.ratio_vs_fp32_unshaped, "%.3f"), Fmt(c.compute_limit, "%.1f"),
                             Fmt(c.compute_dp_limit, "%.1f"), Fmt(c.link_limit, "%.1f"), Fmt(c.schedule_link_limit, "%.1f"),
                             Fmt(c.achieved_vs_limit, "%.2f"), Fmt(c.achieved_vs_schedule, "%.2f"),
                             c.fw_bytes_per_step * per_sample, c.bw_bytes_per_step * per_sample,
                             c.cpu_seconds_per_step / c.samples_per_step * 1e3,
                             cores * c.samples_per_step / c.cpu_seconds_per_step);
    }
    out << absl::StrFormat("total wall time %.0f s; raw runs in %s\n",
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                           remove_root ? "(removed)" : root.string());
  }
  fs::remove(exe, ec);
  if (remove_root) aqswarm::RemoveTree(root).IgnoreError();
  return absl::OkStatus();
}

}  // namespace aqswarm::bench
