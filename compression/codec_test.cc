// Generic entry points: every codec round-trips through Encode/Decode,
// the raw threshold, non-finite input, zero/constant/empty inputs, sizes.
#include "compression/codec.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "common/random.h"
#include "compression/bit_pack.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

const v1::Codec kAll[] = {v1::CODEC_RAW_F32, v1::CODEC_RAW_F16, v1::CODEC_FIXED_POINT,
                          v1::CODEC_QSGD, v1::CODEC_MINMAX, v1::CODEC_GLOBAL_QSGD};

CodecOptions Opts(v1::Codec c, int bits = 4) {
  CodecOptions o;
  o.codec = c;
  o.bits = bits;
  o.bucket_size = 256;
  return o;
}

std::vector<float> Random(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.UnitDouble() * 2 - 1);
  return v;
}

TEST(CodecTest, EveryCodecRoundTripsWithBoundedError) {
  const std::vector<float> x = Random(3000, 1);
  const int64_t shape[2] = {30, 100};
  for (v1::Codec c : kAll) {
    for (v1::Rounding r : {v1::ROUNDING_NEAREST, v1::ROUNDING_STOCHASTIC}) {
      CodecOptions o = Opts(c, 8);
      o.rounding = r;
      v1::EncodedTensor m;
      ASSERT_TRUE(Encode(o, x, shape, 3, &m).ok()) << CodecName(c);
      EXPECT_EQ(m.codec(), c);
      std::vector<float> out(x.size());
      ASSERT_TRUE(Decode(m, absl::MakeSpan(out)).ok()) << CodecName(c);
      for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(out[i], x[i], 0.02) << CodecName(c) << " " << i;
    }
  }
}

TEST(CodecTest, ExactSizes) {
  const size_t n = 3000;
  const std::vector<float> x = Random(n, 2);
  const int64_t shape[2] = {30, 100};
  v1::EncodedTensor m;
  ASSERT_TRUE(Encode(Opts(v1::CODEC_RAW_F32), x, shape, 0, &m).ok());
  EXPECT_EQ(EncodedBytes(m), 4 * n);
  ASSERT_TRUE(Encode(Opts(v1::CODEC_RAW_F16), x, shape, 0, &m).ok());
  EXPECT_EQ(EncodedBytes(m), 2 * n);
  for (int b = 1; b <= 8; ++b) {
    ASSERT_TRUE(Encode(Opts(v1::CODEC_FIXED_POINT, b), x, shape, 0, &m).ok());
    EXPECT_EQ(EncodedBytes(m), 2 * 100 + PackedBytes(n, b));
    ASSERT_TRUE(Encode(Opts(v1::CODEC_MINMAX, b), x, shape, 0, &m).ok());
    EXPECT_EQ(EncodedBytes(m), 2 * 12 * 4 + PackedBytes(n, b));
    if (b >= 2) {
      ASSERT_TRUE(Encode(Opts(v1::CODEC_QSGD, b), x, shape, 0, &m).ok());
      EXPECT_EQ(EncodedBytes(m), 12 * 4 + PackedBytes(n, b));
      ASSERT_TRUE(Encode(Opts(v1::CODEC_GLOBAL_QSGD, b), x, shape, 0, &m).ok());
      EXPECT_EQ(EncodedBytes(m), 12 * 4 + PackedBytes(n, b));
    }
  }
}

TEST(CodecTest, SmallTensorsPassThroughRaw) {
  const std::vector<float> x = Random(1023, 3);
  const int64_t shape[1] = {1023};
  for (v1::Codec c : kAll) {
    v1::EncodedTensor m;
    ASSERT_TRUE(Encode(Opts(c), x, shape, 0, &m).ok());
    EXPECT_EQ(m.codec(), v1::CODEC_RAW_F32);
    std::vector<float> out(x.size());
    ASSERT_TRUE(Decode(m, absl::MakeSpan(out)).ok());
    EXPECT_EQ(out, x);
  }
  CodecOptions o = Opts(v1::CODEC_FIXED_POINT);
  o.min_compress_elements = 100;  // configurable
  v1::EncodedTensor m;
  ASSERT_TRUE(Encode(o, x, shape, 0, &m).ok());
  EXPECT_EQ(m.codec(), v1::CODEC_FIXED_POINT);
}

