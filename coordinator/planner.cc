#include "coordinator/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace aqswarm::coordinator {
namespace {

// Generations: new ones where an end or the group changed since `previous`.
void AssignGenerations(const Grid& previous, Grid* next, uint64_t* next_generation) {
  const int S = next->num_stages, P = next->num_pipelines;
  for (int j = 0; j + 1 < S; ++j) {
    for (int p = 0; p < P; ++p) {
      if (next->at(j, p) != previous.at(j, p) || next->at(j + 1, p) != previous.at(j + 1, p) ||
          next->forward_generation[j * P + p] == 0) {
        next->forward_generation[j * P + p] = (*next_generation)++;
      }
    }
  }
  for (int j = 0; j < S; ++j) {
    std::set<uint64_t> before, after;
    for (int p = 0; p < P; ++p) {
      before.insert(previous.at(j, p));
      after.insert(next->at(j, p));
    }
    if (before != after || next->replica_generation[j] == 0) next->replica_generation[j] = (*next_generation)++;
  }
}

}  // namespace

Grid Grid::Empty(int num_stages, int num_pipelines) {
  Grid g;
  g.num_stages = num_stages;
  g.num_pipelines = num_pipelines;
  g.slots.assign(static_cast<size_t>(num_stages) * num_pipelines, 0);
  g.forward_generation.assign(static_cast<size_t>(std::max(0, num_stages - 1)) * num_pipelines, 0);
  g.replica_generation.assign(num_stages, 0);
  return g;
}

bool Grid::complete() const {
  return !slots.empty() && std::none_of(slots.begin(), slots.end(), [](uint64_t s) { return s == 0; });
}

std::optional<std::pair<int, int>> Grid::Find(uint64_t peer) const {
  if (peer == 0) return std::nullopt;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] == peer) return std::make_pair(static_cast<int>(i / num_pipelines), static_cast<int>(i % num_pipelines));
  }
  return std::nullopt;
}

Planner::Planner(PlannerOptions options, const v1::JobSpec& job) : options_(std::move(options)) {
  num_stages_ = std::max<int>(1, job.stages());
  num_pipelines_ = std::max<int>(1, job.data_parallel());
  const auto& m = job.model();
  const double seq = m.seq_len() ? m.seq_len() : 128;
  const double d = m.d_model() ? m.d_model() : 256;
  num_layers_ = m.n_layer() ? static_cast<int>(m.n_layer()) : 4;
  micro_batches_ = job.micro_batches_per_step() ? static_cast<int>(job.micro_batches_per_step()) : 4;
  const double mb = job.micro_batch_size() ? job.micro_batch_size() : 4;
  const auto& c = job.compression();
  const double fw_bits = c.mode() == v1::LinkCompression::fp32 ? 32 : (c.fw_bits() ? c.fw_bits() : 4);
  // Bits per parameter per step of the DP exchange: diloco exchanges once
  // every inner_steps.
  const double qbits = job.dp().bits() ? job.dp().bits() : 4;
  const double dp_bits = job.dp().optimizer() == v1::DataParallelSpec::quantized_adam ? qbits
                         : job.dp().optimizer() == v1::DataParallelSpec::diloco
                             ? qbits / std::max<uint32_t>(1, job.dp().inner_steps())
                             : 32;
  const double layers_per_stage = std::ceil(static_cast<double>(num_layers_) / num_stages_);
  const double params_per_stage = 12 * d * d * layers_per_stage;
  if (options_.activation_bytes <= 0) options_.activation_bytes = micro_batches_ * mb * seq * d * fw_bits / 8;
  if (options_.gradient_bytes <= 0) options_.gradient_bytes = params_per_stage * dp_bits / 8;
  if (options_.stage_state_bytes <= 0) options_.stage_state_bytes = params_per_stage * 16;
}

