// QSGD and CGX min-max: unbiasedness, the QSGD variance bound, exact sizes.
#include "compression/bucketed.h"

#include <cmath>
#include <vector>

#include "common/random.h"
#include "compression/codec.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

std::vector<float> Laplace(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    const double u = rng.UnitDouble() - 0.5;
    x = static_cast<float>((u < 0 ? 1 : -1) * std::log(1 - 2 * std::fabs(u) + 1e-12));
  }
  return v;
}

CodecOptions Opts(v1::Codec codec, int bits, bool stochastic, int64_t bucket, v1::NormKind norm = v1::NORM_MAX) {
  CodecOptions o;
  o.codec = codec;
  o.bits = bits;
  o.bucket_size = bucket;
  o.norm = norm;
  o.rounding = stochastic ? v1::ROUNDING_STOCHASTIC : v1::ROUNDING_NEAREST;
  o.min_compress_elements = 0;
  return o;
}

// Monte Carlo over rng keys: mean and variance per coordinate.
void MonteCarlo(const CodecOptions& o, const std::vector<float>& x, int trials,
                std::vector<double>* mean, std::vector<double>* var) {
  const int64_t shape[1] = {static_cast<int64_t>(x.size())};
  std::vector<double> s1(x.size(), 0), s2(x.size(), 0);
  std::vector<float> out(x.size());
  for (int t = 0; t < trials; ++t) {
    v1::EncodedTensor msg;
    ASSERT_TRUE(Encode(o, x, shape, 5000 + t, &msg).ok());
    ASSERT_TRUE(Decode(msg, absl::MakeSpan(out)).ok());
    for (size_t i = 0; i < x.size(); ++i) {
      s1[i] += out[i];
      s2[i] += static_cast<double>(out[i]) * out[i];
    }
  }
  mean->resize(x.size());
  var->resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    (*mean)[i] = s1[i] / trials;
    (*var)[i] = std::max(0.0, s2[i] / trials - (*mean)[i] * (*mean)[i]);
  }
}

class QsgdNormTest : public ::testing::TestWithParam<v1::NormKind> {};

TEST_P(QsgdNormTest, UnbiasedAndWithinVarianceBound) {
  const std::vector<float> x = Laplace(150, 1);  // buckets of 64: 64, 64, 22
  const CodecOptions o = Opts(v1::CODEC_QSGD, 3, true, 64, GetParam());
  const int kTrials = 3000;
  std::vector<double> mean, var;
  MonteCarlo(o, x, kTrials, &mean, &var);
  std::vector<float> norms(3);
  ASSERT_TRUE(QsgdNorms(x, 64, GetParam() == v1::NORM_L2 ? NormKind::kL2 : NormKind::kMax, norms.data()).ok());
  const int s = 3;
  // Per coordinate the sample variance of a rare Bernoulli is too noisy to
  // test against its bound; the sum over 150 coordinates is not.
  double total_var = 0, total_bound = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double unit = static_cast<double>(norms[i / 64]) / s;
    const double y = std::fabs(x[i]) / unit, lo = std::floor(y);
    const double bound = (lo + 1 - y) * (y - lo) * unit * unit;  // (hi-x)(x-lo) scale^2
    EXPECT_NEAR(mean[i], x[i], 5 * std::sqrt(bound / kTrials) + 1e-5 * unit) << i;
    total_var += var[i];
    total_bound += bound;
  }
}

INSTANTIATE_TEST_SUITE_P(Norms, QsgdNormTest, ::testing::Values(v1::NORM_MAX, v1::NORM_L2));

TEST(QsgdTest, SizesSignsAndZeroBuckets) {
  std::vector<float> x = Laplace(1037, 2);
  for (int i = 100; i < 200; ++i) x[i] = 0.0f;  // bucket 1 entirely zero
  for (int b = 2; b <= 8; ++b) {
    const CodecOptions o = Opts(v1::CODEC_QSGD, b, false, 100);
    const int64_t shape[1] = {1037};
    v1::EncodedTensor msg;
    ASSERT_TRUE(Encode(o, x, shape, 0, &msg).ok());
    EXPECT_EQ(msg.scales().size(), 4u * 11);
    EXPECT_EQ(msg.payload().size(), (1037u * b + 7) / 8);
    std::vector<float> out(x.size());
    ASSERT_TRUE(Decode(msg, absl::MakeSpan(out)).ok());
    for (size_t i = 0; i < x.size(); ++i) {
      if (i >= 100 && i < 200) {
        EXPECT_EQ(out[i], 0.0f);
      } else if (out[i] != 0.0f) {
        EXPECT_EQ(std::signbit(out[i]), std::signbit(x[i])) << i;
      }
    }
  }
}

