#include "peer/state_keeper.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/sha256.h"
#include "peer/assignment.h"
#include "stage/stage_metrics.h"
#include "stage/stage_checkpoints.h"

namespace aqswarm::peer {

namespace fs = std::filesystem;

StateKeeper::StateKeeper(Options options, std::function<void(const v1::PeerEvent&)> report,
                         std::function<bool()> copied)
    : o_(std::move(options)), report_(std::move(report)), copied_(std::move(copied)) {
  thread_ = std::thread([this] { MirrorLoop(); });
}

StateKeeper::~StateKeeper() { Stop(); }

void StateKeeper::Stop() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::string StateKeeper::root() const { return (fs::path(o_.work_dir) / "checkpoints").string(); }

std::string StateKeeper::StageDir(uint32_t stage) const { return StageCheckpointDir(o_.work_dir, stage); }

std::vector<v1::StageCheckpoints> StateKeeper::Held() const {
  std::vector<v1::StageCheckpoints> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root(), ec)) {
    const std::string name = entry.path().filename().string();
    uint32_t stage = 0;
    if (!absl::StartsWith(name, "stage-") || !absl::SimpleAtoi(name.substr(6), &stage)) continue;
    std::vector<int64_t> steps = stage::StageCheckpointSteps(entry.path().string());
    if (steps.empty()) continue;
    v1::StageCheckpoints h;
    h.set_stage(stage);
    for (size_t i = steps.size() > 64 ? steps.size() - 64 : 0; i < steps.size(); ++i) {
      absl::StatusOr<std::string> sha = Digest(stage::StageCheckpointPath(entry.path().string(), steps[i]));
      if (!sha.ok() && absl::IsNotFound(sha.status())) continue;  // pruned meanwhile
      v1::HeldState& state = *h.add_states();
      state.set_step(steps[i]);
      state.set_sha256(sha.ok() ? *sha : "");
    }
    if (h.states().empty()) continue;
    out.push_back(std::move(h));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.stage() < b.stage(); });
  return out;
}

void StateKeeper::SetJob(const std::string& name) {
  absl::MutexLock l(&mu_);
  job_name_ = name;
}

namespace {

struct FileId {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
};

absl::StatusOr<FileId> Identify(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return FileError(errno, absl::StrCat("stat of ", path));
  return FileId{static_cast<uint64_t>(st.st_size), int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec,
                static_cast<uint64_t>(st.st_ino)};
}

}  // namespace

absl::StatusOr<std::string> StateKeeper::Digest(const std::string& path) const {
  AQSWARM_ASSIGN_OR_RETURN(FileId id, Identify(path));
  {
    absl::MutexLock l(&digest_mu_);
    auto it = digests_.find(path);
    if (it != digests_.end() && it->second.size == id.size && it->second.mtime_ns == id.mtime_ns &&
        it->second.inode == id.inode) {
      return it->second.sha256;
    }
  }
  AQSWARM_ASSIGN_OR_RETURN(std::string sha, Sha256OfFile(path));
  absl::StatusOr<FileId> after = Identify(path);
  if (after.ok() && after->size == id.size && after->mtime_ns == id.mtime_ns && after->inode == id.inode) {
    absl::MutexLock l(&digest_mu_);
    if (digests_.size() > 4096) digests_.clear();  // states come and go; a bound on forgotten ones
    digests_[path] = CachedDigest{id.size, id.mtime_ns, id.inode, sha};
  }
  return sha;
}

void StateKeeper::CacheDigest(const std::string& path, const std::string& sha256) const {
  absl::StatusOr<FileId> id = Identify(path);
  if (!id.ok()) return;
  absl::MutexLock l(&digest_mu_);
  digests_[path] = CachedDigest{id->size, id->mtime_ns, id->inode, sha256};
}

void StateKeeper::SetMaxStateBytes(std::vector<uint64_t> bytes) {
  absl::MutexLock l(&mu_);
  max_state_bytes_ = std::move(bytes);
}

absl::StatusOr<StateSnapshot> StateKeeper::Serve(const v1::StateRequest& r) {
  std::string job;
  {
    absl::MutexLock l(&mu_);
    job = job_name_;
  }
  if (r.job_name() != job) {
    return absl::FailedPreconditionError(absl::StrCat("this peer trains job '", job, "', not '", r.job_name(), "'"));
  }
  const std::string dir = StageDir(r.stage());
  int64_t step = r.step();
  if (step == 0) {  // the newest
    const std::vector<int64_t> kept = stage::StageCheckpointSteps(dir);
    if (kept.empty()) return absl::NotFoundError(absl::StrCat("no state of stage ", r.stage(), " here"));
    step = kept.back();
  }
  const std::string path = stage::StageCheckpointPath(dir, step);
  std::error_code ec;
  if (step < 0 || !fs::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat("no state of stage ", r.stage(), " at step ", step,
                                            " here (only the newest ", o_.keep_checkpoints, " are kept)"));
  }
  StateSnapshot snap;
  snap.step = static_cast<uint64_t>(step);
  snap.path = path;  // streamed from the file (a prune meanwhile leaves the open file readable)
  return snap;
}

