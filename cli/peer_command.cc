// `aqswarm peer`: the peer daemon (peer/peer_daemon.h) — joins a coordinator,
// runs whatever stage it is assigned, leaves on SIGTERM/SIGINT.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "cli/command.h"
#include "common/metrics.h"
#include "peer/peer_daemon.h"
#include "stage/stage_metrics.h"
#include "proto/event_json.h"

ABSL_DECLARE_FLAG(std::string, coordinator);
ABSL_DECLARE_FLAG(std::string, name);
ABSL_DECLARE_FLAG(std::string, tls_dir);
ABSL_DECLARE_FLAG(bool, insecure);  // cli/coordinator_command.cc
ABSL_DECLARE_FLAG(int32_t, link_timeout_s);
ABSL_DECLARE_FLAG(std::string, metrics_listen);

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "Address this process's server binds (aqswarm peer: its stage's StageLink server; aqswarm coordinator: "
          "the Coordinator service).");
ABSL_FLAG(std::string, exchange_listen, "", "Address the stage's GradientExchange server binds (default: --listen's "
                                            "host, any port).");
ABSL_FLAG(bool, adaptive_deadline, false,
          "Bound the stage's waits inside a step by 8x the link's recent p99 wait (at least 5 s, at most "
          "--link_timeout_s): a neighbour that turns slow is blamed to the coordinator within a step.");
ABSL_FLAG(int32_t, keep_checkpoints, 4, "Newest stage states kept in the work dir's checkpoints/stage-<j>.");
ABSL_FLAG(std::string, join_token, "", "Join token from `aqswarm certs token` (or @FILE to read it from FILE).");
ABSL_FLAG(std::string, advertise, "", "HOST:PORT other peers dial for --listen (default: --listen).");
ABSL_FLAG(std::string, exchange_advertise, "", "HOST:PORT replicas dial for --exchange_listen (default: it).");
ABSL_FLAG(std::string, state_listen, "", "Address of this peer's StateTransfer server (default: --listen's host, "
                                         "any port).");
ABSL_FLAG(std::string, state_advertise, "", "HOST:PORT joiners dial for --state_listen (default: it).");
ABSL_FLAG(std::string, work_dir, "", "This peer's directory: job, message store, stage checkpoints, stage.log.");
ABSL_FLAG(double, seconds_per_layer, 0, "Compute claim for placement: seconds per layer per micro-batch (0 = unknown).");
ABSL_FLAG(uint64_t, probe_bytes, 1 << 20,
          "Bytes per timed link-probe transfer when the coordinator asks for probes (0 = never probe; at most 3 MiB).");
ABSL_FLAG(double, emulate_uplink_mbps, 0,
          "Emulate a slow uplink (tests, demos): this peer's stage sends and link probes go at this many Mbit/s "
          "(0 = the real link).");
ABSL_FLAG(bool, no_inbound, false,
          "This peer cannot accept connections (behind NAT or a firewall that drops inbound): the coordinator "
          "places it only where it opens every link itself (a stage of a single-pipeline job, never next to "
          "another such peer); otherwise it stays a standby.");
ABSL_FLAG(uint64_t, memory_bytes, 0, "Memory claim for placement: bytes for one stage (0 = unknown).");
ABSL_FLAG(std::string, daemon_metrics_listen, "",
          "HOST:PORT where the daemon itself serves Prometheus metrics (its StateTransfer server's refusals, "
          "aqswarm_peer_state_transfer_refused_total); the stage's are on --metrics_listen. Default: off.");

