#include "coordinator/placement.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/random.h"
#include "common/status_macros.h"

namespace aqswarm::coordinator {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Relative improvement a move must bring to be applied: guards against
// accepting float noise as progress (which could cycle).
bool Improves(double candidate, double current) {
  if (std::isinf(current)) return candidate < current;
  return candidate < current - 1e-12 * std::max(1.0, std::fabs(current));
}

// ---------------------------------------------------------------------------
// Bottleneck matching by successive minimax augmenting paths: each unmatched
// row is matched through the augmenting path whose largest new edge is
// smallest (a Dijkstra over columns with max instead of +). The answer is the
// largest such path value: for theta* the optimum, the current matching uses
// only edges <= theta* and the optimal matching gives every unmatched row an
// augmenting path inside {cost <= theta*}, so theta never exceeds theta*.
// O(n^3) with no sorting; n = 16 costs ~4k steps.
struct MatchScratch {
  std::vector<int> row_match, col_match, parent;
  std::vector<double> dist;
  std::vector<char> done;
};

double BottleneckImpl(const double* cost, int n, MatchScratch& m, std::vector<int>* row_to_col) {
  if (n == 0) return 0;
  // Lower bound: every row and every column must use one of its edges.
  double theta = 0;
  for (int i = 0; i < n; ++i) {
    double rmin = kInf, cmin = kInf;
    for (int j = 0; j < n; ++j) {
      rmin = std::min(rmin, cost[i * n + j]);
      cmin = std::min(cmin, cost[j * n + i]);
    }
    theta = std::max(theta, std::max(rmin, cmin));
  }
  m.row_match.assign(n, -1);
  m.col_match.assign(n, -1);
  // Greedy start with edges under the lower bound (free: theta is reached anyway).
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (m.col_match[j] < 0 && cost[i * n + j] <= theta) {
        m.row_match[i] = j;
        m.col_match[j] = i;
        break;
      }
    }
  }
  m.dist.resize(n);
  m.parent.resize(n);
  m.done.resize(n);
  for (int r = 0; r < n; ++r) {
    if (m.row_match[r] >= 0) continue;
    for (int j = 0; j < n; ++j) {
      // Edges under theta cost nothing extra: clamp so ties prefer short paths.
      m.dist[j] = std::max(theta, cost[r * n + j]);
      m.parent[j] = r;
      m.done[j] = 0;
    }
    int end = -1;
    while (end < 0) {
      int c = -1;
      for (int j = 0; j < n; ++j) {
        if (!m.done[j] && (c < 0 || m.dist[j] < m.dist[c])) c = j;
      }
      m.done[c] = 1;
      if (m.col_match[c] < 0) {
        end = c;
        break;
      }
      const int r2 = m.col_match[c];
      for (int j = 0; j < n; ++j) {
        if (m.done[j]) continue;
        const double d = std::max(m.dist[c], cost[r2 * n + j]);
        if (d < m.dist[j]) {
          m.dist[j] = d;
          m.parent[j] = r2;
        }
      }
    }
    theta = std::max(theta, m.dist[end]);
    // Augment along the parents.
    for (int c = end; c >= 0;) {
      const int row = m.parent[c];
      const int next = m.row_match[row];
      m.row_match[row] = c;
      m.col_match[c] = row;
      c = (row == r) ? -1 : next;
    }
  }
  if (row_to_col != nullptr) *row_to_col = m.row_match;
  return theta;
}

double PathCost(const std::vector<double>& edge, const std::vector<double>& node, int n,
                const std::vector<int>& order) {
  double c = 0;
  for (int t = 0; t < n; ++t) {
    if (!node.empty()) c += node[order[t] * n + t];
    if (t + 1 < n) c += edge[order[t] * n + order[t + 1]];
  }
  return c;
}

// Nearest-neighbour open path from `start` (ties to the lower index).
std::vector<int> NearestNeighbour(const std::vector<double>& edge, int n, int start) {
  std::vector<int> order{start};
  std::vector<char> used(n, 0);
  used[start] = 1;
  while (static_cast<int>(order.size()) < n) {
    int best = -1;
    for (int h = 0; h < n; ++h) {
      if (!used[h] && (best < 0 || edge[order.back() * n + h] < edge[order.back() * n + best])) best = h;
    }
    used[best] = 1;
    order.push_back(best);
  }
  return order;
}

// Best stage order: exact below the threshold, else the best 2-opt'd path from
// `hint` (if any) and every nearest-neighbour start. `quick` keeps only the
// 2-opt from `hint` (inner loop of the local search).
PathResult BestPath(const std::vector<double>& edge, const std::vector<double>& node, int n,
                    int hk_max, const std::vector<int>* hint, bool quick) {
  if (n <= hk_max) return HeldKarpOpenPath(edge, node, n);
  PathResult best;
  best.cost = kInf;
  if (hint != nullptr && static_cast<int>(hint->size()) == n) {
    best = TwoOptOpenPath(edge, node, n, *hint);
    if (quick) return best;
  }
  for (int s = 0; s < n; ++s) {
    PathResult r = TwoOptOpenPath(edge, node, n, NearestNeighbour(edge, n, s));
    if (Improves(r.cost, best.cost)) best = std::move(r);
  }
  return best;
}

