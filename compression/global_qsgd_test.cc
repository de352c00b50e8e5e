// Global-QSGD: integer-summable codes, width rule, unbiasedness, Theorem 4.5
// variance bound, and the exponential reducer's properties.
#include "compression/global_qsgd.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/random.h"
#include "compression/bucketed.h"
#include "compression/codec.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

struct Workers {
  std::vector<std::vector<float>> x;  // per worker
  std::vector<float> scales;          // allreduce-MAX of local max-abs
  std::vector<double> mean;
};

Workers MakeWorkers(int n, size_t d, size_t bucket, uint64_t seed) {
  Workers w;
  Rng rng(seed);
  w.x.assign(n, std::vector<float>(d));
  w.scales.assign(NumBuckets(d, bucket), 0.0f);
  w.mean.assign(d, 0.0);
  for (int i = 0; i < n; ++i) {
    for (auto& v : w.x[i]) v = static_cast<float>(std::tan(3.0 * (rng.UnitDouble() - 0.5)) * 0.1);
    std::vector<float> local(w.scales.size());
    EXPECT_TRUE(LocalBucketMaxAbs(w.x[i], bucket, absl::MakeSpan(local)).ok());
    for (size_t k = 0; k < local.size(); ++k) w.scales[k] = std::max(w.scales[k], local[k]);
    for (size_t j = 0; j < d; ++j) w.mean[j] += w.x[i][j] / n;
  }
  return w;
}

std::vector<v1::EncodedTensor> EncodeAll(const Workers& w, const GlobalQsgdOptions& o, uint32_t key) {
  std::vector<v1::EncodedTensor> msgs(w.x.size());
  const int64_t shape[1] = {static_cast<int64_t>(w.x[0].size())};
  for (size_t i = 0; i < w.x.size(); ++i) {
    const absl::Status s = EncodeGlobalQsgd(o, w.x[i], shape, w.scales, key * 131 + i, &msgs[i]);
    EXPECT_TRUE(s.ok()) << s;
  }
  return msgs;
}

// Balanced pairwise tree (n a power of two), fresh reducer key per node.
v1::EncodedTensor TreeReduce(std::vector<v1::EncodedTensor> level, int out_bits, uint32_t key) {
  uint32_t node = 0;
  while (level.size() > 1) {
    std::vector<v1::EncodedTensor> next(level.size() / 2);
    for (size_t i = 0; i < next.size(); ++i) {
      CombineOptions c;
      c.out_bits = out_bits;
      c.rng_key = key * 7919 + node++;
      const absl::Status s = CombineGlobalQsgd(level[2 * i], level[2 * i + 1], c, &next[i]);
      EXPECT_TRUE(s.ok()) << s;
    }
    level = std::move(next);
  }
  return level[0];
}

TEST(GlobalQsgdTest, AccumulatorWidthRule) {
  EXPECT_EQ(RequiredAccumulatorBits(127, 1), 8);
  EXPECT_EQ(RequiredAccumulatorBits(127, 16), 12);
  EXPECT_EQ(RequiredAccumulatorBits(7, 2), 5);
  EXPECT_EQ(RequiredAccumulatorBits(1, 1), 2);
  EXPECT_EQ(CeilLog2(1), 0);
  EXPECT_EQ(CeilLog2(5), 3);
  EXPECT_EQ(CeilLog2(8), 3);
}

