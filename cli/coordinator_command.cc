// `aqswarm coordinator` (serve the Coordinator for one job from a state dir),
// `aqswarm status` (ask a coordinator what the swarm is doing) and
// `aqswarm bench coordinator` (heartbeat throughput at 1k/10k peers).
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "cli/command.h"
#include "common/certs.h"
#include "common/join_token.h"
#include "common/metrics.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/swarm_coordinator.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "proto/event_json.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/tls.h"
#include "pipeline/job_spec.h"
#include "proto/coordinator.grpc.pb.h"

ABSL_DECLARE_FLAG(std::string, job);
ABSL_DECLARE_FLAG(int32_t, stages);
ABSL_DECLARE_FLAG(int32_t, dp);
ABSL_DECLARE_FLAG(std::string, listen);
ABSL_DECLARE_FLAG(std::string, tls_dir);
ABSL_DECLARE_FLAG(std::string, name);
ABSL_DECLARE_FLAG(std::string, swarm);
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(uint64_t, seed);

ABSL_FLAG(std::string, state_dir, "", "Coordinator state dir (RocksDB in <dir>/db; join.secret here unless --tls_dir). "
                                      "Restarting on the same dir resumes the job, members and assignment version.");
ABSL_FLAG(bool, mirror_checkpoints, false,
          "Coordinator: each placed peer copies the next stage's state after every checkpoint, so a stage that "
          "loses every replica resumes from the copy instead of step 0 (costs one stage state per checkpoint "
          "interval on that link).");
ABSL_FLAG(bool, fault_domains, false,
          "Coordinator, DiLoCo jobs with dataParallel >= 2: a lost peer stops only its own pipeline. The other "
          "pipelines train on (no restart, no rollback); the hit pipeline's stages restart from the newest "
          "state the running replicas hold, on the parameters they share, and rejoin their next outer step.");
ABSL_FLAG(double, probe_max_age_s, 600,
          "Coordinator: heartbeats ask peers to probe links unmeasured or older than this (0 = no probing).");
ABSL_FLAG(int32_t, probes_per_heartbeat, 2, "Coordinator: at most this many probe requests per heartbeat answer.");
ABSL_FLAG(double, replan_min_gain, 0.2,
          "Coordinator: re-plan on measured links when the predicted step time drops by at least this fraction "
          "(and the gain repays moving state within 500 steps); 0 = only re-plan when a placed peer is lost.");
ABSL_FLAG(double, replan_interval_s, 60, "Coordinator: how often to check whether re-planning on measurements pays.");
ABSL_FLAG(double, replan_hold_s, 600, "Coordinator: no re-plan on measurements within this many seconds of a plan change.");
ABSL_FLAG(double, replan_backoff_s, 10,
          "Coordinator: a peer name whose departures (leave, lease expiry, a rejoin while placed) re-planned the "
          "swarm twice within 30 min has its joins held back this many seconds, doubled with each further "
          "re-plan up to 300 s; 0: no hold.");
ABSL_FLAG(int32_t, evict_strikes, 3,
          "Coordinator: a peer whose neighbours' failures are blamed on it (a refused frame, silence) this many "
          "times within 30 min is evicted: its slot goes to a standby and its joins are refused for "
          "--evict_hold_s, doubled with each later eviction; 0: never evict (blames still restart the plan).");
ABSL_FLAG(double, evict_hold_s, 600,
          "Coordinator: how long an evicted peer's joins are refused (see --evict_strikes).");
ABSL_FLAG(double, reachability_timeout_s, 3,
          "Coordinator: after a join, dial the peer's StateTransfer address and wait this long for an answer; a "
          "peer that does not answer (behind NAT or a firewall) is placed only where it opens its links itself "
          "(0 = no probe: peers count as reachable unless they say --no_inbound).");
