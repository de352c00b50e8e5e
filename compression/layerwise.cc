#include "compression/layerwise.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace aqswarm::compression {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The knapsack over discretised error with `capacity` units of size `unit`.
absl::StatusOr<Allocation> Solve(const std::vector<std::vector<LayerOption>>& layers,
                                 const std::vector<std::vector<int64_t>>& derr, int64_t capacity) {
  const size_t num_layers = layers.size();
  const size_t width = static_cast<size_t>(capacity) + 1;
  // dp[e] = min cost of the layers so far using exactly e error units.
  std::vector<double> dp(width, kInf), next(width);
  std::vector<int> pick(num_layers * width, -1);
  dp[0] = 0;
  for (size_t l = 0; l < num_layers; ++l) {
    std::fill(next.begin(), next.end(), kInf);
    for (size_t c = 0; c < layers[l].size(); ++c) {
      const int64_t d = derr[l][c];
      if (d > capacity) continue;
      for (size_t e = static_cast<size_t>(d); e < width; ++e) {
        const double v = dp[e - d] + layers[l][c].cost_bytes;
        if (v < next[e]) {
          next[e] = v;
          pick[l * width + e] = static_cast<int>(c);
        }
      }
    }
    dp.swap(next);
  }
  size_t best_e = 0;
  for (size_t e = 1; e < width; ++e) {
    if (dp[e] < dp[best_e]) best_e = e;
  }
  if (dp[best_e] == kInf) {
    return absl::NotFoundError("AllocateLayerwise: no assignment fits the error budget");
  }
  Allocation a;
  a.choice.assign(num_layers, 0);
  size_t e = best_e;
  for (size_t l = num_layers; l-- > 0;) {
    const int c = pick[l * width + e];
    a.choice[l] = c;
    e -= static_cast<size_t>(derr[l][c]);
  }
  for (size_t l = 0; l < num_layers; ++l) {
    a.total_cost_bytes += layers[l][a.choice[l]].cost_bytes;
    a.total_error += layers[l][a.choice[l]].error;
  }
  return a;
}

}  // namespace

int64_t DiscretiseError(double error, double unit, int64_t bins) {
  if (error <= 0) return 0;
  if (unit <= 0 || error / unit > static_cast<double>(bins)) return bins + 1;  // alone over budget
  int64_t d = static_cast<int64_t>(std::ceil(error / unit));
  while (static_cast<double>(d) * unit < error) ++d;  // the division may have rounded down
  return d;
}

absl::StatusOr<Allocation> AllocateLayerwise(const std::vector<std::vector<LayerOption>>& layers,
                                             const LayerwiseOptions& options) {
  const double budget = options.error_budget;
  const int bins = options.error_bins;
  if (bins < 1 || bins > (1 << 24) || !std::isfinite(budget) || budget < 0) {
    return absl::InvalidArgumentError(
        "AllocateLayerwise: need error_bins in 1..2^24 and a finite budget >= 0");
  }
  const double unit = budget / bins;
  std::vector<std::vector<int64_t>> derr(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].empty()) return absl::InvalidArgumentError(absl::StrCat("layer ", l, " has no options"));
    for (const LayerOption& o : layers[l]) {
      if (!std::isfinite(o.cost_bytes) || !std::isfinite(o.error) || o.cost_bytes < 0 || o.error < 0) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", l, ": bad cost or error"));
      }
      derr[l].push_back(DiscretiseError(o.error, unit, bins));
    }
  }
  // Each discretised error covers its real error, so sum(real) <= bins*unit
  // ~= budget; float rounding of bins*unit and of the sum could still exceed
  // the budget by an ulp, in which case shrink the capacity and re-solve.
  for (int64_t cap = bins; cap >= 0; --cap) {
    absl::StatusOr<Allocation> a = Solve(layers, derr, cap);
    if (!a.ok() || a->total_error <= budget) return a;
  }
  return absl::NotFoundError("AllocateLayerwise: no assignment fits the error budget");
}

absl::StatusOr<Allocation> AllocateAgainstUniform(const std::vector<std::vector<LayerOption>>& layers,
                                                  const std::vector<int>& uniform, int error_bins) {
  if (uniform.size() != layers.size()) return absl::InvalidArgumentError("uniform plan size mismatch");
  Allocation u;
  u.choice = uniform;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (uniform[l] < 0 || static_cast<size_t>(uniform[l]) >= layers[l].size()) {
      return absl::InvalidArgumentError(absl::StrCat("uniform choice out of range at layer ", l));
    }
    u.total_cost_bytes += layers[l][uniform[l]].cost_bytes;
    u.total_error += layers[l][uniform[l]].error;
  }
  LayerwiseOptions o;
  o.error_budget = u.total_error;
  o.error_bins = error_bins;
  absl::StatusOr<Allocation> dp = AllocateLayerwise(layers, o);
  if (!dp.ok()) {
    if (absl::IsNotFound(dp.status())) return u;
    return dp.status();
  }
  return dp->total_cost_bytes < u.total_cost_bytes ? *dp : u;
}

}  // namespace aqswarm::compression
