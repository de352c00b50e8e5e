#include "coordinator/swarm_coordinator.h"

#include <set>

#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_testing.h"
#include "coordinator/rate_limiter.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::coordinator {
namespace {

using ::aqswarm::coordinator::testing::JoinAs;
using ::aqswarm::testing::ScratchDir;
using ::aqswarm::coordinator::testing::TestOptions;
using ::aqswarm::coordinator::testing::TokenFor;
using ::testing::HasSubstr;

class SwarmCoordinatorTest : public ::testing::Test {
 protected:
  std::unique_ptr<SwarmCoordinator> Make(int stages, int pipelines) {
    auto c = SwarmCoordinator::Create(TestOptions(&clock_, dir_.Sub("state"), stages, pipelines));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  JoinResult MustJoin(SwarmCoordinator& c, const std::string& name, int port = 5000) {
    auto r = c.Join(JoinAs(clock_, name, port));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : JoinResult{};
  }

  std::unique_ptr<SwarmCoordinator> Make(SwarmCoordinatorOptions o) {
    auto c = SwarmCoordinator::Create(std::move(o));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  rpc::FakeClock clock_;
  ScratchDir dir_;
};

// How much a refusal counter grew while `f` ran.
double Counted(Refusal r, const std::function<void()>& f) {
  const double before = RefusalCount(r);
  f();
  return RefusalCount(r) - before;
}

TEST(RateLimiterTest, ABucketEmptiesRefillsAndIdleKeysMakeRoom) {
  RateLimiter l({.per_second = 1, .burst = 2}, /*max_keys=*/2);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(l.Allow("a", t0));
  EXPECT_TRUE(l.Allow("a", t0));
  EXPECT_FALSE(l.Allow("a", t0));
  EXPECT_FALSE(l.Allow("a", t0 - absl::Seconds(5)));  // time going back adds nothing
  EXPECT_TRUE(l.Allow("a", t0 + absl::Seconds(1)));
  EXPECT_TRUE(l.Allow("b", t0));
  EXPECT_TRUE(l.Allow("b", t0));
  // Two keys, neither idle: a third key is refused rather than grown.
  EXPECT_FALSE(l.Allow("c", t0 + absl::Seconds(1)));
  // Once they have refilled they are dropped for it.
  EXPECT_TRUE(l.Allow("c", t0 + absl::Seconds(10)));
  RateLimiter unlimited({.per_second = 0, .burst = 1});
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(unlimited.Allow("x", t0));
}

TEST(LogLimiterTest, OneLinePerKindPerPeriodWithTheCount) {
  LogLimiter log(absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(log.Admit("x", t0), 1);
  EXPECT_EQ(log.Admit("x", t0 + absl::Seconds(1)), 0);
  EXPECT_EQ(log.Admit("x", t0 + absl::Seconds(2)), 0);
  EXPECT_EQ(log.Admit("y", t0 + absl::Seconds(2)), 1);
  EXPECT_EQ(log.Admit("x", t0 + absl::Seconds(11)), 3);
}

TEST_F(SwarmCoordinatorTest, AJoinTokenIsSingleUsePerNameButAProvenRejoinNeedsNoNewOne) {
  JoinResult a;
  JoinParams first = JoinAs(clock_, "a");
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 1, 1);
  o.join_limit_per_name = {};  // unlimited: this test joins one name often
  {
    auto c = Make(o);
    a = *c->Join(first);
    ASSERT_TRUE(c->Leave(a.peer_id, a.session_token).ok());
    // The same token again, proving nothing: refused and counted.
    absl::Status replay;
    EXPECT_EQ(Counted(Refusal::kJoinTokenReplayed, [&] { replay = c->Join(first).status(); }), 1);
    EXPECT_TRUE(absl::IsPermissionDenied(replay)) << replay;
    EXPECT_THAT(replay.message(), HasSubstr("already used"));
    // With the session it got last time, the same token admits it again.
    JoinParams rejoin = first;
    rejoin.previous_session_token = a.session_token;
    auto again = c->Join(rejoin);
    ASSERT_TRUE(again.ok()) << again.status();
    a = *again;
    ASSERT_TRUE(c->Leave(a.peer_id, a.session_token).ok());
    // A wrong session proves nothing.
    rejoin.previous_session_token = std::string(32, '0');
    EXPECT_TRUE(absl::IsPermissionDenied(c->Join(rejoin).status()));
  }
  // The used token survives a restart.
  auto c = Make(o);
  EXPECT_TRUE(absl::IsPermissionDenied(c->Join(first).status()));
  JoinParams rejoin = first;
  rejoin.previous_session_token = a.session_token;
  EXPECT_TRUE(c->Join(rejoin).ok());
  // Another name with a wildcard token: each name once.
  JoinParams w1 = JoinAs(clock_, "w1"), w2 = JoinAs(clock_, "w2");
  w1.join_token = w2.join_token = TokenFor(clock_, kAnyPeer);
  auto j1 = c->Join(w1);
  ASSERT_TRUE(j1.ok()) << j1.status();
  ASSERT_TRUE(c->Join(w2).ok());
  ASSERT_TRUE(c->Leave(j1->peer_id, j1->session_token).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(c->Join(w1).status()));
}

TEST_F(SwarmCoordinatorTest, ALiveNameIsTakenOverOnlyWithItsSessionOrItsCertificate) {
  auto c = Make(1, 1);
  JoinParams p = JoinAs(clock_, "a");
  p.certificate_sha256 = std::string(64, 'a');
  JoinResult a = *c->Join(p);
  JoinParams thief = JoinAs(clock_, "a");
  thief.certificate_sha256 = std::string(64, 'b');
  absl::Status taken;
  EXPECT_EQ(Counted(Refusal::kJoinNameHeld, [&] { taken = c->Join(thief).status(); }), 1);
  EXPECT_TRUE(absl::IsAlreadyExists(taken)) << taken;
  EXPECT_TRUE(c->Heartbeat(a.peer_id, a.session_token).ok()) << "the holder was not evicted";
  // The same certificate (a restarted process) takes its name back.
  JoinParams restarted = JoinAs(clock_, "a");
  restarted.certificate_sha256 = std::string(64, 'a');
  auto back = c->Join(restarted);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(absl::IsNotFound(c->Heartbeat(a.peer_id, a.session_token).status()));
  // Once the lease ran out, the name is free for a fresh token.
  clock_.Advance(absl::Seconds(11));
  EXPECT_TRUE(c->Join(thief).ok());
}

TEST_F(SwarmCoordinatorTest, JoinsOfOneNameAreRateLimitedAndForgedTokensChargeNothing) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 1, 1);
  o.join_limit_per_name = {.per_second = 0.001, .burst = 2};
  auto c = Make(o);
  JoinParams forged = JoinAs(clock_, "a");
  forged.join_token = TokenFor(clock_, "a", std::string(32, 'x'));
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(absl::IsUnauthenticated(c->Join(forged).status()));
  JoinResult a = *c->Join(JoinAs(clock_, "a"));
  JoinParams rejoin = JoinAs(clock_, "a");
  rejoin.previous_session_token = a.session_token;
  a = *c->Join(rejoin);
  rejoin.previous_session_token = a.session_token;
  absl::Status limited;
  EXPECT_EQ(Counted(Refusal::kJoinRate, [&] { limited = c->Join(rejoin).status(); }), 1);
  EXPECT_TRUE(absl::IsResourceExhausted(limited)) << limited;
  EXPECT_TRUE(c->Join(JoinAs(clock_, "b")).ok()) << "another name has its own budget";
}

TEST(BackoffTest, TheSecondOffenceHoldsAndEachLaterOneDoublesUpToTheCapUntilAQuietSpell) {
  Backoff b({.first = absl::Seconds(10), .most = absl::Seconds(35), .decay = absl::Minutes(30)});
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(b.Record("x", t0), 1);
  EXPECT_EQ(b.HeldUntil("x"), absl::InfinitePast()) << "one offence earns no hold";
  EXPECT_EQ(b.Record("x", t0), 2);
  EXPECT_EQ(b.HeldUntil("x"), t0 + absl::Seconds(10));
  EXPECT_EQ(b.Record("x", t0), 3);
  EXPECT_EQ(b.HeldUntil("x"), t0 + absl::Seconds(20));
  EXPECT_EQ(b.Record("x", t0), 4);
  EXPECT_EQ(b.HeldUntil("x"), t0 + absl::Seconds(35)) << "capped";
  for (int i = 0; i < 100; ++i) b.Record("x", t0);
  EXPECT_EQ(b.HeldUntil("x"), t0 + absl::Seconds(35)) << "no overflow";
  EXPECT_EQ(b.HeldUntil("y"), absl::InfinitePast()) << "keys are apart";
  const absl::Time later = t0 + absl::Minutes(31);
  EXPECT_EQ(b.Offences("x", later), 0);
  EXPECT_EQ(b.Record("x", later), 1) << "a quiet spell starts over";
  EXPECT_EQ(b.Record("x", later), 2);
  EXPECT_EQ(b.HeldUntil("x"), later + absl::Seconds(10));
}

TEST_F(SwarmCoordinatorTest, ANameThatRejoinsEveryThreeSecondsReplansTheSwarmThreeTimesIn30sNotTen) {
  // 2 stages x 2 pipelines; f, placed, rejoins under its name every 3 s
  // for 30 s (each rejoin proves it: its last session token). Without the
  // backoff every rejoin re-plans and rolls the swarm back (10 bumps); with
  // it, f's joins are held after its second re-plan and the plan stays put
  // between them.
  auto run = [&](BackoffPolicy policy, const std::string& dir) {
    SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub(dir), 2, 2);
    o.replan_backoff = policy;
    auto c = Make(std::move(o));
    std::vector<JoinResult> honest;
    for (const char* name : {"a", "b", "d"}) honest.push_back(MustJoin(*c, name));
    JoinResult f = MustJoin(*c, "f");
    EXPECT_TRUE(c->grid().complete());
    const uint64_t plan = c->grid().plan_version;
    int held = 0;
    for (int i = 0; i < 10; ++i) {
      clock_.Advance(absl::Seconds(3));
      for (const JoinResult& h : honest) EXPECT_TRUE(c->Heartbeat(h.peer_id, h.session_token).ok());
      EXPECT_TRUE(c->Heartbeat(f.peer_id, f.session_token).ok());
      JoinParams again = JoinAs(clock_, "f");
      again.previous_session_token = f.session_token;
      absl::StatusOr<JoinResult> r;
      held += static_cast<int>(Counted(Refusal::kJoinReplanHeld, [&] { r = c->Join(again); }));
      if (r.ok()) {
        f = *r;
      } else {
        EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
        EXPECT_THAT(r.status().message(), HasSubstr("held back for another"));
      }
    }
    return std::make_pair(c->grid().plan_version - plan, held);
  };
  const auto [bumps_without, held_without] = run({.first = absl::ZeroDuration()}, "off");
  EXPECT_EQ(bumps_without, 10u);
  EXPECT_EQ(held_without, 0);
  // Rejoins at 3 s and 6 s re-plan (hold 10 s: until 16 s), 9-15 s are held,
  // 18 s re-plans (hold 20 s: until 38 s), 21-30 s are held.
  const auto [bumps, held] = run(BackoffPolicy{}, "on");
  EXPECT_EQ(bumps, 3u);
  EXPECT_EQ(held, 7);
}

