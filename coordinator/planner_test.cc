#include "coordinator/planner.h"

#include <set>

#include "coordinator/coordinator_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aqswarm::coordinator {
namespace {

using ::aqswarm::coordinator::testing::TestJob;

std::vector<PlannerPeer> Peers(std::initializer_list<uint64_t> ids) {
  std::vector<PlannerPeer> out;
  for (uint64_t id : ids) out.push_back({id, 0.01, 0});
  return out;
}

std::set<uint64_t> AllGenerations(const Grid& g) {
  std::set<uint64_t> s(g.forward_generation.begin(), g.forward_generation.end());
  s.insert(g.replica_generation.begin(), g.replica_generation.end());
  return s;
}

TEST(PlannerTest, IncompleteUntilEnoughPeersThenEveryPeerOnce) {
  Planner planner({}, TestJob(2, 2));
  LinkMatrix links;
  uint64_t gen = 1;
  Grid g = Grid::Empty(2, 2);
  auto r = planner.Replan(g, Peers({1, 2, 3}), links, &gen);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->complete());
  EXPECT_EQ(gen, 1u) << "no generations for an incomplete grid";

  r = planner.Replan(g, Peers({1, 2, 3, 4, 5}), links, &gen);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->complete());
  std::set<uint64_t> placed(r->slots.begin(), r->slots.end());
  EXPECT_EQ(placed.size(), 4u);
  EXPECT_FALSE(placed.count(0));
  // 2 forward links + 2 DP groups, all distinct and fresh.
  EXPECT_EQ(AllGenerations(*r).size(), 4u);
  EXPECT_FALSE(AllGenerations(*r).count(0));
  EXPECT_EQ(gen, 5u);
}

// Fault domains: every survivor keeps its slot whatever the links say; the
// fastest standby fills the hole; only the hole's links and its stage's DP
// group get new generations; with no standby left there is no fill.
TEST(PlannerTest, FillHolesKeepsEverySurvivorAndSeatsTheFastestStandby) {
  Planner planner({}, TestJob(2, 2));
  LinkMatrix links;
  uint64_t gen = 1;
  auto first = planner.Replan(Grid::Empty(2, 2), Peers({1, 2, 3, 4}), links, &gen);
  ASSERT_TRUE(first.ok() && first->complete());
  std::vector<PlannerPeer> alive = Peers({1, 2, 3, 4});
  alive.erase(alive.begin() + static_cast<int>(first->at(1, 1) - 1));
  alive.push_back({8, 0.05, 0});  // slow standby
  alive.push_back({9, 0.02, 0});  // faster standby
  const std::optional<Grid> filled = planner.FillHoles(*first, alive, &gen);
  ASSERT_TRUE(filled.has_value());
  for (int j = 0; j < 2; ++j) {
    for (int p = 0; p < 2; ++p) {
      EXPECT_EQ(filled->at(j, p), j == 1 && p == 1 ? 9u : first->at(j, p));
    }
  }
  EXPECT_EQ(filled->forward_gen(0, 0), first->forward_gen(0, 0));
  EXPECT_NE(filled->forward_gen(0, 1), first->forward_gen(0, 1));
  EXPECT_EQ(filled->replica_generation[0], first->replica_generation[0]);
  EXPECT_NE(filled->replica_generation[1], first->replica_generation[1]);
  alive.pop_back();
  alive.pop_back();
  EXPECT_FALSE(planner.FillHoles(*first, alive, &gen).has_value()) << "no standby: nothing to fill with";
}

TEST(PlannerTest, LostPeerIsReplacedByAStandbyAndHealthyPeersStayPut) {
  Planner planner({}, TestJob(3, 2));
  LinkMatrix links;
  uint64_t gen = 1;
  auto first = planner.Replan(Grid::Empty(3, 2), Peers({1, 2, 3, 4, 5, 6, 7}), links, &gen);
  ASSERT_TRUE(first.ok() && first->complete());
  // Lose the peer at stage 1 of pipeline 0.
  const uint64_t lost = first->at(1, 0);
  std::vector<PlannerPeer> alive;
  for (uint64_t id = 1; id <= 7; ++id) {
    if (id != lost) alive.push_back({id, 0.01, 0});
  }
  std::set<uint64_t> placed(first->slots.begin(), first->slots.end());
  uint64_t standby = 0;
  for (uint64_t id = 1; id <= 7; ++id) {
    if (!placed.count(id)) standby = id;
  }
  const uint64_t gen_before = gen;
  auto second = planner.Replan(*first, alive, links, &gen);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(second->complete());
  EXPECT_EQ(second->at(1, 0), standby);
  for (int j = 0; j < 3; ++j) {
    for (int p = 0; p < 2; ++p) {
      if (j != 1 || p != 0) {
        EXPECT_EQ(second->at(j, p), first->at(j, p)) << "stage " << j << " pipeline " << p;
      }
    }
  }
  // New generations on the standby's two forward links and its DP group only.
  EXPECT_NE(second->forward_gen(0, 0), first->forward_gen(0, 0));
  EXPECT_NE(second->forward_gen(1, 0), first->forward_gen(1, 0));
  EXPECT_GE(second->forward_gen(0, 0), gen_before);
  EXPECT_EQ(second->forward_gen(0, 1), first->forward_gen(0, 1));
  EXPECT_EQ(second->forward_gen(1, 1), first->forward_gen(1, 1));
  EXPECT_NE(second->replica_generation[1], first->replica_generation[1]);
  EXPECT_EQ(second->replica_generation[0], first->replica_generation[0]);
  EXPECT_EQ(second->replica_generation[2], first->replica_generation[2]);
  EXPECT_EQ(gen, gen_before + 3);
}

