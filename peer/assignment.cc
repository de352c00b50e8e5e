#include "peer/assignment.h"

#include <algorithm>
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
  if (a.start_step() != 0 && (!a.heal() || a.start_step() < a.resume_step())) {
    return absl::InvalidArgumentError(absl::StrCat("assignment start_step ", a.start_step(),
                                                   " without heal or before resume_step ", a.resume_step()));
  }
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

uint64_t RunPlanOf(const v1::Assignment& a) { return a.run_plan() != 0 ? a.run_plan() : a.plan_version(); }

RunKey RunKeyOf(const v1::Assignment& a) {
  return {RunPlanOf(a), a.stage(), a.pipeline(), a.has_next() && a.next().reversed(),
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

v1::StageLaunch StageLaunchFor(const v1::Assignment& a, v1::StageLaunch l, const std::string& work_dir,
                               const v1::Neighbor& self, const std::string& init_checkpoint) {
  namespace fs = std::filesystem;
  l.set_stage(a.stage());
  l.set_pipeline(a.pipeline());
  l.set_plan(RunPlanOf(a));
  l.set_start_step(std::max(a.resume_step(), a.start_step()));
  l.set_dp_timeline(a.num_pipelines() > 1 ? a.dp_timeline() : 0);
  l.set_restart_from_shared(a.heal());
  l.set_init_checkpoint(init_checkpoint);
  l.set_store_dir((fs::path(work_dir) / "store").string());
  l.set_checkpoint_dir(StageCheckpointDir(work_dir, a.stage()));
  l.clear_next();
  l.clear_previous();
  l.clear_replicas();
  if (a.has_next() && a.stage() + 1 < a.num_stages()) *l.mutable_next() = a.next();
  if (a.has_previous() && a.stage() > 0) *l.mutable_previous() = a.previous();
  if (a.num_pipelines() > 1) {
    for (uint32_t p = 0; p < a.num_pipelines(); ++p) l.add_replicas()->set_pipeline(p);
    for (const v1::Neighbor& r : a.replicas()) {
      if (r.pipeline() < a.num_pipelines()) *l.mutable_replicas(static_cast<int>(r.pipeline())) = r;
    }
    v1::Neighbor& own = *l.mutable_replicas(static_cast<int>(a.pipeline()));
    own = self;
    own.set_pipeline(a.pipeline());
    own.set_stage(a.stage());
    if (a.replicas_size() > 0) own.set_link_generation(a.replicas(0).link_generation());
  }
  return l;
}

}  // namespace aqswarm::peer