TEST_F(SwarmCoordinatorTest, ProgressNeverMovesBackWithinAPlanAndCannotDragTheResumeStep) {
  auto c = Make(2, 1);
  JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b");
  const Grid g = c->grid();
  const uint32_t a_stage = g.Find(a.peer_id)->first, b_stage = g.Find(b.peer_id)->first;
  const uint64_t plan = g.plan_version;
  HeldStates ah{{a_stage, {4, 8}}}, bh{{b_stage, {4, 8}}};
  ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {8, 3.0, 10, plan}, 8, &ah).ok());
  ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {8, 3.0, 10, plan}, 8, &bh).ok());
  absl::Status back;
  HeldStates none;
  EXPECT_EQ(Counted(Refusal::kProgressBackward,
                    [&] { back = c->ReportProgress(b.peer_id, b.session_token, {0, 3.0, 10, plan}, 0, &none); }),
            1);
  EXPECT_TRUE(absl::IsFailedPrecondition(back)) << back;
  EXPECT_THAT(back.message(), HasSubstr("behind step 8"));
  const PeerProgress behind{2, 3.0, 1, 0};
  EXPECT_TRUE(absl::IsFailedPrecondition(c->Heartbeat(b.peer_id, b.session_token, &behind).status()));
  // Nothing of the refused report was applied: b still holds 8.
  JoinResult s = MustJoin(*c, "s");
  ASSERT_TRUE(c->Leave(a.peer_id, a.session_token).ok());  // s takes a's stage; a's states are gone
  // No state of a's stage survives, so the job restarts at 0 ... but had a's
  // states survived, b's claim would have kept the resume at 8:
  EXPECT_EQ(c->grid().resume_step, 0);
  const uint64_t plan2 = c->grid().plan_version;
  ASSERT_TRUE(c->ReportProgress(s.peer_id, s.session_token, {3, 3.0, 10, plan2}, 0).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(c->ReportProgress(s.peer_id, s.session_token, {1, 3.0, 10, plan2}, 0)));
}

TEST_F(SwarmCoordinatorTest, ProgressFarAheadOfThePipelineOrPastTheJobIsIgnoredAndCounted) {
  // 2 stages x 1 pipeline, 100 steps. Stage 1 cannot run a step stage 0 has
  // not: a report far past its pipeline's other stage is a lie (2^40 with
  // loss 0.01 would show in Status and set the resume step). It is ignored
  // (the held states it carries are kept) and counted; honest lockstep
  // reports pass.
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 1);
  o.job.set_max_steps(100);
  auto c = Make(std::move(o));
  JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b");
  const uint64_t plan = c->grid().plan_version;
  ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {5, 3.0, 10, plan}, 0).ok());
  ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {4, 3.0, 10, plan}, 0).ok());
  const uint32_t b_stage = c->grid().Find(b.peer_id)->first;
  HeldStates held{{b_stage, {4}}};
  double ignored = Counted(Refusal::kProgressAhead, [&] {
    EXPECT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {int64_t{1} << 40, 0.01, 10, plan}, 4, &held).ok());
  });
  EXPECT_EQ(ignored, 1);
  v1::StatusResponse st = c->GetStatus(true);
  EXPECT_EQ(st.step(), 5) << "the lie is not the swarm's step";
  EXPECT_DOUBLE_EQ(st.loss(), 3.0);
  for (const auto& p : st.peers()) {
    if (p.peer_id() == b.peer_id) {
      EXPECT_EQ(p.progress().step(), 4);
      EXPECT_EQ(p.held_size(), 1) << "the held states of the report are kept";
    }
  }
  // Past the job's last step: ignored even where the pipeline would allow it.
  for (int64_t step = 6; step <= 100; ++step) {
    clock_.Advance(absl::Milliseconds(50));  // within the report rate limit
    ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {step, 3.0, 10, plan}, 0).ok());
    ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {step - 1, 3.0, 10, plan}, 0).ok());
  }
  ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {100, 3.0, 10, plan}, 0).ok());
  EXPECT_EQ(Counted(Refusal::kProgressAhead,
                    [&] { EXPECT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {101, 3.0, 10, plan}, 0).ok()); }),
            1);
  EXPECT_EQ(c->GetStatus(false).step(), 100);
  // Heartbeats carry progress too: the same rule.
  const PeerProgress far{300, 0.01, 10, plan};
  EXPECT_EQ(Counted(Refusal::kProgressAhead, [&] { EXPECT_TRUE(c->Heartbeat(a.peer_id, a.session_token, &far).ok()); }),
            1);
  EXPECT_EQ(c->GetStatus(false).step(), 100);
}

TEST_F(SwarmCoordinatorTest, AReportBelowTheResumeStepIsRefusedSoTheNextReplanKeepsIt) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 1);
  o.mirror_checkpoints = true;
  auto c = Make(o);
  JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b");
  const Grid g = c->grid();
  const uint32_t a_stage = g.Find(a.peer_id)->first, b_stage = g.Find(b.peer_id)->first;
  // Each holds its own stage and (mirror) the other's at 4 and 8.
  HeldStates both{{a_stage, {4, 8}}, {b_stage, {4, 8}}};
  ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {8, 3.0, 10, g.plan_version}, 8, &both).ok());
  ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {8, 3.0, 10, g.plan_version}, 8, &both).ok());
  JoinResult s = MustJoin(*c, "s"), t = MustJoin(*c, "t");
  ASSERT_TRUE(c->Leave(b.peer_id, b.session_token).ok());  // a's mirror copy lets s resume b's stage at 8
  EXPECT_EQ(c->grid().resume_step, 8);
  const uint64_t plan = c->grid().plan_version;
  // a claims it is back at step 0 under the new plan: refused...
  EXPECT_TRUE(absl::IsFailedPrecondition(
      c->ReportProgress(a.peer_id, a.session_token, {0, 3.0, 10, plan}, 0, &both)));
  // ...so the next re-plan still resumes at 8.
  ASSERT_TRUE(c->Leave(c->grid().Find(s.peer_id).has_value() ? t.peer_id : s.peer_id,
                       c->grid().Find(s.peer_id).has_value() ? t.session_token : s.session_token)
                  .ok());
  const JoinResult& placed = c->grid().Find(s.peer_id).has_value() ? s : t;
  ASSERT_TRUE(c->Leave(placed.peer_id, placed.session_token).ok());
  JoinResult u = MustJoin(*c, "u");
  EXPECT_TRUE(c->grid().complete());
  EXPECT_EQ(c->grid().resume_step, 8);
  (void)u;
}

TEST_F(SwarmCoordinatorTest, HeldStatesOfForeignStagesAreDropped) {
  auto c = Make(3, 1);
  JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b"), d = MustJoin(*c, "d");
  const uint32_t a_stage = c->grid().Find(a.peer_id)->first;
  HeldStates claims{{0, {5}}, {1, {5}}, {2, {5}}};
  EXPECT_EQ(Counted(Refusal::kHeldForeignStage,
                    [&] {
                      ASSERT_TRUE(
                          c->ReportProgress(a.peer_id, a.session_token, {5, 3.0, 10}, 5, &claims).ok());
                    }),
            2);
  v1::StatusResponse st = c->GetStatus();
  for (const v1::PeerStatus& p : st.peers()) {
    if (p.peer_id() != a.peer_id) continue;
    ASSERT_EQ(p.held_size(), 1);
    EXPECT_EQ(p.held(0).stage(), a_stage);
  }
  (void)b;
  (void)d;
}

TEST_F(SwarmCoordinatorTest, TheResumeStateHashIsTheMajoritysAndDisagreementsAreCounted) {
  auto c = Make(1, 3);
  JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b"), d = MustJoin(*c, "d");
  const uint64_t plan = c->grid().plan_version;
  const std::string h1(64, '1'), h2(64, '2');
  HeldStates first{{0, {{4, h1}}}}, second{{0, {{4, h2}}}};
  ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {4, 3.0, 10, plan}, 4, &first).ok());
  ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {4, 3.0, 10, plan}, 4, &second).ok());
  ASSERT_TRUE(c->ReportProgress(d.peer_id, d.session_token, {4, 3.0, 10, plan}, 4, &second).ok());
  JoinResult s = MustJoin(*c, "s");
  ASSERT_TRUE(c->Leave(d.peer_id, d.session_token).ok());
  auto sa = c->GetAssignment(s.peer_id, s.session_token);
  ASSERT_TRUE(sa.ok());
  EXPECT_EQ(sa->resume_step(), 4);
  // a (h1) and b (h2) tie: the longest-standing holder, a, wins.
  EXPECT_EQ(sa->state_sha256(), h1);
  // With a third holder of h2 the majority wins.
  JoinParams e = JoinAs(clock_, "e");
  e.held = second;
  e.held_job_name = c->job().name();
  ASSERT_TRUE(c->Join(e).ok());
  sa = c->GetAssignment(s.peer_id, s.session_token);
  EXPECT_EQ(sa->state_sha256(), h2);
  // Hashes must be hex.
  HeldStates bad{{0, {{4, "xyz"}}}};
  EXPECT_TRUE(absl::IsInvalidArgument(c->ReportProgress(a.peer_id, a.session_token, {4, 3.0, 10}, 4, &bad)));
}

TEST_F(SwarmCoordinatorTest, DiLoCoReplicasDifferingBetweenOuterStepsAreNoDisagreement) {
  const std::string h1(64, '1'), h2(64, '2');
  for (const bool diloco : {false, true}) {
    SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub(diloco ? "diloco" : "qadam"), 1, 2);
    o.job.mutable_dp()->set_optimizer(diloco ? v1::DataParallelSpec::diloco : v1::DataParallelSpec::quantized_adam);
    auto c = Make(std::move(o));
    JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b");
    const uint64_t plan = c->grid().plan_version;
    HeldStates first{{0, {{4, h1}}}}, second{{0, {{4, h2}}}};
    const double before = StateHashDisagreements();
    ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {4, 3.0, 10, plan}, 4, &first).ok());
    ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {4, 3.0, 10, plan}, 4, &second).ok());
    EXPECT_EQ(StateHashDisagreements() - before, diloco ? 0 : 1) << (diloco ? "diloco" : "quantized_adam");
  }
}

