#include "peer/stage_child.h"

#include <signal.h>

#include <filesystem>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "proto/event_json.h"
#include "stage/stage_launch.h"

namespace aqswarm::peer {
namespace {

class ProcessStageChild final : public StageChild {
 public:
  ProcessStageChild(std::unique_ptr<Subprocess> process, StageChildCallbacks callbacks)
      : process_(std::move(process)), callbacks_(std::move(callbacks)) {
    reader_ = std::thread([this] { ReadUntilExit(); });
  }

  ~ProcessStageChild() override {
    process_->Signal(SIGKILL);
    if (reader_.joinable()) reader_.join();
  }

  int64_t pid() const override { return process_->pid(); }

  absl::Status SendReplicas(const v1::StageLaunch& patch) override {
    return process_->WriteStdin(stage::StageLaunchJson(patch) + "\n");
  }

  bool Stop(absl::Duration grace) override {
    process_->Signal(SIGTERM);
    bool in_time = true;
    {
      absl::MutexLock l(&mu_);
      if (!mu_.AwaitWithTimeout(absl::Condition(&exited_), grace)) {
        process_->Signal(SIGKILL);
        in_time = false;
      }
    }
    if (reader_.joinable()) reader_.join();
    return in_time;
  }

 private:
  // Owns the child's stdout and its exit.
  void ReadUntilExit() {
    std::string line;
    while (true) {
      const absl::Status s = process_->ReadLine(&line, absl::Hours(24));
      if (absl::IsOutOfRange(s) || (!s.ok() && !absl::IsDeadlineExceeded(s))) break;
      if (!s.ok()) continue;
      absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
      if (!e.ok()) {
        AQSWARM_LOG(WARNING) << "stage pid " << process_->pid() << ": " << e.status().message();
        continue;
      }
      if (callbacks_.on_event) callbacks_.on_event(*e);
    }
    const absl::StatusOr<int> code = process_->Wait(absl::Hours(24));
    if (callbacks_.on_exit) callbacks_.on_exit(code.ok() ? *code : 255);
    absl::MutexLock l(&mu_);
    exited_ = true;
  }

  const std::unique_ptr<Subprocess> process_;
  const StageChildCallbacks callbacks_;
  absl::Mutex mu_;
  bool exited_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reader_;
};

class ProcessLauncher final : public StageLauncher {
 public:
  ProcessLauncher(std::string executable, std::string work_dir)
      : executable_(std::move(executable)),
        launch_path_((std::filesystem::path(work_dir) / "stage-launch.json").string()),
        log_path_((std::filesystem::path(work_dir) / "stage.log").string()) {}

  absl::StatusOr<std::unique_ptr<StageChild>> Launch(const v1::StageLaunch& launch,
                                                     StageChildCallbacks callbacks) override {
    AQSWARM_RETURN_IF_ERROR(stage::WriteStageLaunch(launch_path_, launch));
    SubprocessOptions so;
    so.stderr_path = log_path_;
    so.pipe_stdin = launch.dp_timeline() > 0;  // replica patches (StageChild::SendReplicas)
    AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> process,
                             Subprocess::Spawn({executable_, "stage", "--launch=" + launch_path_}, so));
    return std::make_unique<ProcessStageChild>(std::move(process), std::move(callbacks));
  }

 private:
  const std::string executable_, launch_path_, log_path_;
};

}  // namespace

std::unique_ptr<StageLauncher> ProcessStageLauncher(std::string executable, std::string work_dir) {
  return std::make_unique<ProcessLauncher>(std::move(executable), std::move(work_dir));
}

}  // namespace aqswarm::peer
