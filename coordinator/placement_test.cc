#include "coordinator/placement.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/random.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aqswarm::coordinator {
namespace {

using ::testing::HasSubstr;

constexpr double kInf = std::numeric_limits<double>::infinity();

PlacementProblem Uniform(int n, double latency, double bandwidth) {
  PlacementProblem p;
  p.latency_seconds.assign(n, std::vector<double>(n, latency));
  p.bandwidth_bytes_per_second.assign(n, std::vector<double>(n, bandwidth));
  return p;
}

// Peers spread over `clusters` clusters: fast inside, slow and jittery across;
// heterogeneous compute; optionally asymmetric.
PlacementProblem Clustered(uint64_t seed, int n, int clusters, int dp, int pp, bool asymmetric = false) {
  Rng rng(seed);
  PlacementProblem p = Uniform(n, 0, 1);
  std::vector<int> cl(n);
  for (int i = 0; i < n; ++i) cl[i] = static_cast<int>(rng.Uniform(clusters));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      if (!asymmetric && j < i) {
        p.latency_seconds[i][j] = p.latency_seconds[j][i];
        p.bandwidth_bytes_per_second[i][j] = p.bandwidth_bytes_per_second[j][i];
        continue;
      }
      const bool same = cl[i] == cl[j];
      p.latency_seconds[i][j] = (same ? 0.002 : 0.05) * (0.5 + rng.UnitDouble());
      p.bandwidth_bytes_per_second[i][j] = (same ? 1e9 : 5e7) * (0.3 + rng.UnitDouble());
    }
  }
  p.peers.resize(n);
  for (auto& s : p.peers) s.seconds_per_layer = 0.001 * (0.5 + rng.UnitDouble());
  p.dp_degree = dp;
  p.pp_degree = pp;
  p.activation_bytes = 20e6;
  p.gradient_bytes = 50e6;
  p.num_layers = 4 * pp;
  p.micro_batches = 4;
  return p;
}

double Link(const PlacementProblem& p, int i, int j, double bytes) {
  return p.latency_seconds[i][j] + bytes / p.bandwidth_bytes_per_second[i][j];
}

TEST(PlacementCostTest, HandComputedTwoByTwo) {
  // Peers 0-1 and 2-3 are fast pairs (1000 B/s), everything else 100 B/s; 10 ms latency.
  PlacementProblem p = Uniform(4, 0.01, 100);
  p.bandwidth_bytes_per_second[0][1] = p.bandwidth_bytes_per_second[1][0] = 1000;
  p.bandwidth_bytes_per_second[2][3] = p.bandwidth_bytes_per_second[3][2] = 1000;
  p.dp_degree = 2;
  p.pp_degree = 2;
  p.activation_bytes = 50;
  p.gradient_bytes = 200;
  // DP groups on the fast pairs: DataP = 2 (0.01 + 200 / (2 * 1000)) = 0.22;
  // w = 0.01 + 50 / 100 = 0.51; total = 0.22 + 2 * 0.51 = 1.24.
  auto a = EvaluateGroups(p, {{0, 1}, {2, 3}});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_NEAR(a->cost.data_parallel_seconds, 0.22, 1e-12);
  EXPECT_NEAR(a->cost.pipeline_seconds, 0.51, 1e-12);
  EXPECT_NEAR(a->cost.total_seconds, 1.24, 1e-12);
  // Across the fast pairs: DataP = 2 (0.01 + 200 / 200) = 2.02; the matching
  // uses both fast links: w = 0.01 + 50 / 1000 = 0.06; total 2.14.
  auto b = EvaluateGroups(p, {{0, 2}, {1, 3}});
  ASSERT_TRUE(b.ok());
  EXPECT_NEAR(b->cost.data_parallel_seconds, 2.02, 1e-12);
  EXPECT_NEAR(b->cost.pipeline_seconds, 0.06, 1e-12);
  EXPECT_NEAR(b->cost.total_seconds, 2.14, 1e-12);
  // Pipelines follow the matching (0 with 1, 2 with 3), in either stage order.
  for (int q = 0; q < 2; ++q) {
    EXPECT_EQ(b->stages[0][q] / 2, b->stages[1][q] / 2) << b->DebugString();
  }
  auto best = SolvePlacementExhaustive(p);
  ASSERT_TRUE(best.ok());
  EXPECT_NEAR(best->cost.total_seconds, 1.24, 1e-12);
}