TEST_F(SwarmCoordinatorTest, PeersThatFinishedTheJobLeaveWithoutAReplan) {
  // 1 stage x 2 pipelines and a standby, 10 steps: a leaves (and b's lease
  // runs out) having completed step 10. Their slots stay empty, the plan
  // stays, and the standby is not placed. A peer that leaves before the
  // end still re-plans.
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 1, 2);
  o.job.set_max_steps(10);
  auto c = Make(std::move(o));
  JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b"), s = MustJoin(*c, "s");
  const Grid before = c->grid();
  ASSERT_EQ(before.at(0, 0), a.peer_id);
  ASSERT_EQ(before.at(0, 1), b.peer_id);
  const uint64_t plan = before.plan_version;
  ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {10, 3.0, 10, plan}, 10).ok());
  ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {9, 3.0, 10, plan}, 0).ok());
  ASSERT_TRUE(c->Leave(a.peer_id, a.session_token).ok());
  EXPECT_EQ(c->grid().plan_version, plan);
  EXPECT_EQ(c->grid().at(0, 0), 0u) << "the finished slot stays empty";
  EXPECT_EQ(c->grid().at(0, 1), b.peer_id);
  EXPECT_FALSE(c->grid().Find(s.peer_id).has_value());
  auto sb = c->GetAssignment(b.peer_id, b.session_token);
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(sb->plan_version(), plan) << "b keeps training its last step";
  EXPECT_TRUE(sb->grid_complete()) << "the empty slot is a finished one";
  EXPECT_EQ(sb->replicas_size(), 0);
  // Status says the same: b is active, not waiting for its grid.
  const v1::StatusResponse st = c->GetStatus(/*details=*/true);
  EXPECT_TRUE(st.grid_complete());
  for (const v1::PeerStatus& p : st.peers()) {
    if (p.peer_id() == b.peer_id) {
      EXPECT_EQ(p.state(), v1::PeerStatus::ACTIVE);
    }
  }
  ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {10, 3.0, 10, plan}, 10).ok());
  clock_.Advance(absl::Seconds(6));
  ASSERT_TRUE(c->Heartbeat(s.peer_id, s.session_token).ok());
  clock_.Advance(absl::Seconds(5));  // b's 10 s lease is over, s's is not
  auto expired = c->ExpireLeases();
  ASSERT_TRUE(expired.ok()) << expired.status();
  EXPECT_THAT(*expired, ::testing::ElementsAre(b.peer_id));
  EXPECT_EQ(c->grid().plan_version, plan);
  EXPECT_FALSE(c->grid().Find(s.peer_id).has_value());

  // Before the last step, a departure re-plans as ever.
  SwarmCoordinatorOptions o2 = TestOptions(&clock_, dir_.Sub("early"), 1, 2);
  o2.job.set_max_steps(10);
  auto c2 = Make(std::move(o2));
  JoinResult x = MustJoin(*c2, "x");
  MustJoin(*c2, "y");
  JoinResult z = MustJoin(*c2, "z");
  const uint64_t plan2 = c2->grid().plan_version;
  ASSERT_TRUE(c2->ReportProgress(x.peer_id, x.session_token, {9, 3.0, 10, plan2}, 0).ok());
  ASSERT_TRUE(c2->Leave(x.peer_id, x.session_token).ok());
  EXPECT_EQ(c2->grid().plan_version, plan2 + 1);
  EXPECT_TRUE(c2->grid().Find(z.peer_id).has_value()) << "the standby takes the hole";
}

TEST_F(SwarmCoordinatorTest, ReportsOverTheRateLimitAreRefused) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 1, 2);
  o.report_limit = {.per_second = 0.001, .burst = 3};
  auto c = Make(o);
  JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b", 6000);
  for (int i = 1; i <= 2; ++i) ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {i, 3.0, 10}, 0).ok());
  ASSERT_TRUE(c->ReportLinkProbe(a.peer_id, a.session_token, b.peer_id, 1e6, 0.01).ok());
  absl::Status limited;
  EXPECT_EQ(Counted(Refusal::kReportRate,
                    [&] { limited = c->ReportProgress(a.peer_id, a.session_token, {5, 3.0, 10}, 0); }),
            1);
  EXPECT_TRUE(absl::IsResourceExhausted(limited)) << limited;
  EXPECT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {5, 3.0, 10}, 0).ok()) << "b has its own budget";
  EXPECT_TRUE(c->Heartbeat(a.peer_id, a.session_token).ok()) << "heartbeats are never rate limited";
}

TEST_F(SwarmCoordinatorTest, TheStatusSummaryNamesNoPeerAndNoAddress) {
  auto c = Make(2, 1);
  JoinParams p = JoinAs(clock_, "alice");
  p.state_transfer_address = "10.1.2.3:7003";
  ASSERT_TRUE(c->Join(p).ok());
  MustJoin(*c, "bob");
  const v1::StatusResponse summary = c->GetStatus(/*details=*/false);
  EXPECT_EQ(summary.peers_size(), 2);
  EXPECT_TRUE(summary.grid_complete());
  const std::string text = summary.DebugString();
  for (const char* secret : {"alice", "bob", "10.1.2.3"}) EXPECT_EQ(text.find(secret), std::string::npos) << secret;
  EXPECT_NE(c->GetStatus(/*details=*/true).DebugString().find("alice"), std::string::npos);
}

TEST_F(SwarmCoordinatorTest, JoinsFillTheGridThenStandbysAndAssignmentsNameNeighbours) {
  auto c = Make(2, 1);
  JoinResult a = MustJoin(*c, "a", 5000);
  EXPECT_EQ(a.assignment_version, 1u);
  auto wait = c->GetAssignment(a.peer_id, a.session_token);
  ASSERT_TRUE(wait.ok());
  EXPECT_FALSE(wait->grid_complete());
  JoinResult b = MustJoin(*c, "b", 6000);
  JoinResult s = MustJoin(*c, "s", 7000);
  EXPECT_EQ(c->assignment_version(), 3u);
  auto aa = c->GetAssignment(a.peer_id, a.session_token);
  auto ba = c->GetAssignment(b.peer_id, b.session_token);
  auto sa = c->GetAssignment(s.peer_id, s.session_token);
  ASSERT_TRUE(aa.ok() && ba.ok() && sa.ok());
  EXPECT_TRUE(aa->grid_complete());
  EXPECT_EQ(aa->version(), 3u);
  EXPECT_EQ(aa->role(), v1::Assignment::STAGE);
  EXPECT_EQ(sa->role(), v1::Assignment::STANDBY);
  const v1::Assignment& first = aa->stage() == 0 ? *aa : *ba;
  const v1::Assignment& second = aa->stage() == 0 ? *ba : *aa;
  EXPECT_EQ(first.next().peer_id(), second.peer_id());
  EXPECT_EQ(second.previous().peer_id(), first.peer_id());
  EXPECT_EQ(first.next().link_generation(), second.previous().link_generation());
  EXPECT_NE(first.next().link_generation(), 0u);
  EXPECT_FALSE(first.has_previous());
  EXPECT_FALSE(second.has_next());
  EXPECT_THAT(first.next().stage_link_address(), HasSubstr("127.0.0.1:"));
  // A wrong session learns nothing.
  EXPECT_TRUE(absl::IsUnauthenticated(c->GetAssignment(a.peer_id, b.session_token).status()));
}

TEST_F(SwarmCoordinatorTest, LeaseExpiryWithoutSleepingPromotesTheStandbyWithNewGenerations) {
  auto c = Make(2, 1);
  JoinResult a = MustJoin(*c, "a");
  JoinResult b = MustJoin(*c, "b");
  JoinResult s = MustJoin(*c, "s");
  const Grid before = c->grid();
  const uint64_t version = c->assignment_version();
  clock_.Advance(absl::Seconds(6));
  // Everybody but the peer at stage 1 heartbeats.
  const uint64_t lost = before.at(1, 0);
  for (const JoinResult* j : {&a, &b, &s}) {
    if (j->peer_id != lost) {
      ASSERT_TRUE(c->Heartbeat(j->peer_id, j->session_token).ok());
    }
  }
  ASSERT_TRUE(c->ExpireLeases()->empty());
  clock_.Advance(absl::Seconds(5));  // lost: 11 s; others: 5 s
  auto expired = c->ExpireLeases();
  ASSERT_TRUE(expired.ok()) << expired.status();
  EXPECT_EQ(*expired, std::vector<uint64_t>{lost});
  EXPECT_EQ(c->assignment_version(), version + 1);
  const Grid after = c->grid();
  EXPECT_EQ(after.at(0, 0), before.at(0, 0)) << "the healthy peer stays put";
  EXPECT_EQ(after.at(1, 0), s.peer_id) << "the standby fills the lost stage";
  EXPECT_NE(after.forward_gen(0, 0), before.forward_gen(0, 0));
  auto sa = c->GetAssignment(s.peer_id, s.session_token);
  ASSERT_TRUE(sa.ok());
  EXPECT_EQ(sa->role(), v1::Assignment::STAGE);
  EXPECT_EQ(sa->stage(), 1u);
  EXPECT_EQ(sa->previous().link_generation(), after.forward_gen(0, 0));
  // The expired peer is gone for good.
  const JoinResult& gone = lost == a.peer_id ? a : b;
  EXPECT_TRUE(absl::IsNotFound(c->Heartbeat(gone.peer_id, gone.session_token).status()));
}