// ---------------------------------------------------------------------------
// Immutable precomputation shared by evaluation, search and enumeration.
class Model {
 public:
  explicit Model(const PlacementProblem& p, int hk_max)
      : n_(static_cast<int>(p.latency_seconds.size())),
        dp_(p.dp_degree),
        pp_(p.pp_degree),
        hk_max_(hk_max),
        mig_weight_(p.migration_weight) {
    const double missing = p.missing_link_seconds;
    auto link = [&](int i, int j, double bytes) {
      const double a = p.latency_seconds[i][j];
      const double b = p.bandwidth_bytes_per_second[i][j];
      if (std::isinf(a) || b <= 0) return missing;
      return a + (bytes > 0 ? bytes / b : 0.0);
    };
    pipe_.assign(static_cast<size_t>(n_) * n_, 0);
    data_.assign(static_cast<size_t>(n_) * n_, 0);
    for (int i = 0; i < n_; ++i) {
      for (int j = 0; j < n_; ++j) {
        if (i == j) continue;
        // Forward activations go i->j and backward gradients j->i; the mean of
        // both directions times the formula's 2 is their sum (exact DT-FM for
        // symmetric matrices).
        pipe_[i * n_ + j] = 0.5 * (link(i, j, p.activation_bytes) + link(j, i, p.activation_bytes));
        data_[i * n_ + j] = 2.0 * link(i, j, p.gradient_bytes / dp_);
      }
    }
    spl_.assign(n_, 0);
    eligible_.assign(n_, 1);
    for (int d = 0; d < n_ && !p.peers.empty(); ++d) {
      spl_[d] = p.peers[d].seconds_per_layer;
      eligible_[d] = p.peers[d].memory_bytes >= p.stage_memory_bytes;
    }
    const int layers = p.num_layers > 0 ? (p.num_layers + pp_ - 1) / pp_ : 1;
    compute_factor_ = static_cast<double>(p.micro_batches + pp_ - 1) * layers;
    if (!p.previous_stage.empty()) {
      migration_ = true;
      mig_.assign(static_cast<size_t>(n_) * pp_, 0);
      for (int d = 0; d < n_; ++d) {
        for (int t = 0; t < pp_; ++t) {
          if (p.previous_stage[d] == t) continue;
          double bw = p.checkpoint_bandwidth_bytes_per_second;
          for (int e = 0; e < n_; ++e) {
            if (e != d && p.previous_stage[e] == t) bw = std::max(bw, p.bandwidth_bytes_per_second[e][d]);
          }
          mig_[d * pp_ + t] = p.stage_state_bytes > 0 ? p.stage_state_bytes / bw : 0.0;
        }
      }
    }
  }

  int n() const { return n_; }
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int hk_max() const { return hk_max_; }
  bool eligible(int d) const { return eligible_[d] != 0; }
  bool migration() const { return migration_; }
  double pipe(int i, int j) const { return pipe_[i * n_ + j]; }
  double data(int i, int j) const { return data_[i * n_ + j]; }
  // data(i, j) + data(j, i): how much i and j add to each other's DP sums.
  double dsym(int i, int j) const { return data_[i * n_ + j] + data_[j * n_ + i]; }

  // max over members d of sum over other members d' of data(d, d').
  double GroupData(const std::vector<int>& g) const {
    double worst = 0;
    for (int d : g) {
      double s = 0;
      for (int e : g) s += (d == e) ? 0.0 : data_[d * n_ + e];
      worst = std::max(worst, s);
    }
    return worst;
  }

  // A lower bound of w(a, b): every member of either group needs one link.
  double MatchLowerBound(const std::vector<int>& a, const std::vector<int>& b) const {
    double lb = 0;
    for (int x : a) {
      double m = kInf;
      for (int y : b) m = std::min(m, pipe_[x * n_ + y]);
      lb = std::max(lb, m);
    }
    for (int y : b) {
      double m = kInf;
      for (int x : a) m = std::min(m, pipe_[x * n_ + y]);
      lb = std::max(lb, m);
    }
    return lb;
  }

  // w(a, b) and, optionally, a matching achieving it.
  double Match(const std::vector<int>& a, const std::vector<int>& b, std::vector<int>* row_to_col) {
    const int k = static_cast<int>(a.size());
    scratch_.resize(static_cast<size_t>(k) * k);
    for (int i = 0; i < k; ++i) {
      for (int j = 0; j < k; ++j) scratch_[i * k + j] = pipe_[a[i] * n_ + b[j]];
    }
    return BottleneckImpl(scratch_.data(), k, match_scratch_, row_to_col);
  }

  // Weighted migration cost of group `g` at every stage position.
  void NodeRow(const std::vector<int>& g, double* row, bool weighted = true) const {
    for (int t = 0; t < pp_; ++t) {
      double s = 0;
      for (int d : g) s += mig_[d * pp_ + t];
      row[t] = weighted ? mig_weight_ * s : s;
    }
  }

  double Compute(const std::vector<std::vector<int>>& groups) const {
    double worst = 0;
    for (int j = 0; j < pp_; ++j) {
      for (int d : groups[j]) worst = std::max(worst, spl_[d]);
    }
    return compute_factor_ * worst;
  }
  double seconds_per_layer(int d) const { return spl_[d]; }

 private:
  int n_, dp_, pp_, hk_max_;
  double mig_weight_;
  std::vector<double> pipe_, data_, spl_, mig_;
  std::vector<char> eligible_;
  double compute_factor_ = 1;
  bool migration_ = false;
  // Scratch for Match (the model is owned by one solve; not shared).
  std::vector<double> scratch_;
  MatchScratch match_scratch_;
};

// ---------------------------------------------------------------------------
// A partition with every cost component cached, so a swap recomputes only the
// two groups it touches (their DP cost, their rows of w, their migration rows)
// and then the stage order.
struct State {
  std::vector<std::vector<int>> groups;  // pp active groups, then the standby pool
  std::vector<int> label, slot;          // group index and position of each eligible peer; -1 otherwise
  std::vector<double> gdata;             // DataPCost of each active group
  std::vector<double> w;                 // pp x pp bottleneck link seconds
  std::vector<double> edge;              // 2 * w (objective weights of the path)
  std::vector<double> node;              // pp x pp weighted migration (group, position); empty if none
  std::vector<int> crit_a, crit_b;       // endpoints of each w(g, h) bottleneck edge
  std::vector<int> order;
  // gsum[x * (pp + 1) + g] = sum over members y of active group g of dsym(x, y):
  // makes the swap proxy used to pick candidate moves O(1).
  std::vector<double> gsum;
  // gout[x * (pp + 1) + g] = sum over members y of active group g of data(x, y).
  std::vector<double> gout;
  double data = 0, compute = 0, path = 0, total = kInf;
};