TEST(GlobalQsgdTest, UniformSumIsIdenticalInAnyReductionOrder) {
  const Workers w = MakeWorkers(8, 777, 100, 1);
  GlobalQsgdOptions o;
  o.levels = v1::LEVELS_UNIFORM;
  o.bits = 8;
  o.num_workers = 8;  // s = 2^(8-1-3) - 1 = 15
  o.bucket_size = 100;
  auto msgs = EncodeAll(w, o, 3);
  EXPECT_EQ(msgs[0].num_levels(), 15u);
  const v1::EncodedTensor tree = TreeReduce(msgs, 8, 0);
  std::vector<int32_t> want(777), got(777);
  ASSERT_TRUE(UnpackGlobalQsgdCodes(tree, absl::MakeSpan(want)).ok());
  EXPECT_EQ(tree.num_summed(), 8u);
  Rng rng(5);
  for (int trial = 0; trial < 5; ++trial) {
    std::vector<int> order(8);
    std::iota(order.begin(), order.end(), 0);
    for (int i = 7; i > 0; --i) std::swap(order[i], order[rng.Uniform(i + 1)]);
    v1::EncodedTensor acc = msgs[order[0]];  // a chain (ring-like) in random order
    for (int i = 1; i < 8; ++i) {
      v1::EncodedTensor next;
      ASSERT_TRUE(CombineGlobalQsgd(acc, msgs[order[i]], {}, &next).ok());
      acc = next;
    }
    ASSERT_TRUE(UnpackGlobalQsgdCodes(acc, absl::MakeSpan(got)).ok());
    EXPECT_EQ(got, want);
    EXPECT_EQ(acc.payload(), tree.payload());
  }
  // decode(sum) == mean of the per-worker decodes, to float rounding.
  std::vector<float> mean(777), one(777);
  ASSERT_TRUE(Decode(tree, absl::MakeSpan(mean)).ok());
  std::vector<double> ref(777, 0.0);
  for (const auto& m : msgs) {
    ASSERT_TRUE(Decode(m, absl::MakeSpan(one)).ok());
    for (int j = 0; j < 777; ++j) ref[j] += one[j] / 8.0;
  }
  for (int j = 0; j < 777; ++j) EXPECT_NEAR(mean[j], ref[j], 4e-7 * w.scales[j / 100]) << j;
}