TEST_F(SwarmCoordinatorTest, AGridChangeRestartsEveryPeerAtTheFewestStepsASurvivorCompleted) {
  auto c = Make(2, 2);
  std::vector<JoinResult> j;
  for (const char* n : {"a", "b", "c", "d"}) j.push_back(MustJoin(*c, n));
  auto first = c->GetAssignment(j[0].peer_id, j[0].session_token);
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(first->grid_complete());
  EXPECT_EQ(first->resume_step(), 0);
  const uint64_t plan = first->plan_version();
  EXPECT_GT(plan, 0u);
  // A standby joining changes no slot: same plan, nobody restarts.
  JoinResult s = MustJoin(*c, "s");
  auto same = c->GetAssignment(j[0].peer_id, j[0].session_token);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->plan_version(), plan);
  // Peers report 7, 8, 8, 8 completed steps (each holding the states of its
  // stage after every step); then "d" leaves.
  const Grid g = c->grid();
  for (int i = 0; i < 4; ++i) {
    const int steps = i == 1 ? 7 : 8;
    HeldStates held{{static_cast<uint32_t>(g.Find(j[i].peer_id)->first), {steps - 2, steps - 1, steps}}};
    ASSERT_TRUE(
        c->ReportProgress(j[i].peer_id, j[i].session_token, PeerProgress{steps, 5.0, 10}, 0, &held).ok());
  }
  ASSERT_TRUE(c->Leave(j[3].peer_id, j[3].session_token).ok());
  auto after = c->GetAssignment(s.peer_id, s.session_token);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->role(), v1::Assignment::STAGE);  // promoted
  EXPECT_EQ(after->plan_version(), plan + 1);
  EXPECT_EQ(after->resume_step(), 7);  // b had completed only 7 steps
  auto a = c->GetAssignment(j[0].peer_id, j[0].session_token);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->resume_step(), 7);
  EXPECT_EQ(a->plan_version(), plan + 1);
  // Survivors count as being at the resume step until they report again.
  HeldStates fetched{{after->stage(), {7}}};
  ASSERT_TRUE(c->ReportProgress(s.peer_id, s.session_token, PeerProgress{7, 5.0, 10}, 0, &fetched).ok());
  ASSERT_TRUE(c->Leave(j[2].peer_id, j[2].session_token).ok());
  auto hole = c->GetAssignment(j[0].peer_id, j[0].session_token);
  ASSERT_TRUE(hole.ok());
  EXPECT_FALSE(hole->grid_complete());
  EXPECT_EQ(hole->resume_step(), 7);
  EXPECT_EQ(hole->plan_version(), plan + 2);
}

// Fault domains, DiLoCo (8 inner steps) on a 2x2 grid and three standbys. A
// peer of pipeline 1 leaves at step 19: pipeline 0 keeps its run (same
// run_plan, not healing, its progress and the swarm's step untouched) and
// pipeline 1's peers (its survivor and a standby) heal from pipeline 0's
// newest state not behind its last outer step (16), starting 2 steps past
// pipeline 0's report (21, before the outer step at 24), each from the kept
// peer of its stage. Stages may heal from different steps when one stage
// of the kept pipeline is an outer step ahead of the other. With no state
// since the kept pipeline's last outer step, the whole swarm restarts.
TEST_F(SwarmCoordinatorTest, WithFaultDomainsALostPeerRestartsOnlyItsPipelineWhichHealsFromTheKeptOne) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 2);
  o.fault_domains = true;
  o.job.mutable_dp()->set_optimizer(v1::DataParallelSpec::diloco);
  o.job.mutable_dp()->set_inner_steps(8);
  auto c = Make(std::move(o));
  std::map<uint64_t, JoinResult> j;
  int port = 5000;
  for (const char* n : {"a", "b", "c", "d", "s1", "s2", "s3"}) {
    JoinParams p = JoinAs(clock_, n, port);
    p.state_transfer_address = absl::StrCat("127.0.0.1:", port + 2);
    port += 10;
    absl::StatusOr<JoinResult> r = c->Join(p);
    ASSERT_TRUE(r.ok()) << r.status();
    j[r->peer_id] = *r;
  }
  auto assignment = [&](uint64_t id) {
    absl::StatusOr<v1::Assignment> a = c->GetAssignment(id, j.at(id).session_token);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? *a : v1::Assignment();
  };
  const Grid g = c->grid();
  const uint64_t plan = g.plan_version;
  for (uint64_t id : g.slots) {
    const v1::Assignment a = assignment(id);
    EXPECT_EQ(a.run_plan(), plan);
    EXPECT_EQ(a.dp_timeline(), plan);
    EXPECT_FALSE(a.heal());
  }
  auto report = [&](uint64_t id, int64_t step, std::vector<HeldState> states) {
    HeldStates held{{static_cast<uint32_t>(c->grid().Find(id)->first), std::move(states)}};
    ASSERT_TRUE(c->ReportProgress(id, j.at(id).session_token, PeerProgress{step, 5.0, 10}, 0, &held).ok());
  };
  for (int stage = 0; stage < 2; ++stage) {
    report(g.at(stage, 0), 19, {HeldState(8, std::string(64, '0')), HeldState(16, std::string(64, "ab"[stage]))});
    report(g.at(stage, 1), 19, {HeldState(8, std::string(64, '1')), HeldState(16, std::string(64, "cd"[stage]))});
  }
  const uint64_t gone = g.at(1, 1);
  ASSERT_TRUE(c->Leave(gone, j.at(gone).session_token).ok());
  j.erase(gone);
  const Grid h = c->grid();
  EXPECT_EQ(h.plan_version, plan + 1);
  EXPECT_EQ(h.at(0, 0), g.at(0, 0));
  EXPECT_EQ(h.at(1, 0), g.at(1, 0));
  for (int stage = 0; stage < 2; ++stage) {
    const v1::Assignment kept = assignment(h.at(stage, 0));
    EXPECT_EQ(kept.plan_version(), plan + 1);
    EXPECT_EQ(kept.run_plan(), plan) << "pipeline 0 trains on";
    EXPECT_FALSE(kept.heal());
    EXPECT_EQ(kept.resume_step(), 0);
    EXPECT_EQ(kept.dp_timeline(), plan);
    const v1::Assignment healed = assignment(h.at(stage, 1));
    EXPECT_EQ(healed.run_plan(), plan + 1);
    EXPECT_TRUE(healed.heal());
    EXPECT_EQ(healed.resume_step(), 16);
    EXPECT_EQ(healed.start_step(), 21);
    EXPECT_EQ(healed.dp_timeline(), plan);
    ASSERT_EQ(healed.state_sources_size(), 1);
    EXPECT_EQ(healed.state_sources(0).peer_id(), h.at(stage, 0)) << "the kept peer of its stage";
    EXPECT_EQ(healed.state_sha256(), std::string(64, "ab"[stage]));
  }
  EXPECT_EQ(c->GetStatus(false).step(), 19) << "no rollback";

  // Pipeline 0's stage 0 is past the outer step at 24, its stage 1 is
  // stuck in it: pipeline 1's stage 0 heals from 24, its stage 1 from 16
  // (joining that outer step), and both start at 27.
  report(h.at(0, 0), 25, {HeldState(16, std::string(64, 'e')), HeldState(24, std::string(64, 'f'))});
  report(h.at(1, 0), 23, {HeldState(16, std::string(64, 'b'))});
  const uint64_t second_gone = h.at(1, 1);
  ASSERT_TRUE(c->Leave(second_gone, j.at(second_gone).session_token).ok());
  j.erase(second_gone);
  const Grid u = c->grid();
  EXPECT_EQ(assignment(u.at(0, 0)).run_plan(), plan);
  for (int stage = 0; stage < 2; ++stage) {
    const v1::Assignment healed = assignment(u.at(stage, 1));
    EXPECT_TRUE(healed.heal());
    EXPECT_EQ(healed.resume_step(), stage == 0 ? 24 : 16);
    EXPECT_EQ(healed.start_step(), 27);
  }

  // Past the outer step at 32 with no state since: nothing qualifies.
  for (int stage = 0; stage < 2; ++stage) report(u.at(stage, 0), 33, {HeldState(24, std::string(64, 'e'))});
  const uint64_t next_gone = u.at(0, 1);
  ASSERT_TRUE(c->Leave(next_gone, j.at(next_gone).session_token).ok());
  const Grid k = c->grid();
  for (uint64_t id : k.slots) {
    const v1::Assignment a = assignment(id);
    EXPECT_EQ(a.run_plan(), plan + 3) << "a swarm-wide restart";
    EXPECT_FALSE(a.heal());
    EXPECT_EQ(a.dp_timeline(), plan + 3);
  }
}

TEST_F(SwarmCoordinatorTest, ARollbackLowersTheSwarmStepAndReportsFromTheOldPlanLeaveItAlone) {
  {
    auto c = Make(2, 1);
    JoinResult a = MustJoin(*c, "a");
    JoinResult b = MustJoin(*c, "b");
    const Grid g = c->grid();
    const uint32_t a_stage = g.Find(a.peer_id)->first, b_stage = g.Find(b.peer_id)->first;
    const uint64_t plan = c->GetAssignment(a.peer_id, a.session_token)->plan_version();
    HeldStates a_holds{{a_stage, {6, 8, 10}}}, b_holds{{b_stage, {6, 8, 10}}};
    ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {8, 4.0, 10, plan}, 8, &b_holds).ok());
    ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {10, 4.0, 10, plan}, 10, &a_holds).ok());
    ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {10, 4.0, 10, plan}, 10, &b_holds).ok());
    // A standby restarted with a copy of b's stage at step 6 on its disk.
    JoinParams sp = JoinAs(clock_, "s");
    sp.held = {{b_stage, {6}}};
    sp.held_job_name = c->job().name();
    auto joined = c->Join(sp);
    ASSERT_TRUE(joined.ok()) << joined.status();
    JoinResult s = *joined;
    EXPECT_EQ(c->GetStatus().step(), 10);
    // b leaves: s takes its stage over from its copy, everyone restarts at 6.
    ASSERT_TRUE(c->Leave(b.peer_id, b.session_token).ok());
    auto promoted = c->GetAssignment(s.peer_id, s.session_token);
    ASSERT_TRUE(promoted.ok());
    EXPECT_EQ(promoted->plan_version(), plan + 1);
    EXPECT_EQ(promoted->resume_step(), 6);
    v1::StatusResponse st = c->GetStatus();
    EXPECT_EQ(st.step(), 6);
    EXPECT_EQ(st.checkpoint_step(), 6);
    // a's child of the old plan reports once more before a sees the re-plan:
    // taken (the peer is known) but of the abandoned timeline.
    ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {12, 3.0, 10, plan}, 12, &a_holds).ok());
    st = c->GetStatus();
    EXPECT_EQ(st.step(), 6);
    EXPECT_EQ(st.checkpoint_step(), 6);
    // A plan the coordinator never made is refused.
    EXPECT_TRUE(absl::IsInvalidArgument(
        c->ReportProgress(a.peer_id, a.session_token, {7, 3.0, 10, plan + 2}, 0, &a_holds)));
    // Under the new plan the step moves on from 6.
    ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {7, 3.0, 10, plan + 1}, 0, &a_holds).ok());
    EXPECT_EQ(c->GetStatus().step(), 7);
  }
  // The lowered step is what a restarted coordinator restores.
  auto c = Make(2, 1);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->GetStatus().step(), 7);
  EXPECT_EQ(c->GetStatus().checkpoint_step(), 6);
}