class Engine {
 public:
  Engine(Model& model) : m_(model), pp_(model.pp()) {}

  // Builds every cache from scratch.
  void Init(State& s, bool quick_order) {
    const int n = m_.n();
    s.label.assign(n, -1);
    s.slot.assign(n, -1);
    for (int g = 0; g < static_cast<int>(s.groups.size()); ++g) {
      for (int i = 0; i < static_cast<int>(s.groups[g].size()); ++i) {
        s.label[s.groups[g][i]] = g;
        s.slot[s.groups[g][i]] = i;
      }
    }
    s.gdata.assign(pp_, 0);
    s.w.assign(pp_ * pp_, 0);
    s.edge.assign(pp_ * pp_, 0);
    s.crit_a.assign(pp_ * pp_, -1);
    s.crit_b.assign(pp_ * pp_, -1);
    if (m_.migration()) s.node.assign(pp_ * pp_, 0);
    for (int g = 0; g < pp_; ++g) RefreshGroup(s, g);
    s.data = *std::max_element(s.gdata.begin(), s.gdata.end());
    s.compute = m_.Compute(s.groups);
    s.gsum.assign(static_cast<size_t>(n) * (pp_ + 1), 0);
    s.gout.assign(static_cast<size_t>(n) * (pp_ + 1), 0);
    for (int x = 0; x < n; ++x) {
      for (int g = 0; g < pp_; ++g) {
        for (int y : s.groups[g]) {
          s.gsum[x * (pp_ + 1) + g] += m_.dsym(x, y);
          s.gout[x * (pp_ + 1) + g] += m_.data(x, y);
        }
      }
    }
    Reorder(s, quick_order);
  }

  // Change of (sum over active groups of their members' DP sums) if u and v
  // swapped: a cheap proxy that ranks candidate swaps before exact scoring.
  double Proxy(const State& s, int u, int v) const {
    const int a = s.label[u], b = s.label[v], w = pp_ + 1;
    double d = 0;
    if (a < pp_) d += s.gsum[v * w + a] - m_.dsym(u, v) - s.gsum[u * w + a];
    if (b < pp_) d += s.gsum[u * w + b] - m_.dsym(u, v) - s.gsum[v * w + b];
    return d;
  }

  // Score of swapping eligible peers u and v (different groups); the state is
  // left unchanged. With `screen`, a move whose cost under the CURRENT stage
  // order does not improve is rejected without re-solving the order (a proxy
  // only for which moves get scored; every accepted score is exact).
  double TrySwap(State& s, int u, int v, bool screen) {
    ++evaluations_;
    const int a = s.label[u], b = s.label[v];
    DoSwap(s, u, v);
    double result = kInf;
    // DataP and compute first: they bound the total from below.
    const double da = a < pp_ ? SwappedGroupData(s, a, u, v) : 0;
    const double db = b < pp_ ? SwappedGroupData(s, b, v, u) : 0;
    double data = 0;
    for (int g = 0; g < pp_; ++g) data = std::max(data, g == a ? da : g == b ? db : s.gdata[g]);
    const double compute = (a == pp_ || b == pp_) ? m_.Compute(s.groups) : s.compute;
    if (data + compute < s.total) {
      if (screen && !ScreenFixedOrder(s, a, b, data + compute)) {
        result = kInf;
      } else {
        State t = SnapshotPipe(s);
        if (a < pp_) RefreshGroup(t, a, &s.groups);
        if (b < pp_) RefreshGroup(t, b, &s.groups);
        PathResult path = BestPath(t.edge, t.node, pp_, m_.hk_max(), &s.order, /*quick=*/true);
        result = data + compute + path.cost;
      }
    }
    DoSwap(s, u, v);  // undo
    return result;
  }

  void ApplySwap(State& s, int u, int v) {
    const int a = s.label[u], b = s.label[v];
    DoSwap(s, u, v);
    const int w = pp_ + 1;
    for (int x = 0; x < m_.n(); ++x) {
      const double du = m_.dsym(x, u), dv = m_.dsym(x, v);
      if (a < pp_) s.gsum[x * w + a] += dv - du;
      if (b < pp_) s.gsum[x * w + b] += du - dv;
      const double ou = m_.data(x, u), ov = m_.data(x, v);
      if (a < pp_) s.gout[x * w + a] += ov - ou;
      if (b < pp_) s.gout[x * w + b] += ou - ov;
    }
    if (a < pp_) RefreshGroup(s, a);
    if (b < pp_) RefreshGroup(s, b);
    s.data = *std::max_element(s.gdata.begin(), s.gdata.end());
    s.compute = m_.Compute(s.groups);
    Reorder(s, /*quick=*/true);
  }

  void Reorder(State& s, bool quick) {
    PathResult path = BestPath(s.edge, s.node, pp_, m_.hk_max(), &s.order, quick);
    s.order = std::move(path.order);
    s.path = path.cost;
    s.total = s.data + s.compute + s.path;
  }

  int64_t evaluations() const { return evaluations_; }

 private:
  // DataPCost of group g (already holding `in` instead of `out`) from the
  // pre-swap out-sums: O(D_DP) instead of O(D_DP^2).
  double SwappedGroupData(const State& s, int g, int out, int in) const {
    double worst = 0;
    for (int x : s.groups[g]) {
      worst = std::max(worst, s.gout[x * (pp_ + 1) + g] - m_.data(x, out) + m_.data(x, in));
    }
    return worst;
  }

