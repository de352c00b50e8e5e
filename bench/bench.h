// Benchmarks behind `aqswarm bench <name>`. Each prints a human table, or with
// `json` one JSON object per line, and always measures its baseline in the
// same run (these machines are noisy).
#ifndef AQSWARM_BENCH_BENCH_H_
#define AQSWARM_BENCH_BENCH_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace aqswarm::bench {

struct CompressionBenchOptions {
  // Input size in MiB of float32. Default: 64.
  int64_t mebibytes = 64;
  // Timed repetitions per cell; the best is reported. Default: 3.
  int repeats = 3;
  // Comma-separated codec filter ("" = all).
  std::string codecs;
  bool json = false;
};
absl::Status RunCompressionBench(const CompressionBenchOptions& options, std::ostream& out);

struct StoreBenchOptions {
  // Directory for the RocksDB store and the baseline file; a fresh temporary
  // directory under it is used and removed. Default: $TMPDIR or /tmp.
  std::string dir;
  // Samples per workload. Default: 10000.
  int64_t samples = 10000;
  // Micro-batch size (rows per get/put batch). Default: 8.
  int64_t micro_batch = 8;
  // Prefetch depth in micro-batches; 0 = as many as kAutoPrefetchBytes of
  // fp32 rows hold (at least 4). Default: 0.
  int64_t prefetch_batches = 0;
  // Comma-separated row shapes "ROWSxCOLS" (fp16). Default: the two.
  std::string shapes = "128x768,1024x1600";
  // Comma-separated backends to run, in this order per shape: file_seq (the
  // sequential-file baseline), rocksdb, memory. Default: all three.
  std::string backends = "file_seq,rocksdb,memory";
  bool json = false;
};
inline constexpr int64_t kAutoPrefetchBytes = int64_t{256} << 20;  // the Prefetcher's default memory bound
absl::Status RunStoreBench(const StoreBenchOptions& options, std::ostream& out);

// `aqswarm bench link`: CPU per sample of one link's two ends (sender +
// receiver, each with its own store), AQ-SGD vs DirectQ, no model and no
// transport. See link_bench.cc.
struct LinkBenchOptions {
  // Row shape (seq_len x d_model; fp16 m rows). Default: the slownet bench's.
  int64_t rows = 64;
  int64_t cols = 32;
  int fw_bits = 3;
  // Samples per epoch, timed epochs (after AQ-SGD's FULL epoch 0), rows per
  // micro-batch. Default: one slownet step per epoch.
  int64_t samples = 512;
  int64_t epochs = 8;
  int64_t micro_batch = 8;
  // Bytes of a buffer rewritten between micro-batches, outside the timed
  // CPU (its own CPU is subtracted): stands in for the model, whose work
  // between two link calls evicts the rows from the caches. 0 = none.
  int64_t thrash_bytes = 0;
  // Comma-separated AQ-SGD stores: rocksdb, rocksdb_prefetch,
  // rocksdb_skiplist, memory. DirectQ always runs.
  std::string stores = "rocksdb,rocksdb_prefetch,rocksdb_skiplist,memory";
  // Runs per cell; the lowest CPU time is kept. Default: 3.
  int repeats = 3;
  uint64_t seed = 1;
  // Directory for the RocksDB stores (a temporary directory under it).
  std::string dir;
  bool json = false;
};
absl::Status RunLinkBench(const LinkBenchOptions& options, std::ostream& out);

struct SchedulerBenchOptions {
  // Seed of the synthetic networks and of the solver. Default: 1.
  uint64_t seed = 1;
  // Comma-separated peer counts N. Default: "8,16,64,256".
  std::string sizes = "8,16,64,256";
  // Random instances per (scenario, N); at least 20 when N <= 8, where the
  // exhaustive optimum is cheap. Default: 3.
  int repeats = 3;
  bool json = false;
};
absl::Status RunSchedulerBench(const SchedulerBenchOptions& options, std::ostream& out);