absl::StatusOr<uint64_t> StateKeeper::Fetch(const std::string& address, uint32_t stage, int64_t step,
                                            const std::string& sha256) {
  v1::StateRequest req;
  FetchOptions fo;
  {
    absl::MutexLock l(&mu_);
    req.set_job_name(job_name_);
    if (stage < max_state_bytes_.size() && max_state_bytes_[stage] > 0) fo.max_bytes = max_state_bytes_[stage];
  }
  req.set_stage(stage);
  req.set_step(step);
  fo.tls = o_.tls;
  fo.timeout = absl::Minutes(5);
  fo.expected_sha256 = sha256;
  const std::string dir = StageDir(stage);
  std::error_code ec;
  fs::create_directories(dir, ec);
  // Into a name no listing takes for a state; published once the step is checked.
  const std::string incoming = (fs::path(dir) / absl::StrCat(".incoming-", step, ".ckpt")).string();
  AQSWARM_ASSIGN_OR_RETURN(FetchedState got, FetchStateToFile(address, req, incoming, fo));
  if (got.step != static_cast<uint64_t>(step)) {
    fs::remove(incoming, ec);
    stage::CountStateTransferRefused("bad_chunk");
    return absl::DataLossError(absl::StrCat("asked for step ", step, ", got step ", got.step));
  }
  const std::string path = stage::StageCheckpointPath(dir, step);
  AQSWARM_RETURN_IF_ERROR(PublishFileAtomically(incoming, path));
  CacheDigest(path, got.sha256);
  return got.bytes;
}

absl::StatusOr<std::string> StateKeeper::Prepare(const v1::Assignment& a) {
  const std::string want = stage::StageCheckpointPath(StageDir(a.stage()), a.resume_step());
  std::error_code ec;
  if (fs::exists(want, ec)) {
    if (a.state_sha256().empty()) return want;
    absl::StatusOr<std::string> mine = Digest(want);
    if (mine.ok() && *mine == a.state_sha256()) return want;
    // Ours is not the state the swarm resumes from (another timeline's state
    // of the same step): set it aside and fetch the swarm's.
    AQSWARM_LOG(WARNING) << "peer " << o_.name << ": kept state of stage " << a.stage() << " at step "
                         << a.resume_step() << " has SHA-256 " << (mine.ok() ? *mine : mine.status().ToString())
                         << ", the swarm's is " << a.state_sha256() << ": quarantining it";
    stage::PruneStageCheckpoints(StageDir(a.stage()), a.resume_step() - 1, std::numeric_limits<size_t>::max());
  }
  if (a.resume_step() == 0) return std::string();
  std::vector<std::string> tried;
  std::vector<v1::Neighbor> sources(a.state_sources().begin(), a.state_sources().end());
  sources.insert(sources.end(), a.replicas().begin(), a.replicas().end());
  for (const auto& r : sources) {
    if (r.state_transfer_address().empty()) continue;
    absl::StatusOr<uint64_t> bytes = Fetch(r.state_transfer_address(), a.stage(), a.resume_step(), a.state_sha256());
    if (!bytes.ok()) {
      tried.push_back(absl::StrCat(r.peer_name(), ": ", bytes.status().message()));
      continue;
    }
    v1::PeerEvent e;
    e.mutable_state_fetched()->set_stage(a.stage());
    e.mutable_state_fetched()->set_step(a.resume_step());
    e.mutable_state_fetched()->set_from(r.peer_name());
    e.mutable_state_fetched()->set_bytes(*bytes);
    Tell(e);
    return want;
  }
  return absl::NotFoundError(absl::StrCat("no state of stage ", a.stage(), " at step ", a.resume_step(),
                                          ": not kept here and no holder or replica served it [",
                                          absl::StrJoin(tried, "; "), "]"));
}