  void DoSwap(State& s, int u, int v) {
    const int a = s.label[u], b = s.label[v];
    const int ia = s.slot[u], ib = s.slot[v];
    s.groups[a][ia] = v;
    s.groups[b][ib] = u;
    std::swap(s.label[u], s.label[v]);
    std::swap(s.slot[u], s.slot[v]);
  }

  // Copies only what RefreshGroup rewrites and BestPath reads.
  static State SnapshotPipe(const State& s) {
    State t;
    t.gdata = s.gdata;
    t.w = s.w;
    t.edge = s.edge;
    t.node = s.node;
    t.crit_a = s.crit_a;
    t.crit_b = s.crit_b;
    return t;
  }

  // Recomputes group g's DataP cost, its row/column of w and its migration row,
  // reading the groups from `groups` (default: the state's own).
  void RefreshGroup(State& s, int g, const std::vector<std::vector<int>>* groups = nullptr) {
    const auto& gs = groups != nullptr ? *groups : s.groups;
    s.gdata[g] = m_.GroupData(gs[g]);
    for (int h = 0; h < pp_; ++h) {
      if (h == g) continue;
      const double w = m_.Match(gs[g], gs[h], &match_);
      s.w[g * pp_ + h] = s.w[h * pp_ + g] = w;
      s.edge[g * pp_ + h] = s.edge[h * pp_ + g] = 2 * w;
      // Remember the bottleneck edge: swapping one of its ends is what can lower w.
      int ca = gs[g][0], cb = gs[h][match_[0]];
      for (int i = 0; i < static_cast<int>(match_.size()); ++i) {
        if (m_.pipe(gs[g][i], gs[h][match_[i]]) == w) {
          ca = gs[g][i];
          cb = gs[h][match_[i]];
          break;
        }
      }
      s.crit_a[g * pp_ + h] = ca;
      s.crit_b[g * pp_ + h] = cb;
      s.crit_a[h * pp_ + g] = cb;
      s.crit_b[h * pp_ + g] = ca;
    }
    if (m_.migration()) m_.NodeRow(gs[g], &s.node[g * pp_]);
  }

  // Whether the swapped state (groups already swapped) improves on the total
  // with the current stage order kept: only boundaries touching groups a/b
  // need new matchings, and cheap lower bounds of those reject most moves
  // before any matching is solved.
  bool ScreenFixedOrder(const State& s, int a, int b, double data_compute) {
    double bound = data_compute;
    changed_.clear();
    std::vector<double>& row = row_;
    row.resize(pp_);
    for (int t = 0; t < pp_; ++t) {
      const int g = s.order[t];
      if (m_.migration()) {
        if (g == a || g == b) {
          m_.NodeRow(s.groups[g], row.data());
          bound += row[t];
        } else {
          bound += s.node[g * pp_ + t];
        }
      }
      if (t + 1 < pp_) {
        const int h = s.order[t + 1];
        if (g == a || g == b || h == a || h == b) {
          changed_.push_back({g, h});
        } else {
          bound += s.edge[g * pp_ + h];
        }
      }
    }
    if (bound >= s.total) return false;
    lbs_.clear();
    for (const auto& [g, h] : changed_) {
      lbs_.push_back(m_.MatchLowerBound(s.groups[g], s.groups[h]));
      bound += 2 * lbs_.back();
      if (bound >= s.total) return false;
    }
    for (size_t i = 0; i < changed_.size(); ++i) {
      bound += 2 * (m_.Match(s.groups[changed_[i].first], s.groups[changed_[i].second], nullptr) - lbs_[i]);
      if (bound >= s.total) return false;
    }
    return Improves(bound, s.total);
  }

  Model& m_;
  int pp_;
  int64_t evaluations_ = 0;
  std::vector<int> match_;
  std::vector<std::pair<int, int>> changed_;
  std::vector<double> lbs_, row_;
};

Plan MakePlan(Model& model, const State& s) {
  const int pp = model.pp();
  Plan plan;
  plan.dp_degree = model.dp();
  plan.pp_degree = pp;
  plan.stages.resize(pp);
  // Pipeline p starts at the p-th smallest peer id of the first stage and
  // follows the bottleneck matching across each boundary.
  plan.stages[0] = s.groups[s.order[0]];
  std::sort(plan.stages[0].begin(), plan.stages[0].end());
  std::vector<int> match;
  for (int t = 0; t + 1 < pp; ++t) {
    const std::vector<int>& cur = plan.stages[t];
    const std::vector<int>& next = s.groups[s.order[t + 1]];
    const double w = model.Match(cur, next, &match);
    plan.boundary_seconds.push_back(w);
    plan.cost.pipeline_seconds += w;
    plan.stages[t + 1].resize(cur.size());
    for (size_t p = 0; p < cur.size(); ++p) plan.stages[t + 1][p] = next[match[p]];
  }
  for (int d = 0; d < model.n(); ++d) {
    if (s.label[d] < 0 || s.label[d] >= pp) plan.standbys.push_back(d);
  }
  plan.cost.data_parallel_seconds = s.data;
  plan.cost.compute_seconds = s.compute;
  if (!s.node.empty()) {
    // Unweighted for the breakdown; the weighted sum is what entered the total.
    std::vector<double> row(pp);
    for (int t = 0; t < pp; ++t) {
      model.NodeRow(s.groups[s.order[t]], row.data(), /*weighted=*/false);
      plan.cost.migration_seconds += row[t];
    }
  }
  plan.cost.total_seconds = s.total;
  return plan;
}

// ---------------------------------------------------------------------------
// The genetic algorithm around the local search.
class Solver {
 public:
  // Up to this many peers every swap of every placed peer is scored exactly
  // (no screening); beyond it, each critical peer scores its
  // kCandidatesPerPeer best swaps by the DP-sum proxy plus a few random ones.
  static constexpr int kSmallPeers = 16;
  static constexpr int kCandidatesPerPeer = 12;
  static constexpr int kRandomCandidates = 4;