TEST(PlannerTest, StandbyJoiningOrLeavingChangesNothing) {
  Planner planner({}, TestJob(2, 1));
  LinkMatrix links;
  uint64_t gen = 1;
  auto first = planner.Replan(Grid::Empty(2, 1), Peers({1, 2, 3}), links, &gen);
  ASSERT_TRUE(first.ok() && first->complete());
  uint64_t standby = 6 - first->at(0, 0) - first->at(1, 0);
  std::vector<PlannerPeer> without;
  for (uint64_t id : {1, 2, 3}) {
    if (id != standby) without.push_back({id, 0.01, 0});
  }
  auto second = planner.Replan(*first, without, links, &gen);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, *first);
  auto third = planner.Replan(*first, Peers({1, 2, 3, 9}), links, &gen);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(*third, *first);
}

TEST(PlannerTest, LostPeerWithoutStandbyLeavesAHoleThenTheNextJoinerFillsIt) {
  Planner planner({}, TestJob(2, 2));
  LinkMatrix links;
  uint64_t gen = 1;
  auto first = planner.Replan(Grid::Empty(2, 2), Peers({1, 2, 3, 4}), links, &gen);
  ASSERT_TRUE(first.ok() && first->complete());
  const uint64_t lost = first->at(0, 1);
  std::vector<PlannerPeer> alive;
  for (uint64_t id : {1, 2, 3, 4}) {
    if (id != lost) alive.push_back({id, 0.01, 0});
  }
  auto holed = planner.Replan(*first, alive, links, &gen);
  ASSERT_TRUE(holed.ok());
  EXPECT_FALSE(holed->complete());
  EXPECT_EQ(holed->at(0, 1), 0u);
  alive.push_back({10, 0.01, 0});
  auto filled = planner.Replan(*holed, alive, links, &gen);
  ASSERT_TRUE(filled.ok());
  ASSERT_TRUE(filled->complete());
  EXPECT_EQ(filled->at(0, 1), 10u);
  EXPECT_NE(filled->forward_gen(0, 1), first->forward_gen(0, 1));
  EXPECT_EQ(filled->forward_gen(0, 0), first->forward_gen(0, 0));
}

TEST(PlannerTest, MemoryAndLinksSteerWhoIsPlaced) {
  PlannerOptions o;
  o.stage_memory_bytes = 1e9;
  Planner planner(o, TestJob(2, 1));
  LinkMatrix links(LinkEstimate{1e6, 0.2});
  // 1 <-> 2 fast; 3 has too little memory.
  links.Report(1, 2, 1e9, 0.001);
  std::vector<PlannerPeer> peers = {{1, 0.01, 0}, {2, 0.01, uint64_t{2} << 30}, {3, 0.01, 1000}, {4, 0.01, 0}};
  uint64_t gen = 1;
  auto g = planner.Replan(Grid::Empty(2, 1), peers, links, &gen);
  ASSERT_TRUE(g.ok()) << g.status();
  std::set<uint64_t> placed(g->slots.begin(), g->slots.end());
  EXPECT_EQ(placed, (std::set<uint64_t>{1, 2}));
}

TEST(PlannerTest, WithReplicasPeersOthersCannotDialAreNeverPlacedEvenWhenFastest) {
  Planner planner({}, TestJob(2, 2));
  LinkMatrix links(LinkEstimate{1e6, 0.2});
  // 5 and 6 are the fastest but cannot be dialed: their replicas could not send them updates.
  std::vector<PlannerPeer> peers = {{5, 0.001, 0, false}, {6, 0.001, 0, false}, {1, 0.01, 0}, {3, 0.01, 0}, {4, 0.01, 0}};
  uint64_t gen = 1;
  auto g = planner.Replan(Grid::Empty(2, 1), peers, links, &gen);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_FALSE(g->complete());
  peers.push_back({2, 0.01, 0});
  g = planner.Replan(*g, peers, links, &gen);
  ASSERT_TRUE(g.ok()) << g.status();
  std::set<uint64_t> placed(g->slots.begin(), g->slots.end());
  EXPECT_EQ(placed, (std::set<uint64_t>{1, 2, 3, 4}));
  // Nor does Improve bring them in.
  auto better = planner.Improve(*g, peers, links, &gen);
  ASSERT_TRUE(better.ok()) << better.status();
  if (better->has_value()) {
    for (uint64_t id : (*better)->grid.slots) EXPECT_LT(id, 5u);
  }
}