TEST(CodecTest, NonFiniteInputIsInvalidArgumentForEveryCodec) {
  for (v1::Codec c : kAll) {
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      std::vector<float> x = Random(2000, 4);
      x[1999] = bad;
      const int64_t shape[1] = {2000};
      v1::EncodedTensor m;
      const absl::Status s = Encode(Opts(c), x, shape, 0, &m);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << CodecName(c) << " " << bad;
      EXPECT_NE(s.message().find("non-finite"), std::string::npos) << s;
    }
  }
}

// A hostile sender writes NaN/Inf straight into a raw payload, or scales
// that make a quantized value overflow: Decode refuses it as non-finite.
TEST(CodecTest, DecodeRefusesNonFiniteValuesOfEveryRawCodecAndOverflow) {
  const int64_t shape[1] = {2000};
  for (v1::Codec c : {v1::CODEC_RAW_F32, v1::CODEC_RAW_F16}) {
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      v1::EncodedTensor m;
      ASSERT_TRUE(Encode(Opts(c), Random(2000, 5), shape, 0, &m).ok());
      char* p = m.mutable_payload()->data();
      if (c == v1::CODEC_RAW_F32) {
        std::memcpy(p + 4 * 1234, &bad, 4);
      } else {
        const uint16_t h = std::isnan(bad) ? 0x7e00 : (bad > 0 ? 0x7c00 : 0xfc00);
        std::memcpy(p + 2 * 1234, &h, 2);
      }
      std::vector<float> out(2000, 7.0f);
      const absl::Status s = Decode(m, absl::MakeSpan(out));
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << CodecName(c) << " " << bad;
      EXPECT_TRUE(IsNonFiniteError(s)) << s;
      EXPECT_NE(s.message().find("index 1234"), std::string::npos) << s;
      EXPECT_EQ(out, std::vector<float>(2000, 7.0f)) << "output written before the refusal";
    }
  }
  // Min-max: finite (min, unit) whose codes overflow float32.
  v1::EncodedTensor m;
  ASSERT_TRUE(Encode(Opts(v1::CODEC_MINMAX, 8), Random(2000, 6), shape, 0, &m).ok());
  const float huge[2] = {3e38f, 3e38f};
  std::memcpy(m.mutable_scales()->data(), huge, sizeof(huge));
  std::memset(m.mutable_payload()->data(), 0xff, 4);
  std::vector<float> out(2000);
  const absl::Status s = Decode(m, absl::MakeSpan(out));
  EXPECT_TRUE(IsNonFiniteError(s)) << s;
  // Other malformed input is not reported as non-finite.
  m.mutable_payload()->resize(3);
  EXPECT_FALSE(IsNonFiniteError(Decode(m, absl::MakeSpan(out))));
  EXPECT_TRUE(CheckReceivedFinite(Random(100, 1), "x").ok());
}

TEST(CodecTest, ZeroConstantAndEmptyInputs) {
  for (v1::Codec c : kAll) {
    for (float value : {0.0f, 0.3f, -2.0f}) {
      const std::vector<float> x(2048, value);
      const int64_t shape[2] = {2, 1024};
      for (v1::Rounding r : {v1::ROUNDING_NEAREST, v1::ROUNDING_STOCHASTIC}) {
        CodecOptions o = Opts(c);
        o.rounding = r;
        v1::EncodedTensor m;
        ASSERT_TRUE(Encode(o, x, shape, 0, &m).ok());
        std::vector<float> out(x.size());
        ASSERT_TRUE(Decode(m, absl::MakeSpan(out)).ok());
        for (float v : out) {
          ASSERT_TRUE(std::isfinite(v));
          if (value == 0.0f) {
            ASSERT_EQ(v, 0.0f) << CodecName(c);
          } else {
            // Constant data sits on the top level of every grid (within the
            // fixed-point grid's one-step asymmetry and fp16 scale rounding).
            ASSERT_NEAR(v, value, std::fabs(value) * 0.15f) << CodecName(c);
          }
        }
      }
    }
    const std::vector<float> empty;
    const int64_t shape0[2] = {0, 16};
    CodecOptions o = Opts(c);
    o.min_compress_elements = 0;
    v1::EncodedTensor m;
    ASSERT_TRUE(Encode(o, empty, shape0, 0, &m).ok()) << CodecName(c);
    std::vector<float> out;
    EXPECT_TRUE(Decode(m, absl::MakeSpan(out)).ok()) << CodecName(c);
  }
}

