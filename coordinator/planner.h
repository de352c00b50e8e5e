// Planner: turns the members, the link matrix and the job into a
// PlacementProblem, solves it (SolvePlacement) and keeps the resulting grid
// stable under churn.
//
//   Planner planner(PlannerOptions{}, job);
//   uint64_t next_generation = 1;
//   Grid grid = Grid::Empty(job.stages(), job.data_parallel());
//   AQSWARM_ASSIGN_OR_RETURN(grid, planner.Replan(grid, peers, links, &next_generation));
//   uint64_t peer = grid.at(stage, pipeline);   // 0 = hole
//
// Replan rules (what keeps healthy peers put):
//   - Peers of `previous` that are no longer in `peers` leave holes.
//   - No hole left (a standby joined or left): the grid is returned unchanged.
//   - Fewer eligible peers (memory; PlannerPeer::reachable) than stages x
//     pipelines: the grid keeps its holes (incomplete; placed peers hold
//     still).
//   - Otherwise the surviving holders and the best standbys (up to
//     max_candidates, fastest first) go to SolvePlacement with
//     previous_stage set, so moving a healthy peer costs stage_state_bytes /
//     bandwidth (the migration term) and only pays off for a large gain.
//     Surviving peers that keep their stage also keep their pipeline index and
//     their forward neighbours (a re-pairing would restart AQ-SGD links);
//     peers new to a stage fill its free pipeline indices by link cost.
//   - Link generations: a forward link (stage j -> j+1 of pipeline p) gets a
//     new generation when either end changed; a stage's DP group gets one when
//     its set of peers changed. Generations come from *next_generation and are
//     never reused.
//
// Extra peers (beyond stages x pipelines) are standbys: every member not in
// the grid.
//
// Thread-safety: Replan is const and reads only its arguments.
#ifndef AQSWARM_COORDINATOR_PLANNER_H_
#define AQSWARM_COORDINATOR_PLANNER_H_

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/link_matrix.h"
#include "coordinator/placement.h"
#include "proto/job.pb.h"

namespace aqswarm::coordinator {

// Who runs what: slots[stage * num_pipelines + pipeline] = peer id (0 = hole).
struct Grid {
  int num_stages = 0;
  int num_pipelines = 0;
  std::vector<uint64_t> slots;
  // [boundary * num_pipelines + pipeline] for boundary < num_stages - 1: the
  // generation of the forward link stage boundary -> boundary + 1. 0 = none yet.
  std::vector<uint64_t> forward_generation;
  // [stage]: generation of the stage's DP group. 0 = none yet.
  std::vector<uint64_t> replica_generation;
  // Bumped by SwarmCoordinator whenever `slots` change; with the steps
  // completed every placed peer restarts from (see v1::Assignment).
  uint64_t plan_version = 0;
  int64_t resume_step = 0;
  // Fault domains (SwarmCoordinatorOptions::fault_domains); empty outside
  // them. [pipeline] run_plan: the plan under which the pipeline's stages
  // last started (kept across re-plans that leave its peers in place);
  // run_start: the step they started training at; heal: they started into
  // running replicas, from the parameters those share. [stage *
  // num_pipelines + pipeline] run_resume: the step of the state that slot's
  // stage loaded (<= run_start; healing stages may load different steps).
  // dp_timeline: the plan of the last swarm-wide restart, which names the
  // DP groups (0 = none).
  std::vector<uint64_t> run_plan;
  std::vector<int64_t> run_resume;
  std::vector<bool> heal;
  std::vector<int64_t> run_start;
  uint64_t dp_timeline = 0;