struct AllreduceBenchOptions {
  // Comma-separated replica counts. Default: "2,4".
  std::string dps = "2,4";
  // Comma-separated link bandwidths in Mbit/s (0 = unshaped). Default: "0,100".
  std::string bandwidths_mbps = "0,100";
  // Comma-separated cells: 32 = uncompressed fp32, N = min-max N bits with
  // error feedback, gqN = Global-QSGD N bits (exponential levels, integer-sum
  // path). Default: "32,8,4,1,gq8".
  std::string bits = "32,8,4,1,gq8";
  // Floats averaged per exchange. Default: 25 M.
  int64_t elements = 25'000'000;
  // Timed exchanges per cell (after one warm-up); the best is reported. Default: 2.
  int repeats = 2;
  bool json = false;
};
absl::Status RunAllreduceBench(const AllreduceBenchOptions& options, std::ostream& out);

// One worker process of the allreduce bench (`aqswarm bench allreduce-worker`):
// prints {"event":"listening","port":N}, reads {"replicas":[...]} on stdin,
// runs the exchanges, prints one {"event":"result",...} line per bits value.
struct AllreduceWorkerOptions {
  int rank = 0;
  int size = 2;
  int64_t elements = 25'000'000;
  double bandwidth_mbps = 0;
  std::string bits = "32,8,4,1,gq8";
  int repeats = 2;
};
absl::Status RunAllreduceWorker(const AllreduceWorkerOptions& options, std::ostream& out);

// `aqswarm bench slownet`: the AQ-SGD paper's Table 2 as ratios. One real
// `aqswarm pipeline` run per (mode, bandwidth) cell on 127.0.0.1 with
// user-space link shaping; samples/s over steady-state steps (after AQ-SGD's
// FULL epoch 0), its ratio to unshaped fp32, the compute-only limit (same mode,
// unshaped links), the link-bound limit (bandwidth / bytes per step of the
// busiest link direction) and achieved / min(limits). See slownet_bench.cc.
struct SlownetBenchOptions {
  // Mbit/s list; 0 or "unshaped" = no shaping (always run). Default: the issue's.
  std::string bandwidths = "0,1000,500,300,100,10";
  // Comma-separated modes: fp32 | directq:FW:BW | aqsgd:FW:BW [+qadamBITS].
  std::string modes = "fp32,directq:3:6,aqsgd:3:6,aqsgd:4:8";
  // Also run the grid_dp x stages grid (data parallelism over shaped links).
  bool grid = true;
  int grid_dp = 2;
  std::string grid_modes = "fp32,aqsgd:3:6,fp32+qadam4,aqsgd:3:6+qadam4";
  std::string grid_bandwidths = "0,300,100,10";
  int stages = 4;
  // Model and batch (see docs/METHODOLOGY.md, slow networks: Scaling argument,
  // for why these sizes).
  int vocab_size = 256;
  int seq_len = 64;
  int d_model = 32;
  int n_layer = 4;
  int n_head = 2;
  int micro_batch_size = 8;
  int micro_batches = 128;
  int threads = 1;
  double latency_ms = 0;
  // Steps per epoch of the synthetic corpus; steps skipped in AQ-SGD cells
  // (start-up and the FULL epoch 0); in fp32 and DirectQ cells (start-up:
  // they keep no per-sample state); steps timed.
  int steps_per_epoch = 1;
  int skip_steps = 3;
  int plain_skip_steps = 2;
  // Steps dropped in the D x K grid's AQ-SGD cells (see slownet_bench.cc:
  // with D > 1 a pipeline meets unseen samples in later epochs too).
  int grid_skip_steps = 7;
  int steps = 3;
  // One pipeline run per mode and grid (and pass) with its bandwidths
  // interleaved step by step (JobSpec shaping.bandwidth_schedule_mbps): every
  // bandwidth, the compute-only one included, meets the same machine load.
  // false: one run per cell. Default: true.
  bool sweep = true;
  // Passes over the whole table; a cell's samples/s = samples per step / the
  // median step_seconds of its timed steps in all passes, pooled. Default: 2.
  int repeats = 2;
  // Keep the raw runs here (job.json, pipeline output, metrics.csv, stage
  // logs); empty = a temporary directory, removed at the end.
  std::string out_dir;
  int cell_timeout_s = 600;
  // Set by RunSlownetBench (a private copy of this executable).
  std::string executable;
  bool json = false;
};
absl::Status RunSlownetBench(const SlownetBenchOptions& options, std::ostream& out);

