#include "pipeline/dp_allreduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "compression/codec.h"
#include "gtest/gtest.h"
#include "pipeline/dp_test_util.h"
#include "pipeline/quantized_adam.h"

namespace aqswarm::pipeline {
namespace {

using testing::Hub;
using testing::HubExchange;

std::vector<float> Random(int64_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>((rng.UnitDouble() * 2 - 1) * scale);
  return v;
}

// Runs fn(rank, exchange) on D threads.
template <typename F>
std::vector<absl::Status> RunReplicas(int d, Hub& hub, F fn) {
  std::vector<absl::Status> st(d);
  std::vector<std::thread> threads;
  for (int r = 0; r < d; ++r) {
    threads.emplace_back([&, r] {
      HubExchange ex(&hub, r, d);
      st[r] = fn(r, ex);
    });
  }
  for (auto& t : threads) t.join();
  return st;
}

TEST(AllReduceTest, RawMeanIsExactUpToRoundingAndBitIdenticalOnEveryReplica) {
  for (int d : {1, 2, 3, 4}) {
    const int64_t n = 10007;
    Hub hub;
    std::vector<std::vector<float>> in(d), out(d, std::vector<float>(n));
    for (int r = 0; r < d; ++r) in[r] = Random(n, r + 1);
    AllReduceOptions o;
    o.bucket_elements = 3000;  // several buckets, ragged chunks
    std::vector<AllReduceStats> stats(d);
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      return AllReduceMean(ex, o, 7, 0, in[r], absl::MakeSpan(out[r]), nullptr, nullptr, &stats[r]);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    for (int r = 0; r < d; ++r) {
      EXPECT_EQ(stats[r].raw_bytes, Float32AllReduceBytes(n, r, d, o.bucket_elements)) << "d=" << d << " r=" << r;
      EXPECT_EQ(stats[r].bytes_sent, stats[r].raw_bytes) << "float32 sends its raw size";
    }
    for (int64_t i = 0; i < n; ++i) {
      double mean = 0;
      for (int r = 0; r < d; ++r) mean += in[r][i];
      ASSERT_NEAR(out[0][i], mean / d, 1e-6) << i;
    }
    for (int r = 1; r < d; ++r) EXPECT_EQ(0, std::memcmp(out[0].data(), out[r].data(), n * 4)) << "d=" << d;
  }
}

// Records the order of a replica's sends and receives (round, phase).
class RecordingExchange final : public ReplicaExchange {
 public:
  struct Event {
    bool send;
    uint32_t round;
    v1::ExchangeChunk::Phase phase;
  };
  explicit RecordingExchange(ReplicaExchange& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  absl::Status Send(int to, const v1::ExchangeChunk& chunk) override {
    events.push_back({true, chunk.round(), chunk.phase()});
    return inner_.Send(to, chunk);
  }
  absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                            uint32_t bucket, uint32_t chunk) override {
    events.push_back({false, round, phase});
    return inner_.Receive(from, step, round, phase, bucket, chunk);
  }
  std::vector<Event> events;

 private:
  ReplicaExchange& inner_;
};

// The number of receives a replica starts before its last send of `phase`:
// 0 when every chunk of that phase (of every round and bucket) left before
// anything of it was awaited.
int ReceivesBeforeLastSend(const std::vector<RecordingExchange::Event>& events, v1::ExchangeChunk::Phase phase) {
  int last = -1;
  for (int i = 0; i < static_cast<int>(events.size()); ++i) {
    if (events[i].send && events[i].phase == phase) last = i;
  }
  int receives = 0;
  for (int i = 0; i < last; ++i) receives += !events[i].send && events[i].phase == phase;
  return receives;
}

TEST(AllReduceTest, PartsShareRoundTripsAndMatchSeparateCallsBitForBit) {
  // A compressed vector of 3 buckets with error feedback (round 0) and a
  // small float32 one (round 1), as QuantizedAdam's compressed step sends.
  const int64_t n = 5000, m = 300;
  const AllReduceOptions q = testing::MinMaxAllReduce(4, 256, 64, 2048);
  AllReduceOptions raw;
  raw.bucket_elements = 2048;
  for (int d : {2, 3}) {
    std::vector<std::vector<float>> in(d), small(d);
    for (int r = 0; r < d; ++r) {
      in[r] = Random(n, 40 + r);
      small[r] = Random(m, 80 + r);
    }
    struct Result {
      std::vector<float> out, small_out, we, se;
      AllReduceStats stats;
      std::vector<RecordingExchange::Event> events;
    };
    auto run = [&](bool together) {
      std::vector<Result> res(d);
      Hub hub;
      auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& hub_ex) {
        RecordingExchange ex(hub_ex);
        Result& x = res[r];
        x.out.assign(n, 0);
        x.small_out.assign(m, 0);
        absl::Status s;
        if (together) {
          const AllReducePart parts[] = {{q, 0, in[r], absl::MakeSpan(x.out), &x.we, &x.se},
                                         {raw, 1, small[r], absl::MakeSpan(x.small_out)}};
          s = AllReduceMeanParts(ex, 3, parts, &x.stats);
        } else {
          s = AllReduceMean(ex, q, 3, 0, in[r], absl::MakeSpan(x.out), &x.we, &x.se, &x.stats);
          if (s.ok()) s = AllReduceMean(ex, raw, 3, 1, small[r], absl::MakeSpan(x.small_out), nullptr, nullptr, &x.stats);
        }
        x.events = ex.events;
        return s;
      });
      for (auto& s : st) EXPECT_TRUE(s.ok()) << s;
      return res;
    };
    const std::vector<Result> apart = run(false), together = run(true);
    for (int r = 0; r < d; ++r) {
      EXPECT_EQ(apart[r].out, together[r].out) << "d=" << d << " r=" << r;
      EXPECT_EQ(apart[r].small_out, together[r].small_out);
      EXPECT_EQ(apart[r].we, together[r].we);
      EXPECT_EQ(apart[r].se, together[r].se);
      EXPECT_EQ(apart[r].stats.bytes_sent, together[r].stats.bytes_sent);
      EXPECT_EQ(apart[r].out, together[0].out) << "replicas agree";
      // Together, every SCATTER chunk (both rounds, all buckets) leaves before
      // any is awaited, and every mean before any mean is awaited: about two
      // one-way latencies in all. Apart, the float32 round's chunks wait for
      // the compressed round's means.
      EXPECT_EQ(ReceivesBeforeLastSend(together[r].events, v1::ExchangeChunk::SCATTER), 0);
      EXPECT_EQ(ReceivesBeforeLastSend(together[r].events, v1::ExchangeChunk::GATHER), 0);
      EXPECT_GT(ReceivesBeforeLastSend(apart[r].events, v1::ExchangeChunk::SCATTER), 0);
    }
  }
}

