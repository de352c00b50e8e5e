// `aqswarm bench allreduce` and its worker processes.
#include <iostream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "bench/bench.h"
#include "cli/command.h"

ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(int32_t, repeats);

ABSL_FLAG(std::string, ar_dps, "2,4", "Allreduce bench: comma-separated replica counts.");
ABSL_FLAG(std::string, ar_bandwidths, "0,100", "Allreduce bench: link Mbit/s list (0 = unshaped).");
ABSL_FLAG(std::string, ar_bits, "32,8,4,1,gq8",
          "Allreduce bench: cells (32 = fp32, N = min-max N bits + error feedback, gqN = Global-QSGD N bits).");
ABSL_FLAG(int64_t, ar_elements, 25000000, "Allreduce bench: floats averaged per exchange.");
ABSL_FLAG(int32_t, rank, 0, "Allreduce worker: this replica's rank.");
ABSL_FLAG(int32_t, size, 2, "Allreduce worker: number of replicas.");
ABSL_FLAG(double, bandwidth_mbps, 0, "Allreduce worker: link bandwidth in Mbit/s (0 = unshaped).");

namespace aqswarm::cli {

std::vector<Command> AllreduceCommands() {
  return {
      {"bench allreduce",
       "GradientExchange between D processes on loopback: seconds per exchange and bytes on the wire, "
       "compressed (min-max + error feedback) vs uncompressed, shaped and unshaped.",
       "",
       {"json", "repeats", "ar_dps", "ar_bandwidths", "ar_bits", "ar_elements"},
       [](const std::vector<std::string>& args) {
         if (int rc = BenchNoArgs(args, "allreduce")) return rc;
         bench::AllreduceBenchOptions o;
         o.dps = absl::GetFlag(FLAGS_ar_dps);
         o.bandwidths_mbps = absl::GetFlag(FLAGS_ar_bandwidths);
         o.bits = absl::GetFlag(FLAGS_ar_bits);
         o.elements = absl::GetFlag(FLAGS_ar_elements);
         o.repeats = absl::GetFlag(FLAGS_repeats);
         o.json = absl::GetFlag(FLAGS_json);
         return BenchReport(bench::RunAllreduceBench(o, std::cout), "allreduce");
       }},
      {"bench allreduce-worker",
       "One replica of `aqswarm bench allreduce` (started by it; JSON lines on stdout).",
       "",
       {"rank", "size", "ar_elements", "bandwidth_mbps", "ar_bits", "repeats"},
       [](const std::vector<std::string>& args) {
         if (int rc = BenchNoArgs(args, "allreduce-worker")) return rc;
         bench::AllreduceWorkerOptions o;
         o.rank = absl::GetFlag(FLAGS_rank);
         o.size = absl::GetFlag(FLAGS_size);
         o.elements = absl::GetFlag(FLAGS_ar_elements);
         o.bandwidth_mbps = absl::GetFlag(FLAGS_bandwidth_mbps);
         o.bits = absl::GetFlag(FLAGS_ar_bits);
         o.repeats = absl::GetFlag(FLAGS_repeats);
         return BenchReport(bench::RunAllreduceWorker(o, std::cout), "allreduce-worker");
       }},
  };
}

}  // namespace aqswarm::cli
