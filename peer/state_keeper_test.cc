// StateKeeper over real StateTransfer servers on loopback: what it holds and
// serves, what a new plan prunes, fetching the state an assignment resumes
// from, and mirroring another peer's stage after each of our checkpoints.
#include "peer/state_keeper.h"

#include <filesystem>
#include <fstream>

#include "absl/synchronization/mutex.h"
#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "stage/stage_checkpoints.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm::peer {
namespace {

using ::aqswarm::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A keeper with a StateTransfer server in front of it, as a peer has.
struct Peer {
  explicit Peer(const std::string& work_dir) {
    StateKeeper::Options o;
    o.work_dir = work_dir;
    o.keep_checkpoints = 4;
    o.copy_wait = absl::Seconds(20);
    keeper = std::make_unique<StateKeeper>(
        o,
        [this](const v1::PeerEvent& e) {
          absl::MutexLock l(&mu);
          events.push_back(e);
        },
        [this] {
          absl::MutexLock l(&mu);
          ++copies_reported;
          return true;
        });
    keeper->SetJob("job");
    server = *StateTransferServer::Start("127.0.0.1:0", [this](const v1::StateRequest& r) { return keeper->Serve(r); });
  }
  ~Peer() {
    keeper->Stop();
    server.reset();
  }
  void Write(uint32_t stage, int64_t step, const std::string& bytes) {
    std::filesystem::create_directories(keeper->StageDir(stage));
    std::ofstream(stage::StageCheckpointPath(keeper->StageDir(stage), step)) << bytes;
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", server->port()); }
  v1::Neighbor AsNeighbor(uint32_t stage) const {
    v1::Neighbor n;
    n.set_peer_name("holder");
    n.set_stage(stage);
    n.set_state_transfer_address(address());
    return n;
  }

  std::unique_ptr<StateKeeper> keeper;
  std::unique_ptr<StateTransferServer> server;
  absl::Mutex mu;
  std::vector<v1::PeerEvent> events ABSL_GUARDED_BY(mu);
  int copies_reported ABSL_GUARDED_BY(mu) = 0;
};

v1::Assignment At(uint64_t plan, uint32_t stage, int64_t resume) {
  v1::Assignment a;
  a.set_role(v1::Assignment::STAGE);
  a.set_plan_version(plan);
  a.set_stage(stage);
  a.set_resume_step(resume);
  return a;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(StateKeeperTest, HoldsServesAndANewPlanPrunesTheAbandonedTimeline) {
  testing::ScratchDir dir;
  Peer p(dir.Sub("p"));
  for (int64_t s : {2, 4, 6}) p.Write(0, s, absl::StrCat("s0@", s));
  p.Write(1, 4, "s1@4");
  const std::vector<v1::StageCheckpoints> held = p.keeper->Held();
  ASSERT_EQ(held.size(), 2u);
  // Each state with its SHA-256.
  auto states = [](const v1::StageCheckpoints& c) {
    std::vector<std::pair<int64_t, std::string>> out;
    for (const v1::HeldState& h : c.states()) out.emplace_back(h.step(), h.sha256());
    return out;
  };
  EXPECT_THAT(states(held[0]), ElementsAre(std::pair<int64_t, std::string>{2, Sha256Hex("s0@2")},
                                           std::pair<int64_t, std::string>{4, Sha256Hex("s0@4")},
                                           std::pair<int64_t, std::string>{6, Sha256Hex("s0@6")}));
  EXPECT_THAT(states(held[1]), ElementsAre(std::pair<int64_t, std::string>{4, Sha256Hex("s1@4")}));

  v1::StateRequest r;
  r.set_job_name("job");
  r.set_stage(0);
  ASSERT_OK_AND_ASSIGN(StateSnapshot newest, p.keeper->Serve(r));  // step 0: the newest
  EXPECT_EQ(newest.step, 6u);
  EXPECT_EQ(Read(newest.path), "s0@6");  // streamed from the file
  r.set_step(5);
  EXPECT_THAT(p.keeper->Serve(r), StatusIs(absl::StatusCode::kNotFound, HasSubstr("step 5")));
  r.set_job_name("another");
  EXPECT_THAT(p.keeper->Serve(r), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another")));

  EXPECT_TRUE(p.keeper->Follow(At(1, 0, 4)));   // a new plan resuming at 4: 6 is set aside
  EXPECT_THAT(stage::StageCheckpointSteps(p.keeper->StageDir(0)), ElementsAre(2, 4));
  const std::vector<std::string> quarantined = stage::QuarantinedStates(p.keeper->StageDir(0));
  ASSERT_EQ(quarantined.size(), 1u);
  EXPECT_EQ(Read(stage::StageQuarantineDir(p.keeper->StageDir(0)) + "/" + quarantined[0]), "s0@6");
  EXPECT_FALSE(p.keeper->Follow(At(1, 0, 4)));  // the same plan again: nothing pruned
}

TEST(StateKeeperTest, PrepareUsesAKeptStateOrFetchesItFromAHolder) {
  testing::ScratchDir dir;
  Peer holder(dir.Sub("holder")), joiner(dir.Sub("joiner"));
  holder.Write(1, 8, "stage-1 after 8 steps");
  ASSERT_OK_AND_ASSIGN(const std::string fresh, joiner.keeper->Prepare(At(1, 1, 0)));
  EXPECT_EQ(fresh, "") << "step 0 starts fresh";
  v1::Assignment a = At(1, 1, 8);
  EXPECT_THAT(joiner.keeper->Prepare(a), StatusIs(absl::StatusCode::kNotFound, HasSubstr("stage 1 at step 8")));
  *a.add_state_sources() = holder.AsNeighbor(1);
  ASSERT_OK_AND_ASSIGN(const std::string path, joiner.keeper->Prepare(a));
  EXPECT_EQ(Read(path), "stage-1 after 8 steps");
  absl::MutexLock l(&joiner.mu);
  ASSERT_EQ(joiner.events.size(), 1u);
  EXPECT_EQ(joiner.events[0].state_fetched().from(), "holder");
  EXPECT_EQ(joiner.events[0].state_fetched().bytes(), 21u);
}

// A source whose bytes are not the state its holders reported is refused
// (DATA_LOSS naming both digests) and the next one used; a kept state of
// the step that is not the swarm's is quarantined and fetched instead.
TEST(StateKeeperTest, AStateWhoseSha256DiffersFromTheReportedOneIsRefusedAndAnotherSourceUsed) {
  testing::ScratchDir dir;
  Peer liar(dir.Sub("liar")), honest(dir.Sub("honest")), joiner(dir.Sub("joiner"));
  liar.Write(1, 8, "forged stage-1 after 8");
  honest.Write(1, 8, "stage-1 after 8 steps");
  const std::string reported = Sha256Hex("stage-1 after 8 steps");
  v1::Assignment a = At(1, 1, 8);
  a.set_state_sha256(reported);
  *a.add_state_sources() = liar.AsNeighbor(1);
  EXPECT_THAT(joiner.keeper->Prepare(a),
              StatusIs(absl::StatusCode::kNotFound, ::testing::AllOf(HasSubstr(reported),
                                                                     HasSubstr(Sha256Hex("forged stage-1 after 8")))));
  EXPECT_TRUE(stage::StageCheckpointSteps(joiner.keeper->StageDir(1)).empty()) << "the forged state was kept";
  *a.add_state_sources() = honest.AsNeighbor(1);
  ASSERT_OK_AND_ASSIGN(const std::string path, joiner.keeper->Prepare(a));
  EXPECT_EQ(Read(path), "stage-1 after 8 steps");
  ASSERT_EQ(joiner.keeper->Held()[0].states_size(), 1);
  EXPECT_EQ(joiner.keeper->Held()[0].states(0).sha256(), reported);

  // Our own state of step 8 from another timeline: quarantined, the swarm's fetched.
  Peer other(dir.Sub("other"));
  other.Write(1, 8, "another timeline's stage-1 after 8");
  v1::Assignment b = At(1, 1, 8);
  b.set_state_sha256(reported);
  *b.add_state_sources() = honest.AsNeighbor(1);
  ASSERT_OK_AND_ASSIGN(const std::string path2, other.keeper->Prepare(b));
  EXPECT_EQ(Read(path2), "stage-1 after 8 steps");
  EXPECT_EQ(stage::QuarantinedStates(other.keeper->StageDir(1)).size(), 1u);
}

// A sender declaring more than the stage's bound is refused before a byte is kept.
TEST(StateKeeperTest, AStateOverTheStagesBoundIsRefused) {
  testing::ScratchDir dir;
  Peer holder(dir.Sub("holder")), joiner(dir.Sub("joiner"));
  holder.Write(1, 8, std::string(1000, 'x'));
  joiner.keeper->SetMaxStateBytes({0, 999});
  v1::Assignment a = At(1, 1, 8);
  *a.add_state_sources() = holder.AsNeighbor(1);
  EXPECT_THAT(joiner.keeper->Prepare(a), StatusIs(absl::StatusCode::kNotFound, HasSubstr("999")));
  EXPECT_TRUE(stage::StageCheckpointSteps(joiner.keeper->StageDir(1)).empty());
  joiner.keeper->SetMaxStateBytes({0, 1000});
  EXPECT_TRUE(joiner.keeper->Prepare(a).ok());
}

TEST(StateKeeperTest, AMirrorCopiesTheMirroredStageAfterOurCheckpointAndPinsOurs) {
  testing::ScratchDir dir;
  Peer mirrored(dir.Sub("mirrored")), me(dir.Sub("me"));
  v1::Assignment a = At(1, 0, 0);
  *a.mutable_mirror() = mirrored.AsNeighbor(1);
  me.keeper->Follow(a);
  me.Write(0, 3, "my stage-0 after 3");
  me.keeper->Checkpointed(3);  // wanted before the mirrored peer has it: the copy waits
  mirrored.Write(1, 3, "its stage-1 after 3");
  {
    absl::MutexLock l(&me.mu);
    auto copied = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(me.mu) { return me.copies_reported == 1 && !me.events.empty(); };
    ASSERT_TRUE(me.mu.AwaitWithTimeout(absl::Condition(&copied), absl::Seconds(30)));
    EXPECT_EQ(me.events.back().mirrored().step(), 3);
    EXPECT_TRUE(me.events.back().mirrored().reported());
  }
  EXPECT_EQ(Read(stage::StageCheckpointPath(me.keeper->StageDir(1), 3)), "its stage-1 after 3");
  ASSERT_OK_AND_ASSIGN(const std::vector<int64_t> pins, stage::ReadStageCheckpointPins(me.keeper->StageDir(0)));
  EXPECT_THAT(pins, ElementsAre(3)) << "our own state of the copied step stays";
}

}  // namespace
}  // namespace aqswarm::peer