ABSL_FLAG(bool, insecure, false,
          "Serve plaintext (no --tls_dir) on a listen address other machines can reach. Without it, plaintext "
          "is refused unless the listen address is loopback (127.0.0.0/8, ::1, localhost).");
ABSL_FLAG(std::string, admin_names, "admin",
          "Coordinator: comma-separated certificate names (CN or subjectAltName) whose Status calls get every "
          "detail (peer names, addresses, links, held states) under TLS; other callers get the summary. Without "
          "TLS, loopback callers get the details.");
ABSL_FLAG(double, lease_s, 10, "Coordinator: seconds a peer stays a member without a heartbeat.");
ABSL_FLAG(std::string, coordinator, "127.0.0.1:7000", "HOST:PORT of the coordinator.");
ABSL_FLAG(std::string, coord_sizes, "1000,10000", "Coordinator bench: comma-separated simulated peer counts.");
ABSL_FLAG(double, coord_seconds, 20, "Coordinator bench: measured seconds per peer count.");
ABSL_FLAG(int32_t, coord_threads, 8, "Coordinator bench: client threads (one channel each).");
ABSL_FLAG(double, flood_seconds, 0,
          "Coordinator bench: > 0 runs the flood soak for this many seconds instead (hostile joins and reports "
          "against a loopback coordinator while honest peers heartbeat).");
ABSL_FLAG(int32_t, flood_per_second, 600, "Coordinator flood soak: hostile calls per second.");
ABSL_FLAG(int32_t, honest_peers, 50, "Coordinator flood soak: honest peers heartbeating at 1 Hz.");
ABSL_FLAG(std::string, swarmsim_sizes, "100,300,1000", "Swarm simulation: comma-separated swarm sizes.");
ABSL_FLAG(double, swarmsim_seconds, 600, "Swarm simulation: virtual seconds of churn after the swarm formed.");
ABSL_FLAG(double, swarmsim_churn, 2, "Swarm simulation: departures per live peer per virtual hour (arrivals match).");
ABSL_FLAG(double, swarmsim_kill_fraction, 0.5, "Swarm simulation: share of departures that are kills (no Leave).");
ABSL_FLAG(std::string, swarmsim_grid, "8x8", "Swarm simulation: the job's STAGESxPIPELINES.");

