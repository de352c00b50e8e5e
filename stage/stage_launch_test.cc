// The stage launch (stage/stage_launch.h): what a launcher writes is what the
// stage reads, defaults filled in, and every bad launch is refused with a
// message naming the field.
#include "stage/stage_launch.h"

#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "pipeline/job_spec.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm::stage {
namespace {

using ::aqswarm::testing::IsOk;
using ::aqswarm::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kJob[] = R"({"name": "launch-test", "model": {"seqLen": 16, "dModel": 16, "nLayer": 2, "nHead": 2},
  "data": {"syntheticTokens": 4096}, "microBatchSize": 2, "microBatchesPerStep": 2, "maxSteps": 2,
  "stages": 2, "dataParallel": 2})";

v1::StageLaunch Launch(int stage = 0, int pipeline = 0) {
  v1::StageLaunch l;
  *l.mutable_job() = *pipeline::ParseJobSpec(kJob);
  l.set_stage(stage);
  l.set_pipeline(pipeline);
  if (stage == 0) l.mutable_next()->set_stage_link_address("127.0.0.1:7001");
  for (int p = 0; p < 2; ++p) {
    v1::Neighbor& r = *l.add_replicas();
    r.set_pipeline(p);
    r.set_gradient_exchange_address(absl::StrCat("127.0.0.1:710", p));
    r.set_link_generation(3);
  }
  ApplyStageLaunchDefaults(&l);
  return l;
}

// What a launcher sends on stdin: stage 0's next and the replicas of DP
// group `generation`.
v1::StageLaunch Patch(uint64_t generation = 0) {
  const v1::StageLaunch full = Launch();
  v1::StageLaunch patch;
  *patch.mutable_next() = full.next();
  *patch.mutable_replicas() = full.replicas();
  for (auto& r : *patch.mutable_replicas()) r.set_link_generation(generation);
  return patch;
}

// The JSON with one field replaced (a JSON pointer such as "/stage").
std::string With(const v1::StageLaunch& l, const std::string& pointer, const nlohmann::json& value) {
  nlohmann::json j = nlohmann::json::parse(StageLaunchJson(l));
  j[nlohmann::json::json_pointer(pointer)] = value;
  return j.dump();
}

TEST(StageLaunchTest, WhatALauncherWritesIsWhatTheStageReadsWithDefaultsFilledIn) {
  v1::StageLaunch l = Launch();
  l.clear_listen();
  l.clear_keep_checkpoints();
  l.clear_link_timeout();
  l.set_start_step(7);
  l.mutable_tls()->set_dir("/etc/aqswarm/tls");
  l.mutable_tls()->set_name("peer-1");
  l.mutable_job()->set_schedule(v1::JobSpec::Schedule::one_f_one_b);
  const std::string json = StageLaunchJson(l);
  EXPECT_NE(json.find(R"("schedule":"1f1b")"), std::string::npos) << json;  // the job as jobs are written
  ASSERT_OK_AND_ASSIGN(v1::StageLaunch back, ParseStageLaunch(json));
  EXPECT_EQ(back.job().schedule(), v1::JobSpec::Schedule::one_f_one_b);
  EXPECT_EQ(back.listen(), kDefaultListen);
  EXPECT_EQ(back.keep_checkpoints(), kDefaultKeepCheckpoints);
  EXPECT_EQ(LinkTimeout(back), absl::Seconds(kDefaultLinkTimeoutSeconds));
  ApplyStageLaunchDefaults(&l);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(back, l)) << back.ShortDebugString();
  EXPECT_EQ(LinkGeneration(back.next()), 1u);  // 0 means 1
  EXPECT_EQ(ReplicaGeneration(back), 3u);
  EXPECT_EQ(StoreCapacityBytes(back), kDefaultStoreBytes);
}

TEST(StageLaunchTest, KeepCheckpointsZeroIsKeptNotDefaulted) {
  v1::StageLaunch l = Launch();
  l.set_keep_checkpoints(0);
  ASSERT_OK_AND_ASSIGN(v1::StageLaunch back, ParseStageLaunch(StageLaunchJson(l)));
  EXPECT_TRUE(back.has_keep_checkpoints());
  EXPECT_EQ(back.keep_checkpoints(), 0u);
}