// In a sweep, which of its n cells (bandwidths) step g runs: entry g % size
// of the returned cycle. Plainly g % n, unless the job does something of its
// own every `period` steps (QuantizedAdam's variance refresh, a float32
// exchange; 0 = nothing) and gcd(n, period) > 1: then all of those steps
// would land on the same cells (4 bandwidths, a refresh every 4th step: one
// cell gets every refresh, the others none). There the cycle runs n blocks
// of lcm(n, period) steps, block b rotated by b, so every cell meets every
// phase mod `period` equally often. Either way each aligned run of n steps
// from step `first` (the first timed one) holds every cell once, so a timed
// window of whole runs gives every cell the same number of steps.
std::vector<int> SweepCellCycle(int n, int period, int first);

struct CoordinatorBenchOptions {
  // Comma-separated simulated peer counts; each heartbeats at 1 Hz. Default: "1000,10000".
  std::string sizes = "1000,10000";
  // Measured seconds per peer count. Default: 20.
  double seconds = 20;
  // Client threads (one channel each) sharing the peer ids. Default: 8.
  int client_threads = 8;
  // Parent of the temporary state dir. Default: $TMPDIR or /tmp.
  std::string dir;
  bool json = false;
  // > 0: instead, the flood soak (bench/coordinator_bench.cc): for this many
  // seconds `flood_per_second` hostile joins and reports hit a coordinator on
  // loopback while `honest_peers` peers heartbeat at 1 Hz and watch their
  // assignments; prints the honest heartbeat latency and leases lost.
  double flood_seconds = 0;
  int flood_per_second = 600;
  int honest_peers = 50;
};
absl::Status RunCoordinatorBench(const CoordinatorBenchOptions& options, std::ostream& out);

// `aqswarm bench swarmsim`: N simulated peers speaking the real
// protocol to the real coordinator (gRPC on loopback, RocksDB) under Poisson
// churn, on a virtual clock; one JSON line per N with re-plan time, peers
// moved per membership change, join-to-assignment time, heartbeat latency
// and honest leases lost. See swarmsim_bench.cc.
struct SwarmsimOptions {
  // Comma-separated swarm sizes. Default: "100,300,1000".
  std::string sizes = "100,300,1000";
  // Virtual seconds of churn after the swarm formed. Default: 600.
  double virtual_seconds = 600;
  // Virtual seconds per driver tick (at most lease/3). Default: 0.5.
  double tick_seconds = 0.5;
  double lease_seconds = 10;
  // Departures per live peer per virtual hour (arrivals match). Default: 2.
  double churn_per_peer_hour = 2;
  // Share of departures that are kills (no Leave). Default: 0.5.
  double kill_fraction = 0.5;
  // The job's grid: stages x data-parallel pipelines. Default: 8 x 8.
  int stages = 8;
  int data_parallel = 8;
  // Heartbeat client threads (one connection each). Default: 8.
  int client_threads = 8;
  uint64_t seed = 1;
  // Parent of the temporary state dir. Default: $TMPDIR or /tmp.
  std::string dir;
};
absl::Status RunSwarmsimBench(const SwarmsimOptions& options, std::ostream& out);