TEST(AllReduceTest, PartsWithTheSameRoundAreRefused) {
  Hub hub;
  HubExchange ex(&hub, 0, 1);
  std::vector<float> a(10, 1), b(10, 2);
  const AllReducePart parts[] = {{AllReduceOptions(), 4, a, absl::MakeSpan(a)},
                                 {AllReduceOptions(), 4, b, absl::MakeSpan(b)}};
  const absl::Status s = AllReduceMeanParts(ex, 0, parts);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("share a round"), std::string::npos) << s;
}

TEST(AllReduceTest, CompressedWithErrorFeedbackKeepsTheIdentityAndReplicasAgree) {
  const int d = 3, rounds = 20;
  const int64_t n = 5000;
  AllReduceOptions o;
  o.codec.codec = v1::CODEC_MINMAX;
  o.codec.bits = 2;
  o.codec.bucket_size = 256;
  o.codec.min_compress_elements = 64;  // chunks here are ~680 values
  o.bucket_elements = 2048;
  std::vector<std::vector<float>> we(d), se(d);
  std::vector<double> sum_out(n, 0), sum_mean(n, 0);
  uint64_t bytes = 0, raw = 0;
  for (int t = 0; t < rounds; ++t) {
    Hub hub;
    std::vector<std::vector<float>> in(d), out(d, std::vector<float>(n));
    for (int r = 0; r < d; ++r) in[r] = Random(n, 100 * t + r);
    std::vector<AllReduceStats> stats(d);
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      return AllReduceMean(ex, o, t, 0, in[r], absl::MakeSpan(out[r]), &we[r], &se[r], &stats[r]);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    for (int r = 1; r < d; ++r) ASSERT_EQ(0, std::memcmp(out[0].data(), out[r].data(), n * 4));
    for (int64_t i = 0; i < n; ++i) {
      sum_out[i] += out[0][i];
      for (int r = 0; r < d; ++r) sum_mean[i] += in[r][i] / d;
    }
    bytes += stats[0].bytes_sent;
    raw += stats[0].raw_bytes;
  }
  // Sum of outputs + mean worker error + server error == sum of true means.
  std::vector<double> residual(n, 0);
  for (int r = 0; r < d; ++r) {
    for (int64_t i = 0; i < n; ++i) residual[i] += we[r][i] / d;
  }
  for (int r = 0; r < d; ++r) {  // server errors live on the owner of each element
    int64_t off = 0;
    for (int64_t bs = 0; bs < n; bs += o.bucket_elements) {
      const auto [a, b] = ChunkRange(std::min<int64_t>(o.bucket_elements, n - bs), r, d);
      for (int64_t i = a; i < b; ++i) residual[bs + i] += se[r][off++];
    }
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(sum_out[i] + residual[i], sum_mean[i], 1e-4) << i;
  EXPECT_LT(bytes * 10, raw * 2);  // 2 bits + scales: well under a fifth of fp32
}

TEST(AllReduceTest, VanishedReplicaFailsTheOthersWithinTheTimeout) {
  const int d = 3;
  Hub hub(absl::Milliseconds(300));
  hub.Kill(2);
  std::vector<float> in = Random(1000, 1), out(1000);
  const absl::Time start = absl::Now();
  auto st = RunReplicas(2, hub, [&](int r, ReplicaExchange&) {
    HubExchange ex(&hub, r, d);  // replicas 0 and 1 of a group of 3
    return AllReduceMean(ex, {}, 0, 0, in, absl::MakeSpan(out), nullptr, nullptr);
  });
  for (auto& s : st) {
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) << s;
    EXPECT_NE(s.message().find("replica"), std::string::npos) << s;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A replica that corrupts what it sends: its SCATTER contributions are
// scaled by `scale` or carry a NaN (raw float32 chunks), as a hostile or
// broken peer's would.
class HostileExchange final : public ReplicaExchange {
 public:
  HostileExchange(Hub* hub, int rank, int size, float scale, bool nan) : inner_(hub, rank, size), scale_(scale), nan_(nan) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  absl::Status Send(int to, const v1::ExchangeChunk& chunk) override {
    if (chunk.phase() != v1::ExchangeChunk::SCATTER || chunk.tensor().codec() != v1::CODEC_RAW_F32) {
      return inner_.Send(to, chunk);
    }
    v1::ExchangeChunk bad = chunk;
    std::string& p = *bad.mutable_tensor()->mutable_payload();
    for (size_t i = 0; i + 4 <= p.size(); i += 4) {
      float f;
      std::memcpy(&f, p.data() + i, 4);
      f = nan_ && i == 4 * 3 ? NAN : f * scale_;
      std::memcpy(p.data() + i, &f, 4);
    }
    return inner_.Send(to, bad);
  }
  absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                            uint32_t bucket, uint32_t chunk) override {
    return inner_.Receive(from, step, round, phase, bucket, chunk);
  }

 private:
  HubExchange inner_;
  const float scale_;
  const bool nan_;
};

double RelativeError(const std::vector<float>& x, const std::vector<double>& ref) {
  double e = 0, r = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    e += (x[i] - ref[i]) * (x[i] - ref[i]);
    r += ref[i] * ref[i];
  }
  return std::sqrt(e / r);
}

