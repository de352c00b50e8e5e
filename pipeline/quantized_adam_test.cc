// QuantizedAdam's state handed from one replica to another (a joiner takes
// a live replica's checkpoint).
#include "pipeline/quantized_adam.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "compression/codec.h"
#include "common/status_macros.h"
#include "pipeline/dp_test_util.h"
#include "pipeline/layerwise_plan.h"

namespace aqswarm::pipeline {
namespace {

using testing::Hub;
using testing::HubExchange;
using testing::RandomFloats;
using State = std::vector<std::pair<std::string, std::vector<float>>>;

// Three replicas, 4-bit min-max after one warm-up step; 1000 values in
// buckets of 512: chunks of 171/171/170 and 163/163/162 values, so rank 2's
// server error buffer is shorter than the others'.
constexpr int kReplicas = 3;
constexpr int64_t kN = 1000;

QuantizedAdamOptions Options() {
  QuantizedAdamOptions o;
  o.warmup_steps = 1;
  o.compressed.bucket_elements = 512;
  o.compressed.codec.bucket_size = 64;
  o.compressed.codec.min_compress_elements = 16;  // every chunk compressed
  return o;
}

struct Group {
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  std::vector<std::vector<float>> params;
  // Per step and replica: the step's kind and the bytes it sent.
  std::vector<std::vector<std::string>> kinds;
  std::vector<std::vector<uint64_t>> bytes;
  // The gradient at step t of replica r: (t, r)-seeded noise + 0.2, times
  // `scale` (per element, empty: 1), plus params - target when `target` is
  // set (a quadratic around it).
  std::vector<float> scale, target;
  int scale_from = 0;  // steps before it are not scaled
  explicit Group(const QuantizedAdamOptions& o = Options(), std::vector<int64_t> sizes = {}) {
    for (int r = 0; r < kReplicas; ++r) {
      opt.push_back(std::make_unique<QuantizedAdam>(kN, kN, std::vector<uint8_t>(kN, 0), o, sizes));
      params.push_back(RandomFloats(kN, 7));  // the same start everywhere
    }
  }
  // Steps [from, to): replica r's gradient at step t is seeded by (t, r).
  absl::Status Run(int from, int to, double lr = 0.01) {
    for (int t = from; t < to; ++t) {
      Hub hub;
      std::vector<absl::Status> st(kReplicas);
      std::vector<std::thread> threads;
      kinds.emplace_back(kReplicas);
      bytes.emplace_back(kReplicas);
      for (int r = 0; r < kReplicas; ++r) {
        threads.emplace_back([&, r] {
          HubExchange ex(&hub, r, kReplicas);
          std::vector<float> g = RandomFloats(kN, 1000 * t + r);
          for (int64_t i = 0; i < kN; ++i) {
            g[i] += 0.2f;
            if (!scale.empty() && t >= scale_from) g[i] *= scale[i];
            if (!target.empty()) g[i] += params[r][i] - target[i];
          }
          const uint64_t before = opt[r]->stats().bytes_sent;
          st[r] = opt[r]->Step(ex, lr, absl::MakeSpan(params[r]), g);
          kinds.back()[r] = std::string(DpStepKindName(opt[r]->last_step_kind()));
          bytes.back()[r] = opt[r]->stats().bytes_sent - before;
        });
      }
      for (auto& th : threads) th.join();
      for (const auto& s : st) {
        if (!s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }
  bool Identical() const {
    for (int r = 1; r < kReplicas; ++r) {
      if (std::memcmp(params[0].data(), params[r].data(), kN * sizeof(float)) != 0) return false;
    }
    return true;
  }
  State Save(int r) const {
    State s;
    for (const auto& [name, buf] : opt[r]->NamedState()) s.emplace_back(name, *buf);
    return s;
  }
};

State Without(State s, const std::string& name) {
  std::erase_if(s, [&](const auto& e) { return e.first == name; });
  return s;
}

// `name` set to `v` (added when the state lacks it).
State Replace(State s, const std::string& name, std::vector<float> v) {
  for (auto& e : s) {
    if (e.first == name) {
      e.second = std::move(v);
      return s;
    }
  }
  s.emplace_back(name, std::move(v));
  return s;
}

// The buffer `name` of `q`'s state; empty when NamedState leaves it out.
std::vector<float> Buffer(const QuantizedAdam& q, const std::string& name) {
  for (const auto& [n, buf] : q.NamedState()) {
    if (n == name) return *buf;
  }
  return {};
}

void ExpectSameParams(const Group& a, const Group& b) {
  for (int r = 0; r < kReplicas; ++r) {
    EXPECT_EQ(0, std::memcmp(a.params[r].data(), b.params[r].data(), kN * sizeof(float))) << "replica " << r;
  }
}

// The joiner at rank j takes rank 0's state (m, v and parameters are the
// same on every replica; the error buffers are rank 0's). Its next steps
// equal an undisturbed group's whose rank j had its error buffers reset at
// the join, and every replica stays bit-identical. Rank 1's buffers are the
// size of rank 0's (its residues would be counted twice), rank 2's are not
// (its next step would fail).
TEST(QuantizedAdamStateTest, AJoinerGivenAnotherRanksStateStepsAsAnUndisturbedGroupWithItsErrorsReset) {
  Group base;
  ASSERT_TRUE(base.Run(0, 4).ok());
  std::vector<State> saved;
  for (int r = 0; r < kReplicas; ++r) saved.push_back(base.Save(r));
  const std::vector<float> p = base.params[0];
  double error_sq = 0;
  for (float x : *base.opt[0]->NamedState()[2].second) error_sq += x * x;
  ASSERT_GT(error_sq, 0) << "no worker error to hand over: the exchange was lossless";
  for (int joiner : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("joiner at rank ", joiner));
    Group joined;  // the joiner loads rank 0's state
    Group reset;   // the joiner keeps its own state but starts its error feedback from zero
    for (Group* g : {&joined, &reset}) {
      for (int r = 0; r < kReplicas; ++r) {
        g->params[r] = p;
        if (r != joiner) ASSERT_TRUE(g->opt[r]->LoadState(saved[r], {4, true}).ok());
      }
    }
    ASSERT_TRUE(joined.opt[joiner]->LoadState(saved[0], {4, true}).ok());
    ASSERT_TRUE(reset.opt[joiner]
                    ->LoadState(Replace(Replace(saved[joiner], "worker_error", {}), "server_error", {}), {4, true})
                    .ok());
    const absl::Status js = joined.Run(4, 8);
    ASSERT_TRUE(js.ok()) << js;
    ASSERT_TRUE(reset.Run(4, 8).ok());
    ExpectSameParams(joined, reset);
    for (int r = 1; r < kReplicas; ++r) {
      EXPECT_EQ(0, std::memcmp(joined.params[0].data(), joined.params[r].data(), kN * sizeof(float)));
    }
  }
}

// A replica restarted from its own state (a re-plan that keeps it at its
// rank) keeps its error buffers: its steps equal an undisturbed run's.
TEST(QuantizedAdamStateTest, AReplicaRestoredFromItsOwnStateStepsAsIfUndisturbed) {
  Group base;
  ASSERT_TRUE(base.Run(0, 4).ok());
  Group restored;
  for (int r = 0; r < kReplicas; ++r) {
    restored.params[r] = base.params[r];
    ASSERT_TRUE(restored.opt[r]->LoadState(base.Save(r), {4, true}).ok());
  }
  ASSERT_TRUE(base.Run(4, 8).ok());
  ASSERT_TRUE(restored.Run(4, 8).ok());
  ExpectSameParams(base, restored);
}

// A state of an older format (no error_owner) loads; its error buffers are
// of unknown owner and are reset, as a joiner's are.
TEST(QuantizedAdamStateTest, AStateWithoutAnErrorOwnerLoadsWithItsErrorsReset) {
  Group base;
  ASSERT_TRUE(base.Run(0, 4).ok());
  Group old, reset;
  for (int r = 0; r < kReplicas; ++r) {
    old.params[r] = reset.params[r] = base.params[r];
    ASSERT_TRUE(old.opt[r]->LoadState(Without(base.Save(r), "error_owner"), {4, true}).ok());
    ASSERT_TRUE(reset.opt[r]
                    ->LoadState(Replace(Replace(base.Save(r), "worker_error", {}), "server_error", {}), {4, true})
                    .ok());
  }
  ASSERT_TRUE(old.Run(4, 6).ok());
  ASSERT_TRUE(reset.Run(4, 6).ok());
  ExpectSameParams(old, reset);
}

TEST(QuantizedAdamStateTest, BuffersOfTheWrongSizeAreRefusedByNameAndChangeNothing) {
  Group base;
  ASSERT_TRUE(base.Run(0, 3).ok());
  const State good = base.Save(0);
  struct Case {
    State state;
    std::string name;
  } cases[] = {
      {Replace(good, "m", std::vector<float>(kN - 1)), "m"},
      {Replace(good, "v", std::vector<float>(kN + 1)), "v"},
      {Replace(good, "worker_error", std::vector<float>(kN / 2)), "worker_error"},
      {Replace(good, "server_error", std::vector<float>(kN + 1)), "server_error"},
      {Replace(good, "error_owner", {3, 3}), "error_owner"},
      {Replace(good, "error_owner", {0.5f, 3}), "error_owner"},
      {Replace(good, "error_owner", {1, 2, 3}), "error_owner"},
      {Replace(good, "local", {0.01f, 1}), "anchor"},  // local steps pending without their anchor
      {Replace(good, "anchor", std::vector<float>(kN)), "anchor"},  // an anchor with nothing pending
      {Replace(Replace(Replace(good, "local", {-1, 1}), "anchor", std::vector<float>(kN)), "local_update",
               std::vector<float>(kN)),
       "local"},
      {Replace(good, "layerwise", {3, 9}), "layerwise"},
      {Replace(good, "layerwise", {3, 4, 4}), "layerwise"},
  };
  for (const Case& c : cases) {
    QuantizedAdam q(kN, kN, std::vector<uint8_t>(kN, 0), Options());
    const absl::Status s = q.LoadState(c.state, {3, true});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << s;
    EXPECT_NE(s.message().find(c.name), std::string::npos) << s;
    EXPECT_EQ(q.step(), 0) << c.name;
    EXPECT_EQ(*q.NamedState()[0].second, std::vector<float>(kN, 0.0f)) << c.name << ": m changed";
  }
  QuantizedAdam q(kN, kN, std::vector<uint8_t>(kN, 0), Options());
  EXPECT_EQ(q.LoadState(Without(good, "v"), {3, true}).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(q.LoadState(good, {3, true}).ok());
}


TEST(QuantizedAdamScheduleTest, RefreshIntervalsDoubleAfterEveryGrowthRefreshes) {
  std::vector<int64_t> at, len;
  for (int64_t k = 1; k <= 130; ++k) {
    if (const int64_t i = VarianceRefreshInterval(k, 4, 2)) {
      at.push_back(k);
      len.push_back(i);
    }
  }
  EXPECT_EQ(at, (std::vector<int64_t>{4, 8, 16, 24, 40, 56, 88, 120}));
  EXPECT_EQ(len, (std::vector<int64_t>{4, 4, 8, 8, 16, 16, 32, 32}));
  // Fixed interval (G = 0), never (R = 0), and a step far out (G = 1:
  // refreshes at 4 (2^j - 1), j >= 1).
  EXPECT_EQ(VarianceRefreshInterval(12, 4, 0), 4);
  EXPECT_EQ(VarianceRefreshInterval(13, 4, 0), 0);
  EXPECT_EQ(VarianceRefreshInterval(8, 0, 0), 0);
  EXPECT_EQ(VarianceRefreshInterval(4 * ((int64_t{1} << 40) - 1), 4, 1), 4 * (int64_t{1} << 39));
  EXPECT_EQ(VarianceRefreshInterval(4 * ((int64_t{1} << 40) - 1) - 4, 4, 1), 0);
}

TEST(QuantizedAdamScheduleTest, LocalIntervalsDoubleAfterEveryGrowthSyncsUpToTheCap) {
  std::vector<int64_t> syncs;
  for (int64_t k = 1; k <= 22; ++k) {
    if (LocalStepsSyncAt(k, 4, 2)) syncs.push_back(k);
  }
  EXPECT_EQ(syncs, (std::vector<int64_t>{1, 2, 4, 6, 10, 14, 18, 22}));
  syncs.clear();
  for (int64_t k = 1; k <= 12; ++k) {
    if (LocalStepsSyncAt(k, 4, 0)) syncs.push_back(k);
  }
  EXPECT_EQ(syncs, (std::vector<int64_t>{4, 8, 12}));
  for (int64_t k = 1; k <= 5; ++k) {
    EXPECT_TRUE(LocalStepsSyncAt(k, 1, 3));
    EXPECT_TRUE(LocalStepsSyncAt(k, 0, 0));
  }
}

// Refreshes on the growing schedule (R = 4, G = 2) and local steps (L = 4,
// K = 1) after one warm-up step: each step is the kind the schedule says;
// local steps send nothing and leave the replicas apart; every other step
// leaves all three bit-identical.
QuantizedAdamOptions ZeroOneOptions() {
  QuantizedAdamOptions o = Options();
  o.variance_refresh_steps = 4;
  o.refresh_growth = 2;
  o.max_local_steps = 4;
  o.local_step_growth = 1;
  return o;
}

std::string ExpectedKind(int64_t k) {
  if (k == 0) return "warmup";
  if (VarianceRefreshInterval(k, 4, 2) > 0) return "refresh";
  if (!LocalStepsSyncAt(k, 4, 1) && VarianceRefreshInterval(k + 1, 4, 2) == 0) return "local";
  return "compressed";
}

TEST(QuantizedAdamLocalStepsTest, StepsFollowTheScheduleSendNothingLocallyAndSyncBitIdentical) {
  // The schedule spelled out for the first post-freeze steps (k = 1..16).
  const std::vector<std::string> first = {"compressed", "local", "compressed", "refresh", "local", "local",
                                          "compressed", "refresh", "local", "local", "compressed", "local",
                                          "local", "local", "compressed", "refresh"};
  for (size_t k = 1; k <= first.size(); ++k) EXPECT_EQ(ExpectedKind(k), first[k - 1]) << "k = " << k;
  Group g(ZeroOneOptions());
  int apart = 0;
  for (int t = 0; t < 45; ++t) {
    ASSERT_TRUE(g.Run(t, t + 1).ok());
    for (int r = 0; r < kReplicas; ++r) {
      ASSERT_EQ(g.kinds[t][r], ExpectedKind(t)) << "step " << t << " replica " << r;
      if (g.kinds[t][r] == "local") {
        EXPECT_EQ(g.bytes[t][r], 0u) << "step " << t;
      } else {
        EXPECT_GT(g.bytes[t][r], 0u) << "step " << t;
      }
    }
    if (g.kinds[t][0] == "local") {
      apart += !g.Identical();
    } else {
      ASSERT_TRUE(g.Identical()) << "step " << t << " (" << g.kinds[t][0] << ")";
    }
    // Nothing is pending after a sync; something is during local steps.
    EXPECT_EQ(Buffer(*g.opt[0], "local").empty(), g.kinds[t][0] != "local") << "step " << t;
  }
  EXPECT_GT(apart, 10) << "local steps should move each replica by its own gradient";
}

// Syncs with no local step before them are the plain compressed steps: with
// L = 4, K = 2 the first two steps after the freeze sync (intervals of 1) and
// match an optimizer without local steps bit for bit; the third is local.
TEST(QuantizedAdamLocalStepsTest, SyncsWithNothingPendingAreThePlainCompressedSteps) {
  QuantizedAdamOptions local = Options();
  local.max_local_steps = 4;
  local.local_step_growth = 2;
  Group a, b(local);
  ASSERT_TRUE(a.Run(0, 3).ok());
  ASSERT_TRUE(b.Run(0, 4).ok());
  EXPECT_EQ(b.kinds[2][0], "compressed");
  EXPECT_EQ(b.kinds[3][0], "local");
  Group c(local);
  ASSERT_TRUE(c.Run(0, 3).ok());
  ExpectSameParams(a, c);
}

// A learning rate of 0 (a schedule's min_lr) through a local interval: the
// sync divides by no zero sum, nothing moves, and the pending state loads.
TEST(QuantizedAdamLocalStepsTest, ALearningRateOfZeroThroughALocalIntervalMovesNothing) {
  Group g(ZeroOneOptions());
  ASSERT_TRUE(g.Run(0, 9).ok());  // k = 8: a refresh
  const std::vector<float> before = g.params[0];
  ASSERT_TRUE(g.Run(9, 11, 0.0).ok());  // k = 9, 10: local, lr 0
  ASSERT_EQ(g.kinds.back()[0], "local");
  QuantizedAdam q(kN, kN, std::vector<uint8_t>(kN, 0), ZeroOneOptions());
  const absl::Status load = q.LoadState(g.Save(0), {11, true});
  EXPECT_TRUE(load.ok()) << load;
  ASSERT_TRUE(g.Run(11, 12, 0.0).ok());  // k = 11: the sync
  ASSERT_EQ(g.kinds.back()[0], "compressed");
  EXPECT_TRUE(g.Identical());
  EXPECT_EQ(g.params[0], before);
}

// A joiner takes rank 0's state and parameters in the middle of a local
// interval (steps k = 12, 13 are local) with a layer-wise plan in force: it
// follows the same schedule as the undisturbed replica of its rank, sends
// nothing at local steps, the next sync leaves the whole group bit-identical,
// and every replica keeps the same plan.
TEST(QuantizedAdamLocalStepsTest, AJoinerMidIntervalContinuesTheScheduleAndSyncsBitIdentical) {
  QuantizedAdamOptions o = ZeroOneOptions();
  o.layerwise_every_steps = 2;  // compressed exchanges at k = 1, 3, 7, 11: a plan after 3 and 11
  const std::vector<int64_t> sizes = {400, 600};
  Group base(o, sizes);
  ASSERT_TRUE(base.Run(0, 14).ok());
  ASSERT_EQ(base.kinds[13][0], "local");
  ASSERT_FALSE(Buffer(*base.opt[0], "anchor").empty());
  ASSERT_EQ(base.opt[0]->layerwise_bits().size(), sizes.size());
  for (int joiner : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("joiner at rank ", joiner));
    Group undisturbed(o, sizes), joined(o, sizes);
    for (int r = 0; r < kReplicas; ++r) {
      const int from = r == joiner ? 0 : r;
      for (Group* g : {&undisturbed, &joined}) {
        g->params[r] = base.params[g == &joined ? from : r];
        ASSERT_TRUE(g->opt[r]->LoadState(base.Save(g == &joined ? from : r), {14, true}).ok());
      }
    }
    ASSERT_TRUE(undisturbed.Run(14, 32).ok());
    for (int t = 14; t < 32; ++t) {  // k = 14 .. 31: syncs at 15, 19, 23, 27, 31; a refresh at 16 and 24
      const absl::Status js = joined.Run(t, t + 1);
      ASSERT_TRUE(js.ok()) << js;
      const std::string& kind = joined.kinds[t - 14][joiner];
      EXPECT_EQ(kind, undisturbed.kinds[t - 14][joiner]) << "step " << t;
      EXPECT_EQ(kind, ExpectedKind(t)) << "step " << t;
      if (kind == "local") {
        EXPECT_EQ(joined.bytes[t - 14][joiner], 0u) << "step " << t;
      } else {
        EXPECT_TRUE(joined.Identical()) << "step " << t << " (" << kind << ")";
      }
      for (int r = 1; r < kReplicas; ++r) {
        EXPECT_EQ(joined.opt[r]->layerwise_bits(), joined.opt[0]->layerwise_bits()) << "step " << t;
      }
    }
    EXPECT_EQ(joined.kinds.back()[joiner], "compressed");
  }
}

// Layer-wise widths in the optimizer: tensors of 500, 300 and 200 values;
// after the freeze the first one's gradients shrink a hundredfold and the
// last one's grow, so its preconditioned momentum spans less (more) than the
// others'. After every 3 compressed exchanges the replicas re-plan on the
// exchanged mean: the same plan everywhere, bit-identical parameters across
// the change, and fewer bytes per compressed step than the uniform 4 bits.
TEST(QuantizedAdamLayerwiseTest, ReplicasShareThePlanStayIdenticalAndSendFewerBytes) {
  QuantizedAdamOptions o = Options();
  o.warmup_steps = 2;
  o.layerwise_every_steps = 3;
  const std::vector<int64_t> sizes = {500, 300, 200};
  Group g(o, sizes);
  g.scale.assign(kN, 1.0f);
  std::fill(g.scale.begin(), g.scale.begin() + 500, 0.01f);
  std::fill(g.scale.begin() + 800, g.scale.end(), 4.0f);
  g.scale_from = 2;
  std::vector<int> plan;
  uint64_t uniform_bytes = 0, planned_bytes = 0;
  for (int t = 0; t < 12; ++t) {
    ASSERT_TRUE(g.Run(t, t + 1).ok());
    ASSERT_TRUE(g.Identical()) << "step " << t;
    const std::vector<int> bits = g.opt[0]->layerwise_bits();
    for (int r = 1; r < kReplicas; ++r) ASSERT_EQ(g.opt[r]->layerwise_bits(), bits) << "step " << t;
    // Compressed exchanges 1, 2, 3 are steps 2, 3, 4: the first plan comes after step 4.
    EXPECT_EQ(bits.empty(), t < 4) << "step " << t;
    if (t >= 2 && t <= 4) uniform_bytes = g.bytes[t][0];
    if (t == 5) plan = bits;
    if (t > 5) planned_bytes = g.bytes[t][0];
  }
  ASSERT_EQ(plan.size(), sizes.size());
  std::printf("compressed step bytes (rank 0): uniform 4-bit %llu, layer-wise %llu, bits %d %d %d\n",
              static_cast<unsigned long long>(uniform_bytes), static_cast<unsigned long long>(planned_bytes), plan[0],
              plan[1], plan[2]);
  EXPECT_LT(plan[0], 4);
  EXPECT_GE(plan[2], plan[1]);
  EXPECT_LT(planned_bytes, uniform_bytes);
}

// dp.warmupBits: the warm-up and refresh steps exchange the gradient as 8-bit
// min-max (about a quarter of float32's bytes), the replicas stay
// bit-identical, and the parameters stay close to the float32 warm-up's; the
// compressed steps in between are untouched (the same bytes). Not quantized
// (AdamW), the option changes nothing.
TEST(QuantizedAdamWarmupBitsTest, WarmUpAndRefreshStepsSendAQuarterAndStayClose) {
  QuantizedAdamOptions f32 = Options();
  f32.warmup_steps = 4;
  f32.variance_refresh_steps = 3;
  QuantizedAdamOptions q8 = f32;
  q8.warmup_bits = 8;
  QuantizedAdamOptions q2 = f32;
  q2.warmup_bits = 2;
  Group a(f32), b(q8), c2(q2);
  ASSERT_TRUE(a.Run(0, 4).ok());
  ASSERT_TRUE(b.Run(0, 4).ok());
  ASSERT_TRUE(c2.Run(0, 4).ok());
  // After the warm-up the codes' rounding is the only difference. Adam's
  // first steps are nearly sign steps, so a coordinate whose mean gradient
  // is within a code step of zero may step the other way: more bits, fewer.
  const std::vector<std::string> kinds = {"warmup", "warmup",     "warmup",     "warmup",
                                          "compressed", "compressed", "refresh", "compressed"};
  const std::vector<float> start = RandomFloats(kN, 7);
  double diff8 = 0, diff2 = 0, norm = 0;
  for (int64_t i = 0; i < kN; ++i) {
    diff8 += std::pow(a.params[0][i] - b.params[0][i], 2);
    diff2 += std::pow(a.params[0][i] - c2.params[0][i], 2);
    norm += std::pow(a.params[0][i] - start[i], 2);  // how far float32 moved them
  }
  std::printf("after 4 warm-up steps, parameters from float32's: 8-bit %.2e, 2-bit %.2e (float32 moved %.2e)\n",
              std::sqrt(diff8), std::sqrt(diff2), std::sqrt(norm));
  EXPECT_GT(diff8, 0);  // it did quantize
  EXPECT_LT(diff8, 0.01 * norm);
  EXPECT_LT(diff8 * 4, diff2);
  ASSERT_TRUE(a.Run(4, 8).ok());
  ASSERT_TRUE(b.Run(4, 8).ok());
  ASSERT_TRUE(b.Identical());
  for (int t = 0; t < 8; ++t) {
    ASSERT_EQ(b.kinds[t][0], kinds[t]) << "step " << t;
    const bool gradient = kinds[t] != "compressed";
    for (int r = 0; r < kReplicas; ++r) {
      if (gradient) {
        EXPECT_LT(b.bytes[t][r] * 3, a.bytes[t][r]) << "step " << t << " replica " << r;
        EXPECT_GT(b.bytes[t][r] * 5, a.bytes[t][r]) << "step " << t << " replica " << r;
      } else {
        EXPECT_EQ(b.bytes[t][r], a.bytes[t][r]) << "step " << t << " replica " << r;
      }
    }
  }
  QuantizedAdamOptions adamw = q8, adamw32 = f32;
  adamw.quantized = adamw32.quantized = false;
  Group c(adamw), d(adamw32);
  ASSERT_TRUE(c.Run(0, 2).ok());
  ASSERT_TRUE(d.Run(0, 2).ok());
  ExpectSameParams(c, d);
}

// dp.entropy_coding: zstd over the codes is lossless, so the replicas train
// bit for bit as without it, and where most coordinates have gone quiet (as
// the rows of tokens not seen since the freeze have) the codes crowd around
// the middle and the compressed exchanges send fewer bytes.
TEST(QuantizedAdamEntropyTest, ZstdCodesTrainBitIdenticallyAndSendFewerBytes) {
  QuantizedAdamOptions plain = Options();
  plain.warmup_steps = 2;
  plain.warmup_bits = 8;
  plain.variance_refresh_steps = 8;
  plain.compressed.bucket_elements = kN;  // chunks of ~330 values: room for zstd to pay
  QuantizedAdamOptions coded = plain;
  coded.compressed.codec.entropy = true;
  Group a(plain), b(coded);
  for (Group* g : {&a, &b}) {
    // After the warm-up one coordinate in 20 still gets gradients; the
    // others' momentum decays against their frozen variance.
    g->scale.assign(kN, 0.0f);
    for (int64_t i = 0; i < kN; i += 20) g->scale[i] = 1;
    g->scale_from = plain.warmup_steps;
  }
  ASSERT_TRUE(a.Run(0, 24).ok());
  ASSERT_TRUE(b.Run(0, 24).ok());
  ExpectSameParams(a, b);
  ASSERT_TRUE(b.Identical());
  uint64_t sent[2] = {0, 0};
  for (int t = 0; t < 24; ++t) {
    for (int r = 0; r < kReplicas; ++r) {
      EXPECT_LE(b.bytes[t][r], a.bytes[t][r]) << "step " << t << " (" << b.kinds[t][r] << ") replica " << r;
      if (b.kinds[t][r] == "compressed") {
        sent[0] += a.bytes[t][r];
        sent[1] += b.bytes[t][r];
      }
    }
  }
  std::printf("compressed steps' bytes: %llu plain, %llu with zstd\n", static_cast<unsigned long long>(sent[0]),
              static_cast<unsigned long long>(sent[1]));
  EXPECT_LT(sent[1] * 10, sent[0] * 9);  // at least 10% fewer
}

// A small quadratic (gradient params - target + noise) converges under the
// whole 0/1 Adam schedule with layer-wise widths about as well as under
// plain data-parallel AdamW.
TEST(QuantizedAdamLocalStepsTest, AQuadraticConvergesUnderTheWholeSchedule) {
  QuantizedAdamOptions o = ZeroOneOptions();
  o.warmup_steps = 10;
  o.max_local_steps = 8;
  o.local_step_growth = 2;
  o.layerwise_every_steps = 5;
  QuantizedAdamOptions plain = Options();
  plain.quantized = false;
  const std::vector<int64_t> sizes = {400, 600};
  std::vector<float> target = RandomFloats(kN, 99);
  for (float& x : target) x *= 4;
  double start = 0, end[2] = {0, 0};
  uint64_t total_bytes[2] = {0, 0};
  int k = 0;
  for (const QuantizedAdamOptions* opts : {&o, &plain}) {
    Group g(*opts, sizes);
    g.target = target;
    // The optimum: params = target - 0.2 - mean noise.
    start = 0;
    for (int64_t i = 0; i < kN; ++i) start += std::pow(g.params[0][i] - (target[i] - 0.2), 2);
    int t = 0;
    for (; t < 300 || g.kinds.back()[0] == "local"; ++t) ASSERT_TRUE(g.Run(t, t + 1, 0.02).ok());
    for (int64_t i = 0; i < kN; ++i) end[k] += std::pow(g.params[0][i] - (target[i] - 0.2), 2);
    total_bytes[k] = g.opt[0]->stats().bytes_sent;
    if (opts == &o) {
      EXPECT_NE(g.kinds.back()[0], "local");
      EXPECT_TRUE(g.Identical());
      EXPECT_FALSE(g.opt[0]->layerwise_bits().empty());
      int local = 0;
      for (const auto& kinds : g.kinds) local += kinds[0] == "local";
      EXPECT_GT(local, 150) << "most steps after the freeze should be local";
    }
    ++k;
  }
  std::printf("squared distance to the optimum: start %.1f, 0/1 schedule %.3f, AdamW %.3f; bytes sent by rank 0: "
              "%llu vs %llu (%.1fx less)\n",
              start, end[0], end[1], static_cast<unsigned long long>(total_bytes[0]),
              static_cast<unsigned long long>(total_bytes[1]),
              static_cast<double>(total_bytes[1]) / static_cast<double>(total_bytes[0]));
  EXPECT_LT(total_bytes[0] * 5, total_bytes[1]);
  EXPECT_LT(end[0], 0.01 * start);
  EXPECT_LT(end[0], 3 * end[1] + 0.01 * start);
}

}  // namespace
// Two replicas of an n-value QuantizedAdam stepping together: replica r's
// gradient at step t is grad(t, r).
struct Pair {
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  std::vector<std::vector<float>> params;
  Pair(int64_t n, const QuantizedAdamOptions& o, std::vector<int64_t> sizes = {}) {
    for (int r = 0; r < 2; ++r) {
      opt.push_back(std::make_unique<QuantizedAdam>(n, n, std::vector<uint8_t>(n, 0), o, sizes));
      params.push_back(RandomFloats(n, 7));
    }
  }
  absl::Status Step(int t, const std::function<std::vector<float>(int t, int r)>& grad, double lr = 0.01) {
    Hub hub;
    absl::Status st[2];
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        HubExchange ex(&hub, r, 2);
        st[r] = opt[r]->Step(ex, lr, absl::MakeSpan(params[r]), grad(t, r));
      });
    }
    for (auto& th : threads) th.join();
    return st[0].ok() ? st[1] : st[0];
  }
};