  Solver(Model& model, const SolverOptions& options)
      : m_(model), e_(model), o_(options), rng_(Mix64(options.seed ^ 0x61717377ull)) {
    for (int d = 0; d < m_.n(); ++d) {
      if (m_.eligible(d)) eligible_.push_back(d);
    }
    // Small instances score every swap exactly; large ones screen with the
    // current stage order first (see Engine::TrySwap).
    small_ = m_.n() <= kSmallPeers;
  }

  State Run() {
    const int pop_size = std::max(2, o_.population_size);
    std::vector<State> pop;
    for (int i = 0; i < pop_size && (i == 0 || !Exhausted()); ++i) {
      // Half greedy (clustered) starts, half random ones for diversity.
      State s = (i % 2 == 0) ? Greedy({}) : Random();
      LocalSearch(s);
      Consider(s);
      pop.push_back(std::move(s));
    }
    for (int gen = 0; gen < o_.generations && !Exhausted() && pop.size() >= 2; ++gen) {
      const State& p1 = Tournament(pop);
      const State& p2 = Tournament(pop);
      State child = Crossover(p1, p2);
      LocalSearch(child);
      Consider(child);
      // Replace the worst member when the child is better and not a duplicate score.
      auto worst = std::max_element(pop.begin(), pop.end(),
                                    [](const State& x, const State& y) { return x.total < y.total; });
      bool dup = false;
      for (const State& q : pop) dup |= std::fabs(q.total - child.total) <= 1e-12 * std::max(1.0, q.total);
      if (!dup && Improves(child.total, worst->total)) *worst = std::move(child);
    }
    // Polish the winner: full stage-order search, then a last local search.
    e_.Reorder(best_, /*quick=*/false);
    LocalSearch(best_);
    e_.Reorder(best_, /*quick=*/false);
    return best_;
  }

  int64_t plans() const { return plans_; }
  int64_t evaluations() const { return e_.evaluations(); }

 private:
  bool Exhausted() const { return e_.evaluations() >= o_.max_move_evaluations; }

  void Consider(const State& s) {
    ++plans_;
    if (best_.groups.empty() || Improves(s.total, best_.total)) best_ = s;
  }

  State Finish(std::vector<std::vector<int>> groups) {
    // Everyone eligible but unplaced goes to the standby pool.
    std::vector<char> placed(m_.n(), 0);
    for (const auto& g : groups) {
      for (int d : g) placed[d] = 1;
    }
    std::vector<int> pool;
    for (int d : eligible_) {
      if (!placed[d]) pool.push_back(d);
    }
    groups.push_back(std::move(pool));
    State s;
    s.groups = std::move(groups);
    e_.Init(s, /*quick=*/false);
    return s;
  }

  State Random() {
    std::vector<int> perm = eligible_;
    Shuffle(perm);
    std::vector<std::vector<int>> groups(m_.pp());
    for (int g = 0; g < m_.pp(); ++g) {
      groups[g].assign(perm.begin() + g * m_.dp(), perm.begin() + (g + 1) * m_.dp());
    }
    return Finish(std::move(groups));
  }

  // Grows groups around random seeds, adding the peer with the cheapest DP
  // links to the members (slower compute breaks ties). Keeps `fixed` groups.
  State Greedy(std::vector<std::vector<int>> fixed) {
    std::vector<char> used(m_.n(), 0);
    for (const auto& g : fixed) {
      for (int d : g) used[d] = 1;
    }
    std::vector<int> pool;
    for (int d : eligible_) {
      if (!used[d]) pool.push_back(d);
    }
    while (static_cast<int>(fixed.size()) < m_.pp()) {
      std::vector<int> g;
      const size_t k = rng_.Uniform(pool.size());
      g.push_back(pool[k]);
      pool.erase(pool.begin() + static_cast<long>(k));
      while (static_cast<int>(g.size()) < m_.dp()) {
        size_t best = 0;
        double best_cost = kInf;
        for (size_t i = 0; i < pool.size(); ++i) {
          double c = 0;
          for (int x : g) c += m_.data(x, pool[i]) + m_.data(pool[i], x);
          c += 1e-9 * m_.seconds_per_layer(pool[i]);
          if (c < best_cost) {
            best_cost = c;
            best = i;
          }
        }
        g.push_back(pool[best]);
        pool.erase(pool.begin() + static_cast<long>(best));
      }
      fixed.push_back(std::move(g));
    }
    return Finish(std::move(fixed));
  }

  // Group-preserving crossover: a random subset of p1's groups, then every
  // p2 group disjoint from them, then greedy growth for the rest. (DT-FM's
  // label crossover breaks groups apart because group labels are arbitrary.)
  State Crossover(const State& p1, const State& p2) {
    std::vector<std::vector<int>> groups;
    std::vector<char> used(m_.n(), 0);
    auto take = [&](const std::vector<int>& g) {
      for (int d : g) {
        if (used[d]) return;
      }
      for (int d : g) used[d] = 1;
      groups.push_back(g);
    };
    for (int g = 0; g < m_.pp(); ++g) {
      if (rng_.Uniform(2) == 0) take(p1.groups[g]);
    }
    for (int g = 0; g < m_.pp() && static_cast<int>(groups.size()) < m_.pp(); ++g) take(p2.groups[g]);
    return Greedy(std::move(groups));
  }

  const State& Tournament(const std::vector<State>& pop) {
    const State& x = pop[rng_.Uniform(pop.size())];
    const State& y = pop[rng_.Uniform(pop.size())];
    return x.total <= y.total ? x : y;
  }

