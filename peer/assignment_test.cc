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

// What the daemon decides whatever the place.
v1::StageLaunch Base() {
  v1::StageLaunch base;
  *base.mutable_job() = Job(2, 2);
  base.set_listen("0.0.0.0:7100");
  base.set_exchange_listen("0.0.0.0:7200");
  base.mutable_tls()->set_dir("/tls");
  base.mutable_tls()->set_name("gpu-7");
  base.mutable_link_timeout()->set_seconds(30);
  base.set_die_with_parent(true);
  return base;
}

v1::Neighbor Self() {
  v1::Neighbor self;
  self.set_peer_name("gpu-7");
  self.set_gradient_exchange_address("10.0.1.1:7200");
  return self;
}

TEST(AssignmentTest, TheLaunchRunsTheAssignedPlace) {
  const v1::StageLaunch l = StageLaunchFor(Place(3, 0, 1), Base(), "/w", Self(), "/w/checkpoints/stage-0/state-40.ckpt");
  EXPECT_EQ(l.job().name(), "j");
  EXPECT_EQ(l.stage(), 0u);
  EXPECT_EQ(l.pipeline(), 1u);
  EXPECT_EQ(l.plan(), 3u);
  EXPECT_EQ(l.start_step(), 40);
  EXPECT_EQ(l.init_checkpoint(), "/w/checkpoints/stage-0/state-40.ckpt");
  EXPECT_EQ(l.checkpoint_dir(), "/w/checkpoints/stage-0");
  EXPECT_EQ(l.store_dir(), "/w/store");
  EXPECT_EQ(l.listen(), "0.0.0.0:7100");
  // The assignment's neighbours, whole: address, generation, certificate name.
  EXPECT_EQ(l.next().stage_link_address(), "10.0.0.2:7100");
  EXPECT_EQ(l.next().link_generation(), 5u);
  EXPECT_EQ(l.next().peer_name(), "next-peer");
  EXPECT_FALSE(l.has_previous());  // stage 0
  ASSERT_EQ(l.replicas_size(), 2);  // by pipeline, ours at our index
  EXPECT_EQ(l.replicas(0).gradient_exchange_address(), "10.0.1.0:7200");
  EXPECT_EQ(l.replicas(0).peer_name(), "replica-0");
  EXPECT_EQ(l.replicas(1).gradient_exchange_address(), "10.0.1.1:7200");
  EXPECT_EQ(l.replicas(1).peer_name(), "gpu-7");
  for (const v1::Neighbor& r : l.replicas()) EXPECT_EQ(r.link_generation(), 9u);  // each carries the group's
  EXPECT_TRUE(l.die_with_parent());
  EXPECT_EQ(l.link_timeout().seconds(), 30);
  EXPECT_EQ(l.tls().dir(), "/tls");
  EXPECT_EQ(l.tls().name(), "gpu-7");
  // The last stage of a single pipeline: no next, no replicas.
  v1::StageLaunch base = Base();
  *base.mutable_job() = Job(2, 1);
  const v1::StageLaunch last = StageLaunchFor(Place(3, 1, 0, 2, 1), base, "/w", Self(), "");
  EXPECT_FALSE(last.has_next());
  EXPECT_EQ(last.previous().link_generation(), 4u);
  EXPECT_EQ(last.previous().peer_name(), "previous-peer");
  EXPECT_EQ(last.previous().stage_link_address(), "10.0.0.0:7100");
  EXPECT_EQ(last.replicas_size(), 0);
  EXPECT_TRUE(last.init_checkpoint().empty());
  // Links are dialed downstream unless the assignment reverses them.
  EXPECT_FALSE(l.next().reversed());
  EXPECT_FALSE(last.previous().reversed());
}

// A field the coordinator adds to Neighbor reaches the stage with no edit
// here: the launch carries the assignment's Neighbor messages whole.
TEST(AssignmentTest, TheLaunchCarriesTheAssignmentsNeighboursWhole) {
  v1::Assignment a = Place(3, 1, 0);
  a.mutable_previous()->set_state_transfer_address("10.0.0.0:7300");
  a.mutable_next()->set_peer_id(77);
  const v1::StageLaunch l = StageLaunchFor(a, Base(), "/w", Self(), "");
  EXPECT_EQ(l.previous().state_transfer_address(), "10.0.0.0:7300");
  EXPECT_FALSE(l.has_next());  // the last stage of 2
  const v1::StageLaunch first = StageLaunchFor(Place(3, 0, 0), Base(), "/w", Self(), "");
  v1::Assignment b = Place(3, 0, 0);
  b.mutable_next()->set_peer_id(77);
  EXPECT_EQ(StageLaunchFor(b, Base(), "/w", Self(), "").next().peer_id(), 77u);
  EXPECT_EQ(first.next().peer_id(), 0u);
}

TEST(AssignmentTest, AReversedLinkIsDialedByTheDownstreamAndAcceptedByTheUpstream) {
  v1::StageLaunch base = Base();
  *base.mutable_job() = Job(2, 1);
  v1::Assignment up = Place(3, 0, 0, 2, 1), down = Place(3, 1, 0, 2, 1);
  up.mutable_next()->set_reversed(true);
  down.mutable_previous()->set_reversed(true);
  const v1::StageLaunch u = StageLaunchFor(up, base, "/w", Self(), ""), d = StageLaunchFor(down, base, "/w", Self(), "");
  EXPECT_TRUE(u.next().reversed());
  EXPECT_FALSE(u.has_previous());
  EXPECT_TRUE(d.previous().reversed());
  EXPECT_EQ(d.previous().stage_link_address(), "10.0.0.0:7100");
  EXPECT_FALSE(d.has_next());
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
  v1::Assignment healing = Place(1, 0, 0);
  healing.set_heal(true);
  healing.set_resume_step(16);
  healing.set_start_step(21);
  EXPECT_TRUE(ValidateAssignment(healing, job).ok());
  healing.set_start_step(15);  // before the state it loads
  EXPECT_FALSE(ValidateAssignment(healing, job).ok());
  v1::Assignment skip_without_heal = Place(1, 0, 0);
  skip_without_heal.set_start_step(21);
  EXPECT_FALSE(ValidateAssignment(skip_without_heal, job).ok());
  v1::Assignment standby;
  standby.set_role(v1::Assignment::STANDBY);
  EXPECT_TRUE(ValidateAssignment(standby, job).ok());
}

}  // namespace
}  // namespace aqswarm::peer
