#include "peer/peer_daemon_impl.h"

namespace aqswarm::peer::daemon {

std::vector<v1::StageCheckpoints> ListHeld(const fs::path& root) {
  std::vector<v1::StageCheckpoints> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    uint32_t stage = 0;
    if (!absl::StartsWith(name, "stage-") || !absl::SimpleAtoi(name.substr(6), &stage)) continue;
    std::vector<int64_t> steps = StageCheckpointSteps(entry.path().string());
    if (steps.empty()) continue;
    v1::StageCheckpoints h;
    h.set_stage(stage);
    for (size_t i = steps.size() > 64 ? steps.size() - 64 : 0; i < steps.size(); ++i) h.add_steps(steps[i]);
    out.push_back(std::move(h));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.stage() < b.stage(); });
  return out;
}

// Copies the mirrored peer's state after each of our checkpoints.
void PeerDaemonImpl::MirrorLoop() {
  while (true) {
    v1::Neighbor target;
    int64_t want = 0;
    uint64_t plan = 0;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](PeerDaemonImpl* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) {
            return d->stop_ || (d->mirror_target_.has_value() && d->mirror_want_ > d->mirror_done_);
          },
          this));
      if (stop_) return;
      target = *mirror_target_;
      want = mirror_want_;
      plan = plan_;
      mirror_copying_ = want;
    }
    UpdatePins();
    const absl::Status s = CopyMirror(target, want, plan);
    {
      absl::MutexLock l(&mu_);
      mirror_done_ = std::max(mirror_done_, want);  // on failure too: the next checkpoint tries again
      mirror_copying_ = 0;
      if (s.ok() && plan_ == plan) mirror_landed_ = want;
    }
    UpdatePins();
    if (s.ok()) {
      // Logged once the coordinator knows of the copy (or the report
      // failed): only then can a re-plan resume from it.
      const bool reported = ReportProgress();
      v1::PeerEvent e;
      e.mutable_mirrored()->set_stage(target.stage());
      e.mutable_mirrored()->set_step(want);
      e.mutable_mirrored()->set_from(target.peer_name());
      e.mutable_mirrored()->set_reported(reported);
      Event(e);
    } else if (!absl::IsCancelled(s)) {
      AQSWARM_LOG(WARNING) << "peer " << o_.name << ": no copy of stage " << target.stage() << " at step " << want
                           << ": " << s;
    }
  }
}

// Pins in our own stage's checkpoint dir (peer/stage_checkpoints.h) the
// steps of the newest mirror copy that landed, of the copy under way and
// of the one wanted next: the child prunes its states to the newest few,
// and a copy is of use to a re-plan only beside our own state of its step.
void PeerDaemonImpl::UpdatePins() {
  absl::MutexLock serial(&pins_mu_);
  std::string dir;
  std::vector<int64_t> steps;
  {
    absl::MutexLock l(&mu_);
    if (own_stage_.has_value()) dir = CheckpointDir(*own_stage_).string();
    if (mirror_target_.has_value()) {
      for (int64_t s : {mirror_landed_, mirror_copying_, mirror_want_ > mirror_done_ ? mirror_want_ : 0}) {
        if (s > 0) steps.push_back(s);
      }
    }
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  if (pins_dir_ != dir) {  // we moved to another stage (or none)
    if (!pins_dir_.empty()) {
      const absl::Status s = WriteStageCheckpointPins(pins_dir_, {});
      if (!s.ok()) AQSWARM_LOG(WARNING) << "peer " << o_.name << ": " << s;
    }
    pins_dir_ = dir;
    pinned_.reset();  // unknown there (a file of an earlier run): written below
  }
  if (dir.empty() || steps == pinned_) return;
  const absl::Status s = WriteStageCheckpointPins(dir, steps);
  if (!s.ok()) {
    AQSWARM_LOG(WARNING) << "peer " << o_.name << ": cannot pin the states of mirrored steps: " << s;
    return;
  }
  pinned_ = std::move(steps);
}

absl::Status PeerDaemonImpl::CopyMirror(const v1::Neighbor& target, int64_t step, uint64_t plan) {
  // The mirrored peer completes the same step at about the same time; until
  // it has, it answers NOT_FOUND.
  const absl::Time deadline = absl::Now() + o_.link_timeout;
  while (true) {
    absl::StatusOr<uint64_t> s = FetchStageState(target.state_transfer_address(), target.stage(), step);
    if (s.ok()) {
      const std::string dir = CheckpointDir(target.stage()).string();
      absl::MutexLock l(&mu_);
      if (plan_ != plan) {  // a re-plan pruned while we fetched: this state may be from its abandoned timeline
        std::error_code ec;
        fs::remove(StageCheckpointPath(dir, step), ec);
        return absl::CancelledError("the plan changed");
      }
      PruneStageCheckpoints(dir, std::numeric_limits<int64_t>::max(), o_.keep_checkpoints);
      return absl::OkStatus();
    }
    if (!absl::IsNotFound(s.status()) || absl::Now() > deadline) return s.status();
    absl::MutexLock l(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(200))) return absl::CancelledError("stopped");
    if (plan_ != plan) return absl::CancelledError("the plan changed");
  }
}