// `aqswarm bench converge`: time to a target validation loss.
// Runs a base job (JSON) under each configuration (DP optimizer + link
// compression) and each link shaping, one real `aqswarm pipeline` per run,
// and prints one JSON object per run: steps and seconds to the target, final
// validation loss and its gap to the baseline (AdamW + fp32 links, always
// run first), DP and link bytes and their ratios to the baseline's. Shaped
// runs are cut short and extrapolated (training is bit-identical under any
// shaping; the bench checks it). See converge_bench.cc.
struct ConvergeBenchOptions {
  // The base job (JSON, proto/job.proto): stages >= 2; data_parallel >= 2 for
  // configurations whose optimizer is not adamw.
  // Relative data paths are read from the working directory.
  std::string job;
  // Comma-separated configurations OPT-LINK, OPT = adamw | qadam | diloco-hH
  // (dp.innerSteps H), LINK = fp32 | directq | aqsgd (fw3 bw6) | tiledB
  // (tiled fw B bw 6) | aqsgd_tiledB (tiled first visits at B bits), all but
  // fp32 optionally + _ent (zstd-coded codes). adamw-fp32, the baseline,
  // always runs first. Default: AdamW's baseline and four DP x link variants.
  std::string configs = "adamw-fp32,qadam-aqsgd,diloco-h16-aqsgd,diloco-h32-aqsgd,diloco-h64-aqsgd";
  // Comma-separated link shapings MBIT/MS (bandwidth in Mbit/s, one-way
  // latency in ms; 0/0 = unshaped, always run first). Default: the issue's.
  std::string shapings = "0/0,100/50,10/50";
  // Target validation loss; 0 = the baseline's final one x (1 + target_slack).
  double target_val_loss = 0;
  double target_slack = 0.01;
  // A shaped run trains at least this many steps, and past the second step
  // of every DP step kind the unshaped run shows after step 0 (the first of
  // a kind that occurs once), rounded up
  // to whole diloco outer periods; the rest of its time to target is
  // extrapolated. Default: 8.
  int shaped_steps = 8;
  // Keep the runs (job files, run directories) here; empty = a temporary
  // directory, removed after a successful bench.
  std::string out_dir;
  // Limit per pipeline run, seconds. Default: 3600.
  int run_timeout_s = 3600;
  // A JSONL file of an earlier converge bench of the same job: its unshaped
  // adamw-fp32 row stands in for the baseline, which then does not run
  // (AdamW + fp32 trains bit-identically every time: its loss and bytes are
  // the same; its times are that run's). Empty = run the baseline.
  std::string baseline;
};
absl::Status RunConvergeBench(const ConvergeBenchOptions& options, std::ostream& out);

// `aqswarm bench churn`: what peer losses cost a real swarm (churn_bench.cc).
// Two runs of the job, from scratch each: "undisturbed", then "churn" (a
// random placed peer SIGKILLed at Poisson times, a fresh peer arriving for
// each). One JSON line per run: events, steps and steps/s over `seconds`
// (the mean over pipelines of the steps their last stage completed on its
// current timeline: a rollback lowers it, and steps a healing pipeline
// skipped, steps_skipped, do not count), throughput_ratio_vs_undisturbed,
// swarm_seconds_lost_per_event (per kill, over the time until the next: the
// seconds the undisturbed rate needs for the progress not made; p50/p99),
// healthy_steps_redone
// (steps the pipelines a kill did not hit trained again), affected_pipeline_recovery_s
// (per kill: until the hit pipeline reports a step from a stage started
// after it), and the loss at equal steps against the undisturbed run
// (val losses when the job evaluates, else training losses). With out_dir,
// each run keeps every peer's event lines (<name>.out) beside its logs.
struct ChurnBenchOptions {
  // The job (JSON): a name, stages >= 2, dataParallel >= 2. Relative data
  // paths are read from the working directory.
  std::string job;
  int standbys = 2;
  // Measured seconds per run, after the warm-up. Default: 300.
  double seconds = 300;
  // Mean seconds between kills. Default: 30.
  double kill_every_s = 30;
  // The coordinator's --lease_s. Default: 10.
  double lease_s = 10;
  // Every peer's --link_timeout_s. Default: 120 (the peer's).
  int link_timeout_s = 120;
  // The coordinator's --fault_domains (a kill stops only its pipeline; DiLoCo
  // jobs). Default: off.
  bool fault_domains = false;
  // Warm-up: the grid complete and this many steps trained, within
  // warmup_timeout_s. Defaults: 3, 300.
  int warmup_steps = 3;
  double warmup_timeout_s = 300;
  uint64_t seed = 1;
  // Keep both runs' directories (logs, states) here; empty = a temporary
  // directory, removed after the bench.
  std::string out_dir;
};
absl::Status RunChurnBench(const ChurnBenchOptions& options, std::ostream& out);

}  // namespace aqswarm::bench

#endif  // AQSWARM_BENCH_BENCH_H_
