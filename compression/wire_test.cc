// Hostile EncodedTensor messages: every malformed case yields an error
// status from ValidateEncodedTensor and Decode, never a crash.
#include "compression/wire.h"

#include <vector>

#include "common/random.h"
#include "compression/codec.h"
#include "compression/global_qsgd.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

v1::EncodedTensor Valid(v1::Codec codec = v1::CODEC_FIXED_POINT, int bits = 4) {
  std::vector<float> x(2048);
  Rng rng(1);
  for (auto& v : x) v = static_cast<float>(rng.UnitDouble() - 0.5);
  CodecOptions o;
  o.codec = codec;
  o.bits = bits;
  o.bucket_size = 100;
  o.checksum = true;
  const int64_t shape[2] = {16, 128};
  v1::EncodedTensor m;
  EXPECT_TRUE(Encode(o, x, shape, 1, &m).ok());
  return m;
}

// Expects both the validator and Decode to refuse `m` with `code`.
void ExpectRejected(const v1::EncodedTensor& m, absl::StatusCode code) {
  EXPECT_EQ(ValidateEncodedTensor(m).code(), code) << ValidateEncodedTensor(m);
  std::vector<float> out(m.num_elements() < (1u << 20) ? m.num_elements() : 0, 7.0f);
  EXPECT_EQ(Decode(m, absl::MakeSpan(out)).code(), code);
  for (float v : out) ASSERT_EQ(v, 7.0f);  // untouched
}

TEST(WireTest, ValidMessagesOfEveryCodecPass) {
  for (v1::Codec c : {v1::CODEC_RAW_F32, v1::CODEC_RAW_F16, v1::CODEC_FIXED_POINT, v1::CODEC_QSGD,
                      v1::CODEC_MINMAX, v1::CODEC_GLOBAL_QSGD}) {
    EXPECT_TRUE(ValidateEncodedTensor(Valid(c)).ok()) << CodecName(c);
  }
}

TEST(WireTest, EmptyMessageHasNoVersion) { ExpectRejected(v1::EncodedTensor(), absl::StatusCode::kInvalidArgument); }