namespace aqswarm::cli {
namespace {

int Fail(const std::string& cmd, const absl::Status& s) {
  std::cerr << "aqswarm " << cmd << ": " << s << "\n";
  return 1;
}

int RunCoordinator(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("coordinator", absl::InvalidArgumentError("unexpected argument " + args[0]));
  const std::string job_path = absl::GetFlag(FLAGS_job), state_dir = absl::GetFlag(FLAGS_state_dir);
  if (job_path.empty()) return Fail("coordinator", absl::InvalidArgumentError("--job is required"));
  if (state_dir.empty()) return Fail("coordinator", absl::InvalidArgumentError("--state_dir is required"));
  const double lease_s = absl::GetFlag(FLAGS_lease_s);
  if (!(lease_s >= 0.1 && lease_s <= 86400)) {
    return Fail("coordinator", absl::InvalidArgumentError("--lease_s must be in [0.1, 86400]"));
  }
  const double probe_age = absl::GetFlag(FLAGS_probe_max_age_s);
  if (!(probe_age >= 0 && probe_age <= 30 * 86400)) {
    return Fail("coordinator", absl::InvalidArgumentError("--probe_max_age_s must be in [0, 2592000]"));
  }
  const double min_gain = absl::GetFlag(FLAGS_replan_min_gain), hold = absl::GetFlag(FLAGS_replan_hold_s);
  const double interval = absl::GetFlag(FLAGS_replan_interval_s);
  if (!(interval >= 0.1 && interval <= 24 * 3600)) {
    return Fail("coordinator", absl::InvalidArgumentError("--replan_interval_s must be in [0.1, 86400]"));
  }
  if (!(min_gain >= 0 && min_gain < 1)) {
    return Fail("coordinator", absl::InvalidArgumentError("--replan_min_gain must be in [0, 1)"));
  }
  if (!(hold >= 0 && hold <= 30 * 24 * 3600)) {
    return Fail("coordinator", absl::InvalidArgumentError("--replan_hold_s must be in [0, 2592000]"));
  }
  const double backoff_s = absl::GetFlag(FLAGS_replan_backoff_s);
  if (!(backoff_s >= 0 && backoff_s <= 300)) {
    return Fail("coordinator", absl::InvalidArgumentError("--replan_backoff_s must be in [0, 300]"));
  }
  const int evict_strikes = absl::GetFlag(FLAGS_evict_strikes);
  if (evict_strikes < 0 || evict_strikes > 1000) {
    return Fail("coordinator", absl::InvalidArgumentError("--evict_strikes must be in [0, 1000]"));
  }
  const double evict_hold_s = absl::GetFlag(FLAGS_evict_hold_s);
  if (!(evict_hold_s >= 0 && evict_hold_s <= 24 * 3600)) {
    return Fail("coordinator", absl::InvalidArgumentError("--evict_hold_s must be in [0, 86400]"));
  }
  const double reach_s = absl::GetFlag(FLAGS_reachability_timeout_s);
  if (!(reach_s >= 0 && reach_s <= 5)) {  // within a peer's 10 s Join deadline
    return Fail("coordinator", absl::InvalidArgumentError("--reachability_timeout_s must be in [0, 5]"));
  }
  const int probes = absl::GetFlag(FLAGS_probes_per_heartbeat);
  if (probes < 0 || probes > 64) {
    return Fail("coordinator", absl::InvalidArgumentError("--probes_per_heartbeat must be in [0, 64]"));
  }
  auto job = pipeline::LoadJobSpec(job_path);
  if (!job.ok()) return Fail("coordinator", job.status());
  if (absl::GetFlag(FLAGS_stages) > 0) job->set_stages(absl::GetFlag(FLAGS_stages));
  if (absl::GetFlag(FLAGS_dp) > 0) job->set_data_parallel(absl::GetFlag(FLAGS_dp));
  if (absl::Status s = pipeline::ValidateJobSpec(*job); !s.ok()) return Fail("coordinator", s);

  std::error_code ec;
  std::filesystem::create_directories(state_dir, ec);
  if (ec) return Fail("coordinator", absl::InternalError(absl::StrCat("cannot create ", state_dir, ": ", ec.message())));
  rpc::TlsOptions tls{absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_name)};
  if (tls.enabled() && tls.name.empty()) tls.name = "coordinator";
  if (absl::Status s = rpc::CheckListenSecurity(absl::GetFlag(FLAGS_listen), tls.enabled(),
                                                absl::GetFlag(FLAGS_insecure));
      !s.ok()) {
    return Fail("coordinator", s);
  }
  if (!tls.enabled()) {
    std::cerr << "warning: the coordinator serves plaintext: peers and join tokens are not protected"
              << (rpc::IsLoopbackAddress(absl::GetFlag(FLAGS_listen)) ? " (loopback only)" : "") << std::endl;
  }
  const std::string secret_path =
      absl::StrCat(tls.enabled() ? tls.dir : state_dir, "/", kJoinSecretFile);
  auto secret = LoadOrCreateJoinSecret(secret_path);
  if (!secret.ok()) return Fail("coordinator", secret.status());
  auto creds = rpc::MakeServerCredentials(tls);
  if (!creds.ok()) return Fail("coordinator", creds.status());