bool StateKeeper::Follow(const v1::Assignment& a) {
  bool new_plan = false;
  {
    absl::MutexLock l(&mu_);
    const std::optional<uint32_t> mirrored_before =
        mirror_target_.has_value() ? std::optional<uint32_t>(mirror_target_->stage()) : std::nullopt;
    if (a.has_mirror() && !a.mirror().state_transfer_address().empty()) {
      mirror_target_ = a.mirror();
    } else {
      mirror_target_.reset();
    }
    if (!mirror_target_.has_value() || mirrored_before != mirror_target_->stage()) mirror_landed_ = 0;
    own_stage_ = a.role() == v1::Assignment::STAGE ? std::optional<uint32_t>(a.stage()) : std::nullopt;
    if (RunPlanOf(a) != plan_) {
      new_plan = true;
      plan_ = RunPlanOf(a);
      mirror_want_ = std::min(mirror_want_, a.resume_step());
      mirror_done_ = std::min(mirror_done_, a.resume_step());
      if (mirror_landed_ > a.resume_step()) mirror_landed_ = 0;
      std::error_code ec;
      for (const auto& entry : fs::directory_iterator(root(), ec)) {
        const size_t n = stage::PruneStageCheckpoints(entry.path().string(), a.resume_step(), o_.keep_checkpoints);
        if (n > 0) {
          AQSWARM_LOG(WARNING) << "peer " << o_.name << ": plan " << a.plan_version() << " resumes at step "
                               << a.resume_step() << ": " << n << " later state(s) of " << entry.path().string()
                               << " moved to " << stage::StageQuarantineDir(entry.path().string());
        }
      }
    }
  }
  UpdatePins();
  return new_plan;
}

void StateKeeper::Checkpointed(int64_t step) {
  {
    absl::MutexLock l(&mu_);
    mirror_want_ = std::max(mirror_want_, step);
  }
  UpdatePins();
}

void StateKeeper::MirrorLoop() {
  while (true) {
    v1::Neighbor target;
    int64_t want = 0;
    uint64_t plan = 0;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (mirror_target_.has_value() && mirror_want_ > mirror_done_);
      };
      mu_.Await(absl::Condition(&ready));
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
      // Told once the coordinator knows of the copy (or the report failed):
      // only then can a re-plan resume from it.
      const bool reported = copied_ ? copied_() : false;
      v1::PeerEvent e;
      e.mutable_mirrored()->set_stage(target.stage());
      e.mutable_mirrored()->set_step(want);
      e.mutable_mirrored()->set_from(target.peer_name());
      e.mutable_mirrored()->set_reported(reported);
      Tell(e);
    } else if (!absl::IsCancelled(s)) {
      AQSWARM_LOG(WARNING) << "peer " << o_.name << ": no copy of stage " << target.stage() << " at step " << want
                           << ": " << s;
    }
  }
}

absl::Status StateKeeper::CopyMirror(const v1::Neighbor& target, int64_t step, uint64_t plan) {
  // The mirrored peer completes the same step at about the same time; until
  // it has, it answers NOT_FOUND.
  const absl::Time deadline = absl::Now() + o_.copy_wait;
  while (true) {
    absl::StatusOr<uint64_t> s = Fetch(target.state_transfer_address(), target.stage(), step);
    if (s.ok()) {
      const std::string dir = StageDir(target.stage());
      absl::MutexLock l(&mu_);
      if (plan_ != plan) {  // a re-plan pruned while we fetched: this state may be from its abandoned timeline
        std::error_code ec;
        fs::remove(stage::StageCheckpointPath(dir, step), ec);
        return absl::CancelledError("the plan changed");
      }
      stage::PruneStageCheckpoints(dir, std::numeric_limits<int64_t>::max(), o_.keep_checkpoints);
      return absl::OkStatus();
    }
    if (!absl::IsNotFound(s.status()) || absl::Now() > deadline) return s.status();
    absl::MutexLock l(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(200))) return absl::CancelledError("stopped");
    if (plan_ != plan) return absl::CancelledError("the plan changed");
  }
}

void StateKeeper::UpdatePins() {
  absl::MutexLock serial(&pins_mu_);
  std::string dir;
  std::vector<int64_t> steps;
  {
    absl::MutexLock l(&mu_);
    if (own_stage_.has_value()) dir = StageDir(*own_stage_);
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
      const absl::Status s = stage::WriteStageCheckpointPins(pins_dir_, {});
      if (!s.ok()) {
        AQSWARM_LOG(WARNING) << "peer " << o_.name << ": " << s;
      }
    }
    pins_dir_ = dir;
    pinned_.reset();  // unknown there (a file of an earlier run): written below
  }
  if (dir.empty() || steps == pinned_) return;
  const absl::Status s = stage::WriteStageCheckpointPins(dir, steps);
  if (!s.ok()) {
    AQSWARM_LOG(WARNING) << "peer " << o_.name << ": cannot pin the states of mirrored steps: " << s;
    return;
  }
  pinned_ = std::move(steps);
}

}  // namespace aqswarm::peer
