#include "pipeline/step_schedule.h"

#include <cmath>
#include <functional>
#include <optional>
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
  for (auto kind : {StepSchedule::kGpipe, StepSchedule::k1F1B, StepSchedule::kAdaptive}) {
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

// Runs a sequencer, offering a backward only when `gradient_ready(mb)` and
// a forward only when `input_ready(mb)`, the way the stage runner does.
std::string Sequence(const StepSchedule& s, int stage, const std::function<bool(int)>& gradient_ready,
                     const std::function<bool(int)>& input_ready) {
  StepOpSequencer seq(s, stage);
  std::string out;
  while (!seq.done()) {
    const std::optional<StepOp> b = seq.backward(), f = seq.forward();
    std::optional<StepOp> op;
    if (!seq.adaptive()) {
      op = b ? b : f;
    } else if (b && gradient_ready(b->micro_batch)) {
      op = b;
    } else if (f && input_ready(f->micro_batch)) {
      op = f;
    }
    if (!op) return out + " (waits)";
    if (!out.empty()) out += ' ';
    out += (op->forward ? "F" : "B") + std::to_string(op->micro_batch);
    seq.Ran(*op);
  }
  return out;
}

TEST(StepScheduleTest, StaticSequencersHandOutTheirOpList) {
  for (auto kind : {StepSchedule::kGpipe, StepSchedule::k1F1B}) {
    const StepSchedule s = Make(kind, 4, 6, 4);
    for (int i = 0; i < 4; ++i) {
      auto never = [](int) { return false; };  // static schedules do not look
      EXPECT_EQ(Sequence(s, i, never, never), Ops(s, i)) << StepScheduleName(s) << " stage " << i;
    }
  }
}

TEST(StepScheduleTest, AdaptiveRunsWhateverHasArrivedWithinTheWindow) {
  const StepSchedule s = Make(StepSchedule::kAdaptive, 4, 6, 4);
  EXPECT_EQ(StepScheduleName(s), "adaptive/4");
  EXPECT_EQ(InFlightAt(s, 1), 3);
  auto all = [](int) { return true; };
  auto none = [](int) { return false; };
  // Inputs in the 1F1B order: the 1F1B list. A gradient that is there runs first.
  EXPECT_EQ(Sequence(s, 1, all, all), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  // No gradient yet: forwards up to the window, then it waits.
  EXPECT_EQ(Sequence(s, 1, none, all), "F0 F1 F2 (waits)");
  // Gradients of 0 and 1 only: a late gradient does not hold forwards back,
  // a late input does not hold backwards back.
  EXPECT_EQ(Sequence(s, 1, [](int mb) { return mb < 2; }, all), "F0 B0 F1 B1 F2 F3 F4 (waits)");
  EXPECT_EQ(Sequence(s, 1, all, [](int mb) { return mb < 2; }), "F0 B0 F1 B1 (waits)");
  // The last stage's gradient is its loss; stage 0's input is its data.
  EXPECT_EQ(Sequence(s, 3, all, all), Ops(s, 3));
}

TEST(StepScheduleTest, AdaptiveLinkBoundStepTimes) {
  // Fast enough windows reach the bound of any flushed schedule...
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::kAdaptive, 4, 64), 1, 1), 63 + 6);
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::kAdaptive, 4, 64), 1, 2), 63 * 2 + 9);
  // ... and, unlike 1f1b's fixed order, a deeper window still does: no
  // stage holds a gradient back behind a forward.
  for (int w : {8, 12, 16, 64}) {
    EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::kAdaptive, 4, 64, w), 1, 1), 63 + 6) << w;
    EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::kAdaptive, 4, 64, w), 0.5, 1), 63 + 4.5) << w;
  }
  // A window too small for the round trip waits like 1f1b's does.
  EXPECT_DOUBLE_EQ(LinkBoundStepTime(Make(StepSchedule::kAdaptive, 4, 8, 4), 1, 1),
                   LinkBoundStepTime(Make(StepSchedule::k1F1B, 4, 8, 4), 1, 1));
}

TEST(StepScheduleTest, FromJob) {
  v1::JobSpec job;
  job.set_stages(3);
  job.set_micro_batches_per_step(5);
  auto s = StepScheduleFromJob(job);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->kind, StepSchedule::kAdaptive);
  EXPECT_EQ(StepScheduleName(*s), "adaptive");
  EXPECT_EQ(InFlightAt(*s, 0), 5);  // 4K - 1 = 11, capped at M
  job.set_schedule(v1::JobSpec::Schedule::gpipe);
  EXPECT_EQ(StepScheduleName(*StepScheduleFromJob(job)), "gpipe");
  job.set_schedule(v1::JobSpec::Schedule::one_f_one_b);
  EXPECT_EQ(InFlightAt(*StepScheduleFromJob(job), 0), 5);
  job.set_micro_batches_per_step(64);
  EXPECT_EQ(InFlightAt(*StepScheduleFromJob(job), 0), 5);  // 2K - 1
  job.set_schedule(v1::JobSpec::Schedule::UNSPECIFIED);
  EXPECT_EQ(InFlightAt(*StepScheduleFromJob(job), 0), 11);  // 4K - 1
  job.set_schedule(v1::JobSpec::Schedule::one_f_one_b);
  job.set_schedule_in_flight(3);
  EXPECT_EQ(StepScheduleName(*StepScheduleFromJob(job)), "1f1b/3");
  job.set_schedule(v1::JobSpec::Schedule::adaptive);
  EXPECT_EQ(StepScheduleName(*StepScheduleFromJob(job)), "adaptive/3");
  EXPECT_EQ(StepScheduleFromJob(job)->kind, StepSchedule::kAdaptive);
  job.set_schedule(static_cast<v1::JobSpec::Schedule::Value>(9));
  EXPECT_FALSE(StepScheduleFromJob(job).ok());
}

}  // namespace
}  // namespace aqswarm::pipeline