// One of 4 replicas sends x1000 or NaN contributions. The plain mean follows
// it (x1000) or refuses the round (NaN); both robust modes stay close to the
// honest replicas' mean, drop the NaN (counted) and keep every replica's
// output bit-identical.
TEST(AllReduceRobustTest, OneHostileReplicaOfFourIsClippedOrDropped) {
  constexpr int d = 4, hostile = 3;
  const int64_t n = 6001;
  std::vector<std::vector<float>> in(d);
  const std::vector<float> g = Random(n, 99);
  for (int r = 0; r < d; ++r) {
    const std::vector<float> noise = Random(n, r + 1, 0.1);
    in[r].resize(n);
    for (int64_t i = 0; i < n; ++i) in[r][i] = g[i] + noise[i];
  }
  std::vector<double> honest(n, 0);
  for (int r = 0; r < d; ++r) {
    if (r == hostile) continue;
    for (int64_t i = 0; i < n; ++i) honest[i] += in[r][i] / 3.0;
  }
  for (bool nan : {false, true}) {
    for (RobustAggregation mode :
         {RobustAggregation::kOff, RobustAggregation::kClipNorm, RobustAggregation::kCenteredClip}) {
      Hub hub(absl::Seconds(2));
      AllReduceOptions o;
      o.bucket_elements = 2500;  // several buckets, ragged chunks
      o.robust = mode;
      std::vector<std::vector<float>> out(d, std::vector<float>(n));
      std::vector<AllReduceStats> stats(d);
      std::vector<absl::Status> st(d);
      std::vector<std::thread> threads;
      for (int r = 0; r < d; ++r) {
        threads.emplace_back([&, r] {
          HubExchange honest_ex(&hub, r, d);
          HostileExchange hostile_ex(&hub, r, d, nan ? 1.0f : 1000.0f, nan);
          ReplicaExchange& ex = r == hostile ? static_cast<ReplicaExchange&>(hostile_ex) : honest_ex;
          st[r] = AllReduceMean(ex, o, 3, 0, in[r], absl::MakeSpan(out[r]), nullptr, nullptr, &stats[r]);
        });
      }
      for (auto& t : threads) t.join();
      const std::string what = absl::StrCat(nan ? "NaN" : "x1000", " mode ", static_cast<int>(mode));
      if (mode == RobustAggregation::kOff && nan) {
        for (int r = 0; r < d; ++r) {
          if (r != hostile) EXPECT_TRUE(compression::IsNonFiniteError(st[r])) << what << " rank " << r << ": " << st[r];
        }
        continue;
      }
      for (int r = 0; r < d; ++r) ASSERT_TRUE(st[r].ok()) << what << " rank " << r << ": " << st[r];
      for (int r = 1; r < d; ++r) EXPECT_EQ(0, std::memcmp(out[0].data(), out[r].data(), n * 4)) << what;
      for (float v : out[0]) ASSERT_TRUE(std::isfinite(v)) << what;
      const double err = RelativeError(out[0], honest);
      if (mode == RobustAggregation::kOff) {
        EXPECT_GT(err, 100) << what << ": the plain mean follows the hostile replica";
        continue;
      }
      EXPECT_LT(err, mode == RobustAggregation::kCenteredClip ? 0.1 : 0.4) << what;
      uint64_t dropped = 0, clipped = 0;
      for (const AllReduceStats& s : stats) {
        dropped += s.robust_dropped;
        clipped += s.robust_clipped;
      }
      if (nan) {
        EXPECT_EQ(dropped, 3u * 3u) << what << ": one per bucket at each of 3 honest owners";
      } else {
        EXPECT_EQ(dropped, 0u) << what;
        EXPECT_GE(clipped, 3u * 3u) << what;
      }
    }
  }
}

