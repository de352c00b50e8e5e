#include "common/row_format.h"

#include <cmath>
#include <string>
#include <vector>

#include "common/random.h"
#include "gtest/gtest.h"

namespace aqswarm {
namespace {

std::vector<float> RandomRow(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.UnitDouble() * 8 - 4);
  return v;
}

class RowFormatTest : public ::testing::TestWithParam<RowPrecision> {};

TEST_P(RowFormatTest, DecodeOfEncodeEqualsRoundInPlaceBitForBit) {
  const int64_t rows = 7, cols = 13;
  std::vector<float> v = RandomRow(rows * cols, 1);
  std::string buf(EncodedRowBytes(GetParam(), rows, cols), '\0');
  EncodeRow(GetParam(), rows, cols, v, buf.data());
  std::vector<float> decoded(rows * cols);
  ASSERT_TRUE(DecodeRow(GetParam(), rows, cols, buf, absl::MakeSpan(decoded)).ok());
  std::vector<float> rounded = v;
  RoundRowInPlace(GetParam(), rows, cols, absl::MakeSpan(rounded));
  ASSERT_EQ(0, std::memcmp(decoded.data(), rounded.data(), decoded.size() * 4));
  // Rounding is idempotent: a stored value re-stored is unchanged.
  std::vector<float> twice = rounded;
  RoundRowInPlace(GetParam(), rows, cols, absl::MakeSpan(twice));
  EXPECT_EQ(0, std::memcmp(twice.data(), rounded.data(), twice.size() * 4));
}

TEST_P(RowFormatTest, WrongLengthIsDataLoss) {
  std::vector<float> out(6);
  std::string buf(EncodedRowBytes(GetParam(), 2, 3) - 1, '\0');
  EXPECT_EQ(DecodeRow(GetParam(), 2, 3, buf, absl::MakeSpan(out)).code(),
            absl::StatusCode::kDataLoss);
}

INSTANTIATE_TEST_SUITE_P(All, RowFormatTest,
                         ::testing::Values(RowPrecision::kFloat32, RowPrecision::kFloat16,
                                           RowPrecision::kInt8));

TEST(RowFormatInt8Test, ErrorBoundedByHalfStep) {
  const int64_t rows = 16, cols = 8;
  std::vector<float> v = RandomRow(rows * cols, 2);
  std::vector<float> r = v;
  RoundRowInPlace(RowPrecision::kInt8, rows, cols, absl::MakeSpan(r));
  for (int64_t c = 0; c < cols; ++c) {
    float maxabs = 0;
    for (int64_t i = 0; i < rows; ++i) maxabs = std::max(maxabs, std::fabs(v[i * cols + c]));
    for (int64_t i = 0; i < rows; ++i) {
      EXPECT_LE(std::fabs(r[i * cols + c] - v[i * cols + c]), maxabs / 127 * 0.5001f);
    }
  }
}

TEST(RowFormatTest, NamesAndFiniteness) {
  EXPECT_STREQ(RowPrecisionName(RowPrecision::kFloat16), "fp16");
  EXPECT_FALSE(ValidateFinite({1.0f, NAN}).ok());
}

}  // namespace
}  // namespace aqswarm