// warmup_steps 0: the first step is a warm-up step, since a variance of
// zeros would make x = m / eps (a job runs kMinQuantizedAdamWarmup); and
// after every
// step no error-feedback residue is larger than the largest update that step
// may take (bc1 B, in units of x), even for rare coordinates whose x is far
// past the bound (a gradient every 5th step, 100x the others, frozen v from
// a step without one), at 1, 2 and 4 bits.
TEST(QuantizedAdamWarmupTest, WarmupZeroStartsWithAWarmupStepAndResiduesStayWithinTheStepBound) {
  constexpr int64_t n = 1024;
  for (int bits : {1, 2, 4}) {
    QuantizedAdamOptions o = Options();
    o.warmup_steps = 0;
    o.compressed.codec.bits = bits;
    Pair p(n, o);
    const auto grad = [](int t, int r) {
      std::vector<float> g = RandomFloats(n, 100 * t + r);
      for (int64_t i = 0; i < 64; ++i) g[i] = t % 5 == 4 ? 100 * g[i] : 0.0f;
      return g;
    };
    for (int t = 0; t < 20; ++t) {
      ASSERT_TRUE(p.Step(t, grad).ok()) << "bits " << bits << " step " << t;
      EXPECT_EQ(DpStepKindName(p.opt[0]->last_step_kind()), t == 0 ? "warmup" : "compressed") << "bits " << bits << " step " << t;
      EXPECT_TRUE(p.opt[0]->frozen());
      const double bc1 = 1 - std::pow(o.beta1, t + 1), bound = AdamUpdateBound(o.beta1, o.beta2, t + 1);
      for (int r = 0; r < 2; ++r) {
        for (const char* name : {"worker_error", "server_error"}) {
          float worst = 0;
          for (float e : Buffer(*p.opt[r], name)) worst = std::max(worst, std::fabs(e));
          EXPECT_LE(worst, bc1 * bound * (1 + 1e-6)) << name << " of replica " << r << ", bits " << bits << " step " << t;
        }
      }
    }
    EXPECT_EQ(0, std::memcmp(p.params[0].data(), p.params[1].data(), n * sizeof(float)));
  }
}

