// End-to-end: the same job under job.schedule = gpipe, = 1f1b (classic and
// the default depth) and = adaptive (whose order follows the frames' arrival
// times, so differs from run to run) trains to bit-identical weights and
// optimizer state.
// Real `aqswarm stage` processes over loopback gRPC, AQ-SGD links with their
// RocksDB stores; every stage writes its state after every step
// (checkpointDir) and the files are compared byte for byte.
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "proto/event_json.h"
#include "nlohmann/json.hpp"
#include "tests/integration/test_device.h"
#include "tests/testing/stage_launch_file.h"

namespace aqswarm {
namespace {

namespace fs = std::filesystem;
using ::aqswarm::testing::WriteStageLaunchFile;

const char* kBinary = AQSWARM_BINARY;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class ScheduleTest : public ::testing::Test {
 protected:
  static constexpr int kStages = 3;
  static constexpr int kSteps = 4;

  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("aqswarm_sched_", ::getpid(), "_",
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    aqswarm::RemoveTree(dir_).IgnoreError();
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) aqswarm::RemoveTree(dir_).IgnoreError();
  }

  // A 3-stage AQ-SGD job, 6 micro-batches per step (so that every schedule
  // interleaves differently), 2 steps per epoch: steps 2 and 3 send deltas.
  std::string WriteJob(const std::string& tag, const std::string& schedule, int in_flight) {
    const std::string json = absl::StrCat(R"({"name":"sched","seed":7,
      "model":{"vocabSize":64,"seqLen":32,"dModel":32,"nLayer":3,"nHead":2},
      "data":{"syntheticTokens":)", 2 * 6 * 2 * 32 + 200, R"(,"validationFraction":0.05},
      "optimizer":{"lr":0.003,"warmupSteps":1,"gradClip":0.5},
      "microBatchSize":2,"microBatchesPerStep":6,"epochs":4,"maxSteps":)", kSteps, R"(,
      "compression":{"mode":"aqsgd","fwBits":3,"bwBits":6,"warmupEpochs":0},
      "stages":)", kStages, R"(,"evalEverySteps":0,"evalBatches":1,
      "schedule":")", schedule, R"(","scheduleInFlight":)", in_flight, R"(,"device":")", TestDevice(), "\"}");
    const fs::path path = dir_ / (tag + ".json");
    std::ofstream(path) << json;
    return path.string();
  }

  struct Run {
    std::map<int64_t, std::string> losses;  // step -> stage 0's loss field, as printed
    fs::path checkpoints;                   // <checkpoints>/stage<i>/state-<n>.ckpt
  };

  // Starts the stages last to first (each dials the next one's port), waits
  // for all of them; the last stage's step lines give the losses.
  void RunStages(const std::string& tag, const std::string& job, Run* run) {
    run->checkpoints = dir_ / (tag + "-ckpt");
    std::vector<std::unique_ptr<Subprocess>> procs(kStages);
    std::string next;
    for (int s = kStages - 1; s >= 0; --s) {
      nlohmann::json fields = {{"stage", s},
                               {"storeDir", (dir_ / absl::StrCat(tag, "-store", s)).string()},
                               {"checkpointDir", (run->checkpoints / absl::StrCat("stage", s)).string()},
                               {"keepCheckpoints", kSteps + 1},
                               {"linkTimeout", "60s"}};
      if (!next.empty()) fields["next"] = {{"stageLinkAddress", next}};
      const std::string launch = WriteStageLaunchFile((dir_ / absl::StrCat(tag, "-stage", s, ".launch.json")).string(),
                                                      job, std::move(fields));
      auto p = Subprocess::Spawn({kBinary, "stage", "--launch=" + launch},
                                 {.capture_stdout = true,
                                  .stderr_path = (dir_ / absl::StrCat(tag, "-stage", s, ".err")).string()});
      ASSERT_TRUE(p.ok()) << p.status();
      procs[s] = std::move(*p);
      std::string line;
      ASSERT_TRUE(procs[s]->ReadLine(&line, absl::Seconds(60)).ok()) << tag << " stage " << s << " did not start";
      absl::StatusOr<v1::StageEvent> listening = events::ParseStageEvent(line);
      ASSERT_TRUE(listening.ok() && listening->has_listening()) << line;
      next = absl::StrCat("127.0.0.1:", listening->listening().port());
    }
    std::string line;
    while (procs[kStages - 1]->ReadLine(&line, absl::Seconds(60)).ok()) {
      absl::StatusOr<v1::StageEvent> ev = events::ParseStageEvent(line);
      if (!ev.ok() || !ev->has_step()) continue;
      // The loss and the gradient norm, to 6 decimals.
      run->losses[ev->step().step()] = absl::StrFormat("%.6f %.6f", ev->step().loss(), ev->step().grad_norm());
    }
    for (int s = 0; s < kStages; ++s) {
      auto code = procs[s]->Wait(absl::Seconds(60));
      ASSERT_TRUE(code.ok()) << tag << " stage " << s;
      EXPECT_EQ(*code, 0) << tag << " stage " << s << ": " << ReadFile(dir_ / absl::StrCat(tag, "-stage", s, ".err"));
    }
  }