TEST(AllReduceRobustTest, CombineContributionsDropsAndClips) {
  const std::vector<std::vector<float>> c = {{1, 0}, {1, 0.2f}, {0.8f, 0}, {-500, 500}};
  std::vector<float> out(2);
  AllReduceStats st;
  ASSERT_TRUE(CombineContributions(RobustAggregation::kOff, 2, c, {true, true, true, false}, absl::MakeSpan(out), &st).ok());
  EXPECT_NEAR(out[0], 2.8 / 3, 1e-6);
  ASSERT_TRUE(CombineContributions(RobustAggregation::kClipNorm, 2, c, {true, true, true, true}, absl::MakeSpan(out), &st).ok());
  EXPECT_EQ(st.robust_clipped, 1u);
  EXPECT_LT(std::hypot(out[0] - 0.6, out[1] - 0.05), 0.6);
  EXPECT_TRUE(absl::IsFailedPrecondition(
      CombineContributions(RobustAggregation::kClipNorm, 2, c, {false, false, false, false}, absl::MakeSpan(out), &st)));
}

// Training with data parallelism where one replica of 4 sends gradients
// reversed and x1000 (AdamW over the exchange, a quadratic loss): the plain
// mean climbs, both robust modes still converge.
TEST(AllReduceRobustTest, TrainingConvergesWithAHostileReplicaOnlyUnderRobust) {
  constexpr int d = 4, hostile = 2, steps = 60;
  const int64_t n = 3000;
  const std::vector<float> target = Random(n, 5);
  auto loss = [&](const std::vector<float>& x) {
    double l = 0;
    for (int64_t i = 0; i < n; ++i) l += 0.5 * (x[i] - target[i]) * (x[i] - target[i]);
    return l / n;
  };
  for (RobustAggregation mode :
       {RobustAggregation::kOff, RobustAggregation::kClipNorm, RobustAggregation::kCenteredClip}) {
    QuantizedAdamOptions qo;
    qo.quantized = false;  // AdamW on the exchanged mean gradient
    qo.compressed.robust = mode;
    std::vector<std::unique_ptr<QuantizedAdam>> opt;
    std::vector<std::vector<float>> x(d, std::vector<float>(n, 0.0f));
    for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, 0, std::vector<uint8_t>(n, 0), qo));
    const double start = loss(x[0]);
    for (int t = 0; t < steps; ++t) {
      Hub hub;
      auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
        std::vector<float> grad(n);
        const std::vector<float> noise = Random(n, 1000 * t + r, 0.05);
        for (int64_t i = 0; i < n; ++i) grad[i] = x[r][i] - target[i] + noise[i];
        if (r == hostile) {
          for (float& v : grad) v *= -1000.0f;
        }
        return opt[r]->Step(ex, 0.05, absl::MakeSpan(x[r]), grad);
      });
      for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    }
    for (int r = 1; r < d; ++r) EXPECT_EQ(0, std::memcmp(x[0].data(), x[r].data(), n * 4));
    const double end = loss(x[0]);
    if (mode == RobustAggregation::kOff) {
      EXPECT_GT(end, start) << "the hostile replica should win the plain mean";
    } else {
      EXPECT_LT(end, 0.1 * start) << "mode " << static_cast<int>(mode);
    }
  }
}

TEST(AllReduceTest, ChunksCoverTheBucket) {
  for (int64_t len : {0, 1, 5, 1000}) {
    for (int d = 1; d <= 5; ++d) {
      int64_t next = 0;
      for (int r = 0; r < d; ++r) {
        auto [a, b] = ChunkRange(len, r, d);
        EXPECT_EQ(a, next);
        EXPECT_LE(b - a, len / d + 1);
        next = b;
      }
      EXPECT_EQ(next, len);
    }
  }
}

class GlobalQsgdAllReduceTest : public ::testing::TestWithParam<v1::LevelFamily> {};