TEST(GlobalQsgdTest, RefusesNarrowAccumulatorAndNeverOverflows) {
  // All workers at +max: every code is exactly s and the sum is n*s.
  const int n = 16;
  std::vector<float> x(300, 2.0f);
  const std::vector<float> scales(3, 2.0f);
  GlobalQsgdOptions o;
  o.levels = v1::LEVELS_UNIFORM;
  o.bucket_size = 100;
  o.bits = 8;  // s = 127 for one worker
  const int64_t shape[1] = {300};
  std::vector<v1::EncodedTensor> msgs(n);
  for (int i = 0; i < n; ++i) ASSERT_TRUE(EncodeGlobalQsgd(o, x, shape, scales, i, &msgs[i]).ok());
  v1::EncodedTensor out;
  // 2 * 127 needs 1 + 7 + 1 = 9 bits: 8-bit output refused, out untouched.
  out.set_num_summed(99);
  EXPECT_EQ(CombineGlobalQsgd(msgs[0], msgs[1], {}, &out).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(out.num_summed(), 99u);
  // With 16-bit codes (rule: 1 + 7 + 4 = 12 <= 16) 16 workers fit.
  const v1::EncodedTensor sum = TreeReduce(msgs, 16, 1);
  std::vector<int32_t> codes(300);
  ASSERT_TRUE(UnpackGlobalQsgdCodes(sum, absl::MakeSpan(codes)).ok());
  for (int32_t c : codes) EXPECT_EQ(c, n * 127);
  std::vector<float> mean(300);
  ASSERT_TRUE(Decode(sum, absl::MakeSpan(mean)).ok());
  for (float v : mean) EXPECT_EQ(v, 2.0f);  // scale maps to the top level exactly
  // Planning for 16 workers in 8 bits: s = 2^(8-1-4) - 1 = 7, and the sum fits 8 bits.
  o.num_workers = 16;
  for (int i = 0; i < n; ++i) ASSERT_TRUE(EncodeGlobalQsgd(o, x, shape, scales, i, &msgs[i]).ok());
  EXPECT_EQ(msgs[0].num_levels(), 7u);
  const v1::EncodedTensor sum8 = TreeReduce(msgs, 8, 1);
  ASSERT_TRUE(UnpackGlobalQsgdCodes(sum8, absl::MakeSpan(codes)).ok());
  for (int32_t c : codes) EXPECT_EQ(c, n * 7);
  // Too many workers for the width is refused at encode time.
  o.num_workers = 1 << 8;
  v1::EncodedTensor m;
  EXPECT_EQ(EncodeGlobalQsgd(o, x, shape, scales, 0, &m).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GlobalQsgdTest, ValuesOnLevelsRoundTripExactlyAndZeroBucketIsZero) {
  std::vector<float> x = {0, 0.25f, -0.5f, 0.75f, 1, -1, 0, 0};
  const std::vector<float> scales = {1.0f, 0.0f};
  for (int i = 6; i < 8; ++i) x[i] = 0.0f;
  GlobalQsgdOptions o;
  o.levels = v1::LEVELS_UNIFORM;
  o.bucket_size = 6;
  o.num_levels = 4;
  const int64_t shape[1] = {8};
  v1::EncodedTensor m;
  ASSERT_TRUE(EncodeGlobalQsgd(o, x, shape, scales, 42, &m).ok());
  std::vector<float> out(8);
  ASSERT_TRUE(Decode(m, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, x);
  // Exponential levels {0, 1/8, 1/4, 1/2, 1} with s = 4.
  o.levels = v1::LEVELS_EXPONENTIAL;
  x = {0, 0.125f, -0.25f, 0.5f, -1, 1, 0, 0};
  ASSERT_TRUE(EncodeGlobalQsgd(o, x, shape, scales, 42, &m).ok());
  ASSERT_TRUE(Decode(m, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, x);
}

TEST(GlobalQsgdTest, ValueAboveSharedScaleIsRejected) {
  const std::vector<float> x(10, 1.0f);
  const std::vector<float> scales = {0.5f};
  const int64_t shape[1] = {10};
  v1::EncodedTensor m;
  EXPECT_EQ(EncodeGlobalQsgd({}, x, shape, scales, 0, &m).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> bad(10, 0.1f);
  bad[3] = NAN;
  EXPECT_EQ(EncodeGlobalQsgd({}, bad, shape, {1.0f}, 0, &m).code(), absl::StatusCode::kInvalidArgument);
}

class GlobalQsgdLevelsTest : public ::testing::TestWithParam<v1::LevelFamily> {};

// Unbiasedness of the combined mean and the Theorem 4.5 bound
// E||G(x) - mean||^2 <= (theta / n) sum_i ||x_i||^2.
TEST_P(GlobalQsgdLevelsTest, UnbiasedMeanAndTheorem45Bound) {
  const int n = 4;
  const size_t d = 64;
  const Workers w = MakeWorkers(n, d, d, 2);
  GlobalQsgdOptions o;
  o.levels = GetParam();
  o.bits = 8;
  o.num_workers = n;
  o.num_levels = 3;
  o.bucket_size = d;
  const int kTrials = 2000;
  std::vector<double> sum(d, 0.0);
  double sq_err = 0;
  std::vector<float> out(d), one(d);
  for (int t = 0; t < kTrials; ++t) {
    auto msgs = EncodeAll(w, o, 100 + t);
    // Theorem 4.5 is about the quantizer: mean of the per-worker decodes.
    std::vector<double> q(d, 0.0);
    for (const auto& m : msgs) {
      ASSERT_TRUE(Decode(m, absl::MakeSpan(one)).ok());
      for (size_t j = 0; j < d; ++j) q[j] += one[j] / n;
    }
    for (size_t j = 0; j < d; ++j) sq_err += (q[j] - w.mean[j]) * (q[j] - w.mean[j]) / kTrials;
    // Unbiasedness through the actual integer / reducer path.
    const v1::EncodedTensor red = TreeReduce(msgs, 8, 900 + t);
    ASSERT_TRUE(Decode(red, absl::MakeSpan(out)).ok());
    for (size_t j = 0; j < d; ++j) sum[j] += out[j];
  }
  double norm_sq = 0;
  for (const auto& xi : w.x) for (float v : xi) norm_sq += static_cast<double>(v) * v;
  const double s = 3;
  const double theta = GetParam() == v1::LEVELS_UNIFORM
                           ? std::sqrt(d) / (std::sqrt(n) * s)
                           : 1.0 / (8 * n) + std::sqrt(d) / (std::sqrt(n) * std::pow(2.0, s - 1));
  EXPECT_LE(sq_err, theta / n * norm_sq);
  // Per coordinate, the reduced value's spread is at most the scale.
  const double scale = w.scales[0];
  for (size_t j = 0; j < d; ++j) {
    EXPECT_NEAR(sum[j] / kTrials, w.mean[j], 5 * scale / std::sqrt(kTrials * 1.0)) << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, GlobalQsgdLevelsTest,
                         ::testing::Values(v1::LEVELS_UNIFORM, v1::LEVELS_EXPONENTIAL));

TEST(ExponentialReducerTest, KDistribution) {
  EXPECT_EQ(ReducerK(0x80000000u, 32), 1);
  EXPECT_EQ(ReducerK(0xffffffffu, 32), 1);
  EXPECT_EQ(ReducerK(0x40000000u, 32), 2);
  EXPECT_EQ(ReducerK(1u, 32), 32);
  EXPECT_EQ(ReducerK(0u, 32), 32);
  EXPECT_EQ(ReducerK(1u, 5), 5);
  // P(k > b) = 2^-b by counting over a uniform sample.
  const int kN = 1 << 20, m = 8;
  std::vector<int> count(m + 2, 0);
  for (int i = 0; i < kN; ++i) count[ReducerK(DrawU32(99, i), m)]++;
  for (int b = 0; b < m; ++b) {
    int above = 0;
    for (int k = b + 1; k <= m; ++k) above += count[k];
    const double p = std::ldexp(1.0, -b);
    EXPECT_NEAR(above / double(kN), p, 5 * std::sqrt(p * (1 - p) / kN) + 1e-9) << b;
  }
}

double Value(ExpValue v) { return v.exponent == 0 ? 0.0 : v.sign * std::ldexp(1.0, -v.exponent); }

TEST(ExponentialReducerTest, ExactEnumerationProperties) {
  const int m = 12;
  auto prob = [&](int k) { return k < m ? std::ldexp(1.0, -k) : std::ldexp(1.0, -(m - 1)); };
  for (int e1 = 0; e1 <= 10; ++e1) {
    for (int e2 = 0; e2 <= 10; ++e2) {
      for (int s1 : {-1, 1}) {
        for (int s2 : {-1, 1}) {
          const ExpValue a{s1, e1}, b{s2, e2};
          const double truth = Value(a) + Value(b);
          // Partial sums above 1/2 cannot occur with the 2^-t pre-scaling
          // in a balanced tree; the reducer saturates there.
          const bool in_range = std::fabs(truth) <= 0.5;
          double mean = 0, sq = 0;
          for (int k = 1; k <= m; ++k) {
            const ExpValue r = ReduceExponential(a, b, k);
            const double v = Value(r);
            mean += prob(k) * v;
            sq += prob(k) * v * v;
            // Output brackets the true sum between neighbouring powers of two.
            if (truth != 0 && in_range) {
              const double lo = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(std::fabs(truth)))));
              EXPECT_TRUE(std::fabs(v) == lo || std::fabs(v) == 2 * lo) << e1 << " " << e2 << " k=" << k;
              EXPECT_EQ(v > 0, truth > 0);
            } else if (truth == 0) {
              EXPECT_EQ(v, 0.0);
            }
          }
          if (e1 == 0) { EXPECT_EQ(Value(ReduceExponential(a, b, 3)), Value(b)); }
          if (e2 == 0) { EXPECT_EQ(Value(ReduceExponential(a, b, 3)), Value(a)); }
          if (e1 == e2 && e1 > 1) {
            const ExpValue r = ReduceExponential(a, b, 1);
            if (s1 == s2) {
              EXPECT_EQ(r.exponent, e1 - 1);
              EXPECT_EQ(r.sign, s1);
            } else {
              EXPECT_EQ(r.exponent, 0);
            }
          }
          if (in_range) {
            EXPECT_NEAR(mean, truth, 1e-15) << e1 << " " << e2 << " " << s1 << " " << s2;
            if (truth != 0) {
              EXPECT_LE(sq - mean * mean, truth * truth / 8 + 1e-18);
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace aqswarm::compression
