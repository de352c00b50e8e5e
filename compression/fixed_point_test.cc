// Fixed-point per-channel quantizer: golden values, error bounds,
// unbiasedness of stochastic rounding, sizes, edge inputs.
#include "compression/fixed_point.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "common/checksum.h"
#include "common/half.h"
#include "common/random.h"
#include "compression/bit_pack.h"
#include "compression/codec.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

CodecOptions FixedOpts(int bits, bool stochastic) {
  CodecOptions o;
  o.codec = v1::CODEC_FIXED_POINT;
  o.bits = bits;
  o.rounding = stochastic ? v1::ROUNDING_STOCHASTIC : v1::ROUNDING_NEAREST;
  o.min_compress_elements = 0;
  return o;
}

std::vector<float> Activations(int64_t rows, int64_t cols, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(rows * cols);
  for (int64_t c = 0; c < cols; ++c) {
    const double chan = 0.1 + 3 * rng.UnitDouble();
    for (int64_t r = 0; r < rows; ++r) v[r * cols + c] = static_cast<float>(chan * (2 * rng.UnitDouble() - 1));
  }
  return v;
}

TEST(FixedPointTest, GoldenNearestFourBits) {
  const std::vector<float> x = {1, -0.5f, 0.25f, 0, 0.5f, 1, -0.25f, 2};
  const int64_t shape[2] = {2, 4};
  v1::EncodedTensor msg;
  ASSERT_TRUE(Encode(FixedOpts(4, false), x, shape, 0, &msg).ok());
  const uint16_t want_scales[4] = {0x3c00, 0x3c00, 0x3400, 0x4000};
  ASSERT_EQ(msg.scales().size(), 8u);
  EXPECT_EQ(std::memcmp(msg.scales().data(), want_scales, 8), 0);
  EXPECT_EQ(msg.payload(), std::string("\x4f\x8f\xfc\xf0", 4));  // codes 15,4,15,8,12,15,0,15
  std::vector<float> out(8);
  ASSERT_TRUE(Decode(msg, absl::MakeSpan(out)).ok());
  const std::vector<float> want = {0.875f, -0.5f, 0.21875f, 0, 0.5f, 0.875f, -0.25f, 1.75f};
  EXPECT_EQ(out, want);
}

TEST(FixedPointTest, GoldenStochasticPayloadIsPinned) {
  // Pins the RNG path (DrawUnit keyed by rng_key and element index): a
  // change here breaks cross-version reproducibility of encodes.
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = static_cast<float>(i % 7) * 0.3f - 0.9f;
  const int64_t shape[2] = {8, 8};
  v1::EncodedTensor msg;
  ASSERT_TRUE(Encode(FixedOpts(3, true), x, shape, 1234, &msg).ok());
  EXPECT_EQ(Checksum64(msg.payload().data(), msg.payload().size()), 0x4ac8f0de6352978full)
      << std::hex << Checksum64(msg.payload().data(), msg.payload().size());
}

TEST(FixedPointTest, ErrorWithinOneStepEveryWidth) {
  const int64_t rows = 33, cols = 37;  // odd sizes: codes straddle bytes and rows
  const std::vector<float> x = Activations(rows, cols, 3);
  const int64_t shape[2] = {rows, cols};
  for (int b = 1; b <= 8; ++b) {
    for (bool stoch : {false, true}) {
      v1::EncodedTensor msg;
      ASSERT_TRUE(Encode(FixedOpts(b, stoch), x, shape, 9, &msg).ok());
      EXPECT_EQ(msg.scales().size(), 2u * cols);
      EXPECT_EQ(msg.payload().size(), (x.size() * b + 7) / 8);
      std::vector<float> out(x.size());
      ASSERT_TRUE(Decode(msg, absl::MakeSpan(out)).ok());
      std::vector<uint16_t> sc(cols);
      std::memcpy(sc.data(), msg.scales().data(), 2 * cols);
      for (int64_t i = 0; i < rows * cols; ++i) {
        const float step = HalfToFloat(sc[i % cols]) / static_cast<float>(1 << (b - 1));
        const float top = step * static_cast<float>((1 << (b - 1)) - 1);
        // Inside the grid: half a step (nearest) or one step (stochastic);
        // above the top level the value is clipped to it.
        const float tol = x[i] > top ? x[i] - top + 1e-6f : (stoch ? step : step / 2) * 1.0001f;
        EXPECT_LE(std::fabs(out[i] - x[i]), tol) << "b=" << b << " i=" << i;
      }
    }
  }
}

