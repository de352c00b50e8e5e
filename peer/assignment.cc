#include "peer/assignment.h"

#include <filesystem>

#include "absl/strings/str_cat.h"

namespace aqswarm::peer {

absl::Status ValidateAssignment(const v1::Assignment& a, const v1::JobSpec& job) {
  if (a.role() != v1::Assignment::STAGE) return absl::OkStatus();
  if (a.num_stages() != job.stages() || a.num_pipelines() != job.data_parallel()) {
    return absl::InvalidArgumentError(absl::StrCat("assignment grid ", a.num_stages(), "x", a.num_pipelines(),
                                                   " differs from the job's ", job.stages(), "x",
                                                   job.data_parallel()));
  }
  if (a.stage() >= a.num_stages() || a.pipeline() >= a.num_pipelines()) {
    return absl::InvalidArgumentError(absl::StrCat("assignment slot (stage ", a.stage(), ", pipeline ", a.pipeline(),
                                                   ") is outside the grid"));
  }
  if (a.resume_step() < 0) return absl::InvalidArgumentError("assignment resume_step < 0");
  if (!a.grid_complete()) return absl::OkStatus();
  if (a.stage() + 1 < a.num_stages() && a.next().stage_link_address().empty()) {
    return absl::InvalidArgumentError("complete grid but no address for the next stage");
  }
  for (const auto& r : a.replicas()) {
    if (r.pipeline() >= a.num_pipelines() || r.pipeline() == a.pipeline()) {
      return absl::InvalidArgumentError(absl::StrCat("replica with pipeline ", r.pipeline(), " is invalid"));
    }
  }
  if (a.num_pipelines() > 1 && a.replicas_size() + 1 != static_cast<int>(a.num_pipelines())) {
    return absl::InvalidArgumentError(absl::StrCat("complete grid but ", a.replicas_size(), " replicas for ",
                                                   a.num_pipelines(), " pipelines"));
  }
  return absl::OkStatus();
}

RunKey RunKeyOf(const v1::Assignment& a) {
  return {a.plan_version(), a.stage(), a.pipeline(), a.has_next() && a.next().reversed(),
          a.has_previous() && a.previous().reversed()};
}

AssignmentAction DecideAssignment(const v1::Assignment& a, const ChildState& now) {
  if (a.role() != v1::Assignment::STAGE || !a.grid_complete()) return AssignmentAction::kStop;
  const bool same = now.started_for.has_value() && *now.started_for == RunKeyOf(a);
  if (same && now.alive) return AssignmentAction::kKeepRunning;
  if (same && now.failed) return AssignmentAction::kWaitForNextPlan;
  return AssignmentAction::kStart;
}

std::string StageCheckpointDir(const std::string& work_dir, uint32_t stage) {
  return (std::filesystem::path(work_dir) / "checkpoints" / absl::StrCat("stage-", stage)).string();
}

StageCommand StageCommandFor(const v1::Assignment& a, const StagePlacement& p, const std::string& init_checkpoint) {
  namespace fs = std::filesystem;
  StageCommand c;
  c.job = (fs::path(p.work_dir) / "job.json").string();
  c.stage = a.stage();
  c.pipeline = a.pipeline();
  c.listen = p.listen;
  c.store_dir = (fs::path(p.work_dir) / "store").string();
  c.start_step = a.resume_step();
  c.plan = a.plan_version();
  c.die_with_parent = true;
  c.insecure = p.insecure;
  c.checkpoint_dir = StageCheckpointDir(p.work_dir, a.stage());
  c.keep_checkpoints = p.keep_checkpoints;
  c.link_timeout_s = p.link_timeout_s;
  c.uplink_kbps = p.uplink_kbps;
  c.init_checkpoint = init_checkpoint;
  if (a.has_next()) {
    c.next = a.next().stage_link_address();
    c.next_generation = a.next().link_generation();
    c.next_peer = a.next().peer_name();
    c.accept_next = a.next().reversed();
  }
  if (a.has_previous()) {
    c.previous_generation = a.previous().link_generation();
    c.previous_peer = a.previous().peer_name();
    c.previous = a.previous().stage_link_address();
    c.dial_previous = a.previous().reversed();
  }
  if (a.num_pipelines() > 1) {
    c.replicas.assign(a.num_pipelines(), "");
    c.replica_peers.assign(a.num_pipelines(), "");
    c.replicas[a.pipeline()] = p.exchange_advertise;
    c.replica_peers[a.pipeline()] = p.tls_name;
    for (const auto& r : a.replicas()) {
      c.replicas[r.pipeline()] = r.gradient_exchange_address();
      c.replica_peers[r.pipeline()] = r.peer_name();
      c.replica_generation = r.link_generation();
    }
    c.exchange_listen = p.exchange_listen;
  }
  c.metrics_listen = p.metrics_listen;
  c.tls_dir = p.tls_dir;
  c.name = p.tls_dir.empty() ? "" : p.tls_name;
  return c;
}

}  // namespace aqswarm::peer