  coordinator::SwarmCoordinatorOptions o;
  o.job = *job;
  o.swarm_id = absl::GetFlag(FLAGS_swarm);
  o.join_secret = *secret;
  o.lease = absl::Seconds(lease_s);
  o.state.dir = state_dir + "/db";
  o.mirror_checkpoints = absl::GetFlag(FLAGS_mirror_checkpoints);
  o.fault_domains = absl::GetFlag(FLAGS_fault_domains);
  o.probe_max_age = absl::Seconds(probe_age);
  o.probes_per_heartbeat = probes;
  o.improve_interval = min_gain == 0 ? absl::ZeroDuration() : absl::Seconds(interval);
  o.improve_min_gain = min_gain;
  o.improve_hold = absl::Seconds(hold);
  o.replan_backoff.first = absl::Seconds(backoff_s);
  o.evict_strikes = evict_strikes == 0 ? std::numeric_limits<int>::max() : evict_strikes;
  o.evict_hold = absl::Seconds(evict_hold_s);
  o.probe_reachability = reach_s > 0;
  auto coord = coordinator::SwarmCoordinator::Create(std::move(o));
  if (!coord.ok()) return Fail("coordinator", coord.status());
  const std::string swarm_id = (*coord)->options().swarm_id;
  const coordinator::SwarmCoordinator* coord_ptr = coord->get();
  auto metrics = StartMetricsFromFlags();
  if (!metrics.ok()) return Fail("coordinator", metrics.status());