absl::StatusOr<Planner::Solved> Planner::Solve(const Grid& grid, const std::vector<PlannerPeer>& peers,
                                               const LinkMatrix& links, size_t extra_standbys,
                                               bool place_unreachable) const {
  const int S = num_stages_, P = num_pipelines_;
  std::unordered_map<uint64_t, const PlannerPeer*> alive;
  for (const auto& p : peers) alive[p.id] = &p;
  // A peer others cannot dial can run a stage of a single pipeline (no
  // replicas to exchange with) between neighbours that can be dialed: its
  // links are opened from their end (reversed), its state never fetched.
  place_unreachable = place_unreachable && P == 1;
  auto eligible = [&](const PlannerPeer& p) {
    return (p.reachable || place_unreachable) &&
           (options_.stage_memory_bytes <= 0 || p.memory_bytes == 0 ||
            static_cast<double>(p.memory_bytes) >= options_.stage_memory_bytes);
  };
  // Candidates: the peers placed in `grid`, then eligible standbys fastest first.
  Solved out;
  std::vector<int> previous_stage;
  std::set<uint64_t> placed;
  for (int j = 0; j < S; ++j) {
    for (int p = 0; p < P; ++p) {
      if (uint64_t id = grid.at(j, p)) {
        out.candidates.push_back(id);
        previous_stage.push_back(j);
        placed.insert(id);
      }
    }
  }
  std::vector<const PlannerPeer*> standbys;
  for (const auto& p : peers) {
    if (!placed.count(p.id) && eligible(p)) standbys.push_back(&p);
  }
  if (out.candidates.size() + standbys.size() < size_t(S) * P) return out;  // too few: no plan
  std::sort(standbys.begin(), standbys.end(), [](const PlannerPeer* a, const PlannerPeer* b) {
    return a->seconds_per_layer != b->seconds_per_layer ? a->seconds_per_layer < b->seconds_per_layer
                                                        : a->id < b->id;
  });
  const size_t cap = std::max<size_t>(std::max(options_.max_candidates, 1), size_t(S) * P + extra_standbys);
  for (const PlannerPeer* s : standbys) {
    if (out.candidates.size() >= cap) break;
    out.candidates.push_back(s->id);
    previous_stage.push_back(-1);
  }

  const int n = static_cast<int>(out.candidates.size());
  PlacementProblem& problem = out.problem;
  problem.latency_seconds.assign(n, std::vector<double>(n, 0));
  problem.bandwidth_bytes_per_second.assign(n, std::vector<double>(n, 0));
  problem.peers.resize(n);
  for (int a = 0; a < n; ++a) {
    const PlannerPeer& pa = *alive.at(out.candidates[a]);
    problem.peers[a].seconds_per_layer = pa.seconds_per_layer;
    if (pa.memory_bytes > 0) problem.peers[a].memory_bytes = static_cast<double>(pa.memory_bytes);
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      const LinkEstimate e = links.Get(out.candidates[a], out.candidates[b]);
      problem.latency_seconds[a][b] = e.rtt_seconds / 2;
      // Neither end can be dialed: no link.
      const bool none = !pa.reachable && !alive.at(out.candidates[b])->reachable;
      problem.bandwidth_bytes_per_second[a][b] = none ? 0 : e.bandwidth_bytes_per_second;
    }
  }
  problem.dp_degree = P;
  problem.pp_degree = S;
  problem.activation_bytes = options_.activation_bytes;
  problem.gradient_bytes = options_.gradient_bytes;
  problem.num_layers = num_layers_;
  problem.micro_batches = micro_batches_;
  problem.stage_memory_bytes = options_.stage_memory_bytes;
  problem.previous_stage = previous_stage;
  problem.stage_state_bytes = options_.stage_state_bytes;
  problem.migration_weight = options_.migration_weight;
  problem.checkpoint_bandwidth_bytes_per_second = options_.checkpoint_bandwidth_bytes_per_second;
  AQSWARM_ASSIGN_OR_RETURN(Plan plan, SolvePlacement(problem, options_.solver));
  // The solver avoids links that do not exist when it can; when it could
  // not, solve again without the standbys others cannot dial.
  for (size_t j = 0; place_unreachable && j + 1 < plan.stages.size(); ++j) {
    for (size_t p = 0; p < plan.stages[j].size() && p < plan.stages[j + 1].size(); ++p) {
      if (!alive.at(out.candidates[plan.stages[j][p]])->reachable &&
          !alive.at(out.candidates[plan.stages[j + 1][p]])->reachable) {
        return Solve(grid, peers, links, extra_standbys, /*place_unreachable=*/false);
      }
    }
  }
  out.plan = std::move(plan);
  return out;
}

Grid Planner::ToGrid(const Solved& solved, const Grid& kept, const Grid& previous, const LinkMatrix& links,
                     uint64_t* next_generation) const {
  const int S = num_stages_, P = num_pipelines_;
  // One-way-averaged forward+backward cost of the link a <-> b (as the solver's e(d, d')).
  auto edge = [&](uint64_t a, uint64_t b) {
    const LinkEstimate ab = links.Get(a, b), ba = links.Get(b, a);
    return (ab.rtt_seconds / 2 + options_.activation_bytes / ab.bandwidth_bytes_per_second + ba.rtt_seconds / 2 +
            options_.activation_bytes / ba.bandwidth_bytes_per_second) /
           2;
  };
  Grid next = Grid::Empty(S, P);
  next.forward_generation = previous.forward_generation;
  next.replica_generation = previous.replica_generation;
  for (int j = 0; j < S; ++j) {
    std::vector<uint64_t> fresh;  // new to stage j
    for (int p = 0; p < P; ++p) {
      const uint64_t id = solved.candidates[solved.plan.stages[j][p]];
      bool stays = false;
      for (int q = 0; q < P && !stays; ++q) {
        if (kept.at(j, q) == id) {
          next.slots[j * P + q] = id;
          stays = true;
        }
      }
      if (!stays) fresh.push_back(id);
    }
    // Fill free pipeline indices greedily: cheapest (upstream + kept downstream) link first.
    while (!fresh.empty()) {
      double best = std::numeric_limits<double>::infinity();
      size_t best_f = 0;
      int best_q = -1;
      for (int q = 0; q < P; ++q) {
        if (next.slots[j * P + q] != 0) continue;
        for (size_t f = 0; f < fresh.size(); ++f) {
          double c = 0;
          if (j > 0 && next.at(j - 1, q)) c += edge(next.at(j - 1, q), fresh[f]);
          if (j + 1 < S && kept.at(j + 1, q)) c += edge(fresh[f], kept.at(j + 1, q));
          if (best_q < 0 || c < best) {
            best = c;
            best_f = f;
            best_q = q;
          }
        }
      }
      next.slots[j * P + best_q] = fresh[best_f];
      fresh.erase(fresh.begin() + best_f);
    }
  }
  AssignGenerations(previous, &next, next_generation);
  return next;
}

