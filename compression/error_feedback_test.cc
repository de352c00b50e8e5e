#include "compression/error_feedback.h"

#include <cmath>
#include <vector>

#include "common/random.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

std::unique_ptr<Compressor> Make(v1::Codec codec, int bits) {
  CodecOptions o;
  o.codec = codec;
  o.bits = bits;
  o.bucket_size = 128;
  o.rounding = v1::ROUNDING_STOCHASTIC;
  o.min_compress_elements = 0;
  auto c = CreateCompressor(o);
  EXPECT_TRUE(c.ok());
  return std::move(c).value();
}

class ErrorFeedbackTest : public ::testing::TestWithParam<v1::Codec> {};

TEST_P(ErrorFeedbackTest, DecodedPlusResidualEqualsInputs) {
  const size_t n = 1000;
  const int64_t shape[2] = {10, 100};
  ErrorFeedback ef(Make(GetParam(), 2));
  Rng rng(4);
  std::vector<double> sum_in(n, 0), sum_out(n, 0);
  std::vector<float> g(n), out(n);
  for (int step = 0; step < 50; ++step) {
    for (auto& v : g) v = static_cast<float>(rng.UnitDouble() - 0.5);
    v1::EncodedTensor msg;
    ASSERT_TRUE(ef.Compress(g, shape, step, &msg).ok());
    ASSERT_TRUE(ef.Decompress(msg, absl::MakeSpan(out)).ok());
    for (size_t i = 0; i < n; ++i) {
      sum_in[i] += g[i];
      sum_out[i] += out[i];
    }
  }
  for (size_t i = 0; i < n; ++i) EXPECT_NEAR(sum_out[i] + ef.residual()[i], sum_in[i], 1e-4) << i;
}

INSTANTIATE_TEST_SUITE_P(Codecs, ErrorFeedbackTest,
                         ::testing::Values(v1::CODEC_FIXED_POINT, v1::CODEC_QSGD, v1::CODEC_MINMAX));

TEST(ErrorFeedbackRestoreTest, RestoredResidualContinuesIdentically) {
  const int64_t shape[1] = {512};
  std::vector<float> g(512);
  Rng rng(5);
  ErrorFeedback a(Make(v1::CODEC_FIXED_POINT, 3));
  v1::EncodedTensor msg;
  for (int step = 0; step < 3; ++step) {
    for (auto& v : g) v = static_cast<float>(rng.UnitDouble());
    ASSERT_TRUE(a.Compress(g, shape, step, &msg).ok());
  }
  const std::vector<float> checkpoint(a.residual().begin(), a.residual().end());
  ErrorFeedback b(Make(v1::CODEC_FIXED_POINT, 3));
  ASSERT_TRUE(b.RestoreResidual(checkpoint).ok());
  v1::EncodedTensor ma, mb;
  ASSERT_TRUE(a.Compress(g, shape, 9, &ma).ok());
  ASSERT_TRUE(b.Compress(g, shape, 9, &mb).ok());
  EXPECT_EQ(ma.SerializeAsString(), mb.SerializeAsString());
  // Wrong size and non-finite residuals are refused.
  std::vector<float> small(10);
  const int64_t small_shape[1] = {10};
  EXPECT_EQ(a.Compress(small, small_shape, 0, &ma).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> bad(512, 0.0f);
  bad[7] = NAN;
  EXPECT_EQ(b.RestoreResidual(bad).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace aqswarm::compression
