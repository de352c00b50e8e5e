// Layer-wise compression allocation (L-GreCo, papers/markov-thesis ch. 4;
// docs/design/ALGORITHMS.md §1.5): pick one option (bits, codec, ...) per tensor so the
// total cost in bytes is minimal while the total error stays within a
// budget, by a knapsack DP over discretised error:
//   DP[l][e] = min_c DP[l-1][e - Err_d[l][c]] + Cost[l][c]
// Err_d = ceil(err / unit) with unit = budget / error_bins: rounding UP makes
// the DP conservative, so the chosen plan never exceeds the real budget (it
// may cost slightly more than the continuous optimum; raise error_bins).
//
// Example:
//   std::vector<std::vector<LayerOption>> opts = ...;  // per tensor: {cost_bytes, error}
//   LayerwiseOptions lo;  lo.error_budget = TotalError(opts, uniform_choice);
//   AQSWARM_ASSIGN_OR_RETURN(Allocation a, AllocateLayerwise(opts, lo));
//   // a.choice[l] indexes opts[l].
// Pure functions; thread-safe. Time O(L * C * error_bins), memory O(L * error_bins).
#ifndef AQSWARM_COMPRESSION_LAYERWISE_H_
#define AQSWARM_COMPRESSION_LAYERWISE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace aqswarm::compression {

struct LayerOption {
  double cost_bytes = 0;  // bytes on the wire with this option (>= 0)
  double error = 0;       // its (measured or modelled) error, e.g. squared L2 (>= 0)
};

struct LayerwiseOptions {
  // Total error allowed (same unit as LayerOption::error, >= 0). Default: 0.
  double error_budget = 0;
  // Resolution of the error axis. Default: 1000.
  int error_bins = 1000;
};

struct Allocation {
  std::vector<int> choice;  // per layer, an index into its options
  double total_cost_bytes = 0;
  double total_error = 0;
};

// ceil(error / unit) (at least covering `error`), or bins + 1 when one option
// alone exceeds the budget. Exposed so tests can brute-force the same problem.
int64_t DiscretiseError(double error, double unit, int64_t bins);

// NotFound if no assignment fits the budget; InvalidArgument on empty layers,
// negative/non-finite numbers or bins < 1.
absl::StatusOr<Allocation> AllocateLayerwise(const std::vector<std::vector<LayerOption>>& layers,
                                             const LayerwiseOptions& options);

// Budgets against the uniform assignment `uniform[l]` (its total error) and
// returns the DP plan, or the uniform plan itself if the DP's conservative
// rounding finds nothing cheaper: never worse than uniform.
absl::StatusOr<Allocation> AllocateAgainstUniform(
    const std::vector<std::vector<LayerOption>>& layers, const std::vector<int>& uniform,
    int error_bins = 1000);

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_LAYERWISE_H_