TEST(StageLaunchTest, TheJobIsReadByTheJobsOwnRules) {
  const v1::StageLaunch l = Launch();
  EXPECT_THAT(ParseStageLaunch(With(l, "/job/microBatchSise", 2)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("microBatchSize")));
  EXPECT_THAT(ParseStageLaunch(With(l, "/job/model/nHead", 3)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  nlohmann::json no_job = nlohmann::json::parse(StageLaunchJson(l));
  no_job.erase("job");
  EXPECT_THAT(ParseStageLaunch(no_job.dump()).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job")));
}

TEST(StageLaunchTest, BadLaunchesAreRefusedNamingTheField) {
  const v1::StageLaunch l = Launch();
  struct Case {
    std::string pointer;
    nlohmann::json value;
    std::string message;
  };
  const Case cases[] = {
      {"/stage", 2, "stage 2 outside"},
      {"/pipeline", 5, "pipeline 5 outside"},
      {"/startStep", "-1", "start_step"},
      {"/uplinkMbps", -1, "uplink_mbps"},
      {"/linkTimeout", "0s", "link_timeout"},
      {"/tls", nlohmann::json{{"dir", "/tls"}}, "tls.name"},
      {"/next", nlohmann::json::object(), "next.stage_link_address"},
      {"/replicas/1/pipeline", 0, "indexed by pipeline"},
      {"/replicas/1/gradientExchangeAddress", "", "gradient_exchange_address"},
      {"/replicas/1/linkGeneration", "4", "generation"},
      {"/nextStage", 1, "nextStage"},  // unknown field
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ParseStageLaunch(With(l, c.pointer, c.value)).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.pointer;
  }
  v1::StageLaunch one = l;
  one.mutable_replicas()->RemoveLast();
  EXPECT_THAT(ValidateStageLaunch(one), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 replicas")));
  v1::StageLaunch dial = Launch(1);
  dial.mutable_previous()->set_reversed(true);
  EXPECT_THAT(ValidateStageLaunch(dial),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("previous.stage_link_address")));
  EXPECT_THAT(ParseStageLaunch("[1]").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseStageLaunch("{").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ReadStageLaunch("/nonexistent/launch.json").status(), StatusIs(absl::StatusCode::kNotFound));
}

TEST(StageLaunchTest, NeighboursOnStdinComeAsAPatchOfNextAndReplicas) {
  v1::StageLaunch l = Launch();
  l.clear_next();
  l.clear_replicas();
  l.set_neighbors_on_stdin(true);
  ASSERT_THAT(ValidateStageLaunch(l), IsOk());
  const v1::StageLaunch patch = Patch();  // the launch's group: generation 0
  ASSERT_THAT(ApplyNeighborPatch(patch, &l), IsOk());
  EXPECT_EQ(l.next().stage_link_address(), "127.0.0.1:7001");
  ASSERT_EQ(l.replicas_size(), 2);
  EXPECT_EQ(l.replicas(1).gradient_exchange_address(), "127.0.0.1:7101");
  EXPECT_FALSE(l.neighbors_on_stdin());
}

TEST(StageLaunchTest, APatchSettingMoreThanNeighboursOrTheWrongOnesIsRefused) {
  v1::StageLaunch l = Launch();
  l.clear_next();
  l.clear_replicas();
  l.set_neighbors_on_stdin(true);
  const v1::StageLaunch patch = Patch();
  v1::StageLaunch more = patch;
  more.set_start_step(5);
  EXPECT_THAT(ApplyNeighborPatch(more, &l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only next")));
  EXPECT_THAT(ApplyNeighborPatch(Patch(3), &l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("generation 3")));
  v1::StageLaunch no_next = patch;
  no_next.clear_next();
  EXPECT_THAT(ApplyNeighborPatch(no_next, &l), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("next")));
  v1::StageLaunch last = Launch(1);
  last.clear_replicas();
  last.set_neighbors_on_stdin(true);
  EXPECT_THAT(ApplyNeighborPatch(patch, &last),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not dial a next stage")));
}

}  // namespace
}  // namespace aqswarm::stage