TEST(PlacementCostTest, StageOrderComputeAndAsymmetry) {
  // Three single-peer stages; links 0-1 and 1-2 cost 1 s, 0-2 costs 5 s: the
  // order must be 0,1,2 (or reversed); PipeCost = 2, total = 4.
  PlacementProblem p = Uniform(3, 0, 1);
  p.activation_bytes = 1;
  p.bandwidth_bytes_per_second[0][2] = p.bandwidth_bytes_per_second[2][0] = 0.2;
  p.pp_degree = 3;
  auto plan = EvaluateGroups(p, {{0}, {2}, {1}});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->stages[1], std::vector<int>{1});
  EXPECT_NEAR(plan->cost.total_seconds, 4.0, 1e-12);

  // Asymmetric link: forward and backward each use their own direction, so
  // 2 * PipeCost = (1 / 1) + (1 / 0.25) = 5.
  PlacementProblem q = Uniform(2, 0, 1);
  q.bandwidth_bytes_per_second[1][0] = 0.25;
  q.activation_bytes = 1;
  q.pp_degree = 2;
  auto aq = EvaluateGroups(q, {{0}, {1}});
  ASSERT_TRUE(aq.ok());
  EXPECT_NEAR(aq->cost.total_seconds, 5.0, 1e-12);

  // Compute: (micro_batches + pp - 1) * ceil(layers / pp) * slowest placed peer
  // = (3 + 2 - 1) * 3 * 0.5 = 6; the slow standby does not count.
  q = Uniform(3, 0, 1);
  q.pp_degree = 2;
  q.num_layers = 5;
  q.micro_batches = 3;
  q.peers = {{0.25, kInf}, {0.5, kInf}, {9.0, kInf}};
  auto cq = EvaluateGroups(q, {{0}, {1}});
  ASSERT_TRUE(cq.ok());
  EXPECT_NEAR(cq->cost.compute_seconds, 6.0, 1e-12);
  EXPECT_EQ(cq->standbys, std::vector<int>{2});
}

TEST(BottleneckMatchingTest, MatchesBruteForce) {
  Rng rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng.Uniform(6));
    std::vector<double> c(n * n);
    // Few distinct values make ties common.
    for (auto& x : c) x = static_cast<double>(rng.Uniform(trial % 2 ? 5 : 1000));
    std::vector<int> perm(n);
    std::iota(perm.begin(), perm.end(), 0);
    double brute = kInf;
    do {
      double worst = 0;
      for (int i = 0; i < n; ++i) worst = std::max(worst, c[i * n + perm[i]]);
      brute = std::min(brute, worst);
    } while (std::next_permutation(perm.begin(), perm.end()));
    std::vector<int> match;
    const double got = BottleneckMatching(c, n, &match);
    EXPECT_EQ(got, brute) << "trial " << trial;
    // The returned matching is a permutation achieving the value.
    std::vector<int> sorted = match;
    std::sort(sorted.begin(), sorted.end());
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(sorted[i], i);
      EXPECT_LE(c[i * n + match[i]], got);
    }
  }
}

TEST(StageOrderTest, HeldKarpMatchesBruteForce) {
  Rng rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    const int n = 1 + static_cast<int>(rng.Uniform(7));
    std::vector<double> edge(n * n), node;
    for (auto& x : edge) x = rng.UnitDouble();  // asymmetric on purpose
    if (trial % 2) {
      node.resize(n * n);
      for (auto& x : node) x = rng.UnitDouble();
    }
    std::vector<int> perm(n);
    std::iota(perm.begin(), perm.end(), 0);
    double brute = kInf;
    do {
      double c = 0;
      for (int t = 0; t < n; ++t) {
        if (!node.empty()) c += node[perm[t] * n + t];
        if (t + 1 < n) c += edge[perm[t] * n + perm[t + 1]];
      }
      brute = std::min(brute, c);
    } while (std::next_permutation(perm.begin(), perm.end()));
    PathResult r = HeldKarpOpenPath(edge, node, n);
    EXPECT_NEAR(r.cost, brute, 1e-12) << "trial " << trial;
    ASSERT_EQ(static_cast<int>(r.order.size()), n);
  }
}

