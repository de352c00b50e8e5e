// Placement of peers onto pipeline stages and data-parallel (DP) groups: the
// DT-FM scheduler (docs/design/ALGORITHMS.md §4) with exact move scoring,
// per-peer compute and memory, standbys, and a migration term for re-planning
// after churn.
//
// Pure domain logic: no I/O, no gRPC. The coordinator service measures the
// link matrices, fills a PlacementProblem and publishes the returned Plan.
//
//   PlacementProblem problem;
//   problem.latency_seconds = alpha;                 // N x N
//   problem.bandwidth_bytes_per_second = beta;       // N x N
//   problem.dp_degree = 4;
//   problem.pp_degree = 4;
//   problem.activation_bytes = 48e6;                 // c_a after compression
//   problem.gradient_bytes = 160e6;                  // c_s after compression
//   AQSWARM_ASSIGN_OR_RETURN(Plan plan, SolvePlacement(problem, SolverOptions{}));
//   int peer = plan.stages[stage][pipeline];
//
// Cost of a plan (seconds per training step; see coordinator/README.md):
//   total = DataPCost + 2 * PipeCost + ComputeCost + migration_weight * MigrationCost
// where DataPCost and PipeCost are exactly DT-FM's COMM terms.
//
// Thread-safety: every function here is pure (reads its arguments only) and
// may be called concurrently.
#ifndef AQSWARM_COORDINATOR_PLACEMENT_H_
#define AQSWARM_COORDINATOR_PLACEMENT_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aqswarm::coordinator {

// What the planner knows about one peer besides its links.
struct PeerSpec {
  // Seconds one micro-batch takes through one transformer layer, forward plus
  // backward, on this peer. 0 = unknown/ignored. Default: 0.
  double seconds_per_layer = 0;
  // Bytes this peer can devote to one stage (weights, optimizer state,
  // activation stash). A peer with less than `stage_memory_bytes` is never
  // placed (it stays a standby). Default: unlimited.
  double memory_bytes = std::numeric_limits<double>::infinity();
};

struct PlacementProblem {
  // alpha[i][j]: one-way latency from peer i to peer j, seconds. Must be N x N,
  // >= 0 and not NaN; +inf means "no link". The diagonal is ignored.
  std::vector<std::vector<double>> latency_seconds;
  // beta[i][j]: bandwidth from peer i to peer j, bytes per second. Same shape
  // as latency; >= 0 and not NaN; 0 means "no link". Asymmetric allowed.
  std::vector<std::vector<double>> bandwidth_bytes_per_second;
  // Per-peer compute and memory; empty = N default PeerSpecs. Default: empty.
  std::vector<PeerSpec> peers;

  // Pipelines (replicas of every stage) and stages. D_DP * D_PP <= N; the
  // remaining peers become standbys. Default: 1 x 1.
  int dp_degree = 1;
  int pp_degree = 1;

  // c_a: bytes one tasklet (one pipeline's share of a step) sends across one
  // stage boundary, after compression. Default: 0.
  double activation_bytes = 0;
  // c_s: bytes of one stage's gradient/momentum exchanged in its DP group per
  // step, after compression. Default: 0.
  double gradient_bytes = 0;

  // Compute term: stages hold ceil(num_layers / pp_degree) layers each
  // (uneven stage sizes are not modelled). ComputeCost =
  // (micro_batches + pp_degree - 1) * layers_per_stage * max over placed peers
  // of seconds_per_layer (GPipe fill/drain; DP replicas step in lockstep, so
  // the slowest placed peer bounds the step). 0 layers = one layer per stage.
  // Defaults: 0 layers, 1 micro-batch.
  int num_layers = 0;
  int micro_batches = 1;

  // Bytes a peer needs to hold one stage; compared with PeerSpec::memory_bytes.
  // Default: 0 (no limit).
  double stage_memory_bytes = 0;

  // Re-planning after churn. previous_stage[d] = the pipeline stage (0-based,
  // in pipeline order) peer d held in the previous plan, -1 if none. Empty =
  // no migration term. A peer placed on a stage it did not hold must fetch
  // `stage_state_bytes` from the fastest previous holder of that stage (or at
  // `checkpoint_bandwidth_bytes_per_second` when no holder is left).
  // MigrationCost is the SUM of those transfer times (additive, so the
  // stage-order search stays exact; it over-counts parallel transfers, which
  // only makes the planner more reluctant to move peers).
  std::vector<int> previous_stage;
  double stage_state_bytes = 0;         // bytes. Default: 0.
  double migration_weight = 1.0;        // multiplier (e.g. 1 / steps until next re-plan). Default: 1.
  double checkpoint_bandwidth_bytes_per_second = 12.5e6;  // Default: 100 Mbit/s.

