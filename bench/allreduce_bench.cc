// `aqswarm bench allreduce`: D worker processes on loopback average a vector
// with the GradientExchange (pipeline/dp_allreduce.h over stage/gradient_exchange.h),
// uncompressed (32 bits) and compressed (min-max buckets, 1/4/8 bits, error
// feedback), with links unshaped and shaped. Seconds per exchange and bytes on
// the wire per replica, against the uncompressed exchange of the same run.
#include <poll.h>
#include <unistd.h>

#include <iostream>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "nlohmann/json.hpp"
#include "stage/gradient_exchange.h"
#include "pipeline/dp_allreduce.h"

namespace aqswarm::bench {
namespace {

// "32" = fp32, "4" = min-max 4 bits with error feedback, "gq8" = Global-QSGD
// (exponential levels) 8 bits through the integer-sum path.
struct Cell {
  std::string name;
  int bits;
  bool global_qsgd;
};
std::vector<Cell> ParseBits(const std::string& s) {
  std::vector<Cell> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    const bool gq = absl::StartsWith(p, "gq");
    out.push_back({std::string(p), std::stoi(std::string(gq ? p.substr(2) : p)), gq});
  }
  return out;
}

}  // namespace

absl::Status RunAllreduceWorker(const AllreduceWorkerOptions& o, std::ostream& out) {
  stage::ReplicaExchangeOptions eo;
  eo.group = "bench/allreduce";
  eo.rank = o.rank;
  eo.size = o.size;
  eo.shaping.bandwidth_mbps = o.bandwidth_mbps;
  eo.timeout = absl::Seconds(600);
  AQSWARM_ASSIGN_OR_RETURN(auto ex, stage::GrpcReplicaExchange::Start(eo));
  out << nlohmann::json({{"event", "listening"}, {"port", ex->port()}}).dump() << std::endl;
  std::string line;
  AQSWARM_RETURN_IF_ERROR(ReadLineFromFd(0, &line, absl::Seconds(120)));
  nlohmann::json msg = nlohmann::json::parse(line, nullptr, false);
  if (msg.is_discarded() || !msg.contains("replicas")) return absl::InvalidArgumentError("bad replica list");
  AQSWARM_RETURN_IF_ERROR(ex->Connect(msg["replicas"].get<std::vector<std::string>>()));
  // A gradient-like vector: mostly small values, a few large (heavy tails).
  std::vector<float> in(o.elements), res(o.elements);
  Rng rng(o.rank + 1);
  for (auto& x : in) {
    const double u = rng.UnitDouble();
    x = static_cast<float>((u - 0.5) * 1e-3 * (rng.UnitDouble() < 0.01 ? 50 : 1));
  }
  uint64_t step = 0;
  for (const Cell& cell : ParseBits(o.bits)) {
    const int bits = cell.bits;
    pipeline::AllReduceOptions ao;
    ao.bucket_elements = 4 << 20;
    if (bits < 32) {
      ao.codec.codec = v1::CODEC_MINMAX;
      ao.codec.bits = bits;
      ao.codec.bucket_size = 512;
    }
    std::vector<float> we, se;
    double best = 1e30;
    pipeline::AllReduceStats stats;
    for (int r = 0; r <= o.repeats; ++r) {  // r == 0 warms the connections up
      pipeline::AllReduceStats s;
      const absl::Time start = absl::Now();
      if (cell.global_qsgd) {
        pipeline::GlobalQsgdAllReduceOptions go;
        go.bits = bits;
        AQSWARM_RETURN_IF_ERROR(pipeline::GlobalQsgdAllReduceMean(*ex, go, step++, 0, in, absl::MakeSpan(res), &s));
      } else {
        AQSWARM_RETURN_IF_ERROR(pipeline::AllReduceMean(*ex, ao, step++, 0, in, absl::MakeSpan(res),
                                                        bits < 32 ? &we : nullptr, bits < 32 ? &se : nullptr, &s));
      }
      const double secs = absl::ToDoubleSeconds(absl::Now() - start);
      if (r > 0 && secs < best) {
        best = secs;
        stats = s;
      }
    }
    out << nlohmann::json({{"event", "result"}, {"cell", cell.name}, {"bits", bits}, {"seconds", best},
                           {"wire_bytes", stats.bytes_sent}, {"raw_bytes", stats.raw_bytes}})
               .dump()
        << std::endl;
  }
  return absl::OkStatus();
}