TEST_P(GlobalQsgdAllReduceTest, IntegerSumPathGivesTheMeanOnEveryReplicaBitIdentically) {
  for (int d : {2, 3, 4}) {
    const int64_t n = 10000;
    Hub hub;
    std::vector<std::vector<float>> in(d), out(d, std::vector<float>(n));
    for (int r = 0; r < d; ++r) in[r] = Random(n, 40 + r);
    GlobalQsgdAllReduceOptions o;
    o.bits = 8;
    o.levels = GetParam();
    o.bucket_size = 512;
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      return GlobalQsgdAllReduceMean(ex, o, 3, 0, in[r], absl::MakeSpan(out[r]));
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    for (int r = 1; r < d; ++r) ASSERT_EQ(0, std::memcmp(out[0].data(), out[r].data(), n * 4)) << "d=" << d;
    // Unbiased and close: the mean error over many coordinates is ~0 and the
    // per-coordinate error is bounded by the grid.
    // Exponential levels round to a neighbouring power of two, so one
    // coordinate can be off by up to its own magnitude (<= the scale, 1 here);
    // in aggregate the relative squared error stays small.
    double bias = 0, worst = 0, err2 = 0, norm2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      double mean = 0;
      for (int r = 0; r < d; ++r) mean += in[r][i] / d;
      bias += out[0][i] - mean;
      worst = std::max(worst, std::fabs(out[0][i] - mean));
      err2 += (out[0][i] - mean) * (out[0][i] - mean);
      norm2 += mean * mean;
    }
    EXPECT_LT(std::fabs(bias / n), 2e-3) << "d=" << d;
    EXPECT_LT(worst, GetParam() == v1::LEVELS_UNIFORM ? 0.05 : 1.0) << "d=" << d;
    EXPECT_LT(err2 / norm2, GetParam() == v1::LEVELS_UNIFORM ? 0.01 : 0.5) << "d=" << d;
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, GlobalQsgdAllReduceTest,
                         ::testing::Values(v1::LEVELS_UNIFORM, v1::LEVELS_EXPONENTIAL));

// Reference Adam on the mean gradient, in the same float arithmetic.
struct RefAdam {
  std::vector<float> m, v;
  int64_t t = 0;
};

// Adam's largest step at step t, summed term by term: sqrt(sum_i w_i^2 / u_i)
// with w_i, u_i the weights of g_i in m^ and of g_i^2 in v^.
double AdamBoundBySum(double b1, double b2, int t) {
  double sum = 0;
  for (int i = 1; i <= t; ++i) {
    const double w = (1 - b1) * std::pow(b1, t - i) / (1 - std::pow(b1, t));
    const double u = (1 - b2) * std::pow(b2, t - i) / (1 - std::pow(b2, t));
    sum += w * w / u;
  }
  return std::sqrt(sum);
}

TEST(QuantizedAdamTest, AdamUpdateBoundIsReachedBySomeGradientHistory) {
  for (int t : {1, 2, 17, 65, 500}) {
    const double bound = AdamUpdateBound(0.9, 0.999, t);
    EXPECT_NEAR(bound, AdamBoundBySum(0.9, 0.999, t), 1e-9) << t;
    // Cauchy-Schwarz equality: g_i proportional to w_i / u_i ~ (b1/b2)^(t-i).
    double m = 0, v = 0;
    for (int i = 1; i <= t; ++i) {
      const double g = std::pow(0.9 / 0.999, t - i);
      m = 0.9 * m + 0.1 * g;
      v = 0.999 * v + 0.001 * g * g;
    }
    EXPECT_NEAR(m / (1 - std::pow(0.9, t)) / std::sqrt(v / (1 - std::pow(0.999, t))), bound, 1e-9) << t;
  }
  EXPECT_NEAR(AdamUpdateBound(0.9, 0.999, 1), 1.0, 1e-12);  // Adam's first step is +-lr
}

// The reference's AdamW step t on the mean of two replicas' gradients (betas
// 0.9 / 0.99, eps 1e-8, weight decay 0.1 where `decay`): updates m, v, ref.
void ReferenceAdamWStep(int t, double lr, const std::vector<std::vector<float>>& g, const std::vector<uint8_t>& decay,
                        std::vector<double>& m, std::vector<double>& v, std::vector<float>& ref) {
  const double bc1 = 1 - std::pow(0.9, t), bc2 = 1 - std::pow(0.99, t);
  for (size_t i = 0; i < ref.size(); ++i) {
    const double gm = (static_cast<double>(g[0][i]) + g[1][i]) / 2;
    m[i] = 0.9 * m[i] + 0.1 * gm;
    v[i] = 0.99 * v[i] + 0.01 * gm * gm;
    if (decay[i]) ref[i] *= 1 - lr * 0.1;
    ref[i] -= lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + 1e-8);
  }
}

TEST(QuantizedAdamTest, LosslessWarmupMatchesAdamWOnTheMeanGradientAndFrozenPhaseFollowsTheFormula) {
  const int d = 2;
  const int64_t n = 3000, nc = 2000;
  QuantizedAdamOptions o;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  o.warmup_steps = 3;
  o.compressed.codec.codec = v1::CODEC_RAW_F32;  // lossless "compression"
  std::vector<uint8_t> decay(n, 1);
  for (int64_t i = nc; i < n; ++i) decay[i] = 0;
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, nc, decay, o));
  std::vector<std::vector<float>> params(d, Random(n, 9));
  std::vector<float> ref = params[0];
  std::vector<double> m(n, 0), v(n, 0), vf;
  const double lr = 0.01;
  for (int t = 1; t <= 6; ++t) {
    Hub hub;
    std::vector<std::vector<float>> g(d);
    for (int r = 0; r < d; ++r) g[r] = Random(n, 1000 * t + r);
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      return opt[r]->Step(ex, lr, absl::MakeSpan(params[r]), g[r]);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(0, std::memcmp(params[0].data(), params[1].data(), n * 4)) << "replicas diverged at step " << t;
    if (t <= 3) {
      ReferenceAdamWStep(t, lr, g, decay, m, v, ref);
    } else {
      if (vf.empty()) {  // frozen at step 3, bias-corrected (the floor fills zeros only: none here)
        vf = v;
        for (auto& x : vf) x /= 1 - std::pow(0.99, 3);
      }
      // Bias-corrected m over the frozen variance, bounded by Adam's own
      // largest step at t (AdamBoundBySum); where it binds, v rises to
      // (m / bc1 / bound)^2.
      const double bc1 = 1 - std::pow(0.9, t), bound = AdamBoundBySum(0.9, 0.99, t);
      for (int64_t i = 0; i < n; ++i) {
        m[i] = 0.9 * m[i] + 0.1 * (static_cast<double>(g[0][i]) + g[1][i]) / 2;
        const double raw = m[i] / bc1 / (std::sqrt(vf[i]) + 1e-8);
        if (std::fabs(raw) > bound) vf[i] = std::pow(m[i] / bc1 / bound, 2);
        if (decay[i]) ref[i] *= 1 - lr * 0.1;
        ref[i] -= lr * std::clamp(raw, -bound, bound);
      }
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(params[0][i], ref[i], 2e-5) << "step " << t << " i " << i;
  }
  EXPECT_TRUE(opt[0]->frozen());
}

