#include "stage/stage_main.h"

#include <sys/prctl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <atomic>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/malloc_tuning.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "google/protobuf/util/json_util.h"
#include "proto/event_json.h"
#include "rpc/server.h"
#include "stage/blame.h"
#include "stage/stage_launch.h"
#include "stage/stage_runner.h"

namespace aqswarm::stage {
namespace {

int Fail(const absl::Status& s) {
  std::cerr << "aqswarm stage: " << s.message() << "\n";
  return 1;
}

// One StageLaunch JSON line on stdin: the neighbours the launcher learned
// once every stage listened, e.g.
//   {"next": {"stageLinkAddress": "127.0.0.1:7001"},
//    "replicas": [{"gradientExchangeAddress": "127.0.0.1:7101"}, {"pipeline": 1, ...}]}
absl::StatusOr<v1::StageLaunch> ReadNeighborPatch(absl::Duration timeout) {
  std::string line;
  absl::Status rs = ReadLineFromFd(0, &line, timeout);
  if (!rs.ok()) return absl::InvalidArgumentError(absl::StrCat("no neighbour patch on stdin: ", rs.message()));
  v1::StageLaunch patch;
  const auto status = google::protobuf::util::JsonStringToMessage(line, &patch);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("stdin: not a StageLaunch patch (", status.ToString(), "): ", line));
  }
  return patch;
}

// Every event, one line each, from any thread.
class EventPrinter {
 public:
  void operator()(const v1::StageEvent& e) {
    const std::string line = events::ToJsonLine(e);
    std::lock_guard<std::mutex> l(mu_);
    std::fprintf(stdout, "%s\n", line.c_str());
    std::fflush(stdout);
  }

 private:
  std::mutex mu_;
};

absl::Status CheckServers(const v1::StageLaunch& l) {
  for (const std::string& listen : {l.listen(), l.exchange_listen()}) {
    if (listen.empty()) continue;
    AQSWARM_RETURN_IF_ERROR(rpc::CheckListenSecurity(listen, !l.tls().dir().empty(), l.tls().insecure()));
  }
  return absl::OkStatus();
}

// The run's last event: DoneEvent, or ErrorEvent with the status.
void PrintEnd(const v1::StageLaunch& launch, const absl::Status& s, EventPrinter& print) {
  v1::StageEvent e;
  if (s.ok()) {
    e.mutable_done()->set_stage(launch.stage());
  } else {
    e.mutable_error()->set_stage(launch.stage());
    e.mutable_error()->set_code(absl::StatusCodeToString(s.code()));
    e.mutable_error()->set_message(std::string(s.message()));
    if (std::optional<v1::Blame> b = BlameOf(s); b.has_value() && b->link() != v1::Blame::LINK_UNSPECIFIED) {
      const bool up = b->link() == v1::Blame::UPSTREAM;
      if (up ? launch.has_previous() : launch.has_next()) {
        const v1::Neighbor& n = up ? launch.previous() : launch.next();
        b->set_peer_id(n.peer_id());
        b->set_peer_name(n.peer_name());
        b->set_plan(launch.plan());
        *e.mutable_error()->mutable_blame() = *std::move(b);
      }
    }
  }
  print(e);
}

// Errors before the ListeningEvent are the launch's (the launcher reads
// them on stderr); after it, the run's last event says how it ended. That
// event goes out as soon as training ends, before the runner and the
// metrics server are torn down (which may take seconds): the launcher acts
// on it (a peer daemon leaves the swarm).
absl::Status Train(const v1::StageLaunch& launch, EventPrinter& print) {
  AQSWARM_RETURN_IF_ERROR(CheckServers(launch));
  std::unique_ptr<MetricsServer> metrics;
  if (!launch.metrics_listen().empty()) {
    AQSWARM_ASSIGN_OR_RETURN(metrics, MetricsServer::Start(launch.metrics_listen()));
  }
  AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<StageRunner> runner,
                           StageRunner::Create(launch, [&print](const v1::StageEvent& e) { print(e); }));
  v1::StageEvent listening;
  v1::ListeningEvent& l = *listening.mutable_listening();
  l.set_stage(launch.stage());
  l.set_pipeline(launch.pipeline());
  l.set_port(runner->port());
  l.set_exchange_port(runner->exchange_port());
  l.set_metrics_port(metrics ? metrics->port() : 0);
  print(listening);
  absl::Status s;
  if (launch.neighbors_on_stdin()) {
    absl::StatusOr<v1::StageLaunch> patch = ReadNeighborPatch(LinkTimeout(launch));
    s = patch.ok() ? runner->SetNeighbors(*patch) : patch.status();
  }
  // Under fault domains the launcher sends replica patches while the stage
  // trains (a peer of another pipeline replaced); stdin's end stops them.
  std::atomic<bool> trained{false};
  std::thread patches;
  if (s.ok() && launch.dp_timeline() > 0) {
    patches = std::thread([&runner, &trained] {
      while (!trained) {
        std::string line;
        const absl::Status rs = ReadLineFromFd(0, &line, absl::Seconds(1));
        if (absl::IsDeadlineExceeded(rs)) continue;
        if (!rs.ok()) return;
        v1::StageLaunch patch;
        const auto parsed = google::protobuf::util::JsonStringToMessage(line, &patch);
        absl::Status ps = parsed.ok() ? runner->UpdateReplicas(patch)
                                      : absl::InvalidArgumentError(std::string(parsed.message()));
        if (!ps.ok()) std::cerr << "aqswarm stage: replica patch refused: " << ps.message() << "\n";
      }
    });
  }
  if (s.ok()) s = runner->Run();
  trained = true;
  if (patches.joinable()) patches.join();
  PrintEnd(launch, s, print);
  return s;
}

}  // namespace

int RunStageProcess(const std::string& launch_path) {
  if (launch_path.empty()) return Fail(absl::InvalidArgumentError("--launch is required"));
  absl::StatusOr<v1::StageLaunch> launch = ReadStageLaunch(launch_path);
  if (!launch.ok()) return Fail(launch.status());
  if (launch->die_with_parent()) {
    const pid_t parent = getppid();
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) return Fail(absl::AbortedError("the parent process is gone"));
  }
  KeepFreedMemoryForReuse();  // no fresh zeroed pages every micro-batch (common/malloc_tuning.h)
  EventPrinter print;
  const absl::Status s = Train(*launch, print);
  return s.ok() ? 0 : Fail(s);
}

}  // namespace aqswarm::stage