  void Shuffle(std::vector<int>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng_.Uniform(i)]);
  }

  // Peers whose move can lower the cost: members of the group with the worst
  // DP cost, both ends of each boundary's bottleneck link, the slowest placed
  // peer. Small instances try everyone.
  std::vector<int> Critical(const State& s) {
    const int pp = m_.pp();
    std::vector<int> out;
    if (small_) {
      for (int d : eligible_) {
        if (s.label[d] < pp) out.push_back(d);
      }
      return out;
    }
    std::vector<char> mark(m_.n(), 0);
    auto add = [&](int d) {
      if (d >= 0 && !mark[d]) {
        mark[d] = 1;
        out.push_back(d);
      }
    };
    const int worst = static_cast<int>(std::max_element(s.gdata.begin(), s.gdata.end()) - s.gdata.begin());
    for (int d : s.groups[worst]) add(d);
    for (int t = 0; t + 1 < pp; ++t) {
      add(s.crit_a[s.order[t] * pp + s.order[t + 1]]);
      add(s.crit_b[s.order[t] * pp + s.order[t + 1]]);
    }
    int slow = -1;
    for (int g = 0; g < pp; ++g) {
      for (int d : s.groups[g]) {
        if (slow < 0 || m_.seconds_per_layer(d) > m_.seconds_per_layer(slow)) slow = d;
      }
    }
    add(slow);
    return out;
  }

  // Balanced local search: swaps between two groups (or a group and the
  // standby pool) keep every group at D_DP peers. For each critical peer the
  // best-scoring swap is applied if it lowers the exact cost; repeats until no
  // critical peer has an improving swap.
  void LocalSearch(State& s) {
    int moves = 0;
    bool improved = true;
    while (improved && moves < o_.local_search_max_moves && !Exhausted()) {
      improved = false;
      std::vector<int> crit = Critical(s);
      Shuffle(crit);
      for (int u : crit) {
        if (Exhausted()) break;
        double best = s.total;
        int best_v = -1;
        Candidates(s, u);
        for (int v : cand_) {
          const double c = e_.TrySwap(s, u, v, !small_);
          if (Improves(c, best)) {
            best = c;
            best_v = v;
          }
        }
        if (best_v >= 0) {
          e_.ApplySwap(s, u, best_v);
          improved = true;
          if (++moves >= o_.local_search_max_moves) break;
        }
      }
    }
  }

  // Fills cand_ with the peers u may swap with (see kSmallPeers).
  void Candidates(const State& s, int u) {
    cand_.clear();
    for (int v : eligible_) {
      if (s.label[v] != s.label[u]) cand_.push_back(v);
    }
    if (small_ || static_cast<int>(cand_.size()) <= kCandidatesPerPeer + kRandomCandidates) return;
    scored_.clear();
    for (int v : cand_) scored_.push_back({e_.Proxy(s, u, v), v});
    std::partial_sort(scored_.begin(), scored_.begin() + kCandidatesPerPeer, scored_.end());
    cand_.clear();
    for (int k = 0; k < kCandidatesPerPeer; ++k) cand_.push_back(scored_[k].second);
    // A few random extras keep moves the proxy misjudges reachable.
    for (int k = 0; k < kRandomCandidates; ++k) {
      const size_t r = kCandidatesPerPeer + rng_.Uniform(scored_.size() - kCandidatesPerPeer);
      cand_.push_back(scored_[r].second);
    }
    // The slowest placed peer is best traded for the fastest standby.
    if (m_.seconds_per_layer(u) > 0) {
      int fastest = -1;
      for (int v : s.groups[m_.pp()]) {
        if (fastest < 0 || m_.seconds_per_layer(v) < m_.seconds_per_layer(fastest)) fastest = v;
      }
      if (fastest >= 0) cand_.push_back(fastest);
    }
  }

  Model& m_;
  Engine e_;
  SolverOptions o_;
  std::vector<int> cand_;
  std::vector<std::pair<double, int>> scored_;
  Rng rng_;
  std::vector<int> eligible_;
  bool small_ = false;
  State best_;
  int64_t plans_ = 0;
};

