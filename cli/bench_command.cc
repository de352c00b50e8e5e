#include <iostream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "cli/command.h"

ABSL_FLAG(bool, json, false, "Print one JSON object per line instead of a table.");
ABSL_FLAG(int64_t, mib, 64, "Compression bench: MiB of float32 input.");
ABSL_FLAG(int32_t, repeats, 3, "Timed repetitions per cell; the best is reported.");
ABSL_FLAG(std::string, codecs, "", "Compression bench: comma-separated codec names (empty = all).");
ABSL_FLAG(std::string, dir, "", "Store bench: directory for the store and baseline files "
          "(default $TMPDIR or /tmp).");
ABSL_FLAG(int64_t, samples, 10000, "Store bench: samples per workload.");
ABSL_FLAG(int64_t, micro_batch, 8, "Store bench: rows per micro-batch.");
ABSL_FLAG(int64_t, prefetch, 0,
          "Store bench: prefetch depth in micro-batches (0 = as many as 256 MiB of fp32 rows hold, at least 4).");
ABSL_FLAG(std::string, shapes, "128x768,1024x1600", "Store bench: fp16 row shapes ROWSxCOLS.");
ABSL_FLAG(std::string, store_backends, "file_seq,rocksdb,memory",
          "Store bench: comma-separated backends to run (file_seq, rocksdb, memory).");
ABSL_FLAG(std::string, link_shape, "64x32", "Link bench: row shape SEQ_LENxD_MODEL (fp16 m rows).");
ABSL_FLAG(int32_t, link_fw_bits, 3, "Link bench: activation bits.");
ABSL_FLAG(int64_t, link_samples, 512, "Link bench: samples per epoch.");
ABSL_FLAG(int64_t, link_epochs, 8, "Link bench: timed epochs (after AQ-SGD's FULL epoch 0).");
ABSL_FLAG(int64_t, link_thrash_bytes, 0,
          "Link bench: bytes of a buffer rewritten between micro-batches (untimed), as the model's work would: "
          "the rows meet cold caches. 0 = none.");
ABSL_FLAG(std::string, link_stores, "resident,rocksdb,rocksdb_prefetch,rocksdb_skiplist,memory",
          "Link bench: AQ-SGD stores to run (resident: rows kept in the endpoint, RocksDB behind; the others "
          "stream every micro-batch: rocksdb, rocksdb_prefetch, rocksdb_skiplist, memory).");
ABSL_FLAG(std::string, sched_sizes, "8,16,64,256", "Scheduler bench: comma-separated peer counts.");
ABSL_FLAG(uint64_t, seed, 1, "Seed: of the scheduler bench's synthetic networks and solver; of generate's sampling.");
ABSL_FLAG(std::string, slownet_bandwidths, "0,1000,500,300,100,10",
          "Slownet bench: link bandwidths in Mbit/s (0 = unshaped, always run).");
ABSL_FLAG(std::string, slownet_modes, "fp32,directq:3:6,aqsgd:3:6,aqsgd:4:8",
          "Slownet bench: modes fp32 | directq:FW:BW | aqsgd:FW:BW[:memory|:streamed] (m(xi) in RAM, not RocksDB; or rows streamed through RocksDB every micro-batch instead of kept resident), "
          "optionally +qadamBITS and/or +dpu (delayed DP updates, dp.delayed_update), then optionally "
          "@adaptive (default) | @1f1b | @gpipe | @adaptive/W | @1f1b/W (W micro-batches in flight at stage 0).");
ABSL_FLAG(bool, slownet_grid, true, "Slownet bench: also run the data-parallel grid.");
ABSL_FLAG(int32_t, slownet_grid_dp, 2, "Slownet bench: pipelines in the data-parallel grid.");
ABSL_FLAG(std::string, slownet_grid_modes, "fp32,aqsgd:3:6,fp32+qadam4,aqsgd:3:6+qadam4,aqsgd:3:6+dpu,aqsgd:3:6+qadam4+dpu",
          "Slownet bench: modes of the data-parallel grid.");