TEST_F(SwarmCoordinatorTest, LeaveRemovesAtOnceAndRejoinReplacesTheOldId) {
  auto c = Make(1, 1);
  JoinResult a = MustJoin(*c, "a");
  JoinResult b = MustJoin(*c, "b");
  auto v = c->Leave(b.peer_id, b.session_token);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 3u);
  EXPECT_EQ(c->num_members(), 1u);
  // A join under a's name while its lease is live takes nothing away...
  auto taken = c->Join(JoinAs(clock_, "a"));
  EXPECT_TRUE(absl::IsAlreadyExists(taken.status())) << taken.status();
  EXPECT_THAT(taken.status().message(), HasSubstr("previous_session_token"));
  ASSERT_TRUE(c->Heartbeat(a.peer_id, a.session_token).ok());
  // ...but a rejoin that proves it is a (its session token) replaces the old id.
  JoinParams again = JoinAs(clock_, "a");
  again.previous_session_token = a.session_token;
  auto rejoined = c->Join(again);
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  JoinResult a2 = *rejoined;
  EXPECT_NE(a2.peer_id, a.peer_id);
  EXPECT_EQ(c->num_members(), 1u);
  EXPECT_TRUE(absl::IsNotFound(c->Heartbeat(a.peer_id, a.session_token).status()));
  EXPECT_EQ(c->grid().at(0, 0), a2.peer_id);
}

TEST_F(SwarmCoordinatorTest, RestartFromTheStateDirRestoresEverything) {
  JoinResult a, b, s;
  Grid grid;
  {
    auto c = Make(2, 1);
    a = MustJoin(*c, "a");
    b = MustJoin(*c, "b");
    s = MustJoin(*c, "s");
    // Both stages of the pipeline report step 42 (one alone is not backed).
    ASSERT_TRUE(c->ReportProgress(b.peer_id, b.session_token, {42, 2.5, 1000}, 40).ok());
    ASSERT_TRUE(c->ReportProgress(a.peer_id, a.session_token, {42, 2.5, 1000}, 40).ok());
    grid = c->grid();
    EXPECT_EQ(c->assignment_version(), 3u);
  }
  clock_.Advance(absl::Minutes(5));  // every stored lease is long expired
  auto c = Make(2, 1);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->assignment_version(), 3u);
  EXPECT_EQ(c->num_members(), 3u);
  EXPECT_EQ(c->grid(), grid);
  // Leases were extended by the grace period: nothing expires yet.
  ASSERT_TRUE(c->ExpireLeases()->empty());
  // Same ids and session tokens work.
  auto hb = c->Heartbeat(a.peer_id, a.session_token);
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_EQ(hb->assignment_version, 3u);
  auto st = c->GetStatus();
  EXPECT_EQ(st.step(), 42);
  EXPECT_EQ(st.loss(), 2.5);
  EXPECT_EQ(st.checkpoint_step(), 40);
  // New ids never collide with restored ones.
  JoinResult d = MustJoin(*c, "d");
  EXPECT_GT(d.peer_id, s.peer_id);
  EXPECT_EQ(d.assignment_version, 4u);
  // Peers that do not come back expire after the grace period.
  clock_.Advance(absl::Seconds(11));
  ASSERT_TRUE(c->Heartbeat(a.peer_id, a.session_token).ok());
  auto expired = c->ExpireLeases();
  ASSERT_TRUE(expired.ok());
  EXPECT_EQ(expired->size(), 3u);  // b, s and d (d joined 11 s ago)
}

// Reachability of each member in a status, by name.
std::map<std::string, v1::Reachability> ReachabilityByName(const SwarmCoordinator& c) {
  std::map<std::string, v1::Reachability> out;
  const v1::StatusResponse st = c.GetStatus();
  for (const v1::PeerStatus& p : st.peers()) out[p.peer_name()] = p.reachability();
  return out;
}

TEST_F(SwarmCoordinatorTest, PeersOthersCannotDialAreNeverPlacedWithReplicasNorProbedAndARestartRemembers) {
  // One stage, two replicas: a replica must accept the other's updates.
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 1, 2);
  o.probe_reachability = true;
  auto join = [&](SwarmCoordinator& c, const std::string& name, int port, bool no_inbound) {
    JoinParams p = JoinAs(clock_, name, port);
    p.state_transfer_address = absl::StrCat("127.0.0.1:", port + 2);
    p.no_inbound = no_inbound;
    auto r = c.Join(p);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : JoinResult{};
  };
  JoinResult a, n, u, b;
  {
    auto c = Make(o);
    ASSERT_NE(c, nullptr);
    // A joiner waits as PROBING, unplaced, until the probe's answer.
    a = join(*c, "a", 5000, false);
    EXPECT_EQ(a.probe_address, "127.0.0.1:5002");
    EXPECT_EQ(ReachabilityByName(*c)["a"], v1::PROBING);
    EXPECT_FALSE(c->grid().Find(a.peer_id).has_value());
    ASSERT_TRUE(c->SetReachability(a.peer_id, true, "").ok());
    EXPECT_EQ(ReachabilityByName(*c)["a"], v1::REACHABLE);
    // One that says it accepts no connections is not probed, nor one that the probe cannot reach: neither is placed.
    n = join(*c, "n", 6000, true);
    EXPECT_EQ(n.probe_address, "");
    u = join(*c, "u", 7000, false);
    ASSERT_TRUE(c->SetReachability(u.peer_id, false, "connection refused").ok());
    EXPECT_FALSE(c->grid().complete());
    EXPECT_FALSE(c->grid().Find(n.peer_id).has_value());
    EXPECT_FALSE(c->grid().Find(u.peer_id).has_value());
    // A later answer for a member that is not PROBING changes nothing.
    ASSERT_TRUE(c->SetReachability(a.peer_id, false, "late").ok());
    ASSERT_TRUE(c->SetReachability(u.peer_id, true, "late").ok());
    EXPECT_EQ(ReachabilityByName(*c)["a"], v1::REACHABLE);
    EXPECT_EQ(ReachabilityByName(*c)["u"], v1::UNREACHABLE);
    // A reachable joiner completes the grid.
    b = join(*c, "b", 8000, false);
    EXPECT_FALSE(c->grid().complete());
    ASSERT_TRUE(c->SetReachability(b.peer_id, true, "").ok());
    EXPECT_TRUE(c->grid().complete());
    EXPECT_TRUE(c->grid().Find(a.peer_id).has_value());
    EXPECT_TRUE(c->grid().Find(b.peer_id).has_value());
    // Nobody is asked to probe links to the peers that cannot be dialed.
    for (int i = 0; i < 4; ++i) {
      auto hb = c->Heartbeat(a.peer_id, a.session_token);
      ASSERT_TRUE(hb.ok()) << hb.status();
      for (const v1::Neighbor& t : hb->probe) {
        EXPECT_NE(t.peer_id(), n.peer_id);
        EXPECT_NE(t.peer_id(), u.peer_id);
      }
      clock_.Advance(absl::Minutes(2));
      for (const JoinResult* r : {&a, &n, &u, &b}) ASSERT_TRUE(c->Heartbeat(r->peer_id, r->session_token).ok());
    }
  }
  // A restart keeps what was found; with b gone the hole is not filled by them.
  auto c = Make(o);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(ReachabilityByName(*c),
            (std::map<std::string, v1::Reachability>{
                {"a", v1::REACHABLE}, {"b", v1::REACHABLE}, {"n", v1::NO_INBOUND}, {"u", v1::UNREACHABLE}}));
  ASSERT_TRUE(c->Leave(b.peer_id, b.session_token).ok());
  EXPECT_FALSE(c->grid().complete());
  EXPECT_FALSE(c->grid().Find(n.peer_id).has_value());
  EXPECT_FALSE(c->grid().Find(u.peer_id).has_value());
}

TEST_F(SwarmCoordinatorTest, InOnePipelineAPeerOthersCannotDialIsPlacedAndItsLinkIsOpenedFromTheOtherEnd) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 1);
  o.probe_reachability = true;
  o.mirror_checkpoints = true;
  auto c = Make(o);
  ASSERT_NE(c, nullptr);
  JoinParams np = JoinAs(clock_, "nat", 5000);
  np.no_inbound = true;
  np.state_transfer_address = "127.0.0.1:5002";
  auto n = c->Join(np);
  ASSERT_TRUE(n.ok()) << n.status();
  JoinParams rp = JoinAs(clock_, "r", 6000);
  rp.state_transfer_address = "127.0.0.1:6002";
  auto r = c->Join(rp);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(c->SetReachability(r->peer_id, true, "").ok());
  ASSERT_TRUE(c->grid().complete());
  auto na = c->GetAssignment(n->peer_id, n->session_token);
  auto ra = c->GetAssignment(r->peer_id, r->session_token);
  ASSERT_TRUE(na.ok() && ra.ok());
  if (na->stage() == 1) {
    // The NAT peer is downstream: it dials r, which accepts.
    EXPECT_TRUE(na->previous().reversed());
    EXPECT_TRUE(ra->next().reversed());
  } else {
    // Upstream: it dials r as any upstream does.
    EXPECT_FALSE(na->next().reversed());
    EXPECT_FALSE(ra->previous().reversed());
  }
  // Nobody copies from or serves copies through the NAT peer.
  EXPECT_FALSE(na->has_mirror());
  EXPECT_FALSE(ra->has_mirror());
}

TEST_F(SwarmCoordinatorTest, ADifferentJobOnTheSameStateDirIsRefused) {
  { ASSERT_NE(Make(2, 1), nullptr); }
  auto other = SwarmCoordinator::Create(TestOptions(&clock_, dir_.Sub("state"), 3, 1));
  EXPECT_TRUE(absl::IsFailedPrecondition(other.status())) << other.status();
}

TEST_F(SwarmCoordinatorTest, TheFirstPeerWithDataFixesItsIdentityAndADifferentCopyIsRefused) {
  const DataIdentity ours{"00000000000000a1", "00000000000000b1"};
  {
    auto c = Make(2, 1);
    JoinParams first = JoinAs(clock_, "a");
    first.data = ours;
    ASSERT_TRUE(c->Join(first).ok());
    EXPECT_EQ(c->data_identity(), ours);
    EXPECT_EQ(c->GetStatus().job().data().dataset_hash(), ours.dataset_hash);

    JoinParams other = JoinAs(clock_, "b", 6000);
    other.data = {"00000000000000a2", ours.tokenizer_hash};
    auto refused = c->Join(other);
    EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
    EXPECT_THAT(refused.status().message(), HasSubstr("peer 'b'"));
    EXPECT_THAT(refused.status().message(), HasSubstr("dataset hash 00000000000000a2 differs from the job's "
                                                      "00000000000000a1"));
    EXPECT_EQ(c->num_members(), 1u) << "a refused peer is not a member";

    JoinParams silent = JoinAs(clock_, "c", 7000);  // reports no hashes at all
    EXPECT_TRUE(absl::IsFailedPrecondition(c->Join(silent).status()));
  }
  // The identity survives a coordinator restart.
  auto c = Make(2, 1);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->data_identity(), ours);
  JoinParams again = JoinAs(clock_, "b", 6000);
  again.data = ours;
  EXPECT_TRUE(c->Join(again).ok());
}