TEST(StageOrderTest, TwoOptNeverWorseThanInitial) {
  Rng rng(13);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 2 + static_cast<int>(rng.Uniform(20));
    std::vector<double> edge(n * n), node;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j <= i; ++j) edge[i * n + j] = edge[j * n + i] = rng.UnitDouble();
    }
    if (trial % 3 == 0) {
      node.resize(n * n);
      for (auto& x : node) x = rng.UnitDouble();
    }
    std::vector<int> init(n);
    std::iota(init.begin(), init.end(), 0);
    for (int i = n; i > 1; --i) std::swap(init[i - 1], init[rng.Uniform(i)]);
    double init_cost = 0;
    for (int t = 0; t < n; ++t) {
      if (!node.empty()) init_cost += node[init[t] * n + t];
      if (t + 1 < n) init_cost += edge[init[t] * n + init[t + 1]];
    }
    PathResult r = TwoOptOpenPath(edge, node, n, init);
    EXPECT_LE(r.cost, init_cost + 1e-12);
    if (n <= 9) {
      EXPECT_GE(r.cost, HeldKarpOpenPath(edge, node, n).cost - 1e-12);
    }
  }
}

// The solver against the exhaustive optimum on many small random instances,
// including standbys, asymmetric links, compute and a migration term.
TEST(SolverTest, EqualsExhaustiveOptimumOnSmallInstances) {
  struct Shape {
    int n, dp, pp;
  };
  const Shape shapes[] = {{4, 2, 2}, {6, 2, 3}, {6, 3, 2}, {7, 2, 3}, {8, 2, 4},
                          {8, 4, 2}, {8, 2, 3}, {8, 1, 5}, {8, 3, 2}, {5, 1, 4}};
  int cases = 0, optimal = 0;
  double worst_ratio = 1;
  for (int seed = 0; seed < 12; ++seed) {
    for (const Shape& s : shapes) {
      PlacementProblem p = Clustered(1000 + seed, s.n, 2 + seed % 3, s.dp, s.pp, seed % 2 == 1);
      if (seed % 4 == 3) {
        p.previous_stage.assign(s.n, -1);
        for (int d = 0; d < s.n; ++d) p.previous_stage[d] = d % (s.pp + 1) < s.pp ? d % (s.pp + 1) : -1;
        p.stage_state_bytes = 1e8;
        p.migration_weight = 0.01;
      }
      auto opt = SolvePlacementExhaustive(p);
      ASSERT_TRUE(opt.ok()) << opt.status();
      SolverOptions o;
      o.seed = seed;
      auto got = SolvePlacement(p, o);
      ASSERT_TRUE(got.ok()) << got.status();
      ++cases;
      const double ratio = got->cost.total_seconds / opt->cost.total_seconds;
      worst_ratio = std::max(worst_ratio, ratio);
      if (ratio <= 1 + 1e-9) ++optimal;
      EXPECT_GE(ratio, 1 - 1e-9);
    }
  }
  // Target: every case optimal (tolerance 1e-9 relative).
  EXPECT_EQ(optimal, cases) << "worst ratio " << worst_ratio;
}

TEST(SolverTest, DeterministicForSeed) {
  PlacementProblem p = Clustered(5, 40, 3, 4, 6);
  SolverOptions o;
  o.seed = 42;
  o.generations = 8;
  auto a = SolvePlacement(p, o);
  auto b = SolvePlacement(p, o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->stages, b->stages);
  EXPECT_EQ(a->standbys, b->standbys);
  EXPECT_EQ(a->cost.total_seconds, b->cost.total_seconds);
  EXPECT_EQ(a->move_evaluations, b->move_evaluations);
}

