#include "peer/swarm_states.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "peer/fake_coordinator.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::peer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

void Serve(v1::PeerStatus* p, const std::string& address, uint32_t stage, std::vector<int64_t> steps) {
  p->set_state_transfer_address(address);
  v1::StageCheckpoints* h = p->add_held();
  h->set_stage(stage);
  for (int64_t s : steps) h->add_states()->set_step(s);
}

v1::StatusResponse TwoStageStatus() {
  v1::StatusResponse st;
  st.mutable_job()->set_name("live");
  st.mutable_job()->set_stages(2);
  Serve(st.add_peers(), "a:1", 0, {3, 4, 5});
  Serve(st.add_peers(), "b:1", 1, {2, 3, 4});
  Serve(st.add_peers(), "c:1", 1, {4, 5, 6});
  st.add_peers()->set_peer_name("no-state-server");
  return st;
}

TEST(SwarmStatesTest, PicksTheNewestStepEveryStageServesAndAllItsSources) {
  auto picked = PickSwarmStateSources(TwoStageStatus());
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ(picked->step, 5);
  EXPECT_THAT(picked->addresses, ElementsAre(ElementsAre("a:1"), ElementsAre("c:1")));
  EXPECT_THAT(picked->sha256, ElementsAre(ElementsAre(""), ElementsAre("")));
}

TEST(SwarmStatesTest, WithNoCommonStepTheErrorListsWhatEachStageServes) {
  v1::StatusResponse st;
  st.mutable_job()->set_name("live");
  st.mutable_job()->set_stages(2);
  Serve(st.add_peers(), "a:1", 0, {3});
  Serve(st.add_peers(), "b:1", 1, {4});
  auto picked = PickSwarmStateSources(st);
  EXPECT_TRUE(absl::IsFailedPrecondition(picked.status())) << picked.status();
  EXPECT_THAT(picked.status().message(), HasSubstr("stage 0: 3; stage 1: 4"));
  st.mutable_job()->set_stages(0);
  EXPECT_FALSE(PickSwarmStateSources(st).ok());
}

// Real StateTransfer servers: stage 1's first source has dropped step 5
// (peers keep only their newest states), so the second one serves it.
TEST(SwarmStatesTest, FetchesEveryStageOverStateTransferSkippingASourceThatDroppedTheStep) {
  auto serve = [](const std::string& tag, int64_t has_step) {
    return StateTransferServer::Start("127.0.0.1:0", [tag, has_step](const v1::StateRequest& r)
                                                         -> absl::StatusOr<StateSnapshot> {
      if (r.job_name() != "live") return absl::FailedPreconditionError("another job");
      if (r.step() != has_step) return absl::NotFoundError(absl::StrCat("no step ", r.step()));
      return StateSnapshot{absl::StrCat(tag, " stage ", r.stage(), " step ", r.step()),
                           static_cast<uint64_t>(r.step())};
    });
  };
  auto a = serve("a", 5), b = serve("b", 4), c = serve("c", 5);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  v1::StatusResponse st;
  st.mutable_job()->set_name("live");
  st.mutable_job()->set_stages(2);
  auto addr = [](const std::unique_ptr<StateTransferServer>& s) { return absl::StrCat("127.0.0.1:", s->port()); };
  Serve(st.add_peers(), addr(*a), 0, {5});
  Serve(st.add_peers(), addr(*b), 1, {4, 5});  // says 5, serves only 4 by now
  Serve(st.add_peers(), addr(*c), 1, {5});
  v1::JobSpec job;
  FakeCoordinator coordinator(job);
  coordinator.SetStatus(st);
  const aqswarm::testing::ScratchDir dir;
  auto model = FetchSwarmModel(coordinator, {}, dir.Sub("states"));
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->step, 5);
  EXPECT_EQ(model->job.name(), "live");
  ASSERT_EQ(model->stage_files.size(), 2u);
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  EXPECT_EQ(read(model->stage_files[0]), "a stage 0 step 5");
  EXPECT_EQ(read(model->stage_files[1]), "c stage 1 step 5");

  // Stage 1's first source reports a digest its bytes do not have: refused
  // (the message names both digests), the next one used.
  auto digested = [&](const std::string& address, uint32_t stage, const std::string& sha) {
    v1::PeerStatus p;
    Serve(&p, address, stage, {5});
    p.mutable_held(0)->mutable_states(0)->set_sha256(sha);
    return p;
  };
  v1::StatusResponse lying;
  *lying.mutable_job() = st.job();
  *lying.add_peers() = digested(addr(*a), 0, Sha256Hex("a stage 0 step 5"));
  *lying.add_peers() = digested(addr(*c), 1, Sha256Hex("forged"));
  *lying.add_peers() = digested(addr(*c), 1, Sha256Hex("c stage 1 step 5"));
  coordinator.SetStatus(lying);
  auto checked = FetchSwarmModel(coordinator, {}, dir.Sub("states-checked"));
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_EQ(read(checked->stage_files[1]), "c stage 1 step 5");
  lying.mutable_peers()->RemoveLast();  // only the liar left for stage 1
  coordinator.SetStatus(lying);
  auto refused = FetchSwarmModel(coordinator, {}, dir.Sub("states-refused"), 1);
  EXPECT_TRUE(absl::IsUnavailable(refused.status())) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr(Sha256Hex("forged")));
  EXPECT_THAT(refused.status().message(), HasSubstr(Sha256Hex("c stage 1 step 5")));
  EXPECT_FALSE(std::filesystem::exists(dir.Sub("states-refused") + "/stage-1.safetensors"));

  // Nobody serves stage 1's step 5 any more: a bounded number of fresh looks, then a clear error.
  coordinator.SetStatus(st);
  v1::StatusResponse gone = st;
  gone.mutable_peers()->RemoveLast();
  coordinator.SetStatus(gone);
  const int calls = coordinator.status_calls();
  auto failed = FetchSwarmModel(coordinator, {}, dir.Sub("states2"), 2);
  EXPECT_TRUE(absl::IsUnavailable(failed.status())) << failed.status();
  EXPECT_THAT(failed.status().message(), HasSubstr("stage 1 step 5"));
  EXPECT_EQ(coordinator.status_calls(), calls + 2);
}

}  // namespace
}  // namespace aqswarm::peer
