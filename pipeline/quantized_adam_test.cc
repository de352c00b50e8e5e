// QuantizedAdam's state handed from one replica to another (a joiner takes
// a live replica's checkpoint).
#include "pipeline/quantized_adam.h"

#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "pipeline/dp_test_util.h"

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
  Group() {
    for (int r = 0; r < kReplicas; ++r) {
      opt.push_back(std::make_unique<QuantizedAdam>(kN, kN, std::vector<uint8_t>(kN, 0), Options()));
      params.push_back(RandomFloats(kN, 7));  // the same start everywhere
    }
  }
  // Steps [from, to): replica r's gradient at step t is seeded by (t, r).
  absl::Status Run(int from, int to) {
    for (int t = from; t < to; ++t) {
      Hub hub;
      std::vector<absl::Status> st(kReplicas);
      std::vector<std::thread> threads;
      for (int r = 0; r < kReplicas; ++r) {
        threads.emplace_back([&, r] {
          HubExchange ex(&hub, r, kReplicas);
          std::vector<float> g = RandomFloats(kN, 1000 * t + r);
          for (float& x : g) x += 0.2f;
          st[r] = opt[r]->Step(ex, 0.01, absl::MakeSpan(params[r]), g);
        });
      }
      for (auto& th : threads) th.join();
      for (const auto& s : st) {
        if (!s.ok()) return s;
      }
    }
    return absl::OkStatus();
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

State Replace(State s, const std::string& name, std::vector<float> v) {
  for (auto& e : s) {
    if (e.first == name) e.second = std::move(v);
  }
  return s;
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
        if (r != joiner) ASSERT_TRUE(g->opt[r]->LoadState(saved[r], 4, true).ok());
      }
    }
    ASSERT_TRUE(joined.opt[joiner]->LoadState(saved[0], 4, true).ok());
    ASSERT_TRUE(reset.opt[joiner]
                    ->LoadState(Replace(Replace(saved[joiner], "worker_error", {}), "server_error", {}), 4, true)
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
    ASSERT_TRUE(restored.opt[r]->LoadState(base.Save(r), 4, true).ok());
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
    ASSERT_TRUE(old.opt[r]->LoadState(Without(base.Save(r), "error_owner"), 4, true).ok());
    ASSERT_TRUE(reset.opt[r]
                    ->LoadState(Replace(Replace(base.Save(r), "worker_error", {}), "server_error", {}), 4, true)
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
  };
  for (const Case& c : cases) {
    QuantizedAdam q(kN, kN, std::vector<uint8_t>(kN, 0), Options());
    const absl::Status s = q.LoadState(c.state, 3, true);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << s;
    EXPECT_NE(s.message().find(c.name), std::string::npos) << s;
    EXPECT_EQ(q.step(), 0) << c.name;
    EXPECT_EQ(*q.NamedState()[0].second, std::vector<float>(kN, 0.0f)) << c.name << ": m changed";
  }
  QuantizedAdam q(kN, kN, std::vector<uint8_t>(kN, 0), Options());
  EXPECT_EQ(q.LoadState(Without(good, "v"), 3, true).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(q.LoadState(good, 3, true).ok());
}

}  // namespace
}  // namespace aqswarm::pipeline
