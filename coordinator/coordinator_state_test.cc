#include "coordinator/coordinator_state.h"

#include "coordinator/coordinator_testing.h"
#include "storage/state_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::coordinator {
namespace {

using ::aqswarm::testing::ScratchDir;
using ::aqswarm::coordinator::testing::TestJob;

Member MakeMember(uint64_t id) {
  Member m;
  m.id = id;
  m.name = absl::StrCat("peer-", id);
  m.session_token = std::string(32, 'a' + id % 6);
  m.stage_link_address = absl::StrCat("10.0.0.", id, ":5000");
  m.gradient_exchange_address = absl::StrCat("10.0.0.", id, ":5001");
  m.seconds_per_layer = 0.5 * id;
  m.memory_bytes = id << 30;
  m.joined_at = absl::FromUnixMillis(1'700'000'000'123 + id);
  m.lease_expiry = absl::FromUnixMillis(1'700'000'010'456 + id);
  return m;
}

TEST(CoordinatorStateTest, FreshDirLoadsEmpty) {
  ScratchDir dir;
  auto state = CoordinatorState::Open({dir.Sub("state"), false});
  ASSERT_TRUE(state.ok()) << state.status();
  auto s = (*state)->Load();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->job.has_value());
  EXPECT_TRUE(s->members.empty());
  EXPECT_FALSE(s->grid.has_value());
  EXPECT_EQ(s->counters.next_peer_id, 1u);
}

TEST(CoordinatorStateTest, EverythingSurvivesReopen) {
  ScratchDir dir;
  Grid grid = Grid::Empty(2, 2);
  grid.slots = {3, 1, 2, 0};
  grid.forward_generation = {7, 8};
  grid.replica_generation = {9, 10};
  {
    auto state = CoordinatorState::Open({dir.Sub("state")});
    ASSERT_TRUE(state.ok()) << state.status();
    CoordinatorState::Change c;
    c.PutJob(TestJob(2, 2));
    for (uint64_t id : {1, 2, 3, 4}) c.PutMember(MakeMember(id));
    c.PutGrid(grid);
    c.PutCounters({41, 5, 11});
    c.PutProgress({{120, 3.5, 900}, 100});
    ASSERT_TRUE((*state)->Commit(c).ok());
    CoordinatorState::Change drop;
    drop.DeleteMember(4);
    ASSERT_TRUE((*state)->Commit(drop).ok());
  }
  auto state = CoordinatorState::Open({dir.Sub("state")});
  ASSERT_TRUE(state.ok()) << state.status();
  auto s = (*state)->Load();
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(s->job.has_value());
  EXPECT_EQ(s->job->stages(), 2u);
  ASSERT_EQ(s->members.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const Member want = MakeMember(i + 1);
    const Member& got = s->members[i];
    EXPECT_EQ(got.id, want.id);
    EXPECT_EQ(got.name, want.name);
    EXPECT_EQ(got.session_token, want.session_token);
    EXPECT_EQ(got.stage_link_address, want.stage_link_address);
    EXPECT_EQ(got.gradient_exchange_address, want.gradient_exchange_address);
    EXPECT_EQ(got.seconds_per_layer, want.seconds_per_layer);
    EXPECT_EQ(got.memory_bytes, want.memory_bytes);
    EXPECT_EQ(got.joined_at, want.joined_at);
    EXPECT_EQ(got.lease_expiry, want.lease_expiry);
  }
  ASSERT_TRUE(s->grid.has_value());
  EXPECT_EQ(*s->grid, grid);
  EXPECT_EQ(s->counters.assignment_version, 41u);
  EXPECT_EQ(s->counters.next_peer_id, 5u);
  EXPECT_EQ(s->counters.next_generation, 11u);
  EXPECT_EQ(s->progress.progress.step, 120);
  EXPECT_EQ(s->progress.progress.loss, 3.5);
  EXPECT_EQ(s->progress.progress.tokens_per_second, 900);
  EXPECT_EQ(s->progress.checkpoint_step, 100);
}

