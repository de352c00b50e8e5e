#include "proto/event_json.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aqswarm::events {
namespace {

TEST(EventJsonTest, AStepEventRoundTripsWithEveryFieldAndZerosPrinted) {
  v1::StageEvent e;
  v1::StepEvent* s = e.mutable_step();
  s->set_stage(0);
  s->set_step(7);
  s->set_loss(5.25);
  s->set_fw_bytes(uint64_t{1} << 40);
  s->mutable_dp()->set_param_hash("00ff00ff00ff00ff");
  const std::string line = ToJsonLine(e);
  EXPECT_THAT(line, ::testing::StartsWith(R"({"step":{"stage":0,"pipeline":0,"step":7,)"));
  EXPECT_THAT(line, ::testing::HasSubstr(R"("fw_bytes":"1099511627776")"));
  EXPECT_THAT(line, ::testing::Not(::testing::HasSubstr("sender")));  // unset groups are left out
  EXPECT_EQ(line.find('\n'), std::string::npos);
  absl::StatusOr<v1::StageEvent> back = ParseStageEvent(line + "\n");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), e.SerializeAsString());
}

TEST(EventJsonTest, ANonFiniteLossIsValidJsonAndKeepsItsFlag) {
  v1::StageEvent e;
  e.mutable_step()->set_loss(std::numeric_limits<double>::quiet_NaN());
  e.mutable_step()->set_loss_not_finite(true);
  const std::string line = ToJsonLine(e);
  EXPECT_THAT(line, ::testing::HasSubstr(R"("loss":"NaN")"));
  absl::StatusOr<v1::StageEvent> back = ParseStageEvent(line);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(std::isnan(back->step().loss()));
  EXPECT_TRUE(back->step().loss_not_finite());
}

TEST(EventJsonTest, PeerEventsWrapTheStagesOwn) {
  v1::StageEvent e;
  e.mutable_eval()->set_step(3);
  e.mutable_eval()->set_val_loss(4.5);
  const std::string line = ToJsonLine(FromStage(e));
  EXPECT_THAT(line, ::testing::StartsWith(R"({"stage":{"eval":{)"));
  absl::StatusOr<v1::PeerEvent> back = ParsePeerEvent(line);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->stage().eval().val_loss(), 4.5);
}

TEST(EventJsonTest, MalformedLinesAreRefusedWithTheReason) {
  for (const char* bad : {"", "not json", "[]", R"({"step":{"loss":nan}})", R"({"step":{"bogus":1}})", "{}",
                          R"({"step":{"step":-1}})", R"({"step":{},"eval":{}})", R"({"event":"step","step":3})"}) {
    absl::StatusOr<v1::StageEvent> e = ParseStageEvent(bad);
    EXPECT_FALSE(e.ok()) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(e.status())) << bad << ": " << e.status();
  }
  EXPECT_FALSE(ParsePeerEvent(R"({"joined":{"peer_id":"x"}})").ok());
}

}  // namespace
}  // namespace aqswarm::events