  // Block the stop signals before gRPC starts its threads; sigwait below.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  coordinator::CoordinatorServerOptions so;
  so.listen = absl::GetFlag(FLAGS_listen);
  so.tls = tls;
  so.admin_names = absl::StrSplit(absl::GetFlag(FLAGS_admin_names), ',', absl::SkipWhitespace());
  if (reach_s > 0) so.reachability_timeout = absl::Seconds(reach_s);
  auto server = coordinator::CoordinatorServer::Start(*std::move(coord), so);
  if (!server.ok()) return Fail("coordinator", server.status());
  // Declared after the server (which owns the coordinator): destroyed first.
  coordinator::CoordinatorStatusSampler sampler(coord_ptr);
  v1::CoordinatorEvent listening;
  listening.mutable_listening()->set_port((*server)->port());
  listening.mutable_listening()->set_metrics_port(*metrics ? (**metrics).port() : 0);
  std::printf("%s\n", events::ToJsonLine(listening).c_str());
  std::fflush(stdout);
  std::cerr << "coordinator for job '" << job->name() << "' (swarm '" << swarm_id << "', " << job->stages()
            << " stages x " << job->data_parallel() << " pipelines) on " << so.listen << " port "
            << (*server)->port() << ", " << rpc::DescribeTls(tls) << ", state " << state_dir
            << ", join tokens checked with " << secret_path << " (aqswarm certs token --swarm " << swarm_id
            << ")" << std::endl;
  int sig = 0;
  sigwait(&stop, &sig);
  std::cerr << "signal " << sig << ": shutting down" << std::endl;
  (*server)->Shutdown();
  return 0;
}

std::string FormatBandwidth(double bytes_per_second) {
  const double mbit = bytes_per_second * 8 / 1e6;
  return mbit >= 1000 ? absl::StrFormat("%.1fGb/s", mbit / 1000) : absl::StrFormat("%.1fMb/s", mbit);
}

int RunStatus(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("status", absl::InvalidArgumentError("unexpected argument " + args[0]));
  rpc::TlsOptions tls{absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_name)};
  if (tls.enabled() && tls.name.empty()) {
    return Fail("status", absl::InvalidArgumentError("--name (this machine's certificate) is required with --tls_dir"));
  }
  const std::string target = absl::GetFlag(FLAGS_coordinator);
  auto channel = rpc::MakeChannel(target, tls, rpc::ControlChannel());
  if (!channel.ok()) return Fail("status", channel.status());
  auto stub = v1::Coordinator::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::StatusResponse st;
  grpc::Status s = stub->Status(&ctx, v1::StatusRequest(), &st);
  if (!s.ok()) {
    return Fail("status", absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                                       absl::StrCat(target, ": ", s.error_message())));
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::string json;
    google::protobuf::util::JsonPrintOptions jo;
    jo.always_print_primitive_fields = true;
    jo.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(st, &json, jo);
    std::cout << json << "\n";
    return 0;
  }
  std::cout << absl::StrFormat("job %s (swarm %s): %d stages x %d pipelines, grid %s, assignment version %d\n",
                               st.job_name(), st.swarm_id(), st.num_stages(), st.num_pipelines(),
                               st.grid_complete() ? "complete" : "INCOMPLETE", st.assignment_version());
  std::cout << absl::StrFormat("step %d  loss %.4f  tokens/s %.1f  checkpoint step %d  peers %d  evictions %d\n",
                               st.step(), st.loss(), st.tokens_per_second(), st.checkpoint_step(), st.peers_size(),
                               st.evictions());
  const v1::DataSpec& data = st.job().data();
  if (data.synthetic_tokens() > 0) {
    std::cout << "data: " << data.synthetic_tokens() << " synthetic tokens\n";
  } else {
    std::cout << "data: " << data.corpus() << " (dataset "
              << (data.dataset_hash().empty() ? "not fixed yet" : data.dataset_hash()) << ", tokenizer "
              << (data.tokenizer_hash().empty() ? "not fixed yet" : data.tokenizer_hash()) << ")\n";
  }
  std::cout << absl::StrFormat("%6s  %-20s %-8s %-9s %5s %8s %7s %6s %7s  %s\n", "id", "name", "state", "inbound",
                               "stage", "pipeline", "lease_s", "step", "strikes", "links (measured from this peer)");
  for (const v1::PeerStatus& p : st.peers()) {
    std::string links;
    for (const v1::LinkSpeed& l : p.links()) {
      absl::StrAppend(&links, links.empty() ? "" : ", ", "->", l.to_peer_id(), " ",
                      FormatBandwidth(l.bandwidth_bytes_per_second()),
                      absl::StrFormat(" %.0fms", l.rtt_seconds() * 1000));
    }
    std::string state = v1::PeerStatus::State_Name(p.state());
    // Whether other peers can dial it (Reachability).
    const char* inbound = p.reachability() == v1::PROBING       ? "probing"
                          : p.reachability() == v1::NO_INBOUND  ? "no (says)"
                          : p.reachability() == v1::UNREACHABLE ? "no"
                                                                : "yes";
    std::cout << absl::StrFormat("%6d  %-20s %-8s %-9s %5s %8s %7.1f %6d %7d  %s\n", p.peer_id(), p.peer_name(), state,
                                 inbound, p.stage() < 0 ? "-" : absl::StrCat(p.stage()),
                                 p.pipeline() < 0 ? "-" : absl::StrCat(p.pipeline()), p.lease_remaining_seconds(),
                                 p.progress().step(), p.strikes(), links.empty() ? "-" : links);
  }
  return 0;
}

int RunBenchCoordinator(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("bench coordinator", absl::InvalidArgumentError("unexpected argument " + args[0]));
  bench::CoordinatorBenchOptions o;
  o.sizes = absl::GetFlag(FLAGS_coord_sizes);
  o.seconds = absl::GetFlag(FLAGS_coord_seconds);
  o.client_threads = absl::GetFlag(FLAGS_coord_threads);
  o.json = absl::GetFlag(FLAGS_json);
  o.flood_seconds = absl::GetFlag(FLAGS_flood_seconds);
  o.flood_per_second = absl::GetFlag(FLAGS_flood_per_second);
  o.honest_peers = absl::GetFlag(FLAGS_honest_peers);
  absl::Status s = bench::RunCoordinatorBench(o, std::cout);
  return s.ok() ? 0 : Fail("bench coordinator", s);
}

