#include "compression/layerwise.h"

#include <cmath>
#include <limits>
#include <vector>

#include "common/random.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

using Layers = std::vector<std::vector<LayerOption>>;

// Enumerates every assignment; `fits` decides feasibility.
template <typename Fits>
double BruteForce(const Layers& layers, Fits fits) {
  double best = std::numeric_limits<double>::infinity();
  std::vector<int> c(layers.size(), 0);
  while (true) {
    double cost = 0;
    for (size_t l = 0; l < layers.size(); ++l) cost += layers[l][c[l]].cost_bytes;
    if (fits(c) && cost < best) best = cost;
    size_t l = 0;
    while (l < layers.size() && ++c[l] == static_cast<int>(layers[l].size())) c[l++] = 0;
    if (l == layers.size()) break;
  }
  return best;
}

Layers RandomLayers(Rng& rng, bool integer_errors) {
  Layers layers(1 + rng.Uniform(5));
  for (auto& opts : layers) {
    opts.resize(1 + rng.Uniform(4));
    for (auto& o : opts) {
      o.cost_bytes = static_cast<double>(1 + rng.Uniform(1000));
      o.error = integer_errors ? static_cast<double>(rng.Uniform(11)) : rng.UnitDouble() * 10;
    }
  }
  return layers;
}

TEST(LayerwiseTest, EqualsBruteForceOnIntegerErrors) {
  Rng rng(1);
  for (int trial = 0; trial < 300; ++trial) {
    const Layers layers = RandomLayers(rng, true);
    const int budget = static_cast<int>(rng.Uniform(30));
    LayerwiseOptions o;
    o.error_budget = budget;
    o.error_bins = budget == 0 ? 1 : budget;  // unit 1: discretisation is exact
    const double want = BruteForce(layers, [&](const std::vector<int>& c) {
      double e = 0;
      for (size_t l = 0; l < layers.size(); ++l) e += layers[l][c[l]].error;
      return e <= budget;
    });
    auto got = AllocateLayerwise(layers, o);
    if (std::isinf(want)) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
      continue;
    }
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->total_cost_bytes, want) << trial;
    EXPECT_LE(got->total_error, budget);
  }
}

TEST(LayerwiseTest, RealErrorsNeverExceedBudgetAndMatchDiscretisedBruteForce) {
  Rng rng(2);
  for (int trial = 0; trial < 300; ++trial) {
    const Layers layers = RandomLayers(rng, false);
    LayerwiseOptions o;
    o.error_budget = rng.UnitDouble() * 25;
    o.error_bins = 1 + static_cast<int>(rng.Uniform(200));
    const double unit = o.error_budget / o.error_bins;
    const double discretised = BruteForce(layers, [&](const std::vector<int>& c) {
      int64_t e = 0;
      for (size_t l = 0; l < layers.size(); ++l) e += DiscretiseError(layers[l][c[l]].error, unit, o.error_bins);
      return e <= o.error_bins;
    });
    const double continuous = BruteForce(layers, [&](const std::vector<int>& c) {
      double e = 0;
      for (size_t l = 0; l < layers.size(); ++l) e += layers[l][c[l]].error;
      return e <= o.error_budget;
    });
    auto got = AllocateLayerwise(layers, o);
    if (!got.ok()) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
      EXPECT_TRUE(std::isinf(discretised));
      continue;
    }
    EXPECT_LE(got->total_error, o.error_budget);
    EXPECT_EQ(got->total_cost_bytes, discretised);
    EXPECT_GE(got->total_cost_bytes, continuous);
  }
}

TEST(LayerwiseTest, NeverWorseThanUniform) {
  Rng rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const Layers layers = RandomLayers(rng, false);
    std::vector<int> uniform(layers.size());
    double ucost = 0;
    for (size_t l = 0; l < layers.size(); ++l) {
      uniform[l] = static_cast<int>(rng.Uniform(layers[l].size()));
      ucost += layers[l][uniform[l]].cost_bytes;
    }
    auto got = AllocateAgainstUniform(layers, uniform, 100);
    ASSERT_TRUE(got.ok());
    EXPECT_LE(got->total_cost_bytes, ucost);
    double uerr = 0;
    for (size_t l = 0; l < layers.size(); ++l) uerr += layers[l][uniform[l]].error;
    EXPECT_LE(got->total_error, uerr);
  }
}

TEST(LayerwiseTest, RejectsBadInput) {
  LayerwiseOptions o;
  o.error_budget = 1;
  EXPECT_FALSE(AllocateLayerwise({{}}, o).ok());
  EXPECT_FALSE(AllocateLayerwise({{{1, -1}}}, o).ok());
  o.error_bins = 0;
  EXPECT_FALSE(AllocateLayerwise({{{1, 0}}}, o).ok());
}

}  // namespace
}  // namespace aqswarm::compression
