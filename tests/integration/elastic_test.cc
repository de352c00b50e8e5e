// Blame, not suicide: a real `aqswarm coordinator` and real `aqswarm peer`
// daemons on 127.0.0.1, one of them misbehaving through a test fault
// injection (stage/step_protocol.cc): it sends one malformed frame per plan,
// goes silent mid-run, or never opens its links, while its daemon keeps
// heartbeating. Its honest neighbour
// refuses the frame (or times out), blames it, keeps its slot and restarts
// with the plan the coordinator settles; after 3 strikes the offender is
// evicted, the standby takes its slot and the honest peer's step counter
// keeps rising. A straggler is caught by the adaptive deadline within a
// step. Under fault domains a dead peer (killed, or dying mid outer step)
// stops only its own pipeline, which heals from the other. `ctest -L elastic`.
#include <map>

#include "absl/strings/match.h"
#include "tests/integration/swarm_fixture.h"

namespace aqswarm {
namespace {

class ElasticTest : public SwarmTest {
 protected:
  // Fault domains: see the definition.
  void ExpectOnlyTheHitPipelineStops(bool mid_exchange);

  // Events of `peer` that `pred` accepts.
  int CountEvents(const std::string& peer, const std::function<bool(const v1::PeerEvent&)>& pred) {
    int n = 0;
    for (absl::string_view line : absl::StrSplit(Out(peer), '\n')) {
      absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
      if (e.ok() && pred(*e)) ++n;
    }
    return n;
  }

  // A 2-stage x 1 job (the coordinator mirrors checkpoints, so a stage's
  // state outlives its peer): "offender" joins with `fault`, then "honest";
  // once they train, "standby" joins. The offender is struck 3 times and
  // evicted, the standby takes its slot, and training goes on.
  void ExpectTheOffenderEvicted(const std::string& fault, v1::Blame::Kind kind) {
    WriteJob(21, R"("dataParallel":1,"checkpointEverySteps":2)");
    StartCoordinator({"--mirror_checkpoints"});
    const std::string token = Token();
    StartPeer("offender", token, "", fault);
    StartPeer("honest", token);
    ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.peers_size() == 2; }, absl::Seconds(60)))
        << Logs();
    StartPeer("standby", token);
    ASSERT_TRUE(WaitFor(
        [](const auto& st) {
          if (st.evictions() < 1) return false;
          for (const auto& p : st.peers()) {
            if (p.peer_name() == "standby" && p.state() == v1::PeerStatus::ACTIVE) return true;
          }
          return false;
        },
        absl::Seconds(240)))
        << "the offender was not evicted, or the standby did not take its slot" << Logs();
    for (const auto& p : status_.peers()) EXPECT_NE(p.peer_name(), "offender");
    const int64_t evicted_at = status_.step();
    // Liveness: the honest side trains on past the eviction.
    ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= evicted_at + 6; }, absl::Seconds(120)))
        << "training did not go on after the eviction (step " << status_.step() << ")" << Logs();

    // The honest peer kept its slot: it never left or rejoined, and it
    // blamed each of the offender's 3 offences on it.
    auto is = [](auto member) { return [member](const v1::PeerEvent& e) { return (e.*member)(); }; };
    EXPECT_EQ(CountEvents("honest", is(&v1::PeerEvent::has_left)), 0);
    EXPECT_EQ(CountEvents("honest", is(&v1::PeerEvent::has_rejoin)), 0);
    const int blamed = CountEvents("honest", [&](const v1::PeerEvent& e) {
      return e.has_blame_reported() && e.blame_reported().outcome() == "RECORDED" &&
             e.blame_reported().blame().kind() == kind && e.blame_reported().blame().peer_name() == "offender";
    });
    EXPECT_EQ(blamed, 3) << Out("honest");
    // The evicted daemon is told why and stops.
    absl::StatusOr<int> code = peers_.at("offender")->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << "the evicted peer did not stop";
    EXPECT_NE(*code, 0);
    std::ifstream err(dir_ / "offender.err");
    EXPECT_THAT(std::string(std::istreambuf_iterator<char>(err), {}), ::testing::HasSubstr("evicted"));
    TerminatePeersExcept("offender");
  }
};

TEST_F(ElasticTest, APeerSendingBadFramesIsBlamedAndEvictedWhileItsVictimKeepsItsSlotAndTrains) {
  ExpectTheOffenderEvicted("AQSWARM_TEST_FAULT_BAD_FRAME_AT_STEP=3", v1::Blame::REFUSED);
}