namespace aqswarm::cli {
namespace {

int RunPeer(const std::vector<std::string>& args) {
  auto fail = [](const absl::Status& s) {
    std::cerr << "aqswarm peer: " << s.message() << "\n";
    return 1;
  };
  if (!args.empty()) return fail(absl::InvalidArgumentError("unexpected argument " + args[0]));
  peer::PeerDaemonOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.join_token = absl::GetFlag(FLAGS_join_token);
  if (absl::StartsWith(o.join_token, "@")) {
    o.join_token.erase(0, 1);
    std::ifstream in(o.join_token);
    std::string token;
    if (!(in >> token)) return fail(absl::NotFoundError("cannot read a join token from " + o.join_token));
    o.join_token = token;
  }
  o.name = absl::GetFlag(FLAGS_name);
  o.listen = absl::GetFlag(FLAGS_listen);
  o.advertise = absl::GetFlag(FLAGS_advertise);
  o.exchange_listen = absl::GetFlag(FLAGS_exchange_listen);
  o.exchange_advertise = absl::GetFlag(FLAGS_exchange_advertise);
  o.state_listen = absl::GetFlag(FLAGS_state_listen);
  o.state_advertise = absl::GetFlag(FLAGS_state_advertise);
  o.work_dir = absl::GetFlag(FLAGS_work_dir);
  o.tls = {absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_name)};
  o.insecure = absl::GetFlag(FLAGS_insecure);
  o.seconds_per_layer = absl::GetFlag(FLAGS_seconds_per_layer);
  o.memory_bytes = absl::GetFlag(FLAGS_memory_bytes);
  o.link_timeout = absl::Seconds(absl::GetFlag(FLAGS_link_timeout_s));
  o.adaptive_link_deadline = absl::GetFlag(FLAGS_adaptive_deadline);
  o.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  o.probe_bytes = absl::GetFlag(FLAGS_probe_bytes);
  o.emulate_uplink_mbps = absl::GetFlag(FLAGS_emulate_uplink_mbps);
  o.no_inbound = absl::GetFlag(FLAGS_no_inbound);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  std::mutex out_mu;
  o.report = [&](const v1::PeerEvent& e) {
    const std::string line = events::ToJsonLine(e);
    std::lock_guard<std::mutex> l(out_mu);
    std::fprintf(stdout, "%s\n", line.c_str());
    std::fflush(stdout);
  };
  // A stage child that exits while its replica patch is written must not kill the daemon.
  signal(SIGPIPE, SIG_IGN);
  // SIGTERM/SIGINT: leave cleanly. Block them before any thread starts.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  std::unique_ptr<MetricsServer> metrics;
  if (const std::string listen = absl::GetFlag(FLAGS_daemon_metrics_listen); !listen.empty()) {
    stage::DeclarePeerMetrics();
    auto started = MetricsServer::Start(listen);
    if (!started.ok()) return fail(started.status());
    metrics = *std::move(started);
  }
  auto daemon = peer::PeerDaemon::Create(o);
  if (!daemon.ok()) return fail(daemon.status());
  std::atomic<bool> finished{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop, &sig);
    if (finished) return;
    std::cerr << "aqswarm peer: signal " << sig << ": leaving the swarm" << std::endl;
    (*daemon)->Stop();
  });
  absl::Status s = (*daemon)->Run();
  // Wake the signal thread if Run ended on its own (job done or error).
  finished = true;
  pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  if (!s.ok()) return fail(s);
  return 0;
}

}  // namespace

std::vector<Command> PeerCommands() {
  return {
      {"peer",
       "Join a swarm: run whatever pipeline stage the coordinator assigns; leave on SIGTERM.",
       "Ports: --listen (StageLink) and --exchange_listen (GradientExchange) need fixed ports;\n"
       "the StateTransfer server picks one unless --state_listen says. Prints one JSON event per line\n"
       "(proto/events.proto PeerEvent): the daemon's (joined, assignment, stage_started, state_fetched,\n"
       "mirrored, link_measured, child_exit, left ...) and its stage's, as {\"stage\":{...}}.",
       {"coordinator", "join_token", "name", "listen", "advertise", "exchange_listen", "exchange_advertise",
        "state_listen", "state_advertise", "work_dir", "tls_dir", "seconds_per_layer", "memory_bytes",
        "link_timeout_s", "adaptive_deadline", "keep_checkpoints", "probe_bytes", "emulate_uplink_mbps", "no_inbound", "metrics_listen", "daemon_metrics_listen", "insecure"},
       RunPeer},
  };
}

}  // namespace aqswarm::cli