TEST_F(SwarmCoordinatorTest, AJobThatNamesItsDataHashesRefusesOtherCopiesFromTheFirstPeer) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 1);
  o.job.mutable_data()->set_tokenizer_hash("00000000000000b1");
  auto c = SwarmCoordinator::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  JoinParams p = JoinAs(clock_, "a");
  p.data = {"00000000000000a1", "00000000000000b2"};
  auto refused = (*c)->Join(p);
  EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("tokenizer hash 00000000000000b2 differs"));
  p.data.tokenizer_hash = "00000000000000b1";
  EXPECT_TRUE((*c)->Join(p).ok());

  o.job.mutable_data()->set_tokenizer_hash("not-hex");
  o.state.dir = dir_.Sub("state2");
  EXPECT_TRUE(absl::IsInvalidArgument(SwarmCoordinator::Create(o).status()));
}

TEST_F(SwarmCoordinatorTest, JobsOnSyntheticDataSkipTheDataCheck) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 1);
  o.job.mutable_data()->set_synthetic_tokens(100000);
  auto c = SwarmCoordinator::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  JoinParams a = JoinAs(clock_, "a");
  a.data = {"00000000000000a1", "00000000000000b1"};
  ASSERT_TRUE((*c)->Join(a).ok());
  EXPECT_TRUE((*c)->data_identity().empty());
  EXPECT_TRUE((*c)->Join(JoinAs(clock_, "b", 6000)).ok());
}

TEST_F(SwarmCoordinatorTest, ProbesAndProgressShowInStatus) {
  auto c = Make(2, 1);
  JoinResult a = MustJoin(*c, "a");
  JoinResult b = MustJoin(*c, "b");
  ASSERT_TRUE(c->ReportLinkProbe(a.peer_id, a.session_token, b.peer_id, 5e6, 0.03).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(c->ReportLinkProbe(a.peer_id, a.session_token, a.peer_id, 5e6, 0.03)));
  EXPECT_TRUE(absl::IsNotFound(c->ReportLinkProbe(a.peer_id, a.session_token, 999, 5e6, 0.03)));
  EXPECT_TRUE(absl::IsInvalidArgument(c->ReportLinkProbe(a.peer_id, a.session_token, b.peer_id, -1, 0.03)));
  // Real traffic measured 4 MB/s: the bandwidth changes, the probed RTT stays.
  ASSERT_TRUE(c->ReportLinkProbe(a.peer_id, a.session_token, b.peer_id, 4e6, 99, /*passive=*/true).ok());
  const Grid g = c->grid();
  const JoinResult& last = g.at(1, 0) == a.peer_id ? a : b;
  PeerProgress p{7, 3.0, 1234};
  ASSERT_TRUE(c->Heartbeat(last.peer_id, last.session_token, &p).ok());
  PeerProgress bad{7, -3.0, 1};
  EXPECT_TRUE(absl::IsInvalidArgument(c->Heartbeat(last.peer_id, last.session_token, &bad).status()));
  v1::StatusResponse s = c->GetStatus();
  EXPECT_EQ(s.peers_size(), 2);
  EXPECT_EQ(s.step(), 7);
  EXPECT_EQ(s.loss(), 3.0);
  EXPECT_EQ(s.tokens_per_second(), 1234);
  EXPECT_TRUE(s.grid_complete());
  const v1::PeerStatus& pa = s.peers(0).peer_id() == a.peer_id ? s.peers(0) : s.peers(1);
  ASSERT_EQ(pa.links_size(), 1);
  EXPECT_EQ(pa.links(0).to_peer_id(), b.peer_id);
  EXPECT_EQ(pa.links(0).bandwidth_bytes_per_second(), 4e6);
  EXPECT_EQ(pa.links(0).rtt_seconds(), 0.03);
  EXPECT_EQ(pa.state(), v1::PeerStatus::ACTIVE);
}

TEST_F(SwarmCoordinatorTest, AStageWithNoLiveReplicaResumesFromTheNewestStateAMirrorHolds) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 1);
  o.mirror_checkpoints = true;
  auto c = *SwarmCoordinator::Create(o);
  auto join = [&](const std::string& name, int port) {
    JoinParams p = JoinAs(clock_, name, port);
    p.state_transfer_address = absl::StrCat("127.0.0.1:", port + 2);
    return *c->Join(p);
  };
  JoinResult a = join("a", 5000), b = join("b", 6000), s = join("s", 7000);
  const Grid g = c->grid();
  const JoinResult& first = g.at(0, 0) == a.peer_id ? a : b;
  const JoinResult& second = g.at(0, 0) == a.peer_id ? b : a;
  // Each placed peer mirrors the other stage.
  auto fa = c->GetAssignment(first.peer_id, first.session_token);
  ASSERT_TRUE(fa.ok());
  EXPECT_EQ(fa->mirror().peer_id(), second.peer_id);
  EXPECT_EQ(fa->mirror().stage(), 1u);
  EXPECT_EQ(fa->mirror().state_transfer_address(), second.peer_id == b.peer_id ? "127.0.0.1:6002" : "127.0.0.1:5002");
  EXPECT_FALSE(c->GetAssignment(s.peer_id, s.session_token)->has_mirror()) << "standbys mirror nothing";
  // Stage 0 holds its own states at 4 and 6 and a copy of stage 1 at 4 (the
  // copy of 6 is not there yet); both completed 6 steps.
  HeldStates first_holds{{0, {4, 6}}, {1, {4}}}, second_holds{{1, {4, 6}}};
  ASSERT_TRUE(c->ReportProgress(first.peer_id, first.session_token, {6, 3.0, 10}, 6, &first_holds).ok());
  ASSERT_TRUE(c->ReportProgress(second.peer_id, second.session_token, {6, 3.0, 10}, 6, &second_holds).ok());
  // Stage 1's only peer leaves: the standby takes it over from the mirror's
  // copy at step 4, and stage 0 rolls back to 4.
  ASSERT_TRUE(c->Leave(second.peer_id, second.session_token).ok());
  auto sa = c->GetAssignment(s.peer_id, s.session_token);
  ASSERT_TRUE(sa.ok());
  EXPECT_EQ(sa->role(), v1::Assignment::STAGE);
  EXPECT_EQ(sa->stage(), 1u);
  EXPECT_EQ(sa->resume_step(), 4);
  ASSERT_EQ(sa->state_sources_size(), 1);
  EXPECT_EQ(sa->state_sources(0).peer_id(), first.peer_id);
  EXPECT_EQ(sa->state_sources(0).state_transfer_address(), first.peer_id == a.peer_id ? "127.0.0.1:5002" : "127.0.0.1:6002");
  EXPECT_EQ(sa->mirror().peer_id(), first.peer_id);
  EXPECT_EQ(c->GetAssignment(first.peer_id, first.session_token)->resume_step(), 4);
  // Malformed holdings are refused and change nothing.
  HeldStates unordered{{0, {6, 4}}}, no_such_stage{{2, {4}}};
  EXPECT_TRUE(absl::IsInvalidArgument(
      c->ReportProgress(first.peer_id, first.session_token, {4, 3.0, 10}, 0, &unordered)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      c->ReportProgress(first.peer_id, first.session_token, {4, 3.0, 10}, 0, &no_such_stage)));
}

TEST_F(SwarmCoordinatorTest, WithNoStateOfSomeStageAnywhereTheJobStartsOver) {
  auto c = Make(2, 1);
  JoinResult a = MustJoin(*c, "a"), b = MustJoin(*c, "b");
  MustJoin(*c, "s");
  const Grid g = c->grid();
  const JoinResult& first = g.at(0, 0) == a.peer_id ? a : b;
  const JoinResult& second = g.at(0, 0) == a.peer_id ? b : a;
  HeldStates h0{{0, {5}}}, h1{{1, {5}}};
  ASSERT_TRUE(c->ReportProgress(first.peer_id, first.session_token, {5, 3.0, 10}, 5, &h0).ok());
  ASSERT_TRUE(c->ReportProgress(second.peer_id, second.session_token, {5, 3.0, 10}, 5, &h1).ok());
  ASSERT_TRUE(c->Leave(second.peer_id, second.session_token).ok());
  EXPECT_EQ(c->grid().resume_step, 0);
  EXPECT_EQ(c->GetAssignment(first.peer_id, first.session_token)->state_sources_size(), 0);
}

TEST_F(SwarmCoordinatorTest, PeersWithCheckpointsOnDiskRestartAStoppedJobWhereItWas) {
  // A whole swarm restarted (new coordinator state, peers keep their disks):
  // the states the peers name at Join let the first plan resume at step 9.
  auto c = Make(2, 1);
  JoinParams other = JoinAs(clock_, "d", 8000), a = JoinAs(clock_, "a", 5000);
  other.held = {{0, {50}}, {1, {50}}};  // states of another job: they do not count
  other.held_job_name = "another-job";
  a.held = {{0, {8, 9}}, {1, {9}}, {5, {9}}};  // stage 5: from a bigger job; ignored
  a.held_job_name = c->job().name();
  ASSERT_TRUE(c->Join(other).ok());
  ASSERT_TRUE(c->Join(a).ok());
  EXPECT_TRUE(c->grid().complete());
  EXPECT_EQ(c->grid().resume_step, 9);
  JoinParams bad = JoinAs(clock_, "c", 7000);
  bad.held = {{0, {3, 1}}};
  bad.held_job_name = c->job().name();
  EXPECT_TRUE(absl::IsInvalidArgument(c->Join(bad).status()));
}

