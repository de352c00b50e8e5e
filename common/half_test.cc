#include "common/half.h"

#include <cmath>
#include <cstring>
#include <vector>
#include <limits>

#include "gtest/gtest.h"

namespace aqswarm {
namespace {

TEST(HalfTest, EveryHalfRoundTripsExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), h) << "h=" << h;
  }
}

TEST(HalfTest, RoundsToNearestEvenBetweenNeighbours) {
  // For each pair of adjacent finite halves, the midpoint goes to the even one
  // and points just off the midpoint go to the nearer one.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double a = HalfToFloat(static_cast<uint16_t>(h));
    const double b = HalfToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((a + b) / 2);
    const uint16_t even = (h % 2 == 0) ? h : h + 1;
    ASSERT_EQ(FloatToHalf(mid), even) << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, -1.0f)), h) << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, 2e5f)), h + 1) << h;
  }
}

TEST(HalfTest, OverflowAndSpecials) {
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalf(1e30f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e30f), 0xfc00);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1e-10f), 0x0000);
}

TEST(HalfTest, SpanFastPathIsBitIdenticalToPortable) {
  // Every half back to float and forward again, then a dense sweep of float
  // bit patterns (normals, subnormals, halfway cases, overflow to inf).
  std::vector<uint16_t> halves(65536);
  for (uint32_t h = 0; h < 65536; ++h) halves[h] = static_cast<uint16_t>(h);
  std::vector<float> a(65536), b(65536);
  HalfToFloat(halves, a.data());
  HalfToFloatPortable(halves, b.data());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  std::vector<float> floats;
  for (uint64_t bits = 0; bits < 0x7f800000ull; bits += 97) {
    floats.push_back(BitsToFloat(static_cast<uint32_t>(bits)));
    floats.push_back(-BitsToFloat(static_cast<uint32_t>(bits)));
  }
  std::vector<uint16_t> fast(floats.size()), slow(floats.size());
  FloatToHalf(floats, fast.data());
  FloatToHalfPortable(floats, slow.data());
  for (size_t i = 0; i < floats.size(); ++i) ASSERT_EQ(fast[i], slow[i]) << floats[i];
}

TEST(HalfTest, AddRoundToHalfIsTheScalarExpression) {
  // Sums over the whole float range (subnormal, halfway, overflow to inf,
  // inf + -inf = NaN, NaN inputs), in blocks of 8 and a tail.
  std::vector<float> m, d;
  for (uint64_t bits = 0; bits < 0x7f800000ull; bits += 4099) {
    m.push_back(BitsToFloat(static_cast<uint32_t>(bits)));
    d.push_back(-BitsToFloat(static_cast<uint32_t>(bits ^ 0x1234)) * 0.75f);
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {inf, -inf, std::numeric_limits<float>::quiet_NaN(), 65504.f, 70000.f}) {
    m.push_back(x);
    d.push_back(m.size() % 2 ? -inf : 1.f);
  }
  m.push_back(1.f);  // a tail of 1..7 values after the blocks
  d.push_back(1e-4f);
  std::vector<float> want(m.size());
  for (size_t i = 0; i < m.size(); ++i) want[i] = RoundToHalf(m[i] + d[i]);
  AddRoundToHalf(m.data(), d.data(), m.size());
  for (size_t i = 0; i < m.size(); ++i) {
    ASSERT_EQ(FloatToBits(m[i]), FloatToBits(want[i])) << i << ": " << want[i];
  }
}

}  // namespace
}  // namespace aqswarm