// A state dir of an older build holds used tokens as "expiry|sha|session"
// text: it still loads, beside records written now; a record that is
// neither is DataLoss naming its key.
TEST(CoordinatorStateTest, UsedTokensWrittenAsTextByOlderBuildsStillLoad) {
  ScratchDir dir;
  {
    auto store = storage::StateStore::Open({dir.Sub("state"), false});
    ASSERT_TRUE(store.ok()) << store.status();
    storage::StateStore::Batch b;
    b.Put(storage::StateKey<std::string>("tokens/00aa/old-peer"), std::string("1900000000|") + std::string(64, 'c') +
                                                                      "|sess|ion");
    ASSERT_TRUE((*store)->Commit(b).ok());
  }
  {
    auto state = CoordinatorState::Open({dir.Sub("state"), false});
    ASSERT_TRUE(state.ok()) << state.status();
    CoordinatorState::Change change;
    change.PutUsedToken({"00bb", "new-peer", 1'900'000'001, "", "s2"});
    ASSERT_TRUE((*state)->Commit(change).ok());
    auto s = (*state)->Load();
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(s->used_tokens.size(), 2u);
    EXPECT_EQ(s->used_tokens[0].peer_name, "old-peer");
    EXPECT_EQ(s->used_tokens[0].expiry_unix_s, 1'900'000'000);
    EXPECT_EQ(s->used_tokens[0].certificate_sha256, std::string(64, 'c'));
    EXPECT_EQ(s->used_tokens[0].session_token, "sess|ion");
    EXPECT_EQ(s->used_tokens[1].peer_name, "new-peer");
    EXPECT_EQ(s->used_tokens[1].expiry_unix_s, 1'900'000'001);
    EXPECT_EQ(s->used_tokens[1].session_token, "s2");
  }
  {
    auto store = storage::StateStore::Open({dir.Sub("state"), false});
    ASSERT_TRUE(store.ok()) << store.status();
    storage::StateStore::Batch b;
    b.Put(storage::StateKey<std::string>("tokens/00cc/bad"), std::string("12|only-one-bar"));
    ASSERT_TRUE((*store)->Commit(b).ok());
  }
  auto state = CoordinatorState::Open({dir.Sub("state"), false});
  ASSERT_TRUE(state.ok()) << state.status();
  const auto s = (*state)->Load();
  EXPECT_TRUE(absl::IsDataLoss(s.status())) << s.status();
  EXPECT_NE(s.status().message().find("tokens/00cc/bad"), std::string::npos) << s.status();
}

TEST(CoordinatorStateTest, UsedTokensCertificatesAndStateHashesSurviveReopen) {
  ScratchDir dir;
  Member m = MakeMember(3);
  m.certificate_sha256 = std::string(64, 'c');
  m.held = {{1, {{4, std::string(64, '4')}, {8, std::string(64, '8')}}}};
  {
    auto state = CoordinatorState::Open({dir.Sub("state"), false});
    ASSERT_TRUE(state.ok()) << state.status();
    CoordinatorState::Change change;
    change.PutMember(m);
    change.PutUsedToken({"00112233aabbccdd", "peer-3", 1'900'000'000, m.certificate_sha256, m.session_token});
    change.PutUsedToken({"00112233aabbccdd", "peer-4", 1'900'000'000, "", "s4"});
    change.PutUsedToken({"ffff", "gone", 1, "", "x"});
    ASSERT_TRUE((*state)->Commit(change).ok());
    CoordinatorState::Change drop;
    drop.DeleteUsedToken("ffff", "gone");
    ASSERT_TRUE((*state)->Commit(drop).ok());
  }
  auto state = CoordinatorState::Open({dir.Sub("state"), false});
  auto s = (*state)->Load();
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->members.size(), 1u);
  EXPECT_EQ(s->members[0].certificate_sha256, m.certificate_sha256);
  EXPECT_EQ(s->members[0].held, m.held);
  ASSERT_EQ(s->used_tokens.size(), 2u);
  EXPECT_EQ(s->used_tokens[0].token_id, "00112233aabbccdd");
  EXPECT_EQ(s->used_tokens[0].peer_name, "peer-3");
  EXPECT_EQ(s->used_tokens[0].expiry_unix_s, 1'900'000'000);
  EXPECT_EQ(s->used_tokens[0].certificate_sha256, m.certificate_sha256);
  EXPECT_EQ(s->used_tokens[0].session_token, m.session_token);
  EXPECT_EQ(s->used_tokens[1].peer_name, "peer-4");
  EXPECT_EQ(s->used_tokens[1].session_token, "s4");
}

TEST(CoordinatorStateTest, CorruptGridIsDataLoss) {
  ScratchDir dir;
  auto state = CoordinatorState::Open({dir.Sub("state"), false});
  ASSERT_TRUE(state.ok());
  Grid bad = Grid::Empty(2, 2);
  bad.slots.pop_back();
  CoordinatorState::Change c;
  c.PutGrid(bad);
  ASSERT_TRUE((*state)->Commit(c).ok());
  EXPECT_TRUE(absl::IsDataLoss((*state)->Load().status()));
}

// Fault domains' run fields: per pipeline (run_resume per slot), all or
// none; a grid whose lists do not fit is DataLoss, one that fits round-trips.
TEST(CoordinatorStateTest, GridRunFieldsRoundTripAndMisfitsAreDataLoss) {
  ScratchDir dir;
  auto state = CoordinatorState::Open({dir.Sub("state"), false});
  ASSERT_TRUE(state.ok());
  Grid g = Grid::Empty(2, 2);
  g.slots = {1, 2, 3, 4};
  g.run_plan = {5, 7};
  g.run_resume = {0, 16, 0, 24};
  g.heal = {false, true};
  g.run_start = {0, 27};
  g.dp_timeline = 5;
  CoordinatorState::Change c;
  c.PutGrid(g);
  ASSERT_TRUE((*state)->Commit(c).ok());
  auto loaded = (*state)->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->grid.has_value());
  EXPECT_TRUE(*loaded->grid == g);
  Grid bad = g;
  bad.run_resume.pop_back();  // per pipeline instead of per slot
  CoordinatorState::Change b;
  b.PutGrid(bad);
  ASSERT_TRUE((*state)->Commit(b).ok());
  EXPECT_TRUE(absl::IsDataLoss((*state)->Load().status()));
}

}  // namespace
}  // namespace aqswarm::coordinator