TEST(PlannerTest, InOnePipelineAPeerOthersCannotDialRunsAStageButNeverNextToAnother) {
  Planner planner({}, TestJob(3, 1));
  LinkMatrix links(LinkEstimate{1e6, 0.2});
  uint64_t gen = 1;
  // Two such peers and one that can be dialed: the only valid order puts the latter in the middle.
  std::vector<PlannerPeer> peers = {{7, 0.01, 0, false}, {8, 0.01, 0, false}, {9, 0.01, 0}};
  auto g = planner.Replan(Grid::Empty(3, 1), peers, links, &gen);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(g->complete());
  EXPECT_EQ(g->at(1, 0), 9u);
  // Two of them in two stages: no valid order, so neither is placed.
  Planner two({}, TestJob(2, 1));
  auto none = two.Replan(Grid::Empty(2, 1), {{7, 0.01, 0, false}, {8, 0.01, 0, false}}, links, &gen);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->complete());
  EXPECT_EQ(none->Find(7), std::nullopt);
}

// 2 stages x 1 pipeline placed on a uniform 100 Mbit/s network, one standby.
struct SlowLinkSetup {
  Planner planner{{}, TestJob(2, 1)};
  LinkMatrix links{LinkEstimate{12.5e6, 0.02}};
  uint64_t gen = 1;
  std::vector<PlannerPeer> peers = Peers({1, 2, 3});
  Grid grid;
  uint64_t standby = 0;
  SlowLinkSetup() {
    grid = *planner.Replan(Grid::Empty(2, 1), peers, links, &gen);
    for (uint64_t id : {1, 2, 3}) {
      if (!grid.Find(id).has_value()) standby = id;
    }
  }
};

TEST(PlannerTest, ImproveFindsNothingBetterWhenNothingChanged) {
  SlowLinkSetup s;
  ASSERT_TRUE(s.grid.complete());
  const uint64_t gen = s.gen;
  auto better = s.planner.Improve(s.grid, s.peers, s.links, &s.gen);
  ASSERT_TRUE(better.ok()) << better.status();
  EXPECT_FALSE(better->has_value());
  EXPECT_EQ(s.gen, gen) << "no generation spent on a plan not taken";
}

TEST(PlannerTest, ImproveMovesOffALinkMeasuredSlowOntoTheStandbysFastLinks) {
  SlowLinkSetup s;
  const uint64_t a = s.grid.at(0, 0), b = s.grid.at(1, 0);
  // The placed pair's link turns out slow both ways; the standby is fast to both.
  s.links.Report(a, b, 1e5, 0.2);
  s.links.Report(b, a, 1e5, 0.2);
  for (uint64_t x : {a, b}) {
    s.links.Report(x, s.standby, 1e8, 0.005);
    s.links.Report(s.standby, x, 1e8, 0.005);
  }
  auto better = s.planner.Improve(s.grid, s.peers, s.links, &s.gen);
  ASSERT_TRUE(better.ok()) << better.status();
  ASSERT_TRUE(better->has_value());
  const Improvement& i = **better;
  EXPECT_TRUE(i.grid.complete());
  EXPECT_TRUE(i.grid.Find(s.standby).has_value()) << "the standby takes a slot";
  EXPECT_LT(i.step_seconds_after, i.step_seconds_before / 2);
  EXPECT_GT(i.migration_seconds, 0);
  EXPECT_NE(i.grid.forward_gen(0, 0), s.grid.forward_gen(0, 0)) << "a new link gets a new generation";
  // Nothing in a grid that lost a peer: that is Replan's business.
  auto lost = s.planner.Improve(s.grid, Peers({s.grid.at(0, 0), s.standby}), s.links, &s.gen);
  ASSERT_TRUE(lost.ok());
  EXPECT_FALSE(lost->has_value());
  Grid holed = s.grid;
  holed.slots[0] = 0;
  auto incomplete = s.planner.Improve(holed, s.peers, s.links, &s.gen);
  ASSERT_TRUE(incomplete.ok());
  EXPECT_FALSE(incomplete->has_value());
}

}  // namespace
}  // namespace aqswarm::coordinator