void ExpectWellFormed(const PlacementProblem& p, const Plan& plan) {
  const int n = static_cast<int>(p.latency_seconds.size());
  std::vector<int> seen(n, 0);
  ASSERT_EQ(static_cast<int>(plan.stages.size()), p.pp_degree);
  for (const auto& st : plan.stages) {
    ASSERT_EQ(static_cast<int>(st.size()), p.dp_degree);
    for (int d : st) ++seen[d];
  }
  for (int d : plan.standbys) ++seen[d];
  for (int d = 0; d < n; ++d) EXPECT_EQ(seen[d], 1) << "peer " << d;
  EXPECT_EQ(static_cast<int>(plan.standbys.size()), n - p.dp_degree * p.pp_degree);
  // boundary j's bottleneck is carried by the pipeline pairing.
  for (int j = 0; j + 1 < p.pp_degree; ++j) {
    double worst = 0;
    for (int q = 0; q < p.dp_degree; ++q) {
      const int a = plan.stages[j][q], b = plan.stages[j + 1][q];
      worst = std::max(worst, 0.5 * (Link(p, a, b, p.activation_bytes) + Link(p, b, a, p.activation_bytes)));
    }
    EXPECT_DOUBLE_EQ(worst, plan.boundary_seconds[j]);
  }
}

TEST(SolverTest, StandbysAndPipelinePairing) {
  PlacementProblem p = Clustered(9, 20, 3, 3, 4, /*asymmetric=*/true);
  auto plan = SolvePlacement(p, SolverOptions{});
  ASSERT_TRUE(plan.ok());
  ExpectWellFormed(p, *plan);
  EXPECT_EQ(plan->standbys.size(), 8u);
  // The reported cost is the cost of the reported groups.
  auto re = EvaluateGroups(p, plan->stages);
  ASSERT_TRUE(re.ok());
  EXPECT_NEAR(re->cost.total_seconds, plan->cost.total_seconds, 1e-9 * plan->cost.total_seconds);
}

TEST(SolverTest, RespectsMemoryLimits) {
  PlacementProblem p = Clustered(3, 16, 2, 3, 3);
  p.stage_memory_bytes = 8e9;
  for (int d = 0; d < 16; ++d) p.peers[d].memory_bytes = (d % 3 == 0) ? 4e9 : 16e9;  // 6 too small
  auto plan = SolvePlacement(p, SolverOptions{});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectWellFormed(p, *plan);
  for (const auto& st : plan->stages) {
    for (int d : st) EXPECT_NE(d % 3, 0) << "peer " << d << " cannot hold a stage";
  }
  auto opt = SolvePlacementExhaustive(Clustered(3, 8, 2, 2, 2));
  ASSERT_TRUE(opt.ok());
  // Not enough memory anywhere: a clear error.
  p.stage_memory_bytes = 1e10;
  for (int d = 0; d < 16; ++d) p.peers[d].memory_bytes = d < 8 ? 2e10 : 1e9;
  auto bad = SolvePlacement(p, SolverOptions{});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("only 8 of 16 peers"));
}

TEST(SolverTest, SlowAndDisconnectedPeersBecomeStandbys) {
  PlacementProblem p = Clustered(21, 12, 2, 2, 4);
  for (int j = 0; j < 12; ++j) {  // peer 5 has no links at all
    if (j == 5) continue;
    p.bandwidth_bytes_per_second[5][j] = p.bandwidth_bytes_per_second[j][5] = 0;
    p.latency_seconds[5][j] = p.latency_seconds[j][5] = kInf;
  }
  p.peers[7].seconds_per_layer = 5.0;  // far slower than everyone
  auto plan = SolvePlacement(p, SolverOptions{});
  ASSERT_TRUE(plan.ok());
  ExpectWellFormed(p, *plan);
  EXPECT_THAT(plan->standbys, ::testing::Contains(5));
  EXPECT_THAT(plan->standbys, ::testing::Contains(7));
  EXPECT_LT(plan->cost.total_seconds, 1e5);
}

