// AQ-SGD link codec: both ends stay bit-identical, corruption is detected
// and repaired by a FULL resend, baselines behave.
#include "compression/aqsgd_codec.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "common/random.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

constexpr int64_t kRows = 8, kCols = 160;  // 1280 values: above the raw threshold
constexpr size_t kN = kRows * kCols;

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
}

class AqsgdCodecTest : public ::testing::TestWithParam<RowPrecision> {};

TEST_P(AqsgdCodecTest, EndsBitIdenticalAfterThousandRounds) {
  AqsgdLinkOptions o;
  o.stored = GetParam();
  o.quantizer.bits = 3;
  o.quantizer.rounding = v1::ROUNDING_STOCHASTIC;
  auto sender = AqsgdLinkCodec::Create(o);
  auto receiver = AqsgdLinkCodec::Create(o);
  ASSERT_TRUE(sender.ok() && receiver.ok());
  const int kSamples = 8;
  Rng rng(GetParam() == RowPrecision::kInt8 ? 3 : 1);
  std::vector<std::vector<float>> base(kSamples, std::vector<float>(kN));
  for (auto& b : base) for (auto& v : b) v = static_cast<float>(rng.UnitDouble() * 4 - 2);
  std::vector<std::vector<float>> ms(kSamples, std::vector<float>(kN, 0.0f)), mr = ms;
  std::vector<bool> seen(kSamples, false);
  int fulls = 0, deltas = 0;
  std::vector<float> a(kN);
  for (int round = 0; round < 1000; ++round) {
    const int xi = static_cast<int>(rng.Uniform(kSamples));
    const int64_t epoch = round / 100;
    // Activations drift slowly, as they do during training.
    for (size_t i = 0; i < kN; ++i) {
      base[xi][i] += static_cast<float>((rng.UnitDouble() - 0.5) * 0.05);
      a[i] = base[xi][i];
    }
    v1::AqsgdRow msg;
    ASSERT_TRUE((*sender)->EncodeRow({seen[xi], epoch, false, static_cast<uint64_t>(xi)}, a, kRows,
                                     kCols, absl::MakeSpan(ms[xi]), round, &msg).ok());
    seen[xi] = true;
    (msg.kind() == v1::AqsgdRow::KIND_FULL ? fulls : deltas)++;
    if (epoch < 1) {
      ASSERT_EQ(msg.kind(), v1::AqsgdRow::KIND_FULL);
    }
    // Over the wire.
    v1::AqsgdRow wire;
    ASSERT_TRUE(wire.ParseFromString(msg.SerializeAsString()));
    auto r = (*receiver)->DecodeRow(wire, kRows, kCols, absl::MakeSpan(mr[xi]));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(*r, ReceiveResult::kApplied);
    ASSERT_TRUE(SameBits(ms[xi], mr[xi])) << "round " << round;
  }
  EXPECT_GT(deltas, 800);
  EXPECT_GE(fulls, kSamples);
  // The receiver's stage input tracks the activation.
  double err = 0, norm = 0;
  for (size_t i = 0; i < kN; ++i) {
    err += std::fabs(mr[0][i] - base[0][i]);
    norm += std::fabs(base[0][i]);
  }
  EXPECT_LT(err / norm, 0.1);
}