TEST(QsgdTest, BitsOneIsRejected) {
  const std::vector<float> x(10, 1.0f);
  const int64_t shape[1] = {10};
  v1::EncodedTensor msg;
  EXPECT_EQ(Encode(Opts(v1::CODEC_QSGD, 1, false, 4), x, shape, 0, &msg).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MinMaxTest, ExactSizeFormula) {
  const std::vector<float> x = Laplace(1001, 3);
  for (int b = 1; b <= 8; ++b) {
    for (int64_t bucket : {1, 7, 128, 1001, 5000}) {
      const int64_t shape[1] = {1001};
      v1::EncodedTensor msg;
      ASSERT_TRUE(Encode(Opts(v1::CODEC_MINMAX, b, true, bucket), x, shape, 0, &msg).ok());
      const size_t buckets = (1001 + bucket - 1) / bucket;
      EXPECT_EQ(EncodedBytes(msg), 2 * buckets * sizeof(float) + (1001 * b + 7) / 8) << b << " " << bucket;
    }
  }
}

TEST(MinMaxTest, NearestWithinHalfUnitAndConstantBucketExact) {
  std::vector<float> x = Laplace(512, 4);
  for (int i = 256; i < 384; ++i) x[i] = 2.5f;  // constant bucket: unit 0
  const int64_t shape[1] = {512};
  for (int b = 1; b <= 8; ++b) {
    v1::EncodedTensor msg;
    ASSERT_TRUE(Encode(Opts(v1::CODEC_MINMAX, b, false, 128), x, shape, 0, &msg).ok());
    std::vector<float> out(512);
    ASSERT_TRUE(Decode(msg, absl::MakeSpan(out)).ok());
    std::vector<float> mu(8);
    ASSERT_TRUE(MinMaxScales(x, 128, b, mu.data()).ok());
    for (int i = 0; i < 512; ++i) {
      const float unit = mu[2 * (i / 128) + 1];
      EXPECT_LE(std::fabs(out[i] - x[i]), unit * 0.5001f + 1e-6f) << b << " " << i;
    }
    for (int i = 256; i < 384; ++i) EXPECT_EQ(out[i], 2.5f);
  }
}

TEST(MinMaxTest, StochasticIsUnbiased) {
  const std::vector<float> x = Laplace(96, 5);
  const int kTrials = 3000;
  std::vector<double> mean, var;
  MonteCarlo(Opts(v1::CODEC_MINMAX, 2, true, 32), x, kTrials, &mean, &var);
  std::vector<float> mu(6);
  ASSERT_TRUE(MinMaxScales(x, 32, 2, mu.data()).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    const double unit = mu[2 * (i / 32) + 1];
    EXPECT_NEAR(mean[i], x[i], 5 * std::sqrt(0.25 * unit * unit / kTrials) + 1e-5 * unit) << i;
  }
}

TEST(BucketedTest, NonFiniteIsInvalidArgument) {
  for (v1::Codec c : {v1::CODEC_QSGD, v1::CODEC_MINMAX}) {
    for (float bad : {NAN, INFINITY}) {
      std::vector<float> x(300, 1.0f);
      x[257] = bad;
      const int64_t shape[1] = {300};
      v1::EncodedTensor msg;
      EXPECT_EQ(Encode(Opts(c, 4, true, 128), x, shape, 0, &msg).code(),
                absl::StatusCode::kInvalidArgument);
    }
  }
  std::vector<float> big = {-3e38f, 3e38f};
  const int64_t shape[1] = {2};
  v1::EncodedTensor msg;
  EXPECT_EQ(Encode(Opts(v1::CODEC_MINMAX, 4, true, 2), big, shape, 0, &msg).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace aqswarm::compression