ABSL_FLAG(std::string, slownet_grid_bandwidths, "0,300,100,10", "Slownet bench: bandwidths of the grid.");
ABSL_FLAG(int32_t, slownet_stages, 4, "Slownet bench: pipeline stages.");
ABSL_FLAG(int32_t, slownet_vocab, 256, "Slownet bench: model vocabulary.");
ABSL_FLAG(int32_t, slownet_seq_len, 64, "Slownet bench: tokens per sample.");
ABSL_FLAG(int32_t, slownet_d_model, 32, "Slownet bench: model width.");
ABSL_FLAG(int32_t, slownet_layers, 4, "Slownet bench: transformer blocks (split over the stages).");
ABSL_FLAG(int32_t, slownet_heads, 2, "Slownet bench: attention heads.");
ABSL_FLAG(int32_t, slownet_micro_batch, 8, "Slownet bench: samples per micro-batch.");
ABSL_FLAG(int32_t, slownet_micro_batches, 128,
          "Slownet bench: micro-batches per step (many: a step's flush costs (K-1)(t_fw+t_bw) of link time).");
ABSL_FLAG(int32_t, slownet_threads, 1, "Slownet bench: intra-op threads per stage process.");
ABSL_FLAG(double, slownet_latency_ms, 0, "Slownet bench: one-way link latency in ms.");
ABSL_FLAG(int32_t, slownet_steps_per_epoch, 1, "Slownet bench: steps per epoch of the synthetic corpus.");
ABSL_FLAG(int32_t, slownet_skip_steps, 3,
          "Slownet bench: steps dropped before timing in AQ-SGD cells (start-up, FULL epoch).");
ABSL_FLAG(int32_t, slownet_plain_skip_steps, 2,
          "Slownet bench: steps dropped before timing in fp32 and DirectQ cells (start-up; they keep no state).");
ABSL_FLAG(int32_t, slownet_grid_skip_steps, 7, "Slownet bench: steps dropped in the DP grid's AQ-SGD cells (AQ-SGD meets unseen samples in later epochs when D > 1).");
ABSL_FLAG(int32_t, slownet_repeats, 2,
          "Slownet bench: passes over the table; a cell's samples/s = samples per step / the median step time "
          "of its timed steps in all passes, pooled.");
ABSL_FLAG(int32_t, slownet_steps, 3, "Slownet bench: timed steps per cell and pass.");
ABSL_FLAG(bool, slownet_sweep, true,
          "Slownet bench: one pipeline run per mode (and pass) with its bandwidths interleaved step by step; "
          "false: one run per cell.");
ABSL_FLAG(std::string, slownet_out_dir, "", "Slownet bench: keep the raw runs here (default: a temporary "
          "directory, removed).");
ABSL_FLAG(std::string, configs, "adamw-fp32,qadam-aqsgd,diloco-h16-aqsgd,diloco-h32-aqsgd,diloco-h64-aqsgd",
          "Converge bench: configurations OPT-LINK (OPT adamw | qadam | diloco-hH; LINK fp32 | directq | aqsgd | "
          "tiledB | aqsgd_tiledB, all but fp32 optionally with _ent); adamw-fp32, the baseline, always runs first.");
ABSL_FLAG(std::string, shapings, "0/0,100/50,10/50",
          "Converge bench: link shapings MBIT/MS (Mbit/s / one-way ms; 0/0 = unshaped, always run first).");
ABSL_FLAG(double, target_val_loss, 0,
          "Converge bench: target validation loss (0 = the baseline's final one x (1 + --target_slack)).");
ABSL_FLAG(std::string, baseline, "",
          "Converge bench: a JSONL file of an earlier converge bench of the same job; its unshaped adamw-fp32 row "
          "is the baseline, which then does not run (empty: run it).");
ABSL_FLAG(double, target_slack, 0.01, "Converge bench: the default target's margin above the baseline's final val loss.");
ABSL_FLAG(int32_t, shaped_steps, 8,
          "Converge bench: least steps a shaped run trains before its time to target is extrapolated (it also runs "
          "past the 2nd step of every DP step kind, in whole diloco outer periods).");
