#include "stage/stage_checkpoints.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::stage {
namespace {

namespace fs = std::filesystem;

class StageCheckpointsTest : public ::testing::Test {
 protected:
  void Write(int64_t step) { std::ofstream(StageCheckpointPath(dir_, step)) << "state " << step; }
  void WritePinsFile(const std::string& text) { std::ofstream(fs::path(dir_) / "pinned") << text; }

  aqswarm::testing::ScratchDir scratch_;
  const std::string dir_ = scratch_.path();
};

TEST_F(StageCheckpointsTest, PruneKeepsTheNewestAndDropsAnAbandonedTimeline) {
  for (int64_t s : {2, 4, 6, 8, 10, 12}) Write(s);
  PruneStageCheckpoints(dir_, 10, 3);
  EXPECT_EQ(StageCheckpointSteps(dir_), (std::vector<int64_t>{6, 8, 10}));
}

TEST_F(StageCheckpointsTest, PinnedStatesOutliveKeepingTheNewestButNotAnAbandonedTimeline) {
  for (int64_t s : {2, 4, 6, 8, 10, 12}) Write(s);
  ASSERT_TRUE(WriteStageCheckpointPins(dir_, {4, 12}).ok());
  EXPECT_EQ(*ReadStageCheckpointPins(dir_), (std::vector<int64_t>{4, 12}));
  PruneStageCheckpoints(dir_, 10, 2);
  EXPECT_EQ(StageCheckpointSteps(dir_), (std::vector<int64_t>{4, 8, 10}));
  // Unpinned, 4 goes at the next prune.
  ASSERT_TRUE(WriteStageCheckpointPins(dir_, {}).ok());
  EXPECT_FALSE(fs::exists(fs::path(dir_) / "pinned"));
  EXPECT_TRUE(ReadStageCheckpointPins(dir_)->empty());
  PruneStageCheckpoints(dir_, 10, 2);
  EXPECT_EQ(StageCheckpointSteps(dir_), (std::vector<int64_t>{8, 10}));
}

TEST_F(StageCheckpointsTest, ACorruptPinsFileIsAnErrorAndPruningThenKeepsEveryState) {
  for (int64_t s : {2, 4, 6, 8}) Write(s);
  for (const std::string& bad : {std::string("4\nfour\n"), std::string("-2\n"), std::string(5000, '7')}) {
    WritePinsFile(bad);
    absl::StatusOr<std::vector<int64_t>> pins = ReadStageCheckpointPins(dir_);
    EXPECT_EQ(pins.status().code(), absl::StatusCode::kDataLoss) << bad.substr(0, 20);
    PruneStageCheckpoints(dir_, 6, 1);  // the abandoned timeline still goes
    EXPECT_EQ(StageCheckpointSteps(dir_), (std::vector<int64_t>{2, 4, 6})) << bad.substr(0, 20);
  }
  EXPECT_EQ(WriteStageCheckpointPins(dir_, {-1}).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StageCheckpointsTest, OnlyStateFilesCountAsCheckpoints) {
  Write(7);
  std::ofstream(fs::path(dir_) / ".state-9.tmp") << "partial";
  std::ofstream(fs::path(dir_) / "state-x.ckpt") << "?";
  ASSERT_TRUE(WriteStageCheckpointPins(dir_, {7}).ok());
  EXPECT_EQ(StageCheckpointSteps(dir_), (std::vector<int64_t>{7}));
  EXPECT_TRUE(StageCheckpointSteps(dir_ + "/missing").empty());
}

// A rollback's states past the resume step are moved aside, not deleted: a
// lying report that forced it loses nothing an operator cannot restore.
TEST_F(StageCheckpointsTest, ARollbackQuarantinesTheAbandonedStatesWithinItsBounds) {
  for (int64_t s : {2, 4, 6, 8}) Write(s);
  EXPECT_EQ(PruneStageCheckpoints(dir_, 4, 4), 2u);
  EXPECT_EQ(StageCheckpointSteps(dir_), (std::vector<int64_t>{2, 4}));
  std::vector<std::string> q = QuarantinedStates(dir_);
  ASSERT_EQ(q.size(), 2u);
  for (int64_t s : {6, 8}) {
    bool found = false;
    for (const auto& name : q) {
      if (name.rfind(absl::StrCat("state-", s, "-at-"), 0) != 0) continue;
      found = true;
      std::ifstream in(fs::path(StageQuarantineDir(dir_)) / name);
      std::string text;
      std::getline(in, text);
      EXPECT_EQ(text, absl::StrCat("state ", s));
    }
    EXPECT_TRUE(found) << "state " << s << " not quarantined";
  }
  // The quarantine is not a checkpoint directory: nothing there is served or resumed from.
  EXPECT_EQ(StageCheckpointSteps(StageQuarantineDir(dir_)).size(), 0u);

  // Bounded by files: the oldest go first.
  for (int round = 0; round < 5; ++round) {
    Write(6);
    PruneStageCheckpoints(dir_, 4, 4, {.max_files = 3, .max_bytes = 0});
  }
  EXPECT_EQ(QuarantinedStates(dir_).size(), 3u);
  // Bounded by bytes: each state here is 7 bytes; 15 bytes hold two.
  Write(6);
  PruneStageCheckpoints(dir_, 4, 4, {.max_files = 10, .max_bytes = 15});
  q = QuarantinedStates(dir_);
  ASSERT_EQ(q.size(), 2u);
  EXPECT_EQ(q.back().rfind("state-6-at-", 0), 0u);
  EXPECT_EQ(StageCheckpointSteps(dir_), (std::vector<int64_t>{2, 4}));
}

}  // namespace
}  // namespace aqswarm::stage