absl::StatusOr<Grid> Planner::Replan(const Grid& previous_in, const std::vector<PlannerPeer>& peers,
                                     const LinkMatrix& links, uint64_t* next_generation) const {
  const int S = num_stages_, P = num_pipelines_;
  Grid previous = previous_in;
  if (previous.num_stages != S || previous.num_pipelines != P || previous.slots.size() != size_t(S) * P) {
    previous = Grid::Empty(S, P);
  }
  std::set<uint64_t> alive;
  for (const auto& p : peers) alive.insert(p.id);
  Grid grid = previous;
  for (auto& s : grid.slots) {
    if (s != 0 && !alive.count(s)) s = 0;  // lost peers leave holes
  }
  if (grid.complete()) return grid;
  AQSWARM_ASSIGN_OR_RETURN(Solved solved, Solve(grid, peers, links, /*extra_standbys=*/0));
  if (solved.plan.stages.empty()) return grid;  // incomplete: hold still
  return ToGrid(solved, grid, previous, links, next_generation);
}

std::optional<Grid> Planner::FillHoles(const Grid& previous, const std::vector<PlannerPeer>& peers,
                                      uint64_t* next_generation) const {
  const int S = num_stages_, P = num_pipelines_;
  if (previous.num_stages != S || previous.num_pipelines != P || previous.slots.size() != size_t(S) * P) {
    return std::nullopt;
  }
  std::set<uint64_t> alive, placed;
  for (const auto& p : peers) alive.insert(p.id);
  Grid next = previous;
  for (auto& s : next.slots) {
    if (s != 0 && !alive.count(s)) s = 0;
    if (s != 0) placed.insert(s);
  }
  std::vector<const PlannerPeer*> standbys;
  for (const auto& p : peers) {
    const bool fits = options_.stage_memory_bytes <= 0 || p.memory_bytes == 0 ||
                      static_cast<double>(p.memory_bytes) >= options_.stage_memory_bytes;
    if (!placed.count(p.id) && fits && (p.reachable || P == 1)) standbys.push_back(&p);
  }
  std::sort(standbys.begin(), standbys.end(), [](const PlannerPeer* a, const PlannerPeer* b) {
    return a->seconds_per_layer != b->seconds_per_layer ? a->seconds_per_layer < b->seconds_per_layer
                                                        : a->id < b->id;
  });
  size_t used = 0;
  for (auto& s : next.slots) {
    if (s != 0) continue;
    if (used == standbys.size()) return std::nullopt;
    s = standbys[used++]->id;
  }
  AssignGenerations(previous, &next, next_generation);
  return next;
}

absl::StatusOr<std::optional<Improvement>> Planner::Improve(const Grid& current, const std::vector<PlannerPeer>& peers,
                                                            const LinkMatrix& links,
                                                            uint64_t* next_generation) const {
  const int S = num_stages_, P = num_pipelines_;
  if (current.num_stages != S || current.num_pipelines != P || !current.complete()) return std::nullopt;
  std::set<uint64_t> alive;
  for (const auto& p : peers) alive.insert(p.id);
  for (uint64_t s : current.slots) {
    if (!alive.count(s)) return std::nullopt;  // a lost peer: Replan's business
  }
  // A full grid fills max_candidates: a few standbys more, so a faster one can come in.
  AQSWARM_ASSIGN_OR_RETURN(Solved solved, Solve(current, peers, links, /*extra_standbys=*/8));
  if (solved.plan.stages.empty()) return std::nullopt;
  // The current grid's groups are the first S x P candidates, stage by stage.
  std::vector<std::vector<int>> groups(S);
  for (int j = 0; j < S; ++j) {
    for (int p = 0; p < P; ++p) groups[j].push_back(j * P + p);
  }
  AQSWARM_ASSIGN_OR_RETURN(Plan now, EvaluateGroups(solved.problem, groups, options_.solver.held_karp_max_stages));
  auto step_seconds = [&](const PlanCost& c) { return c.total_seconds - options_.migration_weight * c.migration_seconds; };
  Improvement out;
  out.step_seconds_before = step_seconds(now.cost);
  out.step_seconds_after = step_seconds(solved.plan.cost);
  out.migration_seconds = solved.plan.cost.migration_seconds;
  if (out.step_seconds_after >= out.step_seconds_before) return std::nullopt;
  out.grid = ToGrid(solved, current, current, links, next_generation);
  out.grid.plan_version = current.plan_version;
  out.grid.resume_step = current.resume_step;
  if (out.grid.slots == current.slots) return std::nullopt;
  return out;
}

}  // namespace aqswarm::coordinator
