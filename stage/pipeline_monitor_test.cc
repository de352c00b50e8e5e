// PipelineMonitor (stage/pipeline_monitor.h): step rows only once every stage
// reported, diverged replicas or tied copies stop the run, metrics.csv and
// events.jsonl are what it read, and a finished run replays to the same rows.
#include "stage/pipeline_monitor.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/event_json.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm::stage {
namespace {

using ::aqswarm::testing::IsOk;
using ::aqswarm::testing::StatusIs;
using ::testing::HasSubstr;

v1::JobSpec Job(int stages, int dp) {
  v1::JobSpec job;
  job.set_name("monitor");
  job.set_stages(stages);
  job.set_data_parallel(dp);
  return job;
}

std::string Step(int pipeline, int stage, int64_t step, const std::string& hash = "aa", double secs = 1) {
  v1::StageEvent e;
  v1::StepEvent& s = *e.mutable_step();
  s.set_pipeline(pipeline);
  s.set_stage(stage);
  s.set_step(step);
  s.set_loss(2.0 + pipeline);
  s.set_step_seconds(secs);
  s.set_tokens(100);
  s.set_fw_bytes(10);
  s.set_bw_bytes(20);
  s.mutable_dp()->set_param_hash(hash);
  s.mutable_dp()->set_bytes(7);
  return events::ToJsonLine(e);
}

std::string Eval(int pipeline, int stage, int64_t step, double loss) {
  v1::StageEvent e;
  e.mutable_eval()->set_pipeline(pipeline);
  e.mutable_eval()->set_stage(stage);
  e.mutable_eval()->set_step(step);
  e.mutable_eval()->set_val_loss(loss);
  return events::ToJsonLine(e);
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(PipelineMonitorTest, ARowComesOnceEveryStageReportedAndIsWrittenAsRead) {
  testing::ScratchDir dir;
  PipelineMonitor m(Job(2, 2), dir.path(), /*console=*/false, /*keep_steps=*/true);
  ASSERT_THAT(m.OnLine(0, Step(0, 0, 0)), IsOk());
  ASSERT_THAT(m.OnLine(1, Step(0, 1, 0)), IsOk());
  ASSERT_THAT(m.OnLine(2, Step(1, 0, 0, "aa", 3)), IsOk());
  EXPECT_EQ(m.rows(), 0);  // pipeline 1's stage 1 is missing
  ASSERT_THAT(m.OnLine(3, Step(1, 1, 0)), IsOk());
  ASSERT_THAT(m.OnLine(0, "not an event"), IsOk());
  ASSERT_EQ(m.rows(), 1);
  EXPECT_DOUBLE_EQ(m.last_row()->loss, 2.5);          // the pipelines' mean
  EXPECT_DOUBLE_EQ(m.last_row()->step_seconds, 3);    // the slowest pipeline's
  EXPECT_DOUBLE_EQ(m.last_row()->tokens_per_second, 200.0 / 3);
  ASSERT_EQ(m.steps().size(), 1u);
  EXPECT_EQ(m.steps()[0][2].pipeline(), 1u);  // by child, pipeline-major
  const std::string csv = Read(dir.Sub("metrics.csv"));
  EXPECT_THAT(csv, HasSubstr("step,epoch,loss,val_loss,step_seconds,tokens_per_second,fw_bytes_link0,bw_bytes_link0,"
                             "dp_bytes_stage0,dp_bytes_stage1\n"));
  EXPECT_THAT(csv, HasSubstr("0,0,2.5,,3,66.6667,10,20,7,7\n"));
  const std::string events = Read(dir.Sub("events.jsonl"));
  EXPECT_EQ(std::count(events.begin(), events.end(), '\n'), 4) << "every event verbatim, nothing else";
  ASSERT_THAT(m.OnLine(0, Eval(0, 0, 0, 4.0)), IsOk());
  ASSERT_THAT(m.OnLine(2, Eval(1, 0, 0, 5.0)), IsOk());
  EXPECT_EQ(m.final_val_loss(), 4.0);  // pipeline 0's
  EXPECT_THAT(m.evals().at(0), ::testing::ElementsAre(4.0, 5.0));
  EXPECT_DOUBLE_EQ(m.dp_run_bytes(), 14);
}

TEST(PipelineMonitorTest, DivergedReplicasOrTiedCopiesStopTheRun) {
  PipelineMonitor replicas(Job(1, 2), "", false);
  ASSERT_THAT(replicas.OnLine(0, Step(0, 0, 3, "aa")), IsOk());
  EXPECT_THAT(replicas.OnLine(1, Step(1, 0, 3, "bb")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("replicas of stage 0 diverged at step 3")));
  PipelineMonitor tied(Job(2, 1), "", false);
  v1::StageEvent first = *events::ParseStageEvent(Step(0, 0, 1));
  first.mutable_step()->set_tied_hash("01");
  v1::StageEvent last = *events::ParseStageEvent(Step(0, 1, 1));
  last.mutable_step()->set_tied_hash("02");
  ASSERT_THAT(tied.OnLine(0, events::ToJsonLine(first)), IsOk());
  EXPECT_THAT(tied.OnLine(1, events::ToJsonLine(last)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tied embedding copies of pipeline 0 diverged")));
}

TEST(PipelineMonitorTest, AFinishedRunReplaysToTheSameStepsAndAnIncompleteOneIsRefused) {
  testing::ScratchDir dir;
  {
    std::ofstream out(dir.Sub("events.jsonl"));
    for (int64_t step = 0; step < 3; ++step) {
      for (int p = 0; p < 2; ++p) out << Step(p, 0, step) << "\n" << Step(p, 1, step) << "\n";
    }
    out << Eval(0, 0, 2, 4.0) << "\n" << Eval(1, 0, 2, 6.0) << "\n";
  }
  ASSERT_OK_AND_ASSIGN(auto run, PipelineMonitor::Replay(Job(2, 2), dir.Sub("events.jsonl")));
  ASSERT_EQ(run->steps().size(), 3u);
  EXPECT_EQ(run->steps()[2][3].step(), 2);
  EXPECT_THAT(run->evals().at(2), ::testing::ElementsAre(4.0, 6.0));
  {
    std::ofstream out(dir.Sub("events.jsonl"), std::ios::app);
    out << Step(0, 0, 3) << "\n";  // the run stopped with step 3 half reported
  }
  EXPECT_THAT(PipelineMonitor::Replay(Job(2, 2), dir.Sub("events.jsonl")).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("step 3 has 1 stage lines, want 4")));
  EXPECT_THAT(PipelineMonitor::Replay(Job(2, 3), dir.Sub("events.jsonl")).status(),
              StatusIs(absl::StatusCode::kDataLoss));
  {
    std::ofstream out(dir.Sub("bad.jsonl"));
    out << "{\"step\": 5}\n";
  }
  EXPECT_THAT(PipelineMonitor::Replay(Job(2, 2), dir.Sub("bad.jsonl")).status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(PipelineMonitor::Replay(Job(2, 2), dir.Sub("none.jsonl")).status(), StatusIs(absl::StatusCode::kDataLoss));
  {
    std::ofstream out(dir.Sub("outside.jsonl"));
    out << Step(0, 5, 0) << "\n";
  }
  EXPECT_THAT(PipelineMonitor::Replay(Job(2, 2), dir.Sub("outside.jsonl")).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("outside the job's 2x2 grid")));
}

}  // namespace
}  // namespace aqswarm::stage
