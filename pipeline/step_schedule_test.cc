#include "pipeline/step_schedule.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace aqswarm::pipeline {
namespace {

std::string Ops(const StepSchedule& s, int stage) {
  std::string out;
  for (const StepOp& op : StageStepOps(s, stage)) {
    if (!out.empty()) out += ' ';
    out += (op.forward ? "F" : "B") + std::to_string(op.micro_batch);
  }
  return out;
}

StepSchedule Make(StepSchedule::Kind kind, int k, int m, int in_flight = 0) {
  StepSchedule s;
  s.kind = kind;
  s.stages = k;
  s.micro_batches = m;
  s.in_flight = in_flight;
  return s;
}

TEST(StepScheduleTest, GpipeRunsAllForwardsThenBackwardsInIncreasingOrder) {
  const StepSchedule s = Make(StepSchedule::kGpipe, 3, 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Ops(s, i), "F0 F1 F2 B0 B1 B2") << "stage " << i;
}

TEST(StepScheduleTest, ClassicOneFOneBWarmsUpKMinusIForwards) {
  const StepSchedule s = Make(StepSchedule::k1F1B, 4, 6, /*in_flight=*/4);
  EXPECT_EQ(Ops(s, 0), "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  EXPECT_EQ(Ops(s, 1), "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5");
  EXPECT_EQ(Ops(s, 2), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5");
  EXPECT_EQ(Ops(s, 3), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  // Fewer micro-batches than the warm-up: GPipe order on the early stages.
  EXPECT_EQ(Ops(Make(StepSchedule::k1F1B, 4, 2, 4), 0), "F0 F1 B0 B1");
}

TEST(StepScheduleTest, DefaultDepthCoversTheLinkRoundTrip) {
  const StepSchedule s = Make(StepSchedule::k1F1B, 4, 64);
  EXPECT_EQ(InFlightAt(s, 0), 7);
  EXPECT_EQ(InFlightAt(s, 1), 5);
  EXPECT_EQ(InFlightAt(s, 2), 3);
  EXPECT_EQ(InFlightAt(s, 3), 1);
  EXPECT_EQ(InFlightAt(Make(StepSchedule::k1F1B, 4, 64, 8), 1), 6);
  EXPECT_EQ(InFlightAt(Make(StepSchedule::k1F1B, 1, 4), 0), 1);
  EXPECT_EQ(InFlightAt(Make(StepSchedule::k1F1B, 4, 5), 0), 5);  // capped at M
}

// Every op list is a valid step for every shape: each micro-batch forwarded
// once, then backwarded once; backwards in increasing order (the gradient
// accumulation order, hence bit-identical weights across schedules); windows
// never grow along the pipeline (deadlock freedom).
TEST(StepScheduleTest, EveryScheduleIsAValidDeadlockFreeStep) {
  for (auto kind : {StepSchedule::kGpipe, StepSchedule::k1F1B}) {
    for (int k = 1; k <= 8; ++k) {
      for (int m = 1; m <= 20; ++m) {
        for (int w : {0, 1, 2, k, 3 * k}) {
          const StepSchedule s = Make(kind, k, m, w);
          for (int i = 0; i < k; ++i) {
            std::vector<int> state(m, 0);  // 0 new, 1 forwarded, 2 done
            int next_backward = 0, in_flight = 0;
            for (const StepOp& op : StageStepOps(s, i)) {
              ASSERT_GE(op.micro_batch, 0);
              ASSERT_LT(op.micro_batch, m);
              if (op.forward) {
                ASSERT_EQ(state[op.micro_batch], 0);
                state[op.micro_batch] = 1;
                ASSERT_LE(++in_flight, InFlightAt(s, i));
              } else {
                ASSERT_EQ(state[op.micro_batch], 1);
                ASSERT_EQ(op.micro_batch, next_backward++);
                state[op.micro_batch] = 2;
                --in_flight;
              }
            }
            ASSERT_EQ(next_backward, m);
            if (i > 0) ASSERT_GE(InFlightAt(s, i - 1), InFlightAt(s, i));
          }
          ASSERT_EQ(InFlightAt(s, k - 1), kind == StepSchedule::kGpipe ? m : 1);
          ASSERT_TRUE(std::isfinite(LinkBoundStepTime(s, 1.0, 0.5))) << k << " " << m << " " << w;
        }
      }
    }
  }
}

TEST(StepScheduleTest, LinkBoundStepTimes) {
  // GPipe: the flush serialises the two directions over M + K - 2 slots.
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::kGpipe, 4, 8), 1, 1), 20);
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::kGpipe, 4, 8), 1, 2), 30);
  // The default 1F1B depth reaches the bound of any flushed schedule,
  // (M - 1) max(t_fw, t_bw) + (K - 1)(t_fw + t_bw).
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::k1F1B, 4, 8), 1, 1), 7 + 6);
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::k1F1B, 4, 64), 1, 1), 63 + 6);
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::k1F1B, 4, 64), 1, 2), 63 * 2 + 9);
  // Classic depth K: a micro-batch's round trip, 2 (K - 1) transfers, does
  // not fit in K slots, so stage 0 waits for gradients.
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::k1F1B, 4, 8, 4), 1, 1), 16);
  // Deeper than the round trip: the middle stages hold gradients back.
  EXPECT_GT(LinkBoundStepTime(Make(StepSchedule::k1F1B, 4, 64, 12), 1, 1), 63 + 6);
}

TEST(StepScheduleTest, FromJob) {
  v1::JobSpec job;
  job.set_stages(3);
  job.set_micro_batches_per_step(5);
  auto s = StepScheduleFromJob(job);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->kind, StepSchedule::k1F1B);
  EXPECT_EQ(StepScheduleName(*s), "1f1b");
  job.set_schedule("gpipe");
  EXPECT_EQ(StepScheduleName(*StepScheduleFromJob(job)), "gpipe");
  job.set_schedule("1f1b");
  job.set_schedule_in_flight(3);
  EXPECT_EQ(StepScheduleName(*StepScheduleFromJob(job)), "1f1b/3");
  job.set_schedule("interleaved");
  EXPECT_FALSE(StepScheduleFromJob(job).ok());
}

}  // namespace
}  // namespace aqswarm::pipeline
