#include "storage/state_store.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/test_util.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::storage {
namespace {

using ::aqswarm::testing::ScratchDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

const StateKey<uint64_t> kPlanVersion("plan/version");
const StateKey<std::string> kPlanBody("plan/body");
const StateKey<double> kLoss("progress/loss");
const StateKey<int64_t> kStep("progress/step");
const StateKey<bool> kFrozen("progress/frozen");
const StateKey<std::vector<std::string>> kStages("plan/stages");

TEST(StateStoreTest, TypedValuesRoundTripAndSurviveReopen) {
  ScratchDir dir;
  {
    auto store = StateStore::Open({dir.Sub("state")});
    ASSERT_TRUE(store.ok()) << store.status();
    StateStore::Batch b;
    b.Put(kPlanVersion, uint64_t{7});
    b.Put(kPlanBody, std::string("\0binary\xff", 8));
    b.Put(kLoss, 3.25);
    b.Put(kStep, int64_t{-12});
    b.Put(kFrozen, true);
    b.Put(kStages, std::vector<std::string>{"a", "", "peer-3"});
    ASSERT_TRUE((*store)->Commit(b).ok());
  }
  auto store = StateStore::Open({dir.Sub("state")});
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(*(*store)->Get(kPlanVersion), 7u);
  EXPECT_EQ(*(*store)->Get(kPlanBody), std::string("\0binary\xff", 8));
  EXPECT_EQ(*(*store)->Get(kLoss), 3.25);
  EXPECT_EQ(*(*store)->Get(kStep), -12);
  EXPECT_TRUE(*(*store)->Get(kFrozen));
  EXPECT_THAT(*(*store)->Get(kStages), ElementsAre("a", "", "peer-3"));
}

TEST(StateStoreTest, BatchAppliesPutsAndDeletesInOrder) {
  ScratchDir dir;
  auto store = StateStore::Open({dir.Sub("state"), /*sync=*/false});
  ASSERT_TRUE(store.ok()) << store.status();
  StateStore::Batch b;
  for (const char* m : {"members/a", "members/b", "members/c"}) {
    b.Put(StateKey<std::string>(m), std::string("addr"));
  }
  b.Delete("members/b");
  b.Put(kPlanVersion, uint64_t{1});
  ASSERT_TRUE((*store)->Commit(b).ok());
  auto members = (*store)->Scan("members/");
  ASSERT_TRUE(members.ok());
  ASSERT_EQ(members->size(), 2u);
  EXPECT_EQ((*members)[0].first, "members/a");
  EXPECT_EQ(*StateStore::Untag<std::string>((*members)[1].first, (*members)[1].second), "addr");

  StateStore::Batch drop;
  drop.DeletePrefix("members/");
  drop.Put(kPlanVersion, uint64_t{2});
  ASSERT_TRUE((*store)->Commit(drop).ok());
  EXPECT_TRUE((*store)->Scan("members/")->empty());
  EXPECT_EQ(*(*store)->Get(kPlanVersion), 2u);
}

TEST(StateStoreTest, MissingIsNotFoundAndWrongTypeIsDataLoss) {
  ScratchDir dir;
  auto store = StateStore::Open({dir.Sub("state"), /*sync=*/false});
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(absl::IsNotFound((*store)->Get(kPlanVersion).status()));
  ASSERT_TRUE((*store)->Put(kPlanVersion, uint64_t{5}).ok());
  auto wrong = (*store)->Get(StateKey<std::string>("plan/version"));
  EXPECT_TRUE(absl::IsDataLoss(wrong.status())) << wrong.status();
  StateStore::Batch b;
  b.PutRaw("plan/stages", std::string(1, '\x06') + "short");
  ASSERT_TRUE((*store)->Commit(b).ok());
  EXPECT_TRUE(absl::IsDataLoss((*store)->Get(kStages).status()));
}

TEST(StateStoreTest, SecondOpenFailsWithLockMessage) {
  ScratchDir dir;
  auto first = StateStore::Open({dir.Sub("state")});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = StateStore::Open({dir.Sub("state")});
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(dir.Sub("state")));
}

}  // namespace
}  // namespace aqswarm::storage
