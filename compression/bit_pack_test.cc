#include "compression/bit_pack.h"

#include <vector>

#include "common/random.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

TEST(BitPackTest, PackedBytesIsCeilOfBits) {
  for (int b = 1; b <= 8; ++b) {
    for (size_t n = 0; n < 40; ++n) EXPECT_EQ(PackedBytes(n, b), (n * b + 7) / 8) << b << " " << n;
  }
}

TEST(BitPackTest, LayoutIsLsbFirst) {
  const uint8_t codes[3] = {1, 2, 3};
  uint8_t out[1] = {0xff};
  PackBits(codes, 3, 2, out);
  EXPECT_EQ(out[0], 0x39);  // 01 | 10<<2 | 11<<4, top two bits zero
  const uint8_t c3[3] = {5, 7, 1};
  uint8_t o3[2];
  PackBits(c3, 3, 3, o3);  // 101 | 111<<3 | 001<<6 = 0b0111101 + (1<<6)
  EXPECT_EQ(o3[0], 0x7d);
  EXPECT_EQ(o3[1], 0x00);
}

TEST(BitPackTest, RoundTripEveryWidthAndOddLengths) {
  Rng rng(7);
  for (int b = 1; b <= 8; ++b) {
    for (size_t n : {0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4095, 4097, 10001}) {
      std::vector<uint8_t> codes(n), back(n, 0xaa);
      for (auto& c : codes) c = static_cast<uint8_t>(rng.Uniform(1u << b));
      std::vector<uint8_t> packed(PackedBytes(n, b) + 1, 0xcd);  // canary byte at the end
      PackBits(codes.data(), n, b, packed.data());
      EXPECT_EQ(packed.back(), 0xcd) << "wrote past PackedBytes, b=" << b << " n=" << n;
      UnpackBits(packed.data(), n, b, back.data());
      EXPECT_EQ(codes, back) << "b=" << b << " n=" << n;
      if ((n * b) % 8 != 0) {
        // Padding bits of the last byte are zero.
        EXPECT_EQ(packed[PackedBytes(n, b) - 1] >> ((n * b) % 8), 0) << b << " " << n;
      }
    }
  }
}

// The layout by definition, one bit at a time.
std::vector<uint8_t> ReferencePack(const std::vector<uint8_t>& codes, int b) {
  std::vector<uint8_t> out(PackedBytes(codes.size(), b), 0);
  for (size_t i = 0; i < codes.size(); ++i) {
    for (int k = 0; k < b; ++k) {
      const size_t bit = i * b + k;
      if ((codes[i] >> k) & 1) out[bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
    }
  }
  return out;
}

// Both implementations (BMI2 PEXT/PDEP where the CPU has it, and the portable
// loops) write the reference layout and read it back, whole 8-byte loads and
// tails alike.
TEST(BitPackTest, EveryPathMatchesTheReferenceLayout) {
  Rng rng(11);
  for (const bool bmi2 : {true, false}) {
    internal::AllowBmi2ForTesting(bmi2);
    for (int b = 1; b <= 8; ++b) {
      for (size_t n : {1, 7, 8, 9, 24, 31, 64, 65, 2048, 2051}) {
        std::vector<uint8_t> codes(n), back(n, 0xaa);
        for (auto& c : codes) c = static_cast<uint8_t>(rng.Uniform(1u << b));
        const std::vector<uint8_t> want = ReferencePack(codes, b);
        std::vector<uint8_t> packed(want.size());
        PackBits(codes.data(), n, b, packed.data());
        EXPECT_EQ(packed, want) << "bmi2=" << bmi2 << " b=" << b << " n=" << n;
        UnpackBits(want.data(), n, b, back.data());
        EXPECT_EQ(back, codes) << "bmi2=" << bmi2 << " b=" << b << " n=" << n;
      }
    }
  }
  internal::AllowBmi2ForTesting(true);
}

TEST(BitPackTest, HighBitsOfCodesAreMasked) {
  const uint8_t codes[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  for (int b = 1; b <= 8; ++b) {
    uint8_t out[9] = {0};
    PackBits(codes, 8, b, out);
    for (int i = 0; i < b; ++i) EXPECT_EQ(out[i], 0xff);
    EXPECT_EQ(out[b], 0);
  }
}

}  // namespace
}  // namespace aqswarm::compression
