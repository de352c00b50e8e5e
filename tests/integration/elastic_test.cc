// Blame, not suicide: a real `aqswarm coordinator` and real `aqswarm peer`
// daemons on 127.0.0.1, one of them misbehaving through a test fault
// injection (stage/step_protocol.cc): it sends one malformed frame per plan,
// goes silent mid-run, or never opens its links, while its daemon keeps
// heartbeating. Its honest neighbour
// refuses the frame (or times out), blames it, keeps its slot and restarts
// with the plan the coordinator settles; after 3 strikes the offender is
// evicted, the standby takes its slot and the honest peer's step counter
// keeps rising. A straggler is caught by the adaptive deadline within a
// step. `ctest -L elastic`.
#include "absl/strings/match.h"
#include "tests/integration/swarm_fixture.h"

namespace aqswarm {
namespace {

class ElasticTest : public SwarmTest {
 protected:
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

}  // namespace
}  // namespace aqswarm
