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