TEST(FixedPointTest, StochasticRoundingIsUnbiased) {
  const int64_t rows = 4, cols = 16;
  Rng rng(5);
  std::vector<float> x(rows * cols);
  for (auto& v : x) v = static_cast<float>(2.9 * (2 * rng.UnitDouble() - 1));
  for (int c = 0; c < cols; ++c) x[c] = 3.0f;  // fix every channel's scale at 3 (exact in fp16)
  const int64_t shape[2] = {rows, cols};
  const int b = 3, kTrials = 4000;
  std::vector<double> mean(x.size(), 0.0);
  std::vector<float> out(x.size());
  for (int t = 0; t < kTrials; ++t) {
    v1::EncodedTensor msg;
    ASSERT_TRUE(Encode(FixedOpts(b, true), x, shape, 1000 + t, &msg).ok());
    ASSERT_TRUE(Decode(msg, absl::MakeSpan(out)).ok());
    for (size_t i = 0; i < x.size(); ++i) mean[i] += out[i] / static_cast<double>(kTrials);
  }
  const double step = 3.0 / 4;
  for (size_t i = cols; i < x.size(); ++i) {  // row 0 holds the (clipped) maxima
    if (x[i] > 3 * step) continue;             // above the asymmetric grid's top level
    const double y = x[i] / step, lo = std::floor(y);
    const double var = (y - lo) * (lo + 1 - y) * step * step;
    const double tol = 5 * std::sqrt(var / kTrials) + 1e-4 * step;
    EXPECT_NEAR(mean[i], x[i], tol) << i;
  }
}

TEST(FixedPointTest, ZeroAndConstantChannels) {
  const int64_t shape[2] = {64, 32};
  std::vector<float> zeros(64 * 32, 0.0f), out(64 * 32, 1.0f);
  v1::EncodedTensor msg;
  ASSERT_TRUE(Encode(FixedOpts(4, true), zeros, shape, 1, &msg).ok());
  ASSERT_TRUE(Decode(msg, absl::MakeSpan(out)).ok());
  for (float v : out) EXPECT_EQ(v, 0.0f);
  std::vector<float> constant(64 * 32, -0.7f);
  ASSERT_TRUE(Encode(FixedOpts(4, false), constant, shape, 1, &msg).ok());
  ASSERT_TRUE(Decode(msg, absl::MakeSpan(out)).ok());
  for (float v : out) EXPECT_NEAR(v, -0.7f, 1e-3f);  // -8/8 * scale, scale = fp16 round-up of 0.7
}

TEST(FixedPointTest, ScaleIsRoundedUpToHalf) {
  const float m = 0.1f;  // not representable in binary16
  uint16_t h;
  std::vector<float> x = {m, -m / 2};
  ASSERT_TRUE(FixedPointScales(x, 1, &h).ok());
  EXPECT_GE(HalfToFloat(h), m);
  EXPECT_LT(HalfToFloat(h) - m, 1e-4f);
}

TEST(FixedPointTest, NonFiniteAndOutOfRangeAreInvalidArgument) {
  const int64_t shape[2] = {2, 2};
  v1::EncodedTensor msg;
  for (float bad : {NAN, INFINITY, -INFINITY, 1e6f}) {
    std::vector<float> x = {1, 2, bad, 3};
    const absl::Status s = Encode(FixedOpts(4, false), x, shape, 0, &msg);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad << " " << s;
  }
}

TEST(FixedPointTest, DecodeIsDeterministic) {
  const std::vector<float> x = Activations(50, 768, 11);
  const int64_t shape[2] = {50, 768};
  v1::EncodedTensor msg;
  ASSERT_TRUE(Encode(FixedOpts(4, true), x, shape, 77, &msg).ok());
  std::vector<float> a(x.size()), b(x.size());
  ASSERT_TRUE(Decode(msg, absl::MakeSpan(a)).ok());
  ASSERT_TRUE(Decode(msg, absl::MakeSpan(b)).ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 4 * a.size()), 0);
  // Decoding equals the documented formula evaluated element by element.
  std::vector<uint16_t> sc(768);
  std::memcpy(sc.data(), msg.scales().data(), 2 * 768);
  std::vector<uint8_t> codes(x.size());
  UnpackBits(reinterpret_cast<const uint8_t*>(msg.payload().data()), x.size(), 4, codes.data());
  for (size_t i = 0; i < x.size(); ++i) {
    const float step = HalfToFloat(sc[i % 768]) * 0.125f;
    const float want = static_cast<float>(static_cast<int>(codes[i]) - 8) * step;
    ASSERT_EQ(FloatToBits(a[i]), FloatToBits(want)) << i;
  }
  // Same key, same payload; another key, another payload.
  v1::EncodedTensor again, other;
  ASSERT_TRUE(Encode(FixedOpts(4, true), x, shape, 77, &again).ok());
  ASSERT_TRUE(Encode(FixedOpts(4, true), x, shape, 78, &other).ok());
  EXPECT_EQ(again.payload(), msg.payload());
  EXPECT_NE(other.payload(), msg.payload());
}

}  // namespace
}  // namespace aqswarm::compression