TEST_P(AqsgdCodecTest, CorruptionIsDetectedAndFullResendRestores) {
  AqsgdLinkOptions o;
  o.stored = GetParam();
  o.warmup_epochs = 0;
  auto sender = AqsgdLinkCodec::Create(o);
  auto receiver = AqsgdLinkCodec::Create(o);
  Rng rng(9);
  std::vector<float> a(kN), ms(kN), mr(kN);
  for (auto& v : a) v = static_cast<float>(rng.UnitDouble());
  v1::AqsgdRow msg;
  ASSERT_TRUE((*sender)->EncodeRow({false, 0}, a, kRows, kCols, absl::MakeSpan(ms), 0, &msg).ok());
  ASSERT_EQ(msg.kind(), v1::AqsgdRow::KIND_FULL);
  ASSERT_EQ(*(*receiver)->DecodeRow(msg, kRows, kCols, absl::MakeSpan(mr)), ReceiveResult::kApplied);
  // Corrupt one bit of the receiver's stored row: the sign, which every
  // precision keeps (the checksum covers m's stored encoding, so a flip below
  // its resolution would not be a different stored row).
  uint32_t u;
  std::memcpy(&u, &mr[17], 4);
  u ^= 0x80000000u;
  std::memcpy(&mr[17], &u, 4);
  const std::vector<float> corrupted = mr;
  for (auto& v : a) v += 0.01f;
  ASSERT_TRUE((*sender)->EncodeRow({true, 5}, a, kRows, kCols, absl::MakeSpan(ms), 1, &msg).ok());
  ASSERT_EQ(msg.kind(), v1::AqsgdRow::KIND_DELTA);
  auto r = (*receiver)->DecodeRow(msg, kRows, kCols, absl::MakeSpan(mr));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, ReceiveResult::kResendNeeded);
  EXPECT_TRUE(SameBits(mr, corrupted));  // untouched
  // RESEND: the sender sends FULL, and identity is back.
  ASSERT_TRUE((*sender)->EncodeRow({true, 5, /*force_full=*/true}, a, kRows, kCols,
                                   absl::MakeSpan(ms), 2, &msg).ok());
  ASSERT_EQ(msg.kind(), v1::AqsgdRow::KIND_FULL);
  ASSERT_EQ(*(*receiver)->DecodeRow(msg, kRows, kCols, absl::MakeSpan(mr)), ReceiveResult::kApplied);
  EXPECT_TRUE(SameBits(ms, mr));
  // FULL is lossless w.r.t. what is stored: m == Round_p(a).
  std::vector<float> rounded = a;
  RoundRowInPlace(GetParam(), kRows, kCols, absl::MakeSpan(rounded));
  EXPECT_TRUE(SameBits(mr, rounded));
}

INSTANTIATE_TEST_SUITE_P(Precisions, AqsgdCodecTest,
                         ::testing::Values(RowPrecision::kFloat32, RowPrecision::kFloat16,
                                           RowPrecision::kInt8));

TEST(AqsgdBaselineTest, DirectQAndFp32) {
  Rng rng(2);
  std::vector<float> a(kN), m(kN), out(kN);
  for (auto& v : a) v = static_cast<float>(rng.UnitDouble() - 0.5);
  for (LinkMode mode : {LinkMode::kDirectQ, LinkMode::kFp32}) {
    AqsgdLinkOptions o;
    o.mode = mode;
    auto codec = AqsgdLinkCodec::Create(o);
    v1::AqsgdRow msg;
    ASSERT_TRUE((*codec)->EncodeRow({true, 9}, a, kRows, kCols, absl::MakeSpan(m), 0, &msg).ok());
    EXPECT_EQ(msg.kind(), v1::AqsgdRow::KIND_DIRECT);
    ASSERT_EQ(*(*codec)->DecodeRow(msg, kRows, kCols, absl::MakeSpan(out)), ReceiveResult::kApplied);
    if (mode == LinkMode::kFp32) {
      EXPECT_TRUE(SameBits(out, a));
    } else {
      std::vector<float> want(kN);
      ASSERT_TRUE(Decode(msg.tensor(), absl::MakeSpan(want)).ok());
      EXPECT_TRUE(SameBits(out, want));
      EXPECT_LT(msg.tensor().payload().size(), kN);  // 4 bits per value
    }
  }
}

TEST(AqsgdErrorsTest, MalformedOrMismatchedMessagesLeaveMUntouched) {
  AqsgdLinkOptions o;
  o.warmup_epochs = 0;
  auto codec = AqsgdLinkCodec::Create(o);
  std::vector<float> a(kN, 0.5f), ms(kN), mr(kN);
  v1::AqsgdRow msg;
  ASSERT_TRUE((*codec)->EncodeRow({false, 0}, a, kRows, kCols, absl::MakeSpan(ms), 0, &msg).ok());
  ASSERT_TRUE((*codec)->DecodeRow(msg, kRows, kCols, absl::MakeSpan(mr)).ok());
  a[3] = 0.7f;
  ASSERT_TRUE((*codec)->EncodeRow({true, 1}, a, kRows, kCols, absl::MakeSpan(ms), 1, &msg).ok());
  const std::vector<float> before = mr;
  v1::AqsgdRow bad = msg;
  bad.mutable_tensor()->mutable_payload()->resize(3);  // truncated
  EXPECT_EQ((*codec)->DecodeRow(bad, kRows, kCols, absl::MakeSpan(mr)).status().code(),
            absl::StatusCode::kDataLoss);
  bad = msg;
  bad.set_stored_precision(static_cast<uint32_t>(RowPrecision::kInt8));
  EXPECT_FALSE((*codec)->DecodeRow(bad, kRows, kCols, absl::MakeSpan(mr)).ok());
  bad = msg;
  bad.set_kind(v1::AqsgdRow::KIND_UNSPECIFIED);
  EXPECT_FALSE((*codec)->DecodeRow(bad, kRows, kCols, absl::MakeSpan(mr)).ok());
  EXPECT_FALSE((*codec)->DecodeRow(msg, kRows + 1, kCols, absl::MakeSpan(mr)).ok());
  EXPECT_TRUE(SameBits(mr, before));
  // NaN activations are refused and the sender's m is untouched.
  const std::vector<float> ms_before = ms;
  a[5] = NAN;
  EXPECT_EQ((*codec)->EncodeRow({true, 1}, a, kRows, kCols, absl::MakeSpan(ms), 2, &msg).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameBits(ms, ms_before));
}

