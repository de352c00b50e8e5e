// StateKeeper over real StateTransfer servers on loopback: what it holds and
// serves, what a new plan prunes, fetching the state an assignment resumes
// from, and mirroring another peer's stage after each of our checkpoints.
#include "peer/state_keeper.h"

#include <filesystem>
#include <fstream>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "peer/stage_checkpoints.h"
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
    std::ofstream(StageCheckpointPath(keeper->StageDir(stage), step)) << bytes;
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
  EXPECT_THAT(held[0].steps(), ElementsAre(2, 4, 6));
  EXPECT_THAT(held[1].steps(), ElementsAre(4));

  v1::StateRequest r;
  r.set_job_name("job");
  r.set_stage(0);
  ASSERT_OK_AND_ASSIGN(StateSnapshot newest, p.keeper->Serve(r));  // step 0: the newest
  EXPECT_EQ(newest.step, 6u);
  EXPECT_EQ(newest.bytes, "s0@6");
  r.set_step(5);
  EXPECT_THAT(p.keeper->Serve(r), StatusIs(absl::StatusCode::kNotFound, HasSubstr("step 5")));
  r.set_job_name("another");
  EXPECT_THAT(p.keeper->Serve(r), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another")));

  EXPECT_TRUE(p.keeper->Follow(At(1, 0, 4)));   // a new plan resuming at 4: 6 is gone
  EXPECT_THAT(StageCheckpointSteps(p.keeper->StageDir(0)), ElementsAre(2, 4));
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
  EXPECT_EQ(Read(StageCheckpointPath(me.keeper->StageDir(1), 3)), "its stage-1 after 3");
  ASSERT_OK_AND_ASSIGN(const std::vector<int64_t> pins, ReadStageCheckpointPins(me.keeper->StageDir(0)));
  EXPECT_THAT(pins, ElementsAre(3)) << "our own state of the copied step stays";
}

}  // namespace
}  // namespace aqswarm::peer