absl::Status CheckMatrix(const std::vector<std::vector<double>>& m, const char* name, size_t n) {
  for (size_t i = 0; i < m.size(); ++i) {
    if (m[i].size() != n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s must be %d x %d (square, one row per peer): row %d has %d entries", name, n, n, i,
          m[i].size()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNonNegative(double v, const char* name) {
  if (std::isnan(v) || v < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " = ", v, ": must be >= 0 and not NaN"));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
double BottleneckMatching(const std::vector<double>& cost, int n, std::vector<int>* row_to_col) {
  AQSWARM_CHECK(static_cast<int>(cost.size()) == n * n) << "cost must be n x n";
  MatchScratch m;
  return BottleneckImpl(cost.data(), n, m, row_to_col);
}

PathResult HeldKarpOpenPath(const std::vector<double>& edge, const std::vector<double>& node, int n) {
  AQSWARM_CHECK(n >= 0 && n <= 20) << "Held-Karp needs n <= 20, got " << n;
  PathResult r;
  if (n == 0) return r;
  const size_t full = size_t{1} << n;
  std::vector<double> dp(full * n, kInf);
  std::vector<int8_t> parent(full * n, -1);
  for (int g = 0; g < n; ++g) dp[(size_t{1} << g) * n + g] = node.empty() ? 0 : node[g * n + 0];
  for (size_t set = 1; set < full; ++set) {
    const int pos = __builtin_popcountll(set);  // position of the next node
    if (pos == n) continue;
    for (int last = 0; last < n; ++last) {
      const double cur = dp[set * n + last];
      if (!(set >> last & 1) || cur == kInf) continue;
      for (int h = 0; h < n; ++h) {
        if (set >> h & 1) continue;
        const double c = cur + edge[last * n + h] + (node.empty() ? 0 : node[h * n + pos]);
        const size_t next = (set | (size_t{1} << h)) * n + h;
        if (c < dp[next]) {
          dp[next] = c;
          parent[next] = static_cast<int8_t>(last);
        }
      }
    }
  }
  int last = 0;
  for (int g = 1; g < n; ++g) {
    if (dp[(full - 1) * n + g] < dp[(full - 1) * n + last]) last = g;
  }
  r.cost = dp[(full - 1) * n + last];
  size_t set = full - 1;
  while (last >= 0) {
    r.order.push_back(last);
    const int prev = parent[set * n + last];
    set &= ~(size_t{1} << last);
    last = prev;
  }
  std::reverse(r.order.begin(), r.order.end());
  return r;
}

PathResult TwoOptOpenPath(const std::vector<double>& edge, const std::vector<double>& node, int n,
                          std::vector<int> initial) {
  PathResult r;
  r.order = std::move(initial);
  r.cost = PathCost(edge, node, n, r.order);
  bool improved = true;
  for (int pass = 0; improved && pass < 1000; ++pass) {
    improved = false;
    for (int i = 0; i + 1 < n; ++i) {
      for (int j = i + 1; j < n; ++j) {
        std::reverse(r.order.begin() + i, r.order.begin() + j + 1);
        const double c = PathCost(edge, node, n, r.order);
        if (Improves(c, r.cost)) {
          r.cost = c;
          improved = true;
        } else {
          std::reverse(r.order.begin() + i, r.order.begin() + j + 1);
        }
      }
    }
  }
  return r;
}

std::string Plan::DebugString() const {
  std::string s = absl::StrFormat(
      "plan %d stages x %d pipelines: total %.4f s = data-parallel %.4f + 2 x pipeline %.4f + "
      "compute %.4f + migration %.4f\n",
      pp_degree, dp_degree, cost.total_seconds, cost.data_parallel_seconds, cost.pipeline_seconds,
      cost.compute_seconds, cost.migration_seconds);
  for (size_t j = 0; j < stages.size(); ++j) {
    absl::StrAppend(&s, "  stage ", j, ": ", absl::StrJoin(stages[j], " "), "\n");
  }
  absl::StrAppend(&s, "  standby: ", absl::StrJoin(standbys, " "), "\n");
  return s;
}

absl::Status ValidateProblem(const PlacementProblem& p) {
  const size_t n = p.latency_seconds.size();
  if (n == 0) return absl::InvalidArgumentError("latency_seconds is empty: need at least one peer");
  AQSWARM_RETURN_IF_ERROR(CheckMatrix(p.latency_seconds, "latency_seconds", n));
  if (p.bandwidth_bytes_per_second.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bandwidth_bytes_per_second has %d rows but latency_seconds has %d", p.bandwidth_bytes_per_second.size(),
        n));
  }
  AQSWARM_RETURN_IF_ERROR(CheckMatrix(p.bandwidth_bytes_per_second, "bandwidth_bytes_per_second", n));
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      const double a = p.latency_seconds[i][j], b = p.bandwidth_bytes_per_second[i][j];
      if (std::isnan(a) || a < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "latency_seconds[%d][%d] = %g: must be >= 0 and not NaN (+inf = no link)", i, j, a));
      }
      if (std::isnan(b) || b < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "bandwidth_bytes_per_second[%d][%d] = %g: must be >= 0 and not NaN (0 = no link)", i, j, b));
      }
    }
  }
  if (p.dp_degree < 1 || p.pp_degree < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("dp_degree = %d and pp_degree = %d must both be >= 1", p.dp_degree, p.pp_degree));
  }
  if (static_cast<int64_t>(p.dp_degree) * p.pp_degree > static_cast<int64_t>(n)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "dp_degree * pp_degree = %d * %d = %d exceeds the %d peers", p.dp_degree, p.pp_degree,
        static_cast<int64_t>(p.dp_degree) * p.pp_degree, n));
  }
  if (!p.peers.empty() && p.peers.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrFormat("peers has %d entries; expected 0 or %d (one per matrix row)", p.peers.size(), n));
  }
  for (const PeerSpec& s : p.peers) {
    AQSWARM_RETURN_IF_ERROR(CheckNonNegative(s.seconds_per_layer, "seconds_per_layer"));
    if (std::isinf(s.seconds_per_layer)) return absl::InvalidArgumentError("seconds_per_layer must be finite");
    AQSWARM_RETURN_IF_ERROR(CheckNonNegative(s.memory_bytes, "memory_bytes"));
  }
  AQSWARM_RETURN_IF_ERROR(CheckNonNegative(p.activation_bytes, "activation_bytes"));
  AQSWARM_RETURN_IF_ERROR(CheckNonNegative(p.gradient_bytes, "gradient_bytes"));
  AQSWARM_RETURN_IF_ERROR(CheckNonNegative(p.stage_memory_bytes, "stage_memory_bytes"));
  AQSWARM_RETURN_IF_ERROR(CheckNonNegative(p.stage_state_bytes, "stage_state_bytes"));
  AQSWARM_RETURN_IF_ERROR(CheckNonNegative(p.migration_weight, "migration_weight"));
  if (std::isinf(p.activation_bytes) || std::isinf(p.gradient_bytes) || std::isinf(p.stage_state_bytes) ||
      std::isinf(p.migration_weight)) {
    return absl::InvalidArgumentError("activation_bytes, gradient_bytes, stage_state_bytes and "
                                      "migration_weight must be finite");
  }
  if (!(p.checkpoint_bandwidth_bytes_per_second > 0)) {
    return absl::InvalidArgumentError("checkpoint_bandwidth_bytes_per_second must be > 0");
  }
  if (!(p.missing_link_seconds > 0) || std::isinf(p.missing_link_seconds)) {
    return absl::InvalidArgumentError("missing_link_seconds must be finite and > 0");
  }
  if (p.num_layers < 0 || p.micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_layers = %d must be >= 0 and micro_batches = %d >= 1", p.num_layers, p.micro_batches));
  }
  if (!p.previous_stage.empty()) {
    if (p.previous_stage.size() != n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "previous_stage has %d entries; expected 0 or %d", p.previous_stage.size(), n));
    }
    for (size_t d = 0; d < n; ++d) {
      if (p.previous_stage[d] < -1 || p.previous_stage[d] >= p.pp_degree) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "previous_stage[%d] = %d: must be -1 (none) or a stage in [0, %d)", d, p.previous_stage[d],
            p.pp_degree));
      }
    }
  }
  int64_t eligible = 0;
  for (const PeerSpec& s : p.peers) eligible += s.memory_bytes >= p.stage_memory_bytes;
  if (p.peers.empty()) eligible = static_cast<int64_t>(n);
  if (eligible < static_cast<int64_t>(p.dp_degree) * p.pp_degree) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "only %d of %d peers have memory_bytes >= stage_memory_bytes (%g); %d x %d = %d are needed", eligible, n,
        p.stage_memory_bytes, p.dp_degree, p.pp_degree, static_cast<int64_t>(p.dp_degree) * p.pp_degree));
  }
  return absl::OkStatus();
}