absl::StatusOr<StateSnapshot> PeerDaemonImpl::ServeState(const v1::StateRequest& r) {
  if (r.job_name() != job_.name()) {
    return absl::FailedPreconditionError(absl::StrCat("this peer trains job '", job_.name(), "', not '",
                                                      r.job_name(), "'"));
  }
  const std::string dir = CheckpointDir(r.stage()).string();
  int64_t step = r.step();
  if (step == 0) {  // the newest
    const std::vector<int64_t> kept = StageCheckpointSteps(dir);
    if (kept.empty()) return absl::NotFoundError(absl::StrCat("no state of stage ", r.stage(), " here"));
    step = kept.back();
  }
  std::ifstream in(StageCheckpointPath(dir, step), std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("no state of stage ", r.stage(), " at step ", step,
                                            " here (only the newest ", o_.keep_checkpoints, " are kept)"));
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  return StateSnapshot{buf.str(), static_cast<uint64_t>(step)};
}

// The state the child starts from: "" for step 0, else a local file
// (kept, or fetched from a replica).
// Fetches `stage`'s state after `step` steps from `address` into this
// peer's checkpoint dir; returns its size in bytes.
absl::StatusOr<uint64_t> PeerDaemonImpl::FetchStageState(const std::string& address, uint32_t stage, int64_t step) {
  v1::StateRequest req;
  req.set_job_name(job_.name());
  req.set_stage(stage);
  req.set_step(step);
  FetchOptions fo;
  fo.tls = o_.tls;
  fo.timeout = absl::Minutes(5);
  AQSWARM_ASSIGN_OR_RETURN(StateSnapshot s, FetchState(address, req, fo));
  if (s.step != static_cast<uint64_t>(step)) {
    return absl::DataLossError(absl::StrCat("asked for step ", step, ", got step ", s.step));
  }
  const fs::path dir = CheckpointDir(stage);
  std::error_code ec;
  fs::create_directories(dir, ec);
  AQSWARM_RETURN_IF_ERROR(WriteFileAtomically(StageCheckpointPath(dir.string(), step), s.bytes, 0644));
  return s.bytes.size();
}

absl::StatusOr<std::string> PeerDaemonImpl::PrepareState(const v1::Assignment& a) {
  const std::string want = StageCheckpointPath(CheckpointDir(a.stage()).string(), a.resume_step());
  std::error_code ec;
  if (fs::exists(want, ec)) return want;
  if (a.resume_step() == 0) return std::string();
  std::vector<std::string> tried;
  std::vector<v1::Neighbor> sources(a.state_sources().begin(), a.state_sources().end());
  sources.insert(sources.end(), a.replicas().begin(), a.replicas().end());
  for (const auto& r : sources) {
    if (r.state_transfer_address().empty()) continue;
    absl::StatusOr<uint64_t> bytes = FetchStageState(r.state_transfer_address(), a.stage(), a.resume_step());
    if (!bytes.ok()) {
      tried.push_back(absl::StrCat(r.peer_name(), ": ", bytes.status().message()));
      continue;
    }
    v1::PeerEvent e;
    e.mutable_state_fetched()->set_stage(a.stage());
    e.mutable_state_fetched()->set_step(a.resume_step());
    e.mutable_state_fetched()->set_from(r.peer_name());
    e.mutable_state_fetched()->set_bytes(*bytes);
    Event(e);
    return want;
  }
  return absl::NotFoundError(absl::StrCat("no state of stage ", a.stage(), " at step ", a.resume_step(),
                                          ": not kept here and no holder or replica served it [",
                                          absl::StrJoin(tried, "; "), "]"));
}

}  // namespace aqswarm::peer::daemon
