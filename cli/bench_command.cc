#include <iostream>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "bench/bench.h"
#include "cli/command.h"

ABSL_FLAG(bool, json, false, "Print one JSON object per line instead of a table.");
ABSL_FLAG(int64_t, mib, 64, "Compression bench: MiB of float32 input.");
ABSL_FLAG(int32_t, repeats, 3, "Timed repetitions per cell; the best is reported.");
ABSL_FLAG(std::string, codecs, "", "Compression bench: comma-separated codec names (empty = all).");
ABSL_FLAG(std::string, dir, "", "Store bench: directory for the store and baseline files "
          "(default $TMPDIR or /tmp).");
ABSL_FLAG(int64_t, samples, 10000, "Store bench: samples per workload.");
ABSL_FLAG(int64_t, micro_batch, 8, "Store bench: rows per micro-batch.");
ABSL_FLAG(int64_t, prefetch, 4, "Store bench: prefetch depth in micro-batches.");
ABSL_FLAG(std::string, shapes, "128x768,1024x1600", "Store bench: fp16 row shapes ROWSxCOLS.");
ABSL_FLAG(std::string, sched_sizes, "8,16,64,256", "Scheduler bench: comma-separated peer counts.");
ABSL_FLAG(uint64_t, seed, 1, "Scheduler bench: seed of the synthetic networks and the solver.");

namespace aqswarm::cli {
namespace {

int Report(const absl::Status& s, const char* name) {
  if (s.ok()) return 0;
  std::cerr << "aqswarm bench " << name << ": " << s << "\n";
  return 1;
}

int NoArgs(const std::vector<std::string>& args, const char* name) {
  if (args.empty()) return 0;
  std::cerr << "aqswarm bench " << name << ": unexpected argument '" << args[0] << "'\n";
  return 2;
}

}  // namespace

std::vector<Command> BenchCommands() {
  std::vector<Command> out;
  out.push_back({"bench compression",
                 "Encode/decode throughput of every codec against memcpy of the same buffer.",
                 "Input: float32 drawn from a heavy-tailed activation-like distribution.",
                 {"json", "mib", "repeats", "codecs"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = NoArgs(args, "compression")) return rc;
                   bench::CompressionBenchOptions o;
                   o.mebibytes = absl::GetFlag(FLAGS_mib);
                   o.repeats = absl::GetFlag(FLAGS_repeats);
                   o.codecs = absl::GetFlag(FLAGS_codecs);
                   o.json = absl::GetFlag(FLAGS_json);
                   return Report(bench::RunCompressionBench(o, std::cout), "compression");
                 }});
  out.push_back({"bench store",
                 "Per-sample message store through the prefetcher: RocksDB vs in-memory vs a "
                 "sequential file baseline, plus the hidden-I/O stall scenario.",
                 "",
                 {"json", "dir", "samples", "micro_batch", "prefetch", "shapes"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = NoArgs(args, "store")) return rc;
                   bench::StoreBenchOptions o;
                   o.dir = absl::GetFlag(FLAGS_dir);
                   o.samples = absl::GetFlag(FLAGS_samples);
                   o.micro_batch = absl::GetFlag(FLAGS_micro_batch);
                   o.prefetch_batches = absl::GetFlag(FLAGS_prefetch);
                   o.shapes = absl::GetFlag(FLAGS_shapes);
                   o.json = absl::GetFlag(FLAGS_json);
                   return Report(bench::RunStoreBench(o, std::cout), "store");
                 }});
  out.push_back({"bench scheduler",
                 "Placement solver (coordinator/placement.h): cost vs the exhaustive optimum (N <= 8) "
                 "and vs random placement, and solve time, on clustered and world-wide networks.",
                 "repeats = random instances per scenario and size (at least 20 when N <= 8).",
                 {"json", "sched_sizes", "seed", "repeats"},
                 [](const std::vector<std::string>& args) {
                   if (int rc = NoArgs(args, "scheduler")) return rc;
                   bench::SchedulerBenchOptions o;
                   o.sizes = absl::GetFlag(FLAGS_sched_sizes);
                   o.seed = absl::GetFlag(FLAGS_seed);
                   o.repeats = absl::GetFlag(FLAGS_repeats);
                   o.json = absl::GetFlag(FLAGS_json);
                   return Report(bench::RunSchedulerBench(o, std::cout), "scheduler");
                 }});
  return out;
}

}  // namespace aqswarm::cli