TEST_F(ElasticTest, ASilentPlacedPeerIsBlamedAndReplacedByTheStandby) {
  // How long a neighbour's silence takes to notice; also how long a stage
  // waits for its restarted neighbour to come up, so not too short.
  link_timeout_s_ = 8;
  ExpectTheOffenderEvicted("AQSWARM_TEST_FAULT_SILENT_AT_STEP=3", v1::Blame::SILENT);
}

TEST_F(ElasticTest, APlacedPeerThatNeverRunsItsStageIsBlamedAndReplacedByTheStandby) {
  link_timeout_s_ = 8;
  ExpectTheOffenderEvicted("AQSWARM_TEST_FAULT_SILENT_AT_STEP=0", v1::Blame::SILENT);
}

// A neighbour that stalls 8 s before each frame of one step, with a 20 s
// link timeout: the honest stage's adaptive deadline (8 x its recent p99,
// at least 5 s) catches it within that step and blames it as slow; the
// restarted plan trains on (the fresh stages have no history yet, so they
// wait the stall out, the straggler is not struck again) and it is not evicted.
TEST_F(ElasticTest, AStragglerIsCaughtByTheAdaptiveDeadlineWithinAStepAndTrainingGoesOn) {
  WriteJob(23, R"("dataParallel":1,"checkpointEverySteps":2)");
  peer_flags_ = " --adaptive_deadline";
  StartCoordinator();
  const std::string token = Token();
  StartPeer("offender", token, "", "AQSWARM_TEST_FAULT_SLOW_AT_STEP=12:8000");
  StartPeer("honest", token);
  ASSERT_TRUE(WaitFor(
      [](const auto& st) {
        for (const auto& p : st.peers()) {
          if (p.peer_name() == "offender" && p.strikes() == 1) return true;
        }
        return false;
      },
      absl::Seconds(120)))
      << "the straggler was not struck" << Logs();
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.step() >= 16; }, absl::Seconds(180)))
      << "training did not go past the straggler's step (step " << status_.step() << ")" << Logs();
  EXPECT_EQ(status_.evictions(), 0u);
  const int slow = CountEvents("honest", [](const v1::PeerEvent& e) {
    return e.has_blame_reported() && e.blame_reported().blame().reason() == "slow" &&
           e.blame_reported().blame().kind() == v1::Blame::SILENT &&
           e.blame_reported().blame().peer_name() == "offender" && e.blame_reported().blame().step() == 12;
  });
  EXPECT_EQ(slow, 1) << Out("honest");
  EXPECT_TRUE(HasEvent(Out("honest"), [](const v1::PeerEvent& e) {
    return absl::StrContains(e.stage().error().message(), "adaptive deadline");
  })) << Out("honest");
  EXPECT_EQ(CountEvents("honest", [](const v1::PeerEvent& e) { return e.has_rejoin(); }), 0);
  TerminatePeersExcept("");
}

