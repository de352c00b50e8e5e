#include "peer/assignment.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aqswarm::peer {
namespace {

v1::JobSpec Job(int stages, int dp) {
  v1::JobSpec job;
  job.set_name("j");
  job.set_stages(stages);
  job.set_data_parallel(dp);
  return job;
}

v1::Assignment Place(uint64_t plan, uint32_t stage, uint32_t pipeline, int stages = 2, int dp = 2) {
  v1::Assignment a;
  a.set_version(plan * 10);
  a.set_plan_version(plan);
  a.set_role(v1::Assignment::STAGE);
  a.set_stage(stage);
  a.set_pipeline(pipeline);
  a.set_num_stages(stages);
  a.set_num_pipelines(dp);
  a.set_grid_complete(true);
  a.set_resume_step(40);
  if (stage + 1 < static_cast<uint32_t>(stages)) {
    a.mutable_next()->set_stage_link_address("10.0.0.2:7100");
    a.mutable_next()->set_link_generation(5);
    a.mutable_next()->set_peer_name("next-peer");
  }
  if (stage > 0) {
    a.mutable_previous()->set_link_generation(4);
    a.mutable_previous()->set_peer_name("previous-peer");
    a.mutable_previous()->set_stage_link_address("10.0.0.0:7100");
  }
  for (int p = 0; p < dp; ++p) {
    if (p == static_cast<int>(pipeline)) continue;
    v1::Neighbor* r = a.add_replicas();
    r->set_pipeline(p);
    r->set_gradient_exchange_address(absl::StrCat("10.0.1.", p, ":7200"));
    r->set_link_generation(9);
    r->set_peer_name(absl::StrCat("replica-", p));
  }
  return a;
}

TEST(AssignmentTest, TheSamePlaceKeepsItsChildAFailedOneWaitsAnythingElseStarts) {
  const v1::Assignment a = Place(3, 1, 0);
  EXPECT_EQ(DecideAssignment(a, {}), AssignmentAction::kStart);
  EXPECT_EQ(DecideAssignment(a, {RunKeyOf(a), true, false}), AssignmentAction::kKeepRunning);
  EXPECT_EQ(DecideAssignment(a, {RunKeyOf(a), false, true}), AssignmentAction::kWaitForNextPlan);
  EXPECT_EQ(DecideAssignment(a, {RunKeyOf(a), false, false}), AssignmentAction::kStart);  // exited cleanly before
  EXPECT_EQ(DecideAssignment(a, {RunKeyOf(Place(2, 1, 0)), true, false}), AssignmentAction::kStart);  // a new plan
  EXPECT_EQ(DecideAssignment(a, {RunKeyOf(Place(2, 1, 0)), false, true}), AssignmentAction::kStart);
  EXPECT_EQ(DecideAssignment(a, {RunKeyOf(Place(3, 0, 0)), true, false}), AssignmentAction::kStart);  // moved
  // The same plan and place, but a link now opened from the other side (a
  // neighbour's reachability changed): start again, even after a failure.
  v1::Assignment flipped = a;
  flipped.mutable_previous()->set_reversed(!a.previous().reversed());
  EXPECT_EQ(DecideAssignment(flipped, {RunKeyOf(a), true, false}), AssignmentAction::kStart);
  EXPECT_EQ(DecideAssignment(flipped, {RunKeyOf(a), false, true}), AssignmentAction::kStart);
  v1::Assignment standby = a;
  standby.set_role(v1::Assignment::STANDBY);
  EXPECT_EQ(DecideAssignment(standby, {RunKeyOf(a), true, false}), AssignmentAction::kStop);
  v1::Assignment holes = a;
  holes.set_grid_complete(false);
  EXPECT_EQ(DecideAssignment(holes, {RunKeyOf(a), true, false}), AssignmentAction::kStop);
}

TEST(AssignmentTest, TheCommandRunsTheAssignedPlace) {
  StagePlacement p;
  p.work_dir = "/w";
  p.listen = "0.0.0.0:7100";
  p.exchange_listen = "0.0.0.0:7200";
  p.exchange_advertise = "10.0.1.1:7200";
  p.tls_dir = "/tls";
  p.tls_name = "gpu-7";
  p.link_timeout_s = 30;
  const StageCommand c = StageCommandFor(Place(3, 0, 1), p, "/w/checkpoints/stage-0/state-40.ckpt");
  EXPECT_EQ(c.job, "/w/job.json");
  EXPECT_EQ(c.stage, 0);
  EXPECT_EQ(c.pipeline, 1);
  EXPECT_EQ(c.plan, 3u);
  EXPECT_EQ(c.start_step, 40);
  EXPECT_EQ(c.init_checkpoint, "/w/checkpoints/stage-0/state-40.ckpt");
  EXPECT_EQ(c.checkpoint_dir, "/w/checkpoints/stage-0");
  EXPECT_EQ(c.store_dir, "/w/store");
  EXPECT_EQ(c.next, "10.0.0.2:7100");
  EXPECT_EQ(c.next_generation, 5u);
  EXPECT_THAT(c.replicas, ::testing::ElementsAre("10.0.1.0:7200", "10.0.1.1:7200"));  // ours at our index
  EXPECT_EQ(c.replica_generation, 9u);
  // The peers the assignment names, whose certificates the links check.
  EXPECT_EQ(c.next_peer, "next-peer");
  EXPECT_TRUE(c.previous_peer.empty());  // stage 0
  EXPECT_THAT(c.replica_peers, ::testing::ElementsAre("replica-0", "gpu-7"));  // ours at our index
  EXPECT_TRUE(c.die_with_parent);
  EXPECT_EQ(c.link_timeout_s, 30);
  EXPECT_EQ(c.tls_dir, "/tls");
  EXPECT_EQ(c.name, "gpu-7");
  // The last stage of a single pipeline: no next, no replicas, plaintext.
  StagePlacement plain = p;
  plain.tls_dir.clear();
  const StageCommand last = StageCommandFor(Place(3, 1, 0, 2, 1), plain, "");
  EXPECT_TRUE(last.next.empty());
  EXPECT_EQ(last.previous_generation, 4u);
  EXPECT_EQ(last.previous_peer, "previous-peer");
  EXPECT_TRUE(last.next_peer.empty());
  EXPECT_TRUE(last.replica_peers.empty());
  EXPECT_TRUE(last.replicas.empty());
  EXPECT_TRUE(last.name.empty());
  // Links are dialed downstream unless the assignment reverses them.
  EXPECT_FALSE(c.accept_next);
  EXPECT_FALSE(last.dial_previous);
  EXPECT_EQ(last.previous, "10.0.0.0:7100");
}

TEST(AssignmentTest, AReversedLinkIsDialedByTheDownstreamAndAcceptedByTheUpstream) {
  StagePlacement p;
  p.work_dir = "/w";
  v1::Assignment up = Place(3, 0, 0, 2, 1), down = Place(3, 1, 0, 2, 1);
  up.mutable_next()->set_reversed(true);
  down.mutable_previous()->set_reversed(true);
  const StageCommand u = StageCommandFor(up, p, ""), d = StageCommandFor(down, p, "");
  EXPECT_TRUE(u.accept_next);
  EXPECT_FALSE(u.dial_previous);
  EXPECT_TRUE(d.dial_previous);
  EXPECT_EQ(d.previous, "10.0.0.0:7100");
  EXPECT_FALSE(d.accept_next);
}

TEST(AssignmentTest, AssignmentsThatDoNotFitTheJobAreRefused) {
  const v1::JobSpec job = Job(2, 2);
  EXPECT_TRUE(ValidateAssignment(Place(1, 1, 1), job).ok());
  EXPECT_FALSE(ValidateAssignment(Place(1, 1, 1, 3, 2), job).ok());  // another grid
  v1::Assignment outside = Place(1, 1, 1);
  outside.set_stage(2);
  EXPECT_FALSE(ValidateAssignment(outside, job).ok());
  v1::Assignment no_next = Place(1, 0, 0);
  no_next.clear_next();
  EXPECT_FALSE(ValidateAssignment(no_next, job).ok());
  v1::Assignment self_replica = Place(1, 0, 0);
  self_replica.mutable_replicas(0)->set_pipeline(0);
  EXPECT_FALSE(ValidateAssignment(self_replica, job).ok());
  v1::Assignment negative = Place(1, 0, 0);
  negative.set_resume_step(-1);
  EXPECT_FALSE(ValidateAssignment(negative, job).ok());
  v1::Assignment standby;
  standby.set_role(v1::Assignment::STANDBY);
  EXPECT_TRUE(ValidateAssignment(standby, job).ok());
}

}  // namespace
}  // namespace aqswarm::peer