TEST(WireTest, UnknownFormatVersion) {
  auto m = Valid();
  m.set_format_version(2);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, UnknownCodec) {
  auto m = Valid();
  m.set_codec(static_cast<v1::Codec>(42));
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
  m.set_codec(v1::CODEC_UNSPECIFIED);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, UnknownEnumValues) {
  auto m = Valid();
  m.set_rounding(static_cast<v1::Rounding>(9));
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, WrongBitsForCodec) {
  for (uint32_t bits : {0u, 9u, 32u}) {
    auto m = Valid();
    m.set_bits(bits);
    ExpectRejected(m, absl::StatusCode::kInvalidArgument);
  }
  auto q = Valid(v1::CODEC_QSGD);
  q.set_bits(1);
  ExpectRejected(q, absl::StatusCode::kInvalidArgument);
  auto r = Valid(v1::CODEC_RAW_F32);
  r.set_bits(16);
  ExpectRejected(r, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, BitsChangedKeepsLengthsHonest) {
  // Legal bits but not the ones the payload was sized for: length mismatch.
  auto m = Valid();
  m.set_bits(5);
  m.clear_checksum();
  ExpectRejected(m, absl::StatusCode::kDataLoss);
}

TEST(WireTest, IllegalBucketSize) {
  auto m = Valid(v1::CODEC_QSGD);
  m.set_bucket_size(0);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
  m.set_bucket_size(0xffffffffu);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, NegativeDim) {
  auto m = Valid();
  m.set_shape(0, -16);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, ShapeProductOverflow) {
  auto m = Valid();
  m.clear_shape();
  for (int i = 0; i < 3; ++i) m.add_shape(int64_t{1} << 29);  // 2^87 overflows uint64 products
  m.set_num_elements(0);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
  m.clear_shape();
  m.add_shape(int64_t{1} << 62);
  m.add_shape(4);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, ShapeProductDisagreesWithNumElements) {
  auto m = Valid();
  m.set_num_elements(2047);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, HugeCountAboveLimitIsRefusedBeforeAllocating) {
  auto m = Valid();
  m.clear_shape();
  m.add_shape(int64_t{1} << 40);
  m.set_num_elements(uint64_t{1} << 40);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
  // Within the default limit but above a caller's tighter one.
  auto v = Valid();
  WireLimits tight;
  tight.max_elements = 1000;
  EXPECT_EQ(ValidateEncodedTensor(v, tight).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> out(2048);
  EXPECT_EQ(Decode(v, absl::MakeSpan(out), tight).code(), absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, TooManyDims) {
  auto m = Valid();
  m.clear_shape();
  for (int i = 0; i < 9; ++i) m.add_shape(1);
  m.add_shape(2048);
  ExpectRejected(m, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, TruncatedPayload) {
  for (v1::Codec c : {v1::CODEC_RAW_F32, v1::CODEC_RAW_F16, v1::CODEC_FIXED_POINT, v1::CODEC_QSGD,
                      v1::CODEC_MINMAX, v1::CODEC_GLOBAL_QSGD}) {
    auto m = Valid(c);
    m.mutable_payload()->pop_back();
    m.clear_checksum();
    ExpectRejected(m, absl::StatusCode::kDataLoss);
    m.mutable_payload()->append("xy");
    ExpectRejected(m, absl::StatusCode::kDataLoss);
  }
}

TEST(WireTest, WrongScalesLength) {
  for (v1::Codec c : {v1::CODEC_FIXED_POINT, v1::CODEC_QSGD, v1::CODEC_MINMAX, v1::CODEC_GLOBAL_QSGD}) {
    auto m = Valid(c);
    m.mutable_scales()->resize(m.scales().size() - 2);
    m.clear_checksum();
    ExpectRejected(m, absl::StatusCode::kDataLoss);
  }
  auto raw = Valid(v1::CODEC_RAW_F32);
  raw.set_scales("abcd");
  raw.clear_checksum();
  ExpectRejected(raw, absl::StatusCode::kDataLoss);
}

TEST(WireTest, NonFiniteOrNegativeScale) {
  auto m = Valid(v1::CODEC_QSGD);
  const float nan = NAN;
  m.mutable_scales()->replace(4, 4, reinterpret_cast<const char*>(&nan), 4);
  m.clear_checksum();
  ExpectRejected(m, absl::StatusCode::kDataLoss);
  auto f = Valid(v1::CODEC_FIXED_POINT);
  (*f.mutable_scales())[1] = static_cast<char>(0x7c);  // binary16 inf
  f.clear_checksum();
  ExpectRejected(f, absl::StatusCode::kDataLoss);
  auto mm = Valid(v1::CODEC_MINMAX);
  const float neg = -1.0f;
  mm.mutable_scales()->replace(4, 4, reinterpret_cast<const char*>(&neg), 4);  // unit < 0
  mm.clear_checksum();
  ExpectRejected(mm, absl::StatusCode::kDataLoss);
}

TEST(WireTest, ChecksumMismatch) {
  auto m = Valid();
  (*m.mutable_payload())[10] ^= 1;
  ExpectRejected(m, absl::StatusCode::kDataLoss);
}

TEST(WireTest, GlobalQsgdHeaderRules) {
  auto m = Valid(v1::CODEC_GLOBAL_QSGD, 8);
  m.clear_checksum();
  auto a = m;
  a.set_num_levels(0);
  ExpectRejected(a, absl::StatusCode::kInvalidArgument);
  a = m;
  a.set_num_summed(0);
  ExpectRejected(a, absl::StatusCode::kInvalidArgument);
  a = m;
  a.set_num_summed(2);  // 2 sums of s=127 need 9 bits
  ExpectRejected(a, absl::StatusCode::kInvalidArgument);
  a = m;
  a.set_exponent_shift(3);  // uniform levels have no shift
  ExpectRejected(a, absl::StatusCode::kInvalidArgument);
  auto f = Valid(v1::CODEC_FIXED_POINT);
  f.clear_checksum();
  f.set_num_summed(5);  // global-only fields on another codec
  ExpectRejected(f, absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, OutputSizeMismatchIsRejected) {
  auto m = Valid();
  std::vector<float> out(100);
  EXPECT_EQ(Decode(m, absl::MakeSpan(out)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, RandomMutationsNeverCrash) {
  Rng rng(77);
  std::vector<std::string> seeds;
  for (v1::Codec c : {v1::CODEC_RAW_F32, v1::CODEC_RAW_F16, v1::CODEC_FIXED_POINT, v1::CODEC_QSGD,
                      v1::CODEC_MINMAX, v1::CODEC_GLOBAL_QSGD}) {
    auto m = Valid(c, 3);
    m.clear_checksum();
    seeds.push_back(m.SerializeAsString());
  }
  int decoded = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bytes = seeds[trial % seeds.size()];
    const int flips = 1 + static_cast<int>(rng.Uniform(4));
    for (int f = 0; f < flips; ++f) {
      // Bias mutations toward the header, where the interesting fields live.
      const size_t pos = rng.Uniform(std::min<size_t>(bytes.size(), rng.Uniform(2) ? 40 : bytes.size()));
      bytes[pos] = static_cast<char>(rng.Uniform(256));
    }
    if (rng.Uniform(4) == 0) bytes.resize(rng.Uniform(bytes.size()));
    v1::EncodedTensor m;
    if (!m.ParseFromString(bytes)) continue;
    if (!ValidateEncodedTensor(m).ok()) continue;
    std::vector<float> out(m.num_elements());
    // A valid message decodes, unless its values are not finite (refused).
    const absl::Status s = Decode(m, absl::MakeSpan(out));
    EXPECT_TRUE(s.ok() || IsNonFiniteError(s)) << s;
    ++decoded;
  }
  EXPECT_GT(decoded, 10);
}

}  // namespace
}  // namespace aqswarm::compression