  // Seconds charged for any transfer over a missing link (latency +inf or
  // bandwidth 0): a large finite penalty so plans stay comparable and the
  // solver routes around such links. Default: 1e6 s.
  double missing_link_seconds = 1e6;
};

// Cost breakdown in seconds per step.
struct PlanCost {
  double data_parallel_seconds = 0;  // DataPCost
  double pipeline_seconds = 0;       // PipeCost (one direction; counted twice in total)
  double compute_seconds = 0;        // ComputeCost
  double migration_seconds = 0;      // MigrationCost, unweighted
  double total_seconds = 0;          // DataP + 2 Pipe + Compute + migration_weight * Migration
};

struct Plan {
  int dp_degree = 0;
  int pp_degree = 0;
  // stages[j][p]: the peer running stage j of pipeline p. Consecutive stages of
  // one pipeline are paired by the bottleneck matching between the two groups,
  // so stages[j][p] sends activations to stages[j + 1][p].
  std::vector<std::vector<int>> stages;
  // Peers not placed (sorted): extra peers and peers without enough memory.
  std::vector<int> standbys;
  // w(stage j, stage j+1): bottleneck link seconds of boundary j (pp - 1 entries).
  std::vector<double> boundary_seconds;
  PlanCost cost;
  // Solver statistics (0 for plain evaluations).
  int64_t move_evaluations = 0;
  int64_t plans_evaluated = 0;

  std::string DebugString() const;
};

struct SolverOptions {
  // Seed of every random choice; same seed + same problem = same plan.
  // Default: 1.
  uint64_t seed = 1;
  // Genetic algorithm population and number of children. Default: 16, 48.
  int population_size = 16;
  int generations = 48;
  // Improving moves one local-search call may apply. Default: 200.
  int local_search_max_moves = 200;
  // Hard cap on swap moves scored over the whole solve; bounds the solve time
  // deterministically (unlike a wall-clock limit). Default: 400000.
  int64_t max_move_evaluations = 400000;
  // Stage orders are found with Held-Karp (exact) up to this many stages and
  // with nearest-neighbour + 2-opt beyond. Default: 12 (Held-Karp is
  // O(pp^2 2^pp) per evaluation).
  int held_karp_max_stages = 12;
};

// Checks shapes and values; InvalidArgument with the offending entry otherwise.
absl::Status ValidateProblem(const PlacementProblem& problem);

// Cost of a given partition: `groups` holds pp_degree groups of dp_degree
// distinct peers (in any order); peers not listed are standbys. The stage order
// and per-boundary matchings are optimised (Held-Karp / 2-opt as in
// SolverOptions::held_karp_max_stages).
absl::StatusOr<Plan> EvaluateGroups(const PlacementProblem& problem,
                                    const std::vector<std::vector<int>>& groups,
                                    int held_karp_max_stages = 12);

// Seeded genetic algorithm + balanced swap local search with exact move scoring.
absl::StatusOr<Plan> SolvePlacement(const PlacementProblem& problem, const SolverOptions& options);

// Enumerates every partition (and standby set); exact optimum for small N.
// InvalidArgument when N > 12 or more than `max_partitions` partitions exist.
absl::StatusOr<Plan> SolvePlacementExhaustive(const PlacementProblem& problem,
                                              int64_t max_partitions = 2000000);

// ---- Building blocks (exposed for tests and for reuse) ----

// Bottleneck perfect matching on an n x n cost matrix (row-major): the minimum
// over perfect matchings of the largest matched cost. If `row_to_col` is not
// null it receives a matching achieving it. Successive minimax augmenting
// paths: O(n^3), no sorting.
double BottleneckMatching(const std::vector<double>& cost, int n, std::vector<int>* row_to_col);

// Open Hamiltonian path over n nodes minimising
//   sum_t edge[pi_t * n + pi_{t+1}] + sum_t node[pi_t * n + t]
// (`node` may be empty: no position-dependent costs).
struct PathResult {
  double cost = 0;
  std::vector<int> order;
};
// Exact, O(n^2 2^n); n <= 20.
PathResult HeldKarpOpenPath(const std::vector<double>& edge, const std::vector<double>& node, int n);
// 2-opt (segment reversal) from `initial` until no reversal improves; never
// returns a worse path than `initial`.
PathResult TwoOptOpenPath(const std::vector<double>& edge, const std::vector<double>& node, int n,
                          std::vector<int> initial);

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_PLACEMENT_H_