TEST(QuantizedAdamTest, FourBitReplicasStayBitIdenticalAndMoveTowardTheMean) {
  const int d = 3;
  const int64_t n = 4096;
  QuantizedAdamOptions o;
  o.warmup_steps = 2;
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, n, std::vector<uint8_t>(n, 0), o));
  std::vector<std::vector<float>> params(d, std::vector<float>(n, 0.0f));
  for (int t = 0; t < 10; ++t) {
    Hub hub;
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      std::vector<float> g = Random(n, 50 * t + r, 0.1);
      for (auto& x : g) x += 1.0f;  // a common direction every replica sees
      return opt[r]->Step(ex, 0.01, absl::MakeSpan(params[r]), g);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    for (int r = 1; r < d; ++r) ASSERT_EQ(0, std::memcmp(params[0].data(), params[r].data(), n * 4)) << t;
  }
  double mean = 0;
  for (float p : params[0]) mean += p;
  EXPECT_LT(mean / n, -0.05);  // descended along the common gradient
  EXPECT_GT(opt[0]->stats().raw_bytes, 0u);
}

// The cause of the loss spikes after the freeze: min-max buckets quantize
// with an error proportional to the bucket's range, so exchanging raw m puts
// an error sized by the bucket's large-momentum coordinates on coordinates
// whose frozen variance is tiny, and m / sqrt(v) blows it up. Here half a
// bucket never sees a gradient (frozen at the floor) and the other half sees
// a large one of either sign: exchanging the preconditioned momentum moves
// the idle half by less than one lr, exchanging the raw momentum does not.
TEST(QuantizedAdamTest, PreconditionedExchangeKeepsIdleCoordinatesStillInAMixedBucket) {
  const int d = 2;
  const int64_t n = 4096;  // chunks of 2048: above the codec's raw threshold
  // Rows of 16 alternate busy / idle, like the embedding rows of seen and
  // unseen tokens in one min-max bucket of 512.
  auto Idle = [](int64_t i) { return (i / 16) % 2 == 1; };
  auto run = [&](bool precondition) {
    QuantizedAdamOptions o;
    o.warmup_steps = 2;
    o.precondition_exchange = precondition;
    o.update_clip = 0;  // show the raw effect
    std::vector<std::unique_ptr<QuantizedAdam>> opt;
    for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, n, std::vector<uint8_t>(n, 0), o));
    std::vector<std::vector<float>> params(d, std::vector<float>(n, 0.0f));
    for (int t = 0; t < 8; ++t) {
      Hub hub;
      auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
        std::vector<float> g = Random(n, 70 * t + r, 0.5);
        for (int64_t i = 0; i < n; ++i) g[i] = Idle(i) ? 0.0f : g[i] + (i % 2 ? 10.0f : -10.0f);
        return opt[r]->Step(ex, 0.01, absl::MakeSpan(params[r]), g);
      });
      for (auto& s : st) EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(0, std::memcmp(params[0].data(), params[1].data(), n * 4)) << t;
    }
    double idle = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (Idle(i)) idle = std::max(idle, std::fabs(static_cast<double>(params[0][i])));
    }
    return idle;  // largest drift of a coordinate that never had a gradient
  };
  const double pre = run(true), raw = run(false);
  std::printf("idle drift: preconditioned %g raw %g (lr 0.01)\n", pre, raw);
  EXPECT_LT(pre, 0.01);  // under one lr
  EXPECT_GT(raw, 0.01);  // over one lr: the mechanism this test guards against
}