TEST(CodecTest, ShapeMustMatchValues) {
  const std::vector<float> x(2048);
  const int64_t bad[2] = {3, 1000};
  const int64_t neg[2] = {-2, -1024};
  v1::EncodedTensor m;
  EXPECT_EQ(Encode(Opts(v1::CODEC_FIXED_POINT), x, bad, 0, &m).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Encode(Opts(v1::CODEC_FIXED_POINT), x, neg, 0, &m).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CodecTest, DecodeIsBitIdenticalAcrossCallsForEveryCodec) {
  const std::vector<float> x = Random(5000, 6);
  const int64_t shape[2] = {50, 100};
  for (v1::Codec c : kAll) {
    CodecOptions o = Opts(c, 3);
    o.rounding = v1::ROUNDING_STOCHASTIC;
    v1::EncodedTensor m1, m2;
    ASSERT_TRUE(Encode(o, x, shape, 11, &m1).ok());
    ASSERT_TRUE(Encode(o, x, shape, 11, &m2).ok());
    EXPECT_EQ(m1.SerializeAsString(), m2.SerializeAsString()) << CodecName(c);
    v1::EncodedTensor parsed;
    ASSERT_TRUE(parsed.ParseFromString(m1.SerializeAsString()));
    std::vector<float> a(x.size()), b(x.size());
    ASSERT_TRUE(Decode(m1, absl::MakeSpan(a)).ok());
    ASSERT_TRUE(Decode(parsed, absl::MakeSpan(b)).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), 4 * a.size()), 0) << CodecName(c);
  }
}

TEST(CodecTest, ChecksumOptionIsAttachedAndVerified) {
  const std::vector<float> x = Random(2048, 7);
  const int64_t shape[1] = {2048};
  CodecOptions o = Opts(v1::CODEC_QSGD);
  o.checksum = true;
  v1::EncodedTensor m;
  ASSERT_TRUE(Encode(o, x, shape, 0, &m).ok());
  ASSERT_TRUE(m.has_checksum());
  EXPECT_EQ(m.checksum(), EncodedTensorChecksum(m));
  (*m.mutable_scales())[0] ^= 0x10;
  std::vector<float> out(2048);
  EXPECT_EQ(Decode(m, absl::MakeSpan(out)).code(), absl::StatusCode::kDataLoss);
}

TEST(CodecTest, OptionsAndNames) {
  for (v1::Codec c : kAll) {
    auto parsed = ParseCodec(CodecName(c));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, c);
  }
  EXPECT_FALSE(ParseCodec("zip").ok());
  EXPECT_FALSE(ValidateCodecOptions(Opts(v1::CODEC_FIXED_POINT, 0)).ok());
  EXPECT_FALSE(ValidateCodecOptions(Opts(v1::CODEC_FIXED_POINT, 9)).ok());
  EXPECT_FALSE(ValidateCodecOptions(Opts(v1::CODEC_GLOBAL_QSGD, 12)).ok());
  CodecOptions o = Opts(v1::CODEC_MINMAX);
  o.bucket_size = 0;
  EXPECT_FALSE(ValidateCodecOptions(o).ok());
  EXPECT_FALSE(CreateCompressor(o).ok());
  auto comp = CreateCompressor(Opts(v1::CODEC_MINMAX));
  ASSERT_TRUE(comp.ok());
  const std::vector<float> x = Random(2048, 8);
  const int64_t shape[1] = {2048};
  v1::EncodedTensor m;
  ASSERT_TRUE((*comp)->Compress(x, shape, 0, &m).ok());
  std::vector<float> out(2048);
  ASSERT_TRUE((*comp)->Decompress(m, absl::MakeSpan(out)).ok());
  EXPECT_EQ((*comp)->options().codec, v1::CODEC_MINMAX);
}

}  // namespace
}  // namespace aqswarm::compression