TEST_F(SwarmCoordinatorTest, HeartbeatsAskForProbesOfUnmeasuredOrStaleLinksAndMeasurementsPersist) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 1);
  o.probe_max_age = absl::Minutes(10);
  o.probe_retry = absl::Minutes(1);
  o.probes_per_heartbeat = 2;
  JoinResult a, b, s;
  {
    auto c = *SwarmCoordinator::Create(o);
    auto join = [&](const std::string& name, int port) {
      JoinParams p = JoinAs(clock_, name, port);
      p.state_transfer_address = absl::StrCat("127.0.0.1:", port + 2);
      return *c->Join(p);
    };
    a = join("a", 5000);
    b = join("b", 6000);
    s = join("s", 7000);
    auto hb = c->Heartbeat(a.peer_id, a.session_token);
    ASSERT_TRUE(hb.ok());
    std::set<uint64_t> asked;
    for (const auto& n : hb->probe) {
      asked.insert(n.peer_id());
      EXPECT_FALSE(n.state_transfer_address().empty());
    }
    EXPECT_EQ(asked, (std::set<uint64_t>{b.peer_id, s.peer_id}));
    // Not asked again while the probe may still be running...
    EXPECT_TRUE(c->Heartbeat(a.peer_id, a.session_token)->probe.empty());
    ASSERT_TRUE(c->ReportLinkProbe(a.peer_id, a.session_token, b.peer_id, 2e6, 0.04).ok());
    // ...and after the retry period only the unmeasured link is.
    clock_.Advance(absl::Minutes(2));
    ASSERT_TRUE(c->Heartbeat(b.peer_id, b.session_token).ok());
    ASSERT_TRUE(c->Heartbeat(s.peer_id, s.session_token).ok());
    hb = c->Heartbeat(a.peer_id, a.session_token);
    ASSERT_EQ(hb->probe.size(), 1u);
    EXPECT_EQ(hb->probe[0].peer_id(), s.peer_id);
  }
  // The measured link survives a restart; it goes stale after probe_max_age.
  auto c = *SwarmCoordinator::Create(o);
  v1::StatusResponse st = c->GetStatus();
  bool found = false;
  for (const auto& p : st.peers()) {
    for (const auto& l : p.links()) {
      if (p.peer_id() == a.peer_id && l.to_peer_id() == b.peer_id) {
        found = true;
        EXPECT_EQ(l.bandwidth_bytes_per_second(), 2e6);
        EXPECT_EQ(l.rtt_seconds(), 0.04);
      }
    }
  }
  EXPECT_TRUE(found);
  clock_.Advance(absl::Minutes(11));
  auto hb = c->Heartbeat(a.peer_id, a.session_token);
  ASSERT_TRUE(hb.ok());
  std::set<uint64_t> asked;
  for (const auto& n : hb->probe) asked.insert(n.peer_id());
  EXPECT_TRUE(asked.count(b.peer_id)) << "stale after 10 min";
}

TEST_F(SwarmCoordinatorTest, ASlowLinkMeasuredInThePipelineIsReplannedAwayOnceWithHysteresis) {
  SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), 2, 1);
  o.improve_interval = absl::Seconds(30);
  o.improve_hold = absl::Minutes(5);
  auto c = Make(o);
  ASSERT_NE(c, nullptr);
  const JoinResult j1 = MustJoin(*c, "p1", 5000), j2 = MustJoin(*c, "p2", 5010), j3 = MustJoin(*c, "p3", 5020);
  const Grid first = c->grid();
  ASSERT_TRUE(first.complete());
  std::map<uint64_t, std::string> session = {{j1.peer_id, j1.session_token}, {j2.peer_id, j2.session_token},
                                             {j3.peer_id, j3.session_token}};
  const uint64_t a = first.at(0, 0), b = first.at(1, 0);
  uint64_t standby = 0;
  for (const auto& [id, tok] : session) {
    if (id != a && id != b) standby = id;
  }
  auto keep_alive = [&] {
    for (const auto& [id, tok] : session) ASSERT_TRUE(c->Heartbeat(id, tok).ok());
  };
  auto probe = [&](uint64_t from, uint64_t to, double bytes_per_second, double rtt) {
    ASSERT_TRUE(c->ReportLinkProbe(from, session[from], to, bytes_per_second, rtt).ok());
  };
  // Nothing measured: nothing to gain.
  clock_.Advance(absl::Minutes(6));
  keep_alive();
  auto improved = c->ImprovePlan();
  ASSERT_TRUE(improved.ok()) << improved.status();
  EXPECT_FALSE(*improved);
  // The pipeline's link is measured slow, the standby's links fast.
  probe(a, b, 1e5, 0.2);
  probe(b, a, 1e5, 0.2);
  for (uint64_t x : {a, b}) {
    probe(x, standby, 1e8, 0.005);
    probe(standby, x, 1e8, 0.005);
  }
  // Checked at most once per interval.
  clock_.Advance(absl::Seconds(10));
  improved = c->ImprovePlan();
  ASSERT_TRUE(improved.ok());
  EXPECT_FALSE(*improved) << "checked again before the interval passed";
  clock_.Advance(absl::Seconds(25));
  keep_alive();
  const uint64_t version = c->assignment_version();
  improved = c->ImprovePlan();
  ASSERT_TRUE(improved.ok()) << improved.status();
  ASSERT_TRUE(*improved);
  const Grid second = c->grid();
  EXPECT_TRUE(second.Find(standby).has_value());
  EXPECT_EQ(second.plan_version, first.plan_version + 1);
  EXPECT_GT(c->assignment_version(), version);
  // Hysteresis: the standby's links now measure slow too, but within the
  // hold after a plan change nothing moves.
  const uint64_t out = first.Find(a).has_value() && !second.Find(a).has_value() ? a : b;
  for (uint64_t x : {second.at(0, 0), second.at(1, 0)}) {
    for (uint64_t y : {second.at(0, 0), second.at(1, 0)}) {
      if (x != y) probe(x, y, 1e5, 0.2);
    }
    probe(x, out, 1e8, 0.005);
    probe(out, x, 1e8, 0.005);
  }
  clock_.Advance(absl::Minutes(2));
  keep_alive();
  improved = c->ImprovePlan();
  ASSERT_TRUE(improved.ok());
  EXPECT_FALSE(*improved) << "re-planned within the hold";
  EXPECT_EQ(c->grid().slots, second.slots);
}

TEST_F(SwarmCoordinatorTest, AGainBelowTheThresholdOrThatDoesNotRepayTheMoveIsNotTaken) {
  for (const bool payback : {false, true}) {
    SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub(payback ? "payback" : "gain"), 2, 1);
    o.improve_interval = absl::Seconds(1);
    o.improve_hold = absl::ZeroDuration();
    if (!payback) {
      o.improve_min_gain = 0.99;    // no plan is 100x faster
    }
    auto c = Make(o);
    ASSERT_NE(c, nullptr);
    std::map<uint64_t, std::string> session;
    for (const char* name : {"p1", "p2", "p3"}) {
      const JoinResult j = MustJoin(*c, name);
      session[j.peer_id] = j.session_token;
    }
    const Grid first = c->grid();
    const uint64_t a = first.at(0, 0), b = first.at(1, 0);
    for (const auto& [x, tok] : session) {
      for (const auto& [y, tok2] : session) {
        if (x == y) continue;
        const bool slow = (x == a && y == b) || (x == b && y == a);
        ASSERT_TRUE(c->ReportLinkProbe(x, tok, y, slow ? 1e5 : 1e8, slow ? 0.2 : 0.005).ok());
      }
    }
    if (payback) {
      // 2000 steps trained and no checkpoint anywhere: a new plan restarts
      // at step 0, which 500 faster steps do not repay.
      for (uint64_t id : {a, b}) {
        ASSERT_TRUE(c->ReportProgress(id, session[id], {2000, 3.0, 10, first.plan_version}, 0).ok());
      }
    }
    clock_.Advance(absl::Seconds(2));
    auto improved = c->ImprovePlan();
    ASSERT_TRUE(improved.ok()) << improved.status();
    EXPECT_FALSE(*improved) << (payback ? "payback" : "gain");
    EXPECT_EQ(c->grid().slots, first.slots);
  }
}

TEST_F(SwarmCoordinatorTest, AwaitVersionAboveReturnsAtOnceWhenNewerAndTimesOutOtherwise) {
  auto c = Make(1, 1);
  MustJoin(*c, "a");
  EXPECT_EQ(c->AwaitVersionAbove(0, absl::Seconds(30)), 1u);
  EXPECT_EQ(c->AwaitVersionAbove(1, absl::Milliseconds(1)), 1u);
}

}  // namespace
}  // namespace aqswarm::coordinator

namespace aqswarm::coordinator {
namespace {

// Blame (ReportBlame, SettleBlames) on real coordinator logic with a fake clock.
class BlameTest : public SwarmCoordinatorTest {
 protected:
  // A stages x 1 grid of peers s0..s(stages-1) by join order, plus `standbys`.
  void Start(int stages, int standbys) {
    SwarmCoordinatorOptions o = TestOptions(&clock_, dir_.Sub("state"), stages, 1);
    o.replan_backoff.first = absl::ZeroDuration();  // this test counts evictions, not replan holds
    c_ = Make(std::move(o));
    for (int i = 0; i < stages + standbys; ++i) {
      const std::string name = absl::StrCat(i < stages ? "s" : "standby", i);
      JoinParams p = JoinAs(clock_, name, 5000 + 10 * i);
      p.state_transfer_address = absl::StrCat("127.0.0.1:", 5000 + 10 * i + 2);
      absl::StatusOr<JoinResult> j = c_->Join(p);
      ASSERT_TRUE(j.ok()) << j.status();
      joined_[name] = *j;
      state_address_[j->peer_id] = p.state_transfer_address;
    }
    ASSERT_TRUE(c_->grid().complete());
  }
  uint64_t At(int stage) const { return c_->grid().at(stage, 0); }
  const JoinResult& Session(uint64_t id) const {
    for (const auto& [name, j] : joined_) {
      if (j.peer_id == id) return j;
    }
    ADD_FAILURE() << "no peer " << id;
    return joined_.begin()->second;
  }
  // Peer at `stage` blames its neighbour on `link` under the current plan.
  BlameAnswer Blame(int stage, v1::Blame::Link link, v1::Blame::Kind kind, std::optional<uint64_t> plan = {}) {
    v1::Blame b;
    b.set_kind(kind);
    b.set_link(link);
    b.set_reason(kind == v1::Blame::REFUSED ? "activation_invalid" : "timeout");
    b.set_step(4);
    b.set_peer_id(At(stage + (link == v1::Blame::UPSTREAM ? -1 : 1)));
    b.set_plan(plan.value_or(c_->grid().plan_version));
    const JoinResult& j = Session(At(stage));
    absl::StatusOr<BlameAnswer> a = c_->ReportBlame(j.peer_id, j.session_token, b);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? *a : BlameAnswer{};
  }
  int StrikesOf(uint64_t id) const {
    const v1::StatusResponse st = c_->GetStatus();
    for (const auto& p : st.peers()) {
      if (p.peer_id() == id) return static_cast<int>(p.strikes());
    }
    return -1;
  }
  // Settles once blame_settle has passed.
  void Settle() {
    clock_.Advance(absl::Seconds(3));
    absl::StatusOr<bool> s = c_->SettleBlames();
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(*s);
  }