  static Grid Empty(int num_stages, int num_pipelines);
  uint64_t RunPlan(int pipeline) const { return run_plan.empty() ? plan_version : run_plan[pipeline]; }
  int64_t RunResume(int stage, int pipeline) const {
    return run_resume.empty() ? resume_step : run_resume[stage * num_pipelines + pipeline];
  }
  bool Heals(int pipeline) const { return !heal.empty() && heal[pipeline]; }
  int64_t RunStart(int pipeline) const { return run_start.empty() ? resume_step : run_start[pipeline]; }
  uint64_t at(int stage, int pipeline) const { return slots[stage * num_pipelines + pipeline]; }
  uint64_t forward_gen(int boundary, int pipeline) const {
    return forward_generation[boundary * num_pipelines + pipeline];
  }
  bool complete() const;
  // (stage, pipeline) of `peer`, or nullopt for a standby/non-member.
  std::optional<std::pair<int, int>> Find(uint64_t peer) const;
  bool operator==(const Grid& o) const {
    return num_stages == o.num_stages && num_pipelines == o.num_pipelines && slots == o.slots &&
           forward_generation == o.forward_generation && replica_generation == o.replica_generation &&
           plan_version == o.plan_version && resume_step == o.resume_step && run_plan == o.run_plan &&
           run_resume == o.run_resume && heal == o.heal && run_start == o.run_start && dp_timeline == o.dp_timeline;
  }
};

// What the planner needs to know about a member.
struct PlannerPeer {
  uint64_t id = 0;
  double seconds_per_layer = 0;  // 0 = unknown
  uint64_t memory_bytes = 0;     // 0 = unknown (unlimited)
  // Others can open connections to it. One that cannot is placed only in a
  // single-pipeline job (no replicas to exchange with) and never next to
  // another such peer: its links are opened from the other end.
  bool reachable = true;
};

struct PlannerOptions {
  SolverOptions solver;
  // At most this many peers (the surviving holders first, then the fastest
  // standbys) enter one solve; the rest stay standbys. Bounds the N x N
  // matrices with 10k members. Default: 32 (never below stages x pipelines).
  int max_candidates = 32;
  // Cost-model inputs; 0 = derived from the job:
  //   activation_bytes   = micro_batches * micro_batch_size * seq_len * d_model * fw_bits / 8
  //   params_per_stage   = 12 * d_model^2 * ceil(n_layer / stages)
  //   gradient_bytes     = params_per_stage * dp_bits / 8   (32 bits for adamw; bits / inner_steps for diloco)
  //   stage_state_bytes  = params_per_stage * 16            (weights, Adam m and v, error feedback)
  double activation_bytes = 0;
  double gradient_bytes = 0;
  double stage_state_bytes = 0;
  // Bytes a peer needs to hold a stage; peers reporting less (and > 0) stay
  // standbys. Default: 0 (no limit).
  double stage_memory_bytes = 0;
  // Weight of the one-off migration seconds against per-step seconds. Default: 1.
  double migration_weight = 1;
  // Where a stage's state comes from when no holder is left. Default: 12.5e6 B/s.
  double checkpoint_bandwidth_bytes_per_second = 12.5e6;
};

// A better grid for the same members (Planner::Improve).
struct Improvement {
  Grid grid;
  // Predicted seconds per step (the solver's cost model without migration)
  // of the current grid and of `grid`; the one-off seconds of moving state.
  double step_seconds_before = 0;
  double step_seconds_after = 0;
  double migration_seconds = 0;
};

class Planner {
 public:
  Planner(PlannerOptions options, const v1::JobSpec& job);

  // See the banner. `peers` are all current members (any order).
  absl::StatusOr<Grid> Replan(const Grid& previous, const std::vector<PlannerPeer>& peers,
                              const LinkMatrix& links, uint64_t* next_generation) const;

  // The survivors of `previous` all keep their slots and the fastest
  // eligible standbys fill the holes (fault domains: moving a survivor
  // would restart its pipeline); generations as Replan's. nullopt when
  // there are too few standbys (Replan then decides).
  std::optional<Grid> FillHoles(const Grid& previous, const std::vector<PlannerPeer>& peers,
                                uint64_t* next_generation) const;

  // Re-plans a complete grid whose peers are all still members, on what is
  // known now (measured links, standbys that joined since): the placed peers
  // and the best standbys go to SolvePlacement with the migration term. A
  // grid with other slots and a lower predicted step time comes back with
  // both predictions; nullopt when none is better (or the grid is
  // incomplete or lost a peer: Replan's business). Whether the gain is worth
  // the move (threshold, rollback, hysteresis) is the caller's call.
  absl::StatusOr<std::optional<Improvement>> Improve(const Grid& current, const std::vector<PlannerPeer>& peers,
                                                     const LinkMatrix& links, uint64_t* next_generation) const;

  int num_stages() const { return num_stages_; }
  int num_pipelines() const { return num_pipelines_; }
  const PlannerOptions& options() const { return options_; }

 private:
  // The candidates (the peers placed in a grid, then standbys fastest first:
  // max_candidates in all, at least the grid's slots + `extra_standbys`),
  // their placement problem and its solution (no stages: too few peers).
  struct Solved {
    std::vector<uint64_t> candidates;
    PlacementProblem problem;
    Plan plan;
  };
  // `place_unreachable`: standbys others cannot dial are candidates too
  // (single-pipeline jobs only; never two of them adjacent).
  absl::StatusOr<Solved> Solve(const Grid& grid, const std::vector<PlannerPeer>& peers, const LinkMatrix& links,
                               size_t extra_standbys, bool place_unreachable = true) const;
  // The solved plan as a grid: peers that keep their stage in `kept` keep
  // their pipeline index; generations renewed where they differ from `previous`.
  Grid ToGrid(const Solved& solved, const Grid& kept, const Grid& previous, const LinkMatrix& links,
              uint64_t* next_generation) const;

  PlannerOptions options_;
  int num_stages_ = 1;
  int num_pipelines_ = 1;
  int num_layers_ = 1;
  int micro_batches_ = 1;
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_PLANNER_H_