ABSL_FLAG(double, churn_seconds, 300, "Churn bench: measured seconds per run (after the warm-up).");
ABSL_FLAG(double, kill_every_s, 30, "Churn bench: mean seconds between kills of a random placed peer (Poisson).");
ABSL_FLAG(int32_t, standbys, 2, "Churn bench: standby peers beside the job's stages x dataParallel placed ones.");
ABSL_FLAG(int32_t, churn_warmup_steps, 3, "Churn bench: steps the swarm trains before a run's measurement starts.");
ABSL_DECLARE_FLAG(std::string, job);
ABSL_DECLARE_FLAG(std::string, out_dir);
ABSL_DECLARE_FLAG(double, lease_s);
ABSL_DECLARE_FLAG(bool, fault_domains);
ABSL_DECLARE_FLAG(int32_t, link_timeout_s);

namespace aqswarm::cli {
int BenchReport(const absl::Status& s, const char* name) {
  if (s.ok()) return 0;
  std::cerr << "aqswarm bench " << name << ": " << s << "\n";
  return 1;
}

int BenchNoArgs(const std::vector<std::string>& args, const char* name) {
  if (args.empty()) return 0;
  std::cerr << "aqswarm bench " << name << ": unexpected argument '" << args[0] << "'\n";
  return 2;
}

std::vector<Command> BenchCommands() {
  std::vector<Command> out;
  out.push_back({"bench compression",
                 "Encode/decode throughput of every codec against memcpy of the same buffer.",
                 "Input: float32 drawn from a heavy-tailed activation-like distribution.",
                 {"json", "mib", "repeats", "codecs"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = BenchNoArgs(args, "compression")) return rc;
                   bench::CompressionBenchOptions o;
                   o.mebibytes = absl::GetFlag(FLAGS_mib);
                   o.repeats = absl::GetFlag(FLAGS_repeats);
                   o.codecs = absl::GetFlag(FLAGS_codecs);
                   o.json = absl::GetFlag(FLAGS_json);
                   return BenchReport(bench::RunCompressionBench(o, std::cout), "compression");
                 }});
  out.push_back({"bench store",
                 "Per-sample message store through the prefetcher: RocksDB vs in-memory vs a "
                 "sequential file baseline, plus the hidden-I/O stall scenario.",
                 "",
                 {"json", "dir", "samples", "micro_batch", "prefetch", "shapes", "store_backends"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = BenchNoArgs(args, "store")) return rc;
                   bench::StoreBenchOptions o;
                   o.dir = absl::GetFlag(FLAGS_dir);
                   o.samples = absl::GetFlag(FLAGS_samples);
                   o.micro_batch = absl::GetFlag(FLAGS_micro_batch);
                   o.prefetch_batches = absl::GetFlag(FLAGS_prefetch);
                   o.shapes = absl::GetFlag(FLAGS_shapes);
                   o.backends = absl::GetFlag(FLAGS_store_backends);
                   o.json = absl::GetFlag(FLAGS_json);
                   return BenchReport(bench::RunStoreBench(o, std::cout), "store");
                 }});
  out.push_back({"bench link",
                 "CPU per sample of one link's two ends (no model, no transport): AQ-SGD's per-sample "
                 "state (store + prefetcher + delta coding) against DirectQ with the same quantizer.",
                 "",
                 {"json", "dir", "micro_batch", "repeats", "link_shape", "link_fw_bits", "link_samples",
                  "link_epochs", "link_thrash_bytes", "link_stores"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = BenchNoArgs(args, "link")) return rc;
                   bench::LinkBenchOptions o;
                   const std::string shape = absl::GetFlag(FLAGS_link_shape);
                   if (!bench::ParseRowShape(shape, &o.rows, &o.cols)) {
                     std::cerr << "aqswarm bench link: --link_shape must be ROWSxCOLS, got '" << shape << "'\n";
                     return 2;
                   }
                   o.fw_bits = absl::GetFlag(FLAGS_link_fw_bits);
                   o.samples = absl::GetFlag(FLAGS_link_samples);
                   o.epochs = absl::GetFlag(FLAGS_link_epochs);
                   o.thrash_bytes = absl::GetFlag(FLAGS_link_thrash_bytes);
                   o.micro_batch = absl::GetFlag(FLAGS_micro_batch);
                   o.stores = absl::GetFlag(FLAGS_link_stores);
                   o.repeats = absl::GetFlag(FLAGS_repeats);
                   o.dir = absl::GetFlag(FLAGS_dir);
                   o.json = absl::GetFlag(FLAGS_json);
                   return BenchReport(bench::RunLinkBench(o, std::cout), "link");
                 }});
  out.push_back({"bench scheduler",
                 "Placement solver (coordinator/placement.h): cost vs the exhaustive optimum (N <= 8) "
                 "and vs random placement, and solve time, on clustered and world-wide networks.",
                 "repeats = random instances per scenario and size (at least 20 when N <= 8).",
                 {"json", "sched_sizes", "seed", "repeats"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = BenchNoArgs(args, "scheduler")) return rc;
                   bench::SchedulerBenchOptions o;
                   o.sizes = absl::GetFlag(FLAGS_sched_sizes);
                   o.seed = absl::GetFlag(FLAGS_seed);
                   o.repeats = absl::GetFlag(FLAGS_repeats);
                   o.json = absl::GetFlag(FLAGS_json);
                   return BenchReport(bench::RunSchedulerBench(o, std::cout), "scheduler");
                 }});
  out.push_back({"bench slownet",
                 "AQ-SGD paper Table 2 as ratios: samples/s of a K-stage GPT pipeline (and a D x K grid) "
                 "per link mode and shaped bandwidth, vs unshaped fp32, with compute-only and link-bound limits.",
                 "Each cell runs `aqswarm pipeline` on 127.0.0.1 with user-space shaping; timing skips "
                 "AQ-SGD's FULL epoch 0. The default table takes ~10-20 minutes on 2 cores.",
                 {"json", "slownet_bandwidths", "slownet_modes", "slownet_grid", "slownet_grid_dp",
                  "slownet_grid_modes", "slownet_grid_bandwidths", "slownet_stages", "slownet_vocab",
                  "slownet_seq_len", "slownet_d_model", "slownet_layers", "slownet_heads", "slownet_micro_batch",
                  "slownet_micro_batches", "slownet_threads", "slownet_latency_ms", "slownet_steps_per_epoch",
                  "slownet_skip_steps", "slownet_plain_skip_steps", "slownet_grid_skip_steps", "slownet_steps", "slownet_sweep", "slownet_repeats", "slownet_out_dir"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = BenchNoArgs(args, "slownet")) return rc;
                   bench::SlownetBenchOptions o;
                   o.bandwidths = absl::GetFlag(FLAGS_slownet_bandwidths);
                   o.modes = absl::GetFlag(FLAGS_slownet_modes);
                   o.grid = absl::GetFlag(FLAGS_slownet_grid);
                   o.grid_dp = absl::GetFlag(FLAGS_slownet_grid_dp);
                   o.grid_modes = absl::GetFlag(FLAGS_slownet_grid_modes);
                   o.grid_bandwidths = absl::GetFlag(FLAGS_slownet_grid_bandwidths);
                   o.stages = absl::GetFlag(FLAGS_slownet_stages);
                   o.vocab_size = absl::GetFlag(FLAGS_slownet_vocab);
                   o.seq_len = absl::GetFlag(FLAGS_slownet_seq_len);
                   o.d_model = absl::GetFlag(FLAGS_slownet_d_model);
                   o.n_layer = absl::GetFlag(FLAGS_slownet_layers);
                   o.n_head = absl::GetFlag(FLAGS_slownet_heads);
                   o.micro_batch_size = absl::GetFlag(FLAGS_slownet_micro_batch);
                   o.micro_batches = absl::GetFlag(FLAGS_slownet_micro_batches);
                   o.threads = absl::GetFlag(FLAGS_slownet_threads);
                   o.latency_ms = absl::GetFlag(FLAGS_slownet_latency_ms);
                   o.steps_per_epoch = absl::GetFlag(FLAGS_slownet_steps_per_epoch);
                   o.skip_steps = absl::GetFlag(FLAGS_slownet_skip_steps);
                   o.plain_skip_steps = absl::GetFlag(FLAGS_slownet_plain_skip_steps);
                   o.grid_skip_steps = absl::GetFlag(FLAGS_slownet_grid_skip_steps);
                   o.repeats = absl::GetFlag(FLAGS_slownet_repeats);
                   o.steps = absl::GetFlag(FLAGS_slownet_steps);
                   o.sweep = absl::GetFlag(FLAGS_slownet_sweep);
                   o.out_dir = absl::GetFlag(FLAGS_slownet_out_dir);
                   o.json = absl::GetFlag(FLAGS_json);
                   return BenchReport(bench::RunSlownetBench(o, std::cout), "slownet");
                 }});
  out.push_back({"bench converge",
                 "Time to a target validation loss: a base job under DP optimizers x link compression "
                 "x link shapings, one JSON object per run, ratios against AdamW + fp32 links.",
                 "Runs `aqswarm pipeline` per (configuration, shaping) on 127.0.0.1 from the working directory (the "
                 "job's relative data paths). Shaped runs train their first steps only and must match the unshaped "
                 "run's losses bit for bit; the rest of their time to target is extrapolated per DP step kind "
                 "(bench/converge_bench.cc). --out_dir keeps the runs.",
                 {"job", "configs", "shapings", "target_val_loss", "target_slack", "shaped_steps", "out_dir", "baseline"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = BenchNoArgs(args, "converge")) return rc;
                   bench::ConvergeBenchOptions o;
                   o.job = absl::GetFlag(FLAGS_job);
                   o.configs = absl::GetFlag(FLAGS_configs);
                   o.shapings = absl::GetFlag(FLAGS_shapings);
                   o.target_val_loss = absl::GetFlag(FLAGS_target_val_loss);
                   o.target_slack = absl::GetFlag(FLAGS_target_slack);
                   o.shaped_steps = absl::GetFlag(FLAGS_shaped_steps);
                   o.out_dir = absl::GetFlag(FLAGS_out_dir);
                   o.baseline = absl::GetFlag(FLAGS_baseline);
                   return BenchReport(bench::RunConvergeBench(o, std::cout), "converge");
                 }});
  out.push_back({"bench churn",
                 "What peer losses cost a real swarm: an undisturbed run of a job, then one with a random placed "
                 "peer SIGKILLed at Poisson times; one JSON line per run (throughput ratio, seconds lost per kill, "
                 "healthy steps redone, the hit pipeline's recovery, loss at equal steps).",
                 "Runs a real coordinator and stages x dataParallel + --standbys real peers on 127.0.0.1 from the "
                 "working directory (the job's relative data paths), each run from scratch; a fresh peer arrives for "
                 "each kill (bench/churn_bench.cc). --out_dir keeps both runs' logs and states.",
                 {"job", "churn_seconds", "kill_every_s", "standbys", "churn_warmup_steps", "lease_s", "link_timeout_s",
                  "fault_domains", "seed", "out_dir"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = BenchNoArgs(args, "churn")) return rc;
                   bench::ChurnBenchOptions o;
                   o.job = absl::GetFlag(FLAGS_job);
                   o.seconds = absl::GetFlag(FLAGS_churn_seconds);
                   o.kill_every_s = absl::GetFlag(FLAGS_kill_every_s);
                   o.standbys = absl::GetFlag(FLAGS_standbys);
                   o.warmup_steps = absl::GetFlag(FLAGS_churn_warmup_steps);
                   o.lease_s = absl::GetFlag(FLAGS_lease_s);
                   o.link_timeout_s = absl::GetFlag(FLAGS_link_timeout_s);
                   o.fault_domains = absl::GetFlag(FLAGS_fault_domains);
                   o.seed = absl::GetFlag(FLAGS_seed);
                   o.out_dir = absl::GetFlag(FLAGS_out_dir);
                   return BenchReport(bench::RunChurnBench(o, std::cout), "churn");
                 }});
  return out;
}

}  // namespace aqswarm::cli