// Layer-wise widths on tensors aligned with the codec's buckets (two of 512
// values, buckets of 64, chunks of 256): the exchanged mean lies on the
// 4-bit grid of every bucket, so a plan measured on it finds no error at
// 4 bits and keeps uniform widths. Measured on the replicas' own momentum
// (averaged), it gives the quiet tensor (x 100 smaller) fewer bits and sends
// fewer bytes; both replicas choose the same plan and stay bit-identical.
TEST(QuantizedAdamLayerwiseTest, APlanOnBucketAlignedTensorsIsMeasuredOnTheMomentumAndDepartsFromUniform) {
  constexpr int64_t n = 1024;
  QuantizedAdamOptions o = Options();
  o.warmup_steps = 2;
  o.layerwise_every_steps = 2;
  Pair p(n, o, {512, 512});
  const auto grad = [](int t, int r) {
    std::vector<float> g = RandomFloats(n, 100 * t + r);
    for (int64_t i = 0; i < 512 && t >= 2; ++i) g[i] *= 0.01f;
    return g;
  };
  uint64_t uniform_bytes = 0, planned_bytes = 0;
  for (int t = 0; t < 8; ++t) {
    const uint64_t before = p.opt[0]->stats().bytes_sent;
    ASSERT_TRUE(p.Step(t, grad).ok()) << "step " << t;
    ASSERT_EQ(p.opt[0]->layerwise_bits(), p.opt[1]->layerwise_bits()) << "step " << t;
    ASSERT_EQ(0, std::memcmp(p.params[0].data(), p.params[1].data(), n * sizeof(float))) << "step " << t;
    if (t == 2) uniform_bytes = p.opt[0]->stats().bytes_sent - before;
    if (t == 6) planned_bytes = p.opt[0]->stats().bytes_sent - before;
  }
  const std::vector<int> bits = p.opt[0]->layerwise_bits();
  ASSERT_EQ(bits.size(), 2u);
  std::printf("aligned tensors: bits %d %d, compressed step bytes %llu -> %llu\n", bits[0], bits[1],
              static_cast<unsigned long long>(uniform_bytes), static_cast<unsigned long long>(planned_bytes));
  EXPECT_LT(bits[0], 4);
  EXPECT_LT(planned_bytes, uniform_bytes);
}