// A hostile upstream's NaN FULL row, an fp16-overflowing FULL row and a
// DELTA that overflows m are refused as non-finite; m stays as it was.
TEST(AqsgdErrorsTest, NonFiniteRowsAreRefusedAndLeaveMUntouched) {
  AqsgdLinkOptions o;
  o.warmup_epochs = 0;
  o.stored = RowPrecision::kFloat16;
  auto codec = AqsgdLinkCodec::Create(o);
  ASSERT_TRUE(codec.ok());
  std::vector<float> a(kN, 30000.0f), ms(kN), mr(kN);
  v1::AqsgdRow full;
  ASSERT_TRUE((*codec)->EncodeRow({false, 0}, a, kRows, kCols, absl::MakeSpan(ms), 0, &full).ok());
  ASSERT_TRUE((*codec)->DecodeRow(full, kRows, kCols, absl::MakeSpan(mr)).ok());
  const std::vector<float> before = mr;
  // FULL rows sent as raw float32 by a hostile sender: a NaN, and 1e6
  // (finite in float32, infinite once stored as fp16).
  for (float bad : {NAN, 1e6f}) {
    v1::AqsgdRow row = full;
    CodecOptions raw;
    raw.codec = v1::CODEC_RAW_F32;
    std::vector<float> x(kN, 0.25f);
    if (std::isnan(bad)) {
      ASSERT_TRUE(Encode(raw, x, {kRows, kCols}, 0, row.mutable_tensor()).ok());
      std::memcpy(row.mutable_tensor()->mutable_payload()->data() + 4 * 17, &bad, 4);
    } else {
      x[17] = bad;
      ASSERT_TRUE(Encode(raw, x, {kRows, kCols}, 0, row.mutable_tensor()).ok());
    }
    const auto r = (*codec)->DecodeRow(row, kRows, kCols, absl::MakeSpan(mr));
    EXPECT_TRUE(IsNonFiniteError(r.status())) << bad << " " << r.status();
    EXPECT_TRUE(SameBits(mr, before)) << bad;
  }
  // A DELTA whose values are finite but whose sum with m is not.
  a.assign(kN, 30001.0f);
  v1::AqsgdRow delta;
  ASSERT_TRUE((*codec)->EncodeRow({true, 1}, a, kRows, kCols, absl::MakeSpan(ms), 1, &delta).ok());
  ASSERT_EQ(delta.kind(), v1::AqsgdRow::KIND_DELTA);
  // Fixed point decodes (q - 8) * scale / 8: the largest fp16 scale (65504)
  // and code 15 give 57316, which added to m = 30000 exceeds fp16.
  for (size_t i = 0; i < delta.tensor().scales().size(); i += 2) {
    const uint16_t max_half = 0x7bff;
    std::memcpy(delta.mutable_tensor()->mutable_scales()->data() + i, &max_half, 2);
  }
  std::memset(delta.mutable_tensor()->mutable_payload()->data(), 0xff, delta.tensor().payload().size());
  const auto r = (*codec)->DecodeRow(delta, kRows, kCols, absl::MakeSpan(mr));
  EXPECT_TRUE(IsNonFiniteError(r.status())) << r.status();
  EXPECT_TRUE(SameBits(mr, before));
}

}  // namespace
}  // namespace aqswarm::compression