absl::Status RunAllreduceBench(const AllreduceBenchOptions& o, std::ostream& out) {
  const std::string self = SelfExecutable();
  std::vector<int> dps;
  for (absl::string_view p : absl::StrSplit(o.dps, ',', absl::SkipEmpty())) dps.push_back(std::stoi(std::string(p)));
  std::vector<double> bws;
  for (absl::string_view p : absl::StrSplit(o.bandwidths_mbps, ',', absl::SkipEmpty())) {
    bws.push_back(std::stod(std::string(p)));
  }
  if (!o.json) {
    out << absl::StrFormat("%-4s %-10s %-5s %-8s %10s %14s %10s\n", "dp", "link", "bits", "codec", "seconds",
                           "wire MB/repl", "speedup");
  }
  for (int d : dps) {
    for (double bw : bws) {
      std::vector<std::unique_ptr<Subprocess>> w;
      nlohmann::json replicas = nlohmann::json::array();
      for (int r = 0; r < d; ++r) {
        AQSWARM_ASSIGN_OR_RETURN(
            auto p, Subprocess::Spawn({self, "bench", "allreduce-worker", absl::StrCat("--rank=", r),
                                       absl::StrCat("--size=", d), absl::StrCat("--ar_elements=", o.elements),
                                       absl::StrCat("--bandwidth_mbps=", bw), "--ar_bits=" + o.bits,
                                       absl::StrCat("--repeats=", o.repeats)},
                                      {.capture_stdout = true, .pipe_stdin = true}));
        std::string line;
        AQSWARM_RETURN_IF_ERROR(p->ReadLine(&line, absl::Seconds(60)));
        replicas.push_back(absl::StrCat("127.0.0.1:", nlohmann::json::parse(line)["port"].get<int>()));
        w.push_back(std::move(p));
      }
      for (auto& p : w) AQSWARM_RETURN_IF_ERROR(p->WriteStdin(nlohmann::json({{"replicas", replicas}}).dump() + "\n"));
      std::vector<nlohmann::json> results;
      std::string line;
      while (w[0]->ReadLine(&line, absl::Seconds(1800)).ok()) {
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (!j.is_discarded() && j.value("event", "") == "result") results.push_back(j);
      }
      for (auto& p : w) {
        AQSWARM_ASSIGN_OR_RETURN(int code, p->Wait(absl::Seconds(120)));
        if (code != 0) return absl::InternalError(absl::StrCat("allreduce worker exited with ", code));
      }
      double fp32 = 0;
      for (const auto& j : results) {
        if (j["cell"] == "32") fp32 = j["seconds"].get<double>();
      }
      for (const auto& j : results) {
        const int bits = j["bits"].get<int>();
        const double secs = j["seconds"].get<double>();
        const std::string cell = j["cell"].get<std::string>();
        const char* codec = bits == 32 ? "raw_f32" : absl::StartsWith(cell, "gq") ? "global_qsgd" : "minmax";
        const double speedup = fp32 > 0 ? fp32 / secs : 0;
        if (o.json) {
          out << nlohmann::json({{"bench", "allreduce"}, {"dp", d}, {"bits", bits}, {"codec", codec},
                                 {"elements", o.elements}, {"bandwidth_mbps", bw}, {"seconds", secs},
                                 {"wire_bytes", j["wire_bytes"]}, {"raw_bytes", j["raw_bytes"]},
                                 {"speedup_vs_fp32", speedup}})
                     .dump()
              << "\n";
        } else {
          out << absl::StrFormat("%-4d %-10s %-5d %-8s %10.3f %14.2f %9.2fx\n", d,
                                 bw > 0 ? absl::StrCat(bw, "Mbit") : "unshaped", bits, codec, secs,
                                 j["wire_bytes"].get<double>() / 1e6, speedup);
        }
        out.flush();
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::bench