// A replica that lies in the layer-wise measurement round (every value
// -1e30, finite, so the exchange takes it) cannot stall the group: the mean
// is refused as a plan, every replica keeps its widths (uniform here) and
// both keep stepping, bit-identical, with their step counters rising.
TEST(QuantizedAdamLayerwiseTest, AReplicaLyingInTheMeasurementRoundLeavesThePlanAndTheStepsGoOn) {
  class Lying final : public ReplicaExchange {
   public:
    explicit Lying(HubExchange* inner) : inner_(inner) {}
    int rank() const override { return inner_->rank(); }
    int size() const override { return inner_->size(); }
    absl::Status Send(int to, const v1::ExchangeChunk& chunk) override {
      if (chunk.round() != LayerwiseMeasureRound(0)) return inner_->Send(to, chunk);
      int64_t n = 1;
      for (int64_t d : chunk.tensor().shape()) n *= d;
      std::vector<float> lie(n, -1e30f);
      v1::ExchangeChunk c = chunk;
      compression::CodecOptions raw;
      raw.codec = v1::CODEC_RAW_F32;
      const int64_t shape[] = {n};
      AQSWARM_RETURN_IF_ERROR(compression::Encode(raw, lie, shape, 0, c.mutable_tensor()));
      return inner_->Send(to, c);
    }
    absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                              uint32_t bucket, uint32_t chunk) override {
      return inner_->Receive(from, step, round, phase, bucket, chunk);
    }

   private:
    HubExchange* inner_;
  };
  constexpr int64_t n = 1024;
  QuantizedAdamOptions o = Options();
  o.warmup_steps = 2;
  o.layerwise_every_steps = 1;
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  std::vector<std::vector<float>> params;
  for (int r = 0; r < 2; ++r) {
    opt.push_back(std::make_unique<QuantizedAdam>(n, n, std::vector<uint8_t>(n, 0), o, std::vector<int64_t>{512, 512}));
    params.push_back(RandomFloats(n, 7));
  }
  for (int t = 0; t < 6; ++t) {
    Hub hub;
    absl::Status st[2];
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        HubExchange inner(&hub, r, 2);
        Lying liar(&inner);
        std::vector<float> g = RandomFloats(n, 100 * t + r);
        for (int64_t i = 0; i < 512 && t >= 2; ++i) g[i] *= 0.01f;
        ReplicaExchange& ex = r == 1 ? static_cast<ReplicaExchange&>(liar) : inner;
        st[r] = opt[r]->Step(ex, 0.01, absl::MakeSpan(params[r]), g);
      });
    }
    for (auto& th : threads) th.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(st[r].ok()) << "replica " << r << " step " << t << ": " << st[r];
      EXPECT_EQ(opt[r]->step(), t + 1);
      EXPECT_TRUE(opt[r]->layerwise_bits().empty()) << "step " << t;
    }
    ASSERT_EQ(0, std::memcmp(params[0].data(), params[1].data(), n * sizeof(float))) << "step " << t;
  }
}

}  // namespace aqswarm::pipeline