  std::unique_ptr<SwarmCoordinator> c_;
  std::map<std::string, JoinResult> joined_;
  std::map<uint64_t, std::string> state_address_;
};

TEST_F(BlameTest, ARefusedFrameStrikesItsSenderAndRestartsThePlanWithEveryPeerInItsSlot) {
  Start(2, 1);
  const Grid before = c_->grid();
  const uint64_t sender = At(0);
  BlameAnswer a = Blame(1, v1::Blame::UPSTREAM, v1::Blame::REFUSED);
  EXPECT_TRUE(a.recorded);
  EXPECT_EQ(a.plan_version, before.plan_version);
  // The sender's own stage saw its link drop: no evidence against the victim.
  Blame(0, v1::Blame::DOWNSTREAM, v1::Blame::LINK_LOST);
  absl::StatusOr<bool> early = c_->SettleBlames();
  ASSERT_TRUE(early.ok());
  EXPECT_FALSE(*early) << "settled before blame_settle passed";
  Settle();
  const Grid after = c_->grid();
  EXPECT_EQ(after.slots, before.slots) << "a restart keeps every peer in its slot";
  EXPECT_EQ(after.plan_version, before.plan_version + 1);
  EXPECT_EQ(StrikesOf(sender), 1);
  EXPECT_EQ(StrikesOf(At(1)), 0);
  // A report about the plan that is gone is ignored.
  EXPECT_FALSE(Blame(1, v1::Blame::UPSTREAM, v1::Blame::REFUSED, before.plan_version).recorded);
  absl::StatusOr<bool> none = c_->SettleBlames();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(*none);
}

TEST_F(BlameTest, ThreeStrikesEvictTheOffenderTheStandbyTakesItsSlotAndItsJoinsAreRefused) {
  Start(2, 1);
  const uint64_t sender = At(0), victim = At(1);
  std::string sender_name;
  for (const auto& [name, j] : joined_) {
    if (j.peer_id == sender) sender_name = name;
  }
  for (int i = 0; i < 3; ++i) {
    Blame(1, v1::Blame::UPSTREAM, v1::Blame::REFUSED);
    Settle();
  }
  const v1::StatusResponse st = c_->GetStatus();
  EXPECT_EQ(st.evictions(), 1u);
  EXPECT_EQ(c_->num_members(), 2u);
  EXPECT_TRUE(c_->grid().complete()) << "the standby fills the evicted peer's slot";
  EXPECT_NE(At(0), sender);
  EXPECT_EQ(At(1), victim) << "the victim kept its slot throughout";
  EXPECT_TRUE(absl::IsNotFound(c_->Heartbeat(sender, joined_[sender_name].session_token).status()));
  absl::Status again;
  EXPECT_EQ(Counted(Refusal::kJoinEvicted, [&] {
              JoinParams p = JoinAs(clock_, sender_name);
              p.previous_session_token = joined_[sender_name].session_token;
              again = c_->Join(p).status();
            }),
            1);
  EXPECT_TRUE(absl::IsPermissionDenied(again)) << again;
  EXPECT_THAT(again.message(), HasSubstr("evicted"));
  // After the hold (10 min by default) it may come back, with no strikes.
  clock_.Advance(absl::Minutes(11));
  JoinParams p = JoinAs(clock_, sender_name);
  p.previous_session_token = joined_[sender_name].session_token;
  absl::StatusOr<JoinResult> back = c_->Join(p);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(StrikesOf(back->peer_id), 0);
}

// A lost link alone accuses nobody: the settle waits a lease, so a killed
// peer's expiry re-plans it away (one new plan, not a restart first), and
// only a peer still heartbeating then gets its plan restarted, unstruck.
TEST_F(BlameTest, ALostLinkAloneWaitsALeaseSoADeadPeerExpiresAndALiveOneRestartsUnstruck) {
  Start(2, 1);
  const Grid before = c_->grid();
  const uint64_t dead = At(0);
  auto heartbeat_all_but = [&](uint64_t skip) {
    for (const auto& [name, j] : joined_) {
      if (j.peer_id != skip) {
        ASSERT_TRUE(c_->Heartbeat(j.peer_id, j.session_token).ok()) << name;
      }
    }
  };
  Blame(1, v1::Blame::UPSTREAM, v1::Blame::LINK_LOST);
  clock_.Advance(absl::Seconds(3));
  heartbeat_all_but(dead);
  absl::StatusOr<bool> early = c_->SettleBlames();
  ASSERT_TRUE(early.ok());
  EXPECT_FALSE(*early) << "restarted before the accused's lease could run out";
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Seconds(2));
    heartbeat_all_but(dead);
  }
  absl::StatusOr<std::vector<uint64_t>> expired = c_->ExpireLeases();
  ASSERT_TRUE(expired.ok());
  EXPECT_THAT(*expired, ::testing::ElementsAre(dead));
  absl::StatusOr<bool> after_expiry = c_->SettleBlames();
  ASSERT_TRUE(after_expiry.ok());
  EXPECT_FALSE(*after_expiry) << "the expiry's re-plan settles the lost link";
  EXPECT_EQ(c_->grid().plan_version, before.plan_version + 1) << "one new plan for one loss";
  EXPECT_TRUE(c_->grid().complete()) << "the standby takes the dead peer's slot";

  // The same loss with the accused alive: a restart after a lease, no strike.
  const Grid replanned = c_->grid();
  const uint64_t alive = At(0);
  Blame(1, v1::Blame::UPSTREAM, v1::Blame::LINK_LOST);
  for (int i = 0; i < 5; ++i) {
    clock_.Advance(absl::Seconds(2));
    heartbeat_all_but(dead);
  }
  absl::StatusOr<std::vector<uint64_t>> none = c_->ExpireLeases();
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  absl::StatusOr<bool> restarted = c_->SettleBlames();
  ASSERT_TRUE(restarted.ok());
  EXPECT_TRUE(*restarted);
  EXPECT_EQ(c_->grid().slots, replanned.slots);
  EXPECT_EQ(c_->grid().plan_version, replanned.plan_version + 1);
  EXPECT_EQ(StrikesOf(alive), 0);
}

// A lost link gets the accused's own server asked whether its process is
// gone: once per plan, and only a refusal removes it (the standby takes the
// slot at once, no lease waited out); one that answers keeps its slot.
TEST_F(BlameTest, ALostLinksAccusedThatRefusesConnectionsIsRemovedAtOnceAndOneThatAnswersStays) {
  Start(2, 1);
  const Grid before = c_->grid();
  const uint64_t alive = At(0);
  std::vector<std::string> asked;
  auto answers = [&](absl::string_view address) {
    asked.emplace_back(address);
    return false;
  };
  auto none = c_->RemoveRefusingSuspects(answers);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(asked.empty()) << "nobody is asked without a lost link";
  Blame(1, v1::Blame::UPSTREAM, v1::Blame::LINK_LOST);
  auto kept = c_->RemoveRefusingSuspects(answers);
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(kept->empty());
  EXPECT_THAT(asked, ::testing::ElementsAre(state_address_[alive])) << "the accused's state server";
  ASSERT_TRUE(c_->RemoveRefusingSuspects(answers).ok());
  EXPECT_EQ(asked.size(), 1u) << "asked once per plan";
  EXPECT_EQ(c_->grid().slots, before.slots);

  // Under the next plan the same loss, and its server refuses: removed now.
  for (int i = 0; i < 6; ++i) {  // a lease later the live accused's plan restarts
    clock_.Advance(absl::Seconds(2));
    for (const auto& [name, j] : joined_) ASSERT_TRUE(c_->Heartbeat(j.peer_id, j.session_token).ok()) << name;
  }
  absl::StatusOr<bool> restarted = c_->SettleBlames();
  ASSERT_TRUE(restarted.ok());
  EXPECT_TRUE(*restarted);
  const uint64_t plan = c_->grid().plan_version;
  Blame(1, v1::Blame::UPSTREAM, v1::Blame::LINK_LOST);
  auto gone = c_->RemoveRefusingSuspects([](absl::string_view) { return true; });
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_THAT(*gone, ::testing::ElementsAre(alive));
  EXPECT_EQ(c_->grid().plan_version, plan + 1);
  EXPECT_TRUE(c_->grid().complete()) << "the standby takes the slot";
  EXPECT_FALSE(c_->grid().Find(alive).has_value());
  EXPECT_EQ(StrikesOf(At(0)), 0);
}

TEST_F(BlameTest, InAChainOfSilentStagesOnlyTheStageThatBlamesNobodyIsStruck) {
  Start(3, 0);
  // s0 stops sending: s1 times out on it, and s2 times out on s1.
  Blame(2, v1::Blame::UPSTREAM, v1::Blame::SILENT);
  Blame(1, v1::Blame::UPSTREAM, v1::Blame::SILENT);
  Settle();
  EXPECT_EQ(StrikesOf(At(0)), 1);
  EXPECT_EQ(StrikesOf(At(1)), 0);
  EXPECT_EQ(StrikesOf(At(2)), 0);
  // Two stages refusing each other's frames: contested, nobody is struck,
  // the plan still restarts.
  const uint64_t plan = c_->grid().plan_version;
  Blame(1, v1::Blame::DOWNSTREAM, v1::Blame::REFUSED);
  Blame(2, v1::Blame::UPSTREAM, v1::Blame::REFUSED);
  Settle();
  EXPECT_EQ(StrikesOf(At(1)), 0);
  EXPECT_EQ(StrikesOf(At(2)), 0);
  EXPECT_EQ(c_->grid().plan_version, plan + 1);
}

TEST_F(BlameTest, OnlyTheReportersNeighbourCanBeBlamedAndStrikesDecay) {
  Start(3, 0);
  const JoinResult& s2 = Session(At(2));
  v1::Blame far;
  far.set_kind(v1::Blame::REFUSED);
  far.set_link(v1::Blame::UPSTREAM);
  far.set_peer_id(At(0));  // two stages up: not the peer on that link
  far.set_plan(c_->grid().plan_version);
  absl::StatusOr<BlameAnswer> a = c_->ReportBlame(s2.peer_id, s2.session_token, far);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->recorded);
  EXPECT_TRUE(absl::IsUnauthenticated(c_->ReportBlame(s2.peer_id, "wrong", far).status()));
  v1::Blame long_reason = far;
  long_reason.set_reason(std::string(kMaxBlameReason + 1, 'x'));
  EXPECT_TRUE(absl::IsInvalidArgument(c_->ReportBlame(s2.peer_id, s2.session_token, long_reason).status()));
  Blame(1, v1::Blame::UPSTREAM, v1::Blame::REFUSED);
  Settle();
  EXPECT_EQ(StrikesOf(At(0)), 1);
  // Heartbeats keep the members; 31 quiet minutes clear the strike.
  for (int i = 0; i < 31 * 12; ++i) {
    clock_.Advance(absl::Seconds(5));
    for (const auto& [name, j] : joined_) ASSERT_TRUE(c_->Heartbeat(j.peer_id, j.session_token).ok());
  }
  EXPECT_EQ(StrikesOf(At(0)), 0);
}

}  // namespace
}  // namespace aqswarm::coordinator
