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
//
// With flood_seconds > 0 it runs the flood soak instead (loopback only,
// bounded): a coordinator (2 stages x 2 pipelines, 10 s leases, fsync'd
// state) serves `honest_peers` peers that joined with per-peer tokens, each
// heartbeating at 1 Hz with an assignment watch open, while 4 hostile
// clients send `flood_per_second` calls, paced evenly: per 8 calls, 4 joins
// with forged tokens, 1 join under a live honest name with a valid token for
// it, 1 join of a fresh name with a leaked wildcard token, and 2 reports
// from one membership the attacker holds (progress, alternately forward and
// backward, and link probes; one in eight of the latter slots is instead a
// heartbeat that keeps that membership alive). It prints one JSON object: the honest heartbeats' latency
// (p50/p99/max), honest errors, honest leases lost (a heartbeat answered
// NOT_FOUND, or an honest id missing at the end) and the flood's answers by
// status code.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <unistd.h>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
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
  co.join_limit = {};  // the set-up joins N peers at once: no join budget
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

grpc::ClientContext* WithDeadline(grpc::ClientContext* ctx, int seconds = 5) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return ctx;
}

absl::Status RunFloodSoak(const CoordinatorBenchOptions& o, std::ostream& out) {
  if (o.honest_peers < 1 || o.honest_peers > 1000) {
    return absl::InvalidArgumentError("flood soak: honest_peers must be in [1, 1000]");
  }
  if (o.flood_per_second < 0 || o.flood_per_second > 100000) {
    return absl::InvalidArgumentError("flood soak: flood_per_second must be in [0, 100000]");
  }
  const std::string dir = absl::StrCat(o.dir.empty() ? (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp") : o.dir,
                                       "/aqswarm-coord-flood-", getpid());
  aqswarm::RemoveTree(dir).IgnoreError();
  coordinator::SwarmCoordinatorOptions co;
  co.job.set_name("flood");
  co.job.set_stages(2);
  co.job.set_data_parallel(2);
  co.swarm_id = "flood";
  AQSWARM_ASSIGN_OR_RETURN(co.join_secret, GenerateJoinSecret());
  co.lease = absl::Seconds(10);
  co.state.dir = dir;
  co.state.sync = true;  // as deployed: every commit fsync'd
  const std::string secret = co.join_secret;
  AQSWARM_ASSIGN_OR_RETURN(auto coord, coordinator::SwarmCoordinator::Create(co));
  coordinator::CoordinatorServerOptions so;
  AQSWARM_ASSIGN_OR_RETURN(auto server, coordinator::CoordinatorServer::Start(std::move(coord), so));
  const std::string target = absl::StrCat("127.0.0.1:", server->port());
  const int64_t expiry = absl::ToUnixSeconds(absl::Now()) + 3600;
  auto channel = [&] {
    rpc::ChannelPreset own = rpc::ControlChannel();
    own.own_connection = true;
    return *rpc::MakeChannel(target, {}, own);
  };

  // The honest peers join (per-peer tokens) and open their watches.
  const int n = o.honest_peers;
  std::vector<SimPeer> honest(n);
  {
    auto stub = v1::Coordinator::NewStub(channel());
    for (int i = 0; i < n; ++i) {
      v1::JoinRequest req;
      req.set_peer_name(absl::StrCat("honest-", i));
      AQSWARM_ASSIGN_OR_RETURN(std::string token, IssueJoinToken(secret, "flood", req.peer_name(), expiry));
      req.set_join_token(token);
      req.set_stage_link_address(absl::StrCat("127.0.0.1:", 20000 + i));
      req.set_state_transfer_address(absl::StrCat("127.0.0.1:", 30000 + i));
      v1::JoinResponse resp;
      // Joins are paced by the coordinator's join budget: retry when over it.
      for (int attempt = 0;; ++attempt) {
        grpc::ClientContext c;
        grpc::Status st = stub->Join(WithDeadline(&c), req, &resp);
        if (st.ok()) break;
        if (st.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED || attempt > 100) {
          return absl::InternalError(absl::StrCat("honest join failed: ", st.error_message()));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // pacing under the join budget
      }
      honest[i] = {resp.peer_id(), resp.session_token()};
    }
  }
  // The attacker holds a few memberships of its own (a leaked wildcard token).
  const std::string wildcard = *IssueJoinToken(secret, "flood", kAnyPeer, expiry);
  constexpr int kFloodThreads = 4;
  std::vector<SimPeer> attacker(kFloodThreads);
  {
    auto stub = v1::Coordinator::NewStub(channel());
    for (int t = 0; t < kFloodThreads; ++t) {
      v1::JoinRequest req;
      req.set_peer_name(absl::StrCat("attacker-", t));
      req.set_join_token(wildcard);
      req.set_stage_link_address("127.0.0.1:9");
      v1::JoinResponse resp;
      for (int attempt = 0;; ++attempt) {
        grpc::ClientContext c;
        grpc::Status st = stub->Join(WithDeadline(&c), req, &resp);
        if (st.ok()) break;
        if (st.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED || attempt > 100) {
          return absl::InternalError(absl::StrCat("attacker join failed: ", st.error_message()));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // pacing under the join budget
      }
      attacker[t] = {resp.peer_id(), resp.session_token()};
    }
  }

  // One connection per 32 watches (the server allows 64 streams per connection).
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> watch_stubs;
  for (int i = 0; i < n; i += 32) watch_stubs.push_back(v1::Coordinator::NewStub(channel()));
  std::vector<std::unique_ptr<grpc::ClientContext>> watch_ctx(n);
  std::vector<std::thread> watchers;
  for (int i = 0; i < n; ++i) {
    watch_ctx[i] = std::make_unique<grpc::ClientContext>();
    watchers.emplace_back([&, i] {
      v1::WatchAssignmentRequest req;
      req.set_peer_id(honest[i].id);
      req.set_session_token(honest[i].session);
      auto reader = watch_stubs[i / 32]->WatchAssignment(watch_ctx[i].get(), req);
      v1::Assignment a;
      while (reader->Read(&a)) {
      }
      reader->Finish();
    });
  }
  const auto start = Clock::now() + std::chrono::milliseconds(200);
  const auto end = start + std::chrono::milliseconds(static_cast<int64_t>(o.flood_seconds * 1000));
  std::mutex mu;
  std::vector<double> hb_ms;
  int64_t hb_errors = 0, leases_lost = 0;
  std::string first_hb_error;
  std::map<std::string, int64_t> flood_codes;
  int64_t flood_sent = 0, flood_late = 0;

  // Honest heartbeats: 1 Hz per peer, spread over the second, 4 threads.
  constexpr int kHonestThreads = 4;
  std::vector<std::thread> threads;
  for (int t = 0; t < kHonestThreads; ++t) {
    threads.emplace_back([&, t] {
      auto stub = v1::Coordinator::NewStub(channel());
      std::vector<double> mine;
      int64_t errors = 0, lost = 0;
      std::string first;
      for (int64_t round = 0;; ++round) {
        bool done = false;
        for (int i = t; i < n; i += kHonestThreads) {
          const double offset = round + static_cast<double>(i) / n;
          const auto due = start + std::chrono::nanoseconds(static_cast<int64_t>(offset * 1e9));
          if (due >= end) {
            done = true;
            break;
          }
          std::this_thread::sleep_until(due);  // the schedule, not a wait for an event
          v1::HeartbeatRequest req;
          req.set_peer_id(honest[i].id);
          req.set_session_token(honest[i].session);
          v1::HeartbeatResponse resp;
          grpc::ClientContext ctx;
          const auto sent = Clock::now();
          grpc::Status st = stub->Heartbeat(WithDeadline(&ctx), req, &resp);
          const double ms = std::chrono::duration<double, std::milli>(Clock::now() - sent).count();
          if (st.ok()) {
            mine.push_back(ms);
          } else {
            ++errors;
            lost += st.error_code() == grpc::StatusCode::NOT_FOUND;
            if (first.empty()) first = absl::StrCat(st.error_code(), ": ", st.error_message());
          }
        }
        if (done) break;
      }
      std::lock_guard<std::mutex> l(mu);
      hb_ms.insert(hb_ms.end(), mine.begin(), mine.end());
      hb_errors += errors;
      leases_lost += lost;
      if (first_hb_error.empty()) first_hb_error = first;
    });
  }
  // The flood, paced evenly over kFloodThreads threads.
  const double per_thread = static_cast<double>(o.flood_per_second) / kFloodThreads;
  for (int t = 0; t < kFloodThreads && per_thread > 0; ++t) {
    threads.emplace_back([&, t] {
      auto stub = v1::Coordinator::NewStub(channel());
      std::map<std::string, int64_t> codes;
      int64_t sent = 0, late = 0;
      const std::string forged = *IssueJoinToken(std::string(32, 'f'), "flood", kAnyPeer, expiry);
      for (int64_t i = 0;; ++i) {
        const auto due = start + std::chrono::nanoseconds(static_cast<int64_t>(i / per_thread * 1e9));
        if (due >= end) break;
        auto now = Clock::now();
        if (now < due) {
          std::this_thread::sleep_until(due);  // pacing
        } else if (now - due > std::chrono::milliseconds(100)) {
          ++late;
        }
        grpc::ClientContext ctx;
        WithDeadline(&ctx);
        grpc::Status st;
        const int kind = static_cast<int>((i * kFloodThreads + t) % 8);
        if (kind <= 5) {
          v1::JoinRequest req;
          req.set_stage_link_address("127.0.0.1:9");
          if (kind <= 3) {
            req.set_peer_name(absl::StrCat("x-", t, "-", i));
            req.set_join_token(forged);
          } else if (kind == 4) {
            req.set_peer_name(absl::StrCat("honest-", i % n));
            req.set_join_token(*IssueJoinToken(secret, "flood", req.peer_name(), expiry));
          } else {
            req.set_peer_name(absl::StrCat("flood-", t, "-", i));
            req.set_join_token(wildcard);
          }
          v1::JoinResponse resp;
          st = stub->Join(&ctx, req, &resp);
        } else if (kind == 6 || (i / 8) % 2 == 0) {
          // Every report from one membership: far over its budget.
          v1::ProgressReport req;
          req.set_peer_id(attacker[0].id);
          req.set_session_token(attacker[0].session);
          req.mutable_progress()->set_step(i % 2 == 0 ? i : 0);
          v1::ReportResponse resp;
          st = stub->ReportProgress(&ctx, req, &resp);
        } else if ((i / 8) % 4 == 1) {
          // The attacker keeps the reporting membership alive.
          v1::HeartbeatRequest req;
          req.set_peer_id(attacker[0].id);
          req.set_session_token(attacker[0].session);
          v1::HeartbeatResponse resp;
          st = stub->Heartbeat(&ctx, req, &resp);
        } else {
          v1::LinkProbeReport req;
          req.set_peer_id(attacker[0].id);
          req.set_session_token(attacker[0].session);
          req.set_to_peer_id(honest[i % n].id);
          req.set_bandwidth_bytes_per_second(1e6);
          req.set_rtt_seconds(0.01);
          v1::ReportResponse resp;
          st = stub->ReportLinkProbe(&ctx, req, &resp);
        }
        ++sent;
        ++codes[absl::AsciiStrToLower(absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code())))];
      }
      std::lock_guard<std::mutex> l(mu);
      for (const auto& [c, k] : codes) flood_codes[c] += k;
      flood_sent += sent;
      flood_late += late;
    });
  }
  for (auto& th : threads) th.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  // Honest peers still members at the end (none expired, none evicted).
  const v1::StatusResponse status = server->coordinator()->GetStatus();
  std::set<uint64_t> present;
  for (const auto& p : status.peers()) present.insert(p.peer_id());
  int64_t missing = 0;
  for (const SimPeer& p : honest) missing += present.count(p.id) == 0;
  for (auto& c : watch_ctx) c->TryCancel();
  for (auto& w : watchers) w.join();
  server->Shutdown();
  server.reset();
  aqswarm::RemoveTree(dir).IgnoreError();

  const int64_t count = static_cast<int64_t>(hb_ms.size());
  const double p50 = Percentile(hb_ms, 0.50), p99 = Percentile(hb_ms, 0.99);
  const double max = hb_ms.empty() ? 0 : *std::max_element(hb_ms.begin(), hb_ms.end());
  std::string codes;
  for (const auto& [c, k] : flood_codes) absl::StrAppend(&codes, codes.empty() ? "" : ",", "\"", c, "\":", k);
  out << absl::StrFormat(
      "{\"bench\":\"coordinator_flood\",\"seconds\":%.1f,\"honest_peers\":%d,\"flood_offered_per_s\":%d,"
      "\"flood_sent\":%d,\"flood_per_s\":%.1f,\"flood_late\":%d,\"flood_answers\":{%s},"
      "\"heartbeats\":%d,\"heartbeat_p50_ms\":%.3f,\"heartbeat_p99_ms\":%.3f,\"heartbeat_max_ms\":%.3f,"
      "\"heartbeat_errors\":%d,\"honest_leases_lost\":%d,\"members_at_end\":%d,\"goal\":\"p99 < 50 ms, 0 "
      "leases lost\",\"met\":%s}\n",
      elapsed, n, o.flood_per_second, flood_sent, flood_sent / std::max(1e-9, elapsed), flood_late, codes, count,
      p50, p99, max, hb_errors, leases_lost + missing, status.peers_size(),
      p99 < 50 && leases_lost + missing == 0 ? "true" : "false");
  if (!first_hb_error.empty()) out << "  first honest heartbeat error: " << first_hb_error << "\n";
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCoordinatorBench(const CoordinatorBenchOptions& options, std::ostream& out) {
  if (options.flood_seconds > 0) {
    if (options.flood_seconds > 3600) return absl::InvalidArgumentError("flood soak: seconds must be in (0, 3600]");
    return RunFloodSoak(options, out);
  }
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