absl::StatusOr<Plan> EvaluateGroups(const PlacementProblem& problem, const std::vector<std::vector<int>>& groups,
                                    int held_karp_max_stages) {
  AQSWARM_RETURN_IF_ERROR(ValidateProblem(problem));
  const int n = static_cast<int>(problem.latency_seconds.size());
  if (static_cast<int>(groups.size()) != problem.pp_degree) {
    return absl::InvalidArgumentError(
        absl::StrFormat("groups has %d groups; expected pp_degree = %d", groups.size(), problem.pp_degree));
  }
  Model model(problem, held_karp_max_stages);
  std::vector<char> seen(n, 0);
  std::vector<std::vector<int>> all = groups;
  for (const auto& g : groups) {
    if (static_cast<int>(g.size()) != problem.dp_degree) {
      return absl::InvalidArgumentError(
          absl::StrFormat("a group has %d peers; expected dp_degree = %d", g.size(), problem.dp_degree));
    }
    for (int d : g) {
      if (d < 0 || d >= n || seen[d]) {
        return absl::InvalidArgumentError(absl::StrFormat("peer %d is out of range or placed twice", d));
      }
      if (!model.eligible(d)) {
        return absl::InvalidArgumentError(absl::StrFormat("peer %d lacks the memory for a stage", d));
      }
      seen[d] = 1;
    }
  }
  std::vector<int> pool;
  for (int d = 0; d < n; ++d) {
    if (!seen[d] && model.eligible(d)) pool.push_back(d);
  }
  all.push_back(std::move(pool));
  State s;
  s.groups = std::move(all);
  Engine engine(model);
  engine.Init(s, /*quick=*/false);
  return MakePlan(model, s);
}

absl::StatusOr<Plan> SolvePlacement(const PlacementProblem& problem, const SolverOptions& options) {
  AQSWARM_RETURN_IF_ERROR(ValidateProblem(problem));
  if (options.population_size < 1 || options.generations < 0 || options.local_search_max_moves < 0 ||
      options.max_move_evaluations < 0 || options.held_karp_max_stages > 20) {
    return absl::InvalidArgumentError(
        "SolverOptions: population_size >= 1, generations/local_search_max_moves/max_move_evaluations >= 0, "
        "held_karp_max_stages <= 20");
  }
  Model model(problem, options.held_karp_max_stages);
  Solver solver(model, options);
  State best = solver.Run();
  Plan plan = MakePlan(model, best);
  plan.move_evaluations = solver.evaluations();
  plan.plans_evaluated = solver.plans();
  return plan;
}

absl::StatusOr<Plan> SolvePlacementExhaustive(const PlacementProblem& problem, int64_t max_partitions) {
  AQSWARM_RETURN_IF_ERROR(ValidateProblem(problem));
  const int n = static_cast<int>(problem.latency_seconds.size());
  if (n > 12) {
    return absl::InvalidArgumentError(absl::StrFormat("exhaustive placement is for N <= 12 peers, got %d", n));
  }
  Model model(problem, /*hk_max=*/20);
  Engine engine(model);
  const int dp = problem.dp_degree, pp = problem.pp_degree;
  std::vector<int> eligible;
  for (int d = 0; d < n; ++d) {
    if (model.eligible(d)) eligible.push_back(d);
  }
  const int spare = static_cast<int>(eligible.size()) - dp * pp;
  // Canonical enumeration: peers in order; a new group may only be opened at
  // the lowest empty index, so each unordered partition appears once.
  std::vector<std::vector<int>> groups(pp + 1);
  State best;
  int64_t count = 0;
  bool too_many = false;
  std::function<void(size_t)> rec = [&](size_t k) {
    if (too_many) return;
    if (k == eligible.size()) {
      if (++count > max_partitions) {
        too_many = true;
        return;
      }
      State s;
      s.groups = groups;
      engine.Init(s, /*quick=*/false);
      if (best.groups.empty() || Improves(s.total, best.total)) best = std::move(s);
      return;
    }
    const int d = eligible[k];
    if (static_cast<int>(groups[pp].size()) < spare) {
      groups[pp].push_back(d);
      rec(k + 1);
      groups[pp].pop_back();
    }
    for (int g = 0; g < pp; ++g) {
      if (static_cast<int>(groups[g].size()) < dp) {
        groups[g].push_back(d);
        rec(k + 1);
        groups[g].pop_back();
      }
      if (groups[g].empty()) break;  // later empty groups are equivalent
    }
  };
  rec(0);
  if (too_many) {
    return absl::InvalidArgumentError(
        absl::StrFormat("more than %d partitions: too large for exhaustive placement", max_partitions));
  }
  Plan plan = MakePlan(model, best);
  plan.plans_evaluated = count;
  return plan;
}

}  // namespace aqswarm::coordinator