TEST(SolverTest, BeatsRandomPlacement) {
  PlacementProblem p = Clustered(17, 40, 4, 4, 8);
  auto plan = SolvePlacement(p, SolverOptions{});
  ASSERT_TRUE(plan.ok());
  Rng rng(99);
  double best_random = kInf, sum = 0;
  const int trials = 100;
  for (int t = 0; t < trials; ++t) {
    std::vector<int> perm(40);
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = 40; i > 1; --i) std::swap(perm[i - 1], perm[rng.Uniform(i)]);
    std::vector<std::vector<int>> groups(8);
    for (int g = 0; g < 8; ++g) groups[g].assign(perm.begin() + 4 * g, perm.begin() + 4 * g + 4);
    auto r = EvaluateGroups(p, groups);
    ASSERT_TRUE(r.ok());
    best_random = std::min(best_random, r->cost.total_seconds);
    sum += r->cost.total_seconds;
  }
  EXPECT_LT(plan->cost.total_seconds, best_random);
  EXPECT_LT(plan->cost.total_seconds, 0.5 * sum / trials);
}

TEST(SolverTest, MigrationKeepsAGoodPreviousPlan) {
  PlacementProblem p = Clustered(31, 16, 2, 2, 4);
  auto first = SolvePlacement(p, SolverOptions{});
  ASSERT_TRUE(first.ok());
  p.previous_stage.assign(16, -1);
  for (int j = 0; j < 4; ++j) {
    for (int d : first->stages[j]) p.previous_stage[d] = j;
  }
  p.stage_state_bytes = 2e9;
  auto again = SolvePlacement(p, SolverOptions{});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->cost.migration_seconds, 0);
  for (int j = 0; j < 4; ++j) {
    for (int d : again->stages[j]) EXPECT_EQ(p.previous_stage[d], j);
  }
}

TEST(ValidationTest, RejectsBadInputs) {
  PlacementProblem good = Uniform(4, 0.01, 1e8);
  good.dp_degree = 2;
  good.pp_degree = 2;
  ASSERT_TRUE(ValidateProblem(good).ok());

  auto expect = [](const PlacementProblem& p, const char* text) {
    const absl::Status s = ValidateProblem(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(s.message(), HasSubstr(text));
    EXPECT_EQ(SolvePlacement(p, SolverOptions{}).status().code(), absl::StatusCode::kInvalidArgument);
  };
  PlacementProblem p = good;
  p.latency_seconds[2].pop_back();
  expect(p, "latency_seconds must be 4 x 4");
  p = good;
  p.bandwidth_bytes_per_second.pop_back();
  expect(p, "bandwidth_bytes_per_second has 3 rows");
  p = good;
  p.bandwidth_bytes_per_second[1].push_back(1);
  expect(p, "row 1 has 5 entries");
  p = good;
  p.pp_degree = 3;
  expect(p, "dp_degree * pp_degree = 2 * 3 = 6 exceeds the 4 peers");
  p = good;
  p.bandwidth_bytes_per_second[0][3] = std::nan("");
  expect(p, "bandwidth_bytes_per_second[0][3] = nan");
  p = good;
  p.bandwidth_bytes_per_second[2][1] = -5;
  expect(p, "bandwidth_bytes_per_second[2][1] = -5");
  p = good;
  p.latency_seconds[1][0] = std::nan("");
  expect(p, "latency_seconds[1][0] = nan");
  p = good;
  p.peers.resize(3);
  expect(p, "peers has 3 entries");
  p = good;
  p.previous_stage = {0, 1, 2, -1};
  expect(p, "previous_stage[2] = 2");
  p = good;
  p.dp_degree = 0;
  expect(p, "must both be >= 1");
  p = good;
  p.latency_seconds.clear();
  p.bandwidth_bytes_per_second.clear();
  expect(p, "latency_seconds is empty");

  EXPECT_EQ(EvaluateGroups(good, {{0, 1}, {1, 2}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EvaluateGroups(good, {{0, 1}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SolvePlacementExhaustive(Uniform(13, 0, 1)).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace aqswarm::coordinator