int RunBenchSwarmsim(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("bench swarmsim", absl::InvalidArgumentError("unexpected argument " + args[0]));
  bench::SwarmsimOptions o;
  o.sizes = absl::GetFlag(FLAGS_swarmsim_sizes);
  o.virtual_seconds = absl::GetFlag(FLAGS_swarmsim_seconds);
  o.churn_per_peer_hour = absl::GetFlag(FLAGS_swarmsim_churn);
  o.kill_fraction = absl::GetFlag(FLAGS_swarmsim_kill_fraction);
  o.lease_seconds = absl::GetFlag(FLAGS_lease_s);
  o.seed = absl::GetFlag(FLAGS_seed);
  const std::vector<std::string> grid = absl::StrSplit(absl::GetFlag(FLAGS_swarmsim_grid), 'x');
  if (grid.size() != 2 || !absl::SimpleAtoi(grid[0], &o.stages) || !absl::SimpleAtoi(grid[1], &o.data_parallel)) {
    return Fail("bench swarmsim", absl::InvalidArgumentError("--swarmsim_grid must be STAGESxPIPELINES, e.g. 8x8"));
  }
  absl::Status s = bench::RunSwarmsimBench(o, std::cout);
  return s.ok() ? 0 : Fail("bench swarmsim", s);
}

}  // namespace

std::vector<Command> CoordinatorCommands() {
  return {
      {"coordinator", "Serve the Coordinator for one job: admit peers, hold leases, place them on stages.",
       "Prints {\"listening\":{\"port\":N,\"metrics_port\":M}} first (proto/events.proto CoordinatorEvent),\n"
       "then logs on stderr; SIGINT/SIGTERM stop it.\n"
       "example: aqswarm coordinator --job job.json --listen 127.0.0.1:7000 --state_dir ./coord "
       "[--tls_dir ./tls --name coordinator] [--lease_s 10]",
       {"job", "stages", "dp", "listen", "state_dir", "tls_dir", "name", "swarm", "insecure", "admin_names", "lease_s",
        "mirror_checkpoints", "fault_domains", "probe_max_age_s", "probes_per_heartbeat", "replan_min_gain", "replan_interval_s", "replan_hold_s",
        "replan_backoff_s", "evict_strikes", "evict_hold_s", "reachability_timeout_s",
        "metrics_listen"},
       RunCoordinator},
      {"status", "Ask a coordinator for the swarm: peers, stages, links, assignment version, step, loss, tokens/s.",
       "example: aqswarm status --coordinator 127.0.0.1:7000 [--json] [--tls_dir ./tls --name admin]",
       {"coordinator", "json", "tls_dir", "name"}, RunStatus},
      {"bench coordinator",
       "Heartbeats/s and latency of a real Coordinator over loopback gRPC with 1k and 10k simulated peers at 1 Hz.",
       "--flood_seconds N: the flood soak instead (hostile joins and reports at --flood_per_second while\n"
       "--honest_peers heartbeat; prints their p99 and leases lost as JSON).\n"
       "example: aqswarm bench coordinator --flood_seconds 60 --flood_per_second 600 --honest_peers 50",
       {"json", "coord_sizes", "coord_seconds", "coord_threads", "flood_seconds", "flood_per_second", "honest_peers"},
       RunBenchCoordinator},
      {"bench swarmsim",
       "A swarm of N simulated peers under churn against the real coordinator (gRPC, RocksDB), on a virtual clock.",
       "Prints one JSON line per size: re-plan seconds (p50/p99), peers moved per membership change,\n"
       "join-to-assignment seconds, heartbeat latency, honest leases lost, resident memory.\n"
       "example: aqswarm bench swarmsim --swarmsim_sizes 1000 --swarmsim_seconds 600 --swarmsim_churn 2",
       {"swarmsim_sizes", "swarmsim_seconds", "swarmsim_churn", "swarmsim_kill_fraction", "swarmsim_grid", "lease_s",
        "seed"},
       RunBenchSwarmsim},
  };
}

}  // namespace aqswarm::cli