// Fault domains (coordinator --fault_domains): DiLoCo (8 inner steps) over
// 2 stages x 2 pipelines + a standby; one placed peer dies, either SIGKILLed
// just after an outer step or by itself in the middle of an outer step's
// exchange (AQSWARM_TEST_FAULT_DIE_IN_EXCHANGE_AT_STEP: after it took a
// replica's contribution). Only its pipeline stops: the other pipeline's
// stages never restart and their step counters never go back (after a
// plain kill they keep rising while the standby takes the slot); the hit
// pipeline heals from the kept pipeline's newest states (the shared anchor)
// and at every outer step after, the two pipelines' replicas hold
// bit-identical shared parameters.
void ElasticTest::ExpectOnlyTheHitPipelineStops(bool mid_exchange) {
  WriteJob(25, R"("dataParallel":2,"checkpointEverySteps":50,)"
                 R"("dp":{"optimizer":"diloco","innerSteps":8,"bits":4,"bucketSize":512})");
  StartCoordinator({"--fault_domains"});
  const std::string token = Token();
  StartPeer("p1", token, "", mid_exchange ? "AQSWARM_TEST_FAULT_DIE_IN_EXCHANGE_AT_STEP=23" : "");
  for (const char* n : {"p2", "p3", "p4"}) StartPeer(n, token);
  auto step_of = [](const v1::StatusResponse& st, int j, int p) -> int64_t {
    const v1::PeerStatus* x = At(st, j, p);
    return x == nullptr ? -1 : x->progress().step();
  };
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.peers_size() == 4; }, absl::Seconds(120)))
      << Logs();
  StartPeer("p5", token);  // the standby
  int victim_pipeline = 1;
  std::string victim;
  if (mid_exchange) {
    victim = "p1";
    for (const auto& p : status_.peers()) {
      if (p.peer_name() == victim) victim_pipeline = p.pipeline();
    }
  } else {
    // Just past an outer step of the kept pipeline, so it has inner steps
    // to train while the other heals.
    ASSERT_TRUE(WaitFor(
        [&](const auto& st) {
          const int64_t s = step_of(st, 1, 0);
          return st.peers_size() == 5 && s >= 9 && s % 8 >= 1 && s % 8 <= 3;
        },
        absl::Seconds(240)))
        << "the swarm did not train past its first outer step" << Logs();
    victim = At(status_, 1, 1)->peer_name();
  }
  const int kept = 1 - victim_pipeline;
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.peers_size() == 5; }, absl::Seconds(60))) << Logs();
  const std::string kept0 = At(status_, 0, kept)->peer_name();
  const std::string kept1 = At(status_, 1, kept)->peer_name();
  const std::string standby = "p5";
  int64_t at_kill = 0;
  if (mid_exchange) {
    absl::StatusOr<int> code = peers_.at(victim)->Wait(absl::Seconds(240));
    ASSERT_TRUE(code.ok()) << "the peer did not die in its exchange" << Logs();
    at_kill = 23;
  } else {
    at_kill = step_of(status_, 1, kept);
    peers_.at(victim)->Signal(SIGKILL);
  }

  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        bool seated = false;
        for (const auto& p : st.peers()) seated |= p.peer_name() == standby && p.state() == v1::PeerStatus::ACTIVE;
        return st.grid_complete() && st.peers_size() == 4 && seated;
      },
      absl::Seconds(30)))
      << "the standby was not placed: " << status_.DebugString() << Logs();
  EXPECT_EQ(At(status_, 0, kept)->peer_name(), kept0);
  EXPECT_EQ(At(status_, 1, kept)->peer_name(), kept1);
  if (!mid_exchange) {
    EXPECT_GT(step_of(status_, 1, kept), at_kill) << "the kept pipeline did not train while the other lost its peer";
  }
  // Both pipelines train on, through two more outer steps.
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) { return step_of(st, 1, victim_pipeline) >= at_kill + 18 && step_of(st, 1, kept) >= at_kill + 18; },
      absl::Seconds(240)))
      << "training did not go on in both pipelines (steps " << step_of(status_, 1, kept) << ", "
      << step_of(status_, 1, victim_pipeline) << ")" << Logs();

  // The kept pipeline ran one stage process per peer, its steps only went forward.
  std::map<std::pair<uint32_t, uint32_t>, std::string> outer_hash;  // (stage, step) -> the kept pipeline's
  for (const std::string& name : {kept0, kept1}) {
    EXPECT_EQ(CountEvents(name, [](const v1::PeerEvent& e) { return e.has_stage_started(); }), 1) << Out(name);
    int64_t last = -1;
    for (absl::string_view line : absl::StrSplit(Out(name), '\n')) {
      absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
      if (!e.ok() || !e->stage().has_step()) continue;
      const v1::StepEvent& step = e->stage().step();
      EXPECT_GT(int64_t{step.step()}, last) << name << " went back";
      last = step.step();
      if (step.dp().kind() == "outer") outer_hash[{step.stage(), step.step()}] = step.dp().param_hash();
    }
  }
  EXPECT_TRUE(HasEvent(Out(standby), [&](const v1::PeerEvent& e) {
    return e.has_state_fetched() && (e.state_fetched().from() == kept0 || e.state_fetched().from() == kept1);
  })) << "the standby should have healed from the kept pipeline's peer of its stage" << Out(standby);
  int compared = 0;
  for (int stage = 0; stage < 2; ++stage) {
    const std::string healed = At(status_, stage, victim_pipeline)->peer_name();
    for (absl::string_view line : absl::StrSplit(Out(healed), '\n')) {
      absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
      if (!e.ok() || !e->stage().has_step() || e->stage().step().dp().kind() != "outer") continue;
      const v1::StepEvent& step = e->stage().step();
      if (step.step() < at_kill) continue;  // the first incarnation's
      auto it = outer_hash.find({step.stage(), step.step()});
      if (it == outer_hash.end()) continue;
      EXPECT_EQ(step.dp().param_hash(), it->second) << healed << " at step " << step.step();
      ++compared;
    }
  }
  EXPECT_GE(compared, 4) << "too few outer steps of the healed pipeline to compare";
  TerminatePeersExcept(victim);
}

TEST_F(ElasticTest, AKilledPeerStopsOnlyItsPipelineWhichHealsFromALiveReplica) {
  ExpectOnlyTheHitPipelineStops(/*mid_exchange=*/false);
}

TEST_F(ElasticTest, APeerThatDiesInAnOuterStepsExchangeStopsOnlyItsPipeline) {
  ExpectOnlyTheHitPipelineStops(/*mid_exchange=*/true);
}

}  // namespace
}  // namespace aqswarm
