// `aqswarm bench coordinator`: heartbeat throughput and latency of a real
// Coordinator gRPC server on loopback. N simulated peers (joined in-process
// through SwarmCoordinator::Join) heartbeat at 1 Hz each, spread evenly over
// the second, from `client_threads` threads, each with its own channel (TCP
// connection) and N / threads peer ids; every call is a blocking unary
// Heartbeat with a deadline. Per N it reports the offered rate (N/s), the
// sustained rate (completed heartbeats / wall seconds until the last
// scheduled send; more than `seconds` when the clients fall behind), latency
// percentiles (send to reply), late sends (> 100 ms behind schedule: the
// clients could not keep up), errors, and peers whose lease expired during
// the run (must be 0).
// Server and clients share this process and its cores.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <unistd.h>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "common/file_util.h"
#include "common/join_token.h"
#include "common/status_macros.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/swarm_coordinator.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/channel.h"

namespace aqswarm::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct SimPeer {
  uint64_t id = 0;
  std::string session;
};

struct ThreadResult {
  std::vector<double> latency_ms;
  int64_t late = 0;
  int64_t errors = 0;
  std::string first_error;
};

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

absl::Status RunOne(const CoordinatorBenchOptions& o, int n, std::ostream& out) {
  const std::string dir = absl::StrCat(o.dir.empty() ? (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp") : o.dir,
                                       "/aqswarm-coord-bench-", getpid(), "-", n);
  aqswarm::RemoveTree(dir).IgnoreError();
  coordinator::SwarmCoordinatorOptions co;
  co.job.set_name("bench");
  co.job.set_stages(2);
  co.job.set_data_parallel(2);
  co.swarm_id = "bench";
  AQSWARM_ASSIGN_OR_RETURN(co.join_secret, GenerateJoinSecret());
  co.lease = absl::Seconds(10);
  co.max_members = std::max<int64_t>(n, 1);
  co.state.dir = dir;
  co.state.sync = false;  // joins are set-up, not measured; heartbeats never touch the disk
  AQSWARM_ASSIGN_OR_RETURN(auto coord, coordinator::SwarmCoordinator::Create(co));
  AQSWARM_ASSIGN_OR_RETURN(std::string token,
                           IssueJoinToken(co.join_secret, "bench", kAnyPeer, absl::ToUnixSeconds(absl::Now()) + 3600));
  std::vector<SimPeer> peers(n);
  for (int i = 0; i < n; ++i) {
    coordinator::JoinParams p;
    p.peer_name = absl::StrCat("sim-", i);
    p.join_token = token;
    p.stage_link_address = absl::StrCat("127.0.0.1:", 10000 + i % 50000);
    // As every daemon has one: heartbeat answers then also pick links to probe.
    p.state_transfer_address = absl::StrCat("127.0.0.1:", 10001 + i % 50000);
    AQSWARM_ASSIGN_OR_RETURN(coordinator::JoinResult r, coord->Join(p));
    peers[i] = {r.peer_id, r.session_token};
  }
  coordinator::CoordinatorServerOptions so;
  AQSWARM_ASSIGN_OR_RETURN(auto server, coordinator::CoordinatorServer::Start(std::move(coord), so));
  const std::string target = absl::StrCat("127.0.0.1:", server->port());

  const int threads = std::max(1, std::min(o.client_threads, n));
  std::vector<ThreadResult> results(threads);
  const auto start = Clock::now() + std::chrono::milliseconds(200);
  const auto end = start + std::chrono::milliseconds(static_cast<int64_t>(o.seconds * 1000));
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      rpc::ChannelPreset one_connection_per_thread;
      one_connection_per_thread.own_connection = true;
      auto stub = v1::Coordinator::NewStub(*rpc::MakeChannel(target, {}, one_connection_per_thread));
      std::vector<const SimPeer*> mine;
      for (int i = t; i < n; i += threads) mine.push_back(&peers[i]);
      ThreadResult& res = results[t];
      res.latency_ms.reserve(static_cast<size_t>(mine.size() * (o.seconds + 1)));
      for (int64_t round = 0;; ++round) {
        for (size_t i = 0; i < mine.size(); ++i) {
          // Peer i of thread t beats at start + round + (i * threads + t) / n seconds.
          const double offset = round + (i * threads + t) / static_cast<double>(n);
          const auto due = start + std::chrono::nanoseconds(static_cast<int64_t>(offset * 1e9));
          if (due >= end) return;
          auto now = Clock::now();
          if (now < due) {
            std::this_thread::sleep_until(due);
            now = Clock::now();
          } else if (now - due > std::chrono::milliseconds(100)) {
            ++res.late;
          }
          v1::HeartbeatRequest req;
          req.set_peer_id(mine[i]->id);
          req.set_session_token(mine[i]->session);
          v1::HeartbeatResponse resp;
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
          const auto sent = Clock::now();
          grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
          const double ms = std::chrono::duration<double, std::milli>(Clock::now() - sent).count();
          if (s.ok()) {
            res.latency_ms.push_back(ms);
          } else if (res.errors++ == 0) {
            res.first_error = absl::StrCat(s.error_code(), ": ", s.error_message());
          }
        }
      }
    });
  }
  for (auto& w : workers) w.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  const size_t members_left = server->coordinator()->num_members();
  server->Shutdown();
  server.reset();
  aqswarm::RemoveTree(dir).IgnoreError();

  std::vector<double> all;
  int64_t late = 0, errors = 0;
  std::string first_error;
  for (auto& r : results) {
    all.insert(all.end(), r.latency_ms.begin(), r.latency_ms.end());
    late += r.late;
    errors += r.errors;
    if (first_error.empty()) first_error = r.first_error;
  }
  // Behind schedule, the clients finish after `seconds`: divide by the real span.
  const double rate = all.size() / std::max(1e-9, elapsed);
  const int64_t count = static_cast<int64_t>(all.size());
  const double p50 = Percentile(all, 0.50), p99 = Percentile(all, 0.99), p999 = Percentile(all, 0.999);
  const double max = all.empty() ? 0 : *std::max_element(all.begin(), all.end());
  const int64_t expired = n - static_cast<int64_t>(members_left);
  if (o.json) {
    out << absl::StrFormat(
        "{\"bench\":\"coordinator\",\"peers\":%d,\"client_threads\":%d,\"seconds\":%.1f,\"offered_per_s\":%d,"
        "\"heartbeats\":%d,\"heartbeats_per_s\":%.1f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"p999_ms\":%.3f,"
        "\"max_ms\":%.3f,\"late\":%d,\"errors\":%d,\"expired\":%d}\n",
        n, threads, elapsed, n, count, rate, p50, p99, p999, max, late, errors, expired);
  } else {
    out << absl::StrFormat("%7d %7d %9d %12.0f %8.3f %8.3f %8.3f %8.2f %7d %7d %7d\n", n, threads, n, rate, p50, p99,
                           p999, max, late, errors, expired);
  }
  if (!first_error.empty()) out << "  first error: " << first_error << "\n";
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCoordinatorBench(const CoordinatorBenchOptions& options, std::ostream& out) {
  if (options.seconds <= 0 || options.seconds > 3600) {
    return absl::InvalidArgumentError("coordinator bench: seconds must be in (0, 3600]");
  }
  std::vector<int> sizes;
  for (absl::string_view s : absl::StrSplit(options.sizes, ',', absl::SkipEmpty())) {
    int n;
    if (!absl::SimpleAtoi(s, &n) || n < 1 || n > 100000) {
      return absl::InvalidArgumentError(absl::StrCat("coordinator bench: bad peer count '", s, "' (1..100000)"));
    }
    sizes.push_back(n);
  }
  if (!options.json) {
    out << absl::StrFormat("%7s %7s %9s %12s %8s %8s %8s %8s %7s %7s %7s\n", "peers", "threads", "offered/s",
                           "heartbeats/s", "p50_ms", "p99_ms", "p999_ms", "max_ms", "late", "errors", "expired");
  }
  for (int n : sizes) AQSWARM_RETURN_IF_ERROR(RunOne(options, n, out));
  if (!options.json) {
    out << "1 Hz heartbeats per peer over loopback gRPC; server and clients share this process; late = sent > 100 ms "
           "behind schedule\n";
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::bench