TEST(QuantizedAdamTest, UpdateClipBoundsEveryFrozenStep) {
  const int d = 2;
  const int64_t n = 1024;
  QuantizedAdamOptions o;
  o.warmup_steps = 1;
  o.compressed.codec.codec = v1::CODEC_RAW_F32;
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, n, std::vector<uint8_t>(n, 0), o));
  std::vector<std::vector<float>> params(d, std::vector<float>(n, 0.0f));
  const double lr = 0.01;
  for (int t = 0; t < 4; ++t) {
    const double bound = AdamUpdateBound(o.beta1, o.beta2, t + 1);
    std::vector<std::vector<float>> before = params;
    Hub hub;
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      // Tiny gradients while warming up, then 1000x larger: m / sqrt(v_frozen)
      // would be ~100 lr without the bound.
      std::vector<float> g(n, t == 0 ? 1e-3f : 1.0f);
      return opt[r]->Step(ex, lr, absl::MakeSpan(params[r]), g);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_LE(std::fabs(params[0][i] - before[0][i]), lr * bound * (1 + 1e-5)) << "step " << t << " i " << i;
    }
    if (t == 3) EXPECT_NEAR(before[0][0] - params[0][0], lr * bound, 1e-6);  // it binds
  }
}

// The floor only fills coordinates that saw no gradient: a tensor whose v
// spans orders of magnitude (the output head: rows of frequent tokens vs the
// consistent small gradients of rare ones) keeps its small-v coordinates
// stepping ~lr as Adam does (a floor at 1% of the tensor's mean slowed them
// to ~0.001 lr here).
TEST(QuantizedAdamTest, FrozenSmallVarianceCoordinatesKeepAdamsStep) {
  const int d = 2;
  const int64_t n = 2048;
  const double lr = 0.01;
  QuantizedAdamOptions o;
  o.warmup_steps = 4;
  o.compressed.codec.codec = v1::CODEC_RAW_F32;
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, n, std::vector<uint8_t>(n, 0), o));
  std::vector<std::vector<float>> params(d, std::vector<float>(n, 0.0f));
  for (int t = 1; t <= 8; ++t) {
    const float before = params[0][100];
    Hub hub;
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      std::vector<float> g(n, 1e-3f);                  // small, consistent
      for (int64_t i = 0; i < 16; ++i) g[i] = 100.0f;  // a few large ones
      return opt[r]->Step(ex, lr, absl::MakeSpan(params[r]), g);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(0, std::memcmp(params[0].data(), params[1].data(), n * 4)) << "replicas diverged at step " << t;
    // A constant gradient: Adam's m^ / sqrt(v^) is 1 at every step.
    EXPECT_NEAR(before - params[0][100], lr, 1e-4) << "step " << t;
  }
}

// Where the bound binds, raise_variance_at_bound raises v to (m / bc1 / B)^2:
// the clipped step is B lr once, and with no further gradient the next step
// decays with m (as Adam's would), where a fixed v keeps stepping B lr.
TEST(QuantizedAdamTest, RaisedVarianceLetsAClippedStepDecayWithTheMomentum) {
  const int d = 2;
  const int64_t n = 1024;
  const double lr = 0.01;
  auto run = [&](bool raise) {
    QuantizedAdamOptions o;
    o.warmup_steps = 1;
    o.raise_variance_at_bound = raise;
    o.compressed.codec.codec = v1::CODEC_RAW_F32;
    std::vector<std::unique_ptr<QuantizedAdam>> opt;
    for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, n, std::vector<uint8_t>(n, 0), o));
    std::vector<std::vector<float>> params(d, std::vector<float>(n, 0.0f));
    std::vector<double> moved;  // coordinate 0's step, per step
    for (int t = 1; t <= 4; ++t) {
      const float before = params[0][0];
      Hub hub;
      auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
        // Tiny gradient while warming up, then a large one once, then none.
        std::vector<float> g(n, t == 1 ? 1e-3f : t == 2 ? 1.0f : 0.0f);
        return opt[r]->Step(ex, lr, absl::MakeSpan(params[r]), g);
      });
      for (auto& s : st) EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(0, std::memcmp(params[0].data(), params[1].data(), n * 4)) << "replicas diverged at step " << t;
      moved.push_back(before - params[0][0]);
    }
    return moved;
  };
  const double b2 = AdamUpdateBound(0.9, 0.999, 2), b3 = AdamUpdateBound(0.9, 0.999, 3);
  // Adam's bias-corrected momentum at steps 2 and 3 (no gradient at step 3).
  const double m1 = 0.1 * 1e-3, m2 = 0.9 * m1 + 0.1, m3 = 0.9 * m2;
  const double mh2 = m2 / (1 - 0.81), mh3 = m3 / (1 - 0.729);
  const std::vector<double> raised = run(true), fixed = run(false);
  EXPECT_NEAR(raised[1], lr * b2, 1e-6);  // m / sqrt(v_frozen) ~ 500: clipped
  EXPECT_NEAR(fixed[1], lr * b2, 1e-6);
  EXPECT_NEAR(raised[2], lr * b2 * mh3 / mh2, 1e-6);  // ~0.63 of the bound: decays with m
  EXPECT_NEAR(fixed[2], lr * b3, 1e-6);               // still clipped
  EXPECT_LT(raised[3], raised[2]);
  EXPECT_NEAR(fixed[3], lr * AdamUpdateBound(0.9, 0.999, 4), 1e-6);
}