  fs::path dir_;
};

TEST_F(ScheduleTest, GpipeOneFOneBAndAdaptiveTrainToBitIdenticalWeights) {
  Run gpipe, classic, deep, adaptive;
  ASSERT_NO_FATAL_FAILURE(RunStages("gpipe", WriteJob("gpipe", "gpipe", 0), &gpipe));
  ASSERT_NO_FATAL_FAILURE(RunStages("classic", WriteJob("classic", "1f1b", kStages), &classic));
  ASSERT_NO_FATAL_FAILURE(RunStages("deep", WriteJob("deep", "1f1b", 0), &deep));
  ASSERT_NO_FATAL_FAILURE(RunStages("adaptive", WriteJob("adaptive", "adaptive", 6), &adaptive));
  ASSERT_EQ(gpipe.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(classic.losses, gpipe.losses);
  EXPECT_EQ(deep.losses, gpipe.losses);
  EXPECT_EQ(adaptive.losses, gpipe.losses);
  // Weights and optimizer state after every step (start state included).
  for (int s = 0; s < kStages; ++s) {
    for (int n = 0; n <= kSteps; ++n) {
      const fs::path rel = fs::path(absl::StrCat("stage", s)) / absl::StrCat("state-", n, ".ckpt");
      const std::string a = ReadFile(gpipe.checkpoints / rel);
      ASSERT_FALSE(a.empty()) << (gpipe.checkpoints / rel);
      EXPECT_TRUE(a == ReadFile(classic.checkpoints / rel)) << "classic 1f1b differs from gpipe: " << rel;
      EXPECT_TRUE(a == ReadFile(deep.checkpoints / rel)) << "1f1b differs from gpipe: " << rel;
      EXPECT_TRUE(a == ReadFile(adaptive.checkpoints / rel)) << "adaptive differs from gpipe: " << rel;
    }
  }
  // The weights did move (the comparison is not between three initial states).
  EXPECT_FALSE(ReadFile(gpipe.checkpoints / "stage1" / "state-0.ckpt") ==
               ReadFile(gpipe.checkpoints / "stage1" / absl::StrCat("state-", kSteps, ".ckpt")));
}

TEST_F(ScheduleTest, UnknownScheduleIsRejectedBeforeTraining) {
  const std::string job = WriteJob("bad", "interleaved", 0);
  const std::string err = (dir_ / "bad.err").string();
  const std::string launch = WriteStageLaunchFile((dir_ / "bad.launch.json").string(), job,
                                                  {{"stage", 1}, {"storeDir", (dir_ / "bad").string()}});
  auto p = Subprocess::Spawn({kBinary, "stage", "--launch=" + launch},
                             {.capture_stdout = true, .stderr_path = err});
  ASSERT_TRUE(p.ok());
  auto code = (*p)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 1);
  EXPECT_NE(ReadFile(err).find("schedule"), std::string::npos) << ReadFile(err);
}

}  // namespace
}  // namespace aqswarm