// A refresh every step with a lossless codec is AdamW: m and v take the
// float32 mean gradient each step, v weighted as Adam's own EMA.
TEST(QuantizedAdamTest, VarianceRefreshEveryStepWithLosslessCodecMatchesAdamW) {
  const int d = 2;
  const int64_t n = 3000, nc = 2000;
  QuantizedAdamOptions o;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.weight_decay = 0.1;
  o.warmup_steps = 3;
  o.variance_refresh_steps = 1;
  o.update_clip = 0;  // AdamW has no bound (at B = 1 here it would bind now and then)
  o.compressed.codec.codec = v1::CODEC_RAW_F32;
  std::vector<uint8_t> decay(n, 1);
  for (int64_t i = nc; i < n; ++i) decay[i] = 0;
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, nc, decay, o));
  std::vector<std::vector<float>> params(d, Random(n, 9));
  std::vector<float> ref = params[0];
  std::vector<double> m(n, 0), v(n, 0);
  const double lr = 0.01;
  for (int t = 1; t <= 8; ++t) {
    Hub hub;
    std::vector<std::vector<float>> g(d);
    for (int r = 0; r < d; ++r) {
      g[r] = Random(n, 1000 * t + r, 0.5);
      for (auto& x : g[r]) x += 1.0f;  // |g| >= 0.5: the variance floor never binds
    }
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      return opt[r]->Step(ex, lr, absl::MakeSpan(params[r]), g[r]);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(0, std::memcmp(params[0].data(), params[1].data(), n * 4)) << "replicas diverged at step " << t;
    ReferenceAdamWStep(t, lr, g, decay, m, v, ref);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(params[0][i], ref[i], 2e-5) << "step " << t << " i " << i;
  }
  EXPECT_TRUE(opt[0]->frozen());
}

// With the 4-bit codec and a refresh every 3rd frozen step: replicas stay
// bit-identical, and exactly the refresh steps send a warm-up step's float32
// bytes (counted in the stats like any other exchange).
TEST(QuantizedAdamTest, VarianceRefreshStepsSendFloat32AndKeepReplicasBitIdentical) {
  const int d = 2;
  const int64_t n = 8192;
  QuantizedAdamOptions o;
  o.warmup_steps = 2;
  o.variance_refresh_steps = 3;
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, n, std::vector<uint8_t>(n, 1), o));
  std::vector<std::vector<float>> params(d, Random(n, 3));
  std::vector<uint64_t> sent;
  for (int t = 1; t <= 9; ++t) {
    const uint64_t before = opt[0]->stats().bytes_sent;
    Hub hub;
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      std::vector<float> g = Random(n, 40 * t + r, 0.1);
      for (auto& x : g) x += 1.0f;
      return opt[r]->Step(ex, 0.01, absl::MakeSpan(params[r]), g);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(0, std::memcmp(params[0].data(), params[1].data(), n * 4)) << "replicas diverged at step " << t;
    sent.push_back(opt[0]->stats().bytes_sent - before);
  }
  // Steps 1-2 warm up, 5 and 8 refresh (3 and 6 frozen steps after the freeze).
  for (int t : {2, 5, 8}) EXPECT_EQ(sent[t - 1], sent[0]) << "step " << t;
  for (int t : {3, 4, 6, 7, 9}) EXPECT_LT(sent[t - 1] * 4, sent[0]) << "step " << t;  // 4-bit codes
}

// Global-QSGD selected for the momentum exchange (dp.codec: global_qsgd):
// replicas stay bit-identical and still descend along the common direction.
TEST(QuantizedAdamTest, GlobalQsgdExchangeKeepsReplicasBitIdentical) {
  const int d = 2;
  const int64_t n = 5000, nc = 4096;
  QuantizedAdamOptions o;
  o.warmup_steps = 2;
  o.compressed.codec.codec = v1::CODEC_GLOBAL_QSGD;
  o.compressed.codec.levels = v1::LEVELS_EXPONENTIAL;
  o.compressed.codec.bits = 4;
  o.compressed.codec.bucket_size = 512;
  std::vector<std::unique_ptr<QuantizedAdam>> opt;
  for (int r = 0; r < d; ++r) opt.push_back(std::make_unique<QuantizedAdam>(n, nc, std::vector<uint8_t>(n, 1), o));
  std::vector<std::vector<float>> params(d, Random(n, 5));
  const std::vector<float> start = params[0];
  for (int t = 0; t < 10; ++t) {
    Hub hub;
    auto st = RunReplicas(d, hub, [&](int r, ReplicaExchange& ex) {
      std::vector<float> g = Random(n, 90 * t + r, 0.1);
      for (auto& x : g) x += 1.0f;
      return opt[r]->Step(ex, 0.01, absl::MakeSpan(params[r]), g);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(0, std::memcmp(params[0].data(), params[1].data(), n * 4)) << "replicas diverged at step " << t;
  }
  EXPECT_TRUE(opt[0]->frozen());
  double moved = 0;
  for (int64_t i = 0; i < n; ++i) moved += start[i] - params[0][i];
  EXPECT_GT(moved / n, 0.05);  // ~10 steps of ~lr each, downhill
  // 4-bit codes (+ shared scales) instead of float32 on the compressed part.
  EXPECT_LT(opt[0]->stats().bytes_sent, opt[0]->stats().raw_bytes);
}

}  // namespace
}  // namespace aqswarm::pipeline
