// The first-visit codecs (ctest label `codecs`): the tiled codec's round
// trip and rotation, zstd entropy coding of codes, AQ-SGD's tiled first
// visits keeping both ends bit-identical, and hostile input to the decoder.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "compression/aqsgd_codec.h"
#include "compression/bit_pack.h"
#include "compression/codec.h"
#include "compression/tiled.h"
#include "compression/token_reference.h"
#include "common/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aqswarm::compression {
namespace {

std::vector<float> Gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

CodecOptions Tiled(int bits, TileRotation rotation = TileRotation::kOutliers, int64_t tile = 64) {
  CodecOptions o;
  o.codec = v1::CODEC_TILED;
  o.bits = bits;
  o.bucket_size = tile;
  o.rotation = rotation;
  o.min_compress_elements = 1;
  return o;
}

double SquaredError(const std::vector<float>& a, const std::vector<float>& b, size_t from = 0,
                    size_t to = SIZE_MAX) {
  double e = 0;
  for (size_t i = from; i < std::min(to, a.size()); ++i) e += (a[i] - b[i]) * double(a[i] - b[i]);
  return e;
}

std::vector<float> RoundTrip(const CodecOptions& o, const std::vector<float>& x, std::vector<int64_t> shape,
                             v1::EncodedTensor* msg, uint32_t key = 7) {
  EXPECT_TRUE(Encode(o, x, shape, key, msg).ok());
  std::vector<float> out(x.size());
  EXPECT_TRUE(Decode(*msg, absl::MakeSpan(out)).ok());
  return out;
}

bool Rotated(const v1::EncodedTensor& msg, size_t tile_index) {
  const size_t tiles = NumTiles(msg.num_elements(), msg.bucket_size());
  const auto* bitmap = reinterpret_cast<const uint8_t*>(msg.scales().data()) + 2 * tiles;
  return (bitmap[tile_index / 8] >> (tile_index % 8)) & 1;
}

TEST(TiledCodecTest, RoundTripStaysWithinHalfAStepAndSizesAreExact) {
  // 3 rows of 200: tiles of 64 cross rows and the last one is short (600 = 9*64 + 24).
  const std::vector<float> x = Gaussian(600, 1);
  double previous = 1e30;
  for (int bits : {1, 2, 3, 4, 6, 8}) {
    v1::EncodedTensor msg;
    const std::vector<float> y = RoundTrip(Tiled(bits, TileRotation::kNone), x, {3, 200}, &msg);
    EXPECT_EQ(msg.codec(), v1::CODEC_TILED);
    EXPECT_EQ(msg.scales().size(), 2 * 10 + 2u);
    EXPECT_EQ(msg.payload().size(), PackedBytes(600, bits));
    for (size_t k = 0; k < 10; ++k) {
      uint16_t h;
      std::memcpy(&h, msg.scales().data() + 2 * k, 2);
      const float step = HalfToFloat(h) / static_cast<float>((1 << bits) - 1);  // half the level spacing
      for (size_t i = k * 64; i < std::min<size_t>(600, (k + 1) * 64); ++i) {
        ASSERT_LE(std::fabs(x[i] - y[i]), step * 1.0001f) << "bits " << bits << " i " << i;
      }
    }
    const double e = SquaredError(x, y);
    EXPECT_LT(e, previous) << bits;
    previous = e;
  }
  // 3 bits on Gaussian rows: relative error well under a fixed-point 3-bit
  // per-channel grid's (about 0.2 of the signal).
  v1::EncodedTensor msg;
  const std::vector<float> y = RoundTrip(Tiled(3), x, {3, 200}, &msg);
  EXPECT_LT(SquaredError(x, y) / SquaredError(x, std::vector<float>(x.size(), 0.0f)), 0.05);
}

TEST(TiledCodecTest, TheMidtreadGridHasAZeroLevelAndStaysWithinHalfAStep) {
  // Small values among larger ones: on the midrise grid none decodes to 0.
  std::vector<float> x = Gaussian(512, 4);
  for (size_t i = 0; i < x.size(); i += 3) x[i] *= 0.01f;
  for (int bits : {2, 3, 4, 8}) {
    CodecOptions mt = Tiled(bits, TileRotation::kNone), mr = mt;
    mt.tile_grid = v1::TILE_GRID_MIDTREAD;
    v1::EncodedTensor a, b;
    const std::vector<float> y = RoundTrip(mt, x, {8, 64}, &a);
    const std::vector<float> z = RoundTrip(mr, x, {8, 64}, &b);
    EXPECT_EQ(a.tile_grid(), v1::TILE_GRID_MIDTREAD);
    EXPECT_EQ(b.tile_grid(), v1::TILE_GRID_MIDRISE);
    EXPECT_EQ(a.payload().size(), PackedBytes(512, bits));
    size_t zeros = 0, midrise_zeros = 0;
    for (size_t k = 0; k < 8; ++k) {
      uint16_t h;
      std::memcpy(&h, a.scales().data() + 2 * k, 2);
      const float step = HalfToFloat(h) / static_cast<float>((1 << (bits - 1)) - 1);  // level spacing
      for (size_t i = k * 64; i < (k + 1) * 64; ++i) {
        ASSERT_LE(std::fabs(x[i] - y[i]), 0.5f * step * 1.0001f) << "bits " << bits << " i " << i;
        zeros += y[i] == 0.0f;
        midrise_zeros += z[i] == 0.0f;
      }
    }
    if (bits <= 4) EXPECT_GT(zeros, 512u / 3) << bits;  // at least the shrunk values
    EXPECT_EQ(midrise_zeros, 0u) << bits;
  }
  // 2 bits midtread is ternary: -scale, 0, +scale.
  v1::EncodedTensor t;
  CodecOptions ternary = Tiled(2, TileRotation::kNone);
  ternary.tile_grid = v1::TILE_GRID_MIDTREAD;
  const std::vector<float> y = RoundTrip(ternary, x, {512}, &t);
  for (size_t k = 0; k < 8; ++k) {
    uint16_t h;
    std::memcpy(&h, t.scales().data() + 2 * k, 2);
    for (size_t i = k * 64; i < (k + 1) * 64; ++i) {
      EXPECT_TRUE(y[i] == 0.0f || std::fabs(y[i]) == HalfToFloat(h)) << y[i];
    }
  }
  // One bit has no midtread grid.
  CodecOptions one = Tiled(1);
  one.tile_grid = v1::TILE_GRID_MIDTREAD;
  EXPECT_FALSE(ValidateCodecOptions(one).ok());
  EXPECT_FALSE(Encode(one, x, {512}, 1, &t).ok());
}

TEST(TiledCodecTest, RotationSpreadsAnOutlierAndShrinksItsTilesError) {
  // Walsh-Hadamard twice is len times the identity, exactly for small integers.
  std::vector<float> w = {1, -2, 3, 4, 0, 5, -6, 7};
  std::vector<float> w0 = w;
  WalshHadamard(w.data(), 8);
  WalshHadamard(w.data(), 8);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(w[i], 8 * w0[i]);
  // The unrolled, vectorised transform gives the plain stage-by-stage loop's bits.
  for (size_t len : {2, 4, 8, 16, 64, 1024}) {
    std::vector<float> fast = Gaussian(len, 9), plain = fast;
    WalshHadamard(fast.data(), len);
    for (size_t h = 1; h < len; h *= 2) {
      for (size_t i = 0; i < len; i += 2 * h) {
        for (size_t j = i; j < i + h; ++j) {
          const float a = plain[j], b = plain[j + h];
          plain[j] = a + b;
          plain[j + h] = a - b;
        }
      }
    }
    EXPECT_EQ(std::memcmp(fast.data(), plain.data(), 4 * len), 0) << len;
  }

  // Tile 1 of 3 (whole tiles of 64) holds an outlier; the last 32 values are a short tile.
  std::vector<float> x = Gaussian(64 * 3 + 32, 2);
  x[64 + 5] = 40.0f;
  x[64 * 3 + 4] = 40.0f;  // an outlier in the short tile: never rotated
  v1::EncodedTensor none, outliers, all;
  const auto y_none = RoundTrip(Tiled(3, TileRotation::kNone), x, {224}, &none);
  const auto y_out = RoundTrip(Tiled(3, TileRotation::kOutliers), x, {224}, &outliers);
  const auto y_all = RoundTrip(Tiled(3, TileRotation::kAll), x, {224}, &all);
  for (size_t k = 0; k < 4; ++k) EXPECT_FALSE(Rotated(none, k));
  EXPECT_FALSE(Rotated(outliers, 0));
  EXPECT_TRUE(Rotated(outliers, 1));
  EXPECT_FALSE(Rotated(outliers, 2));
  EXPECT_FALSE(Rotated(outliers, 3));
  for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(Rotated(all, k));
  EXPECT_FALSE(Rotated(all, 3));
  // Without rotation the outlier's tile is quantized on a grid stretched to
  // 40: its other 63 values mostly land on the two inner levels.
  EXPECT_LT(SquaredError(x, y_out, 64, 128) * 3, SquaredError(x, y_none, 64, 128));
  EXPECT_EQ(SquaredError(y_out, y_none, 0, 64), 0.0);  // untouched tiles decode the same
}

TEST(TiledCodecTest, TilesDownColumnsKeepAnOutlierChannelOutOfTheOtherChannelsScales) {
  // [128 tokens, 64 channels]; channel 5 is 30x larger in every token (an
  // outlier channel, as in a transformer's residual stream).
  std::vector<float> x = Gaussian(128 * 64, 10);
  for (size_t t = 0; t < 128; ++t) x[t * 64 + 5] *= 30.0f;
  CodecOptions rows = Tiled(3, TileRotation::kNone), columns = rows;
  columns.tile_order = v1::TILES_DOWN_COLUMNS;
  v1::EncodedTensor a, b;
  const auto y_rows = RoundTrip(rows, x, {128, 64}, &a);
  const auto y_cols = RoundTrip(columns, x, {128, 64}, &b);
  EXPECT_EQ(b.tile_order(), v1::TILES_DOWN_COLUMNS);
  EXPECT_EQ(a.scales().size(), b.scales().size());
  double e_rows = 0, e_cols = 0;  // error outside the outlier channel
  for (size_t i = 0; i < x.size(); ++i) {
    if (i % 64 == 5) continue;
    e_rows += (x[i] - y_rows[i]) * double(x[i] - y_rows[i]);
    e_cols += (x[i] - y_cols[i]) * double(x[i] - y_cols[i]);
  }
  EXPECT_LT(e_cols * 20, e_rows);
  // A column tile of 64 holds tokens 0..63 of channel 0: its scale is that column's max.
  float m = 0;
  for (size_t t = 0; t < 64; ++t) m = std::max(m, std::fabs(x[t * 64]));
  uint16_t h;
  std::memcpy(&h, b.scales().data(), 2);
  EXPECT_GE(HalfToFloat(h), m);
  EXPECT_LT(HalfToFloat(h), m * 1.001f);
}

TEST(TiledCodecTest, StochasticRoundingIsUnbiasedAndNearestIsDeterministic) {
  const std::vector<float> x = Gaussian(256, 3);
  CodecOptions o = Tiled(2);
  o.rounding = v1::ROUNDING_STOCHASTIC;
  std::vector<double> mean(x.size(), 0.0);
  const int draws = 400;
  for (int k = 0; k < draws; ++k) {
    v1::EncodedTensor msg;
    const auto y = RoundTrip(o, x, {256}, &msg, /*key=*/k);
    for (size_t i = 0; i < x.size(); ++i) mean[i] += y[i] / draws;
  }
  double bias = 0, signal = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    bias += (mean[i] - x[i]) * (mean[i] - x[i]);
    signal += x[i] * double(x[i]);
  }
  EXPECT_LT(bias / signal, 0.01);
  v1::EncodedTensor a, b;
  EXPECT_EQ(RoundTrip(Tiled(3), x, {256}, &a, 1), RoundTrip(Tiled(3), x, {256}, &b, 2));
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
}

std::vector<float> Laplace(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::exponential_distribution<float> e(1.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (i % 2 ? 1.0f : -1.0f) * e(rng);
  return v;
}

TEST(EntropyCodingTest, ZstdCodesDecodeToTheSameValuesInFewerBytes) {
  // Heavy-tailed values (gradients, activation deltas): max-scaled codes
  // crowd the middle levels, ~3.1 bits of entropy in 4-bit codes.
  const std::vector<float> x = Laplace(64 * 256, 4);
  for (v1::Codec codec : {v1::CODEC_TILED, v1::CODEC_FIXED_POINT, v1::CODEC_MINMAX}) {
    CodecOptions o = Tiled(4);
    o.codec = codec;
    v1::EncodedTensor packed, coded;
    const auto y = RoundTrip(o, x, {256, 64}, &packed);
    o.entropy = true;
    o.checksum = true;
    const auto z = RoundTrip(o, x, {256, 64}, &coded);
    EXPECT_EQ(coded.entropy(), v1::ENTROPY_ZSTD) << CodecName(codec);
    EXPECT_EQ(y, z) << CodecName(codec);
    // Least for min-max, whose 16 levels span each bucket's own range.
    EXPECT_LT(coded.payload().size(), packed.payload().size() * (codec == v1::CODEC_MINMAX ? 1.0 : 0.9))
        << CodecName(codec);
  }
  // 3-bit codes of one link row (64 tokens x 64 channels): short runs of
  // few-valued bytes repeat everywhere, and matches over them cost more than
  // the Huffman-coded literals (zstd's default level 1 sent this no smaller
  // than packed).
  {
    std::mt19937 g(6);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> row(64 * 64);
    for (float& v : row) v = normal(g);  // max-scaled: ~2.6 bits of entropy in 3-bit codes
    CodecOptions o3;
    o3.codec = v1::CODEC_FIXED_POINT;
    o3.bits = 3;
    v1::EncodedTensor packed, coded;
    const auto y = RoundTrip(o3, row, {64, 64}, &packed);
    o3.entropy = true;
    const auto z = RoundTrip(o3, row, {64, 64}, &coded);
    ASSERT_EQ(coded.entropy(), v1::ENTROPY_ZSTD);
    EXPECT_EQ(y, z);
    EXPECT_LT(coded.payload().size(), packed.payload().size() * 0.95)
        << coded.payload().size() << " vs " << packed.payload().size() << " packed";
  }
  // Codes zstd cannot shrink (uniform random, 8 bits) travel packed.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> flat(4096);
  for (float& v : flat) v = u(rng);
  CodecOptions o = Tiled(8);
  o.entropy = true;
  v1::EncodedTensor msg;
  RoundTrip(o, flat, {4096}, &msg);
  EXPECT_EQ(msg.entropy(), v1::ENTROPY_NONE);
}

TEST(TiledFirstVisitTest, AqsgdEndsStayBitIdenticalWithTiledFirstVisitsAndEntropyCodedDeltas) {
  for (RowPrecision stored : {RowPrecision::kFloat16, RowPrecision::kFloat32}) {
    AqsgdLinkOptions lo;
    lo.stored = stored;
    lo.warmup_epochs = 0;
    lo.quantizer.bits = 3;
    lo.quantizer.min_compress_elements = 1;
    lo.quantizer.entropy = true;
    lo.first_visit = Tiled(3);
    lo.first_visit->entropy = true;
    auto sender = AqsgdLinkCodec::Create(lo);
    auto receiver = AqsgdLinkCodec::Create(lo);
    ASSERT_TRUE(sender.ok() && receiver.ok());
    const int64_t rows = 16, cols = 64;
    std::vector<float> m_send(rows * cols), m_recv(rows * cols);
    std::vector<float> a = Gaussian(rows * cols, 6);
    size_t full_bytes = 0;
    for (int visit = 0; visit < 4; ++visit) {
      v1::AqsgdRow msg;
      ASSERT_TRUE((*sender)->EncodeRow({.seen = visit > 0, .epoch = visit}, a, rows, cols,
                                       absl::MakeSpan(m_send), visit, &msg).ok());
      EXPECT_EQ(msg.kind(), visit == 0 ? v1::AqsgdRow::KIND_FULL : v1::AqsgdRow::KIND_DELTA);
      if (visit == 0) {
        EXPECT_EQ(msg.tensor().codec(), v1::CODEC_TILED);
        full_bytes = EncodedBytes(msg.tensor());
      }
      auto r = (*receiver)->DecodeRow(msg, rows, cols, absl::MakeSpan(m_recv));
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(*r, ReceiveResult::kApplied);
      ASSERT_EQ(std::memcmp(m_send.data(), m_recv.data(), 4 * m_send.size()), 0) << "visit " << visit;
      for (float& v : a) v += 0.05f;  // the sample's activations drift between visits
    }
    // A first visit costs ~3.25 bits a value, not the 16 of raw fp16.
    EXPECT_LT(full_bytes * 4, size_t(rows * cols * 2));
  }
}

TEST(TokenReferenceTest, RowsAreMeansOfTheirTokensVisitsThenExponentialAveragesAndOnlyChangeOnCommit) {
  TokenReference ref(/*vocab=*/5, /*rows=*/2, /*cols=*/3);
  const std::vector<int32_t> tokens = {4, 1};
  std::vector<float> r(6, 9.0f);
  ASSERT_TRUE(ref.Gather(tokens, absl::MakeSpan(r)).ok());
  EXPECT_EQ(r, std::vector<float>(6, 0.0f));
  // Token 4 seen with 1, 2, 3 (and recorded twice at one place: the last wins).
  ASSERT_TRUE(ref.Record(0, 0, tokens, std::vector<float>{7, 7, 7, 2, 2, 2}).ok());
  ASSERT_TRUE(ref.Record(0, 0, tokens, std::vector<float>{1, 1, 1, 2, 2, 2}).ok());
  ASSERT_TRUE(ref.Record(1, 0, std::vector<int32_t>{4, 4}, std::vector<float>{2, 2, 2, 3, 3, 3}).ok());
  EXPECT_EQ(ref.pending(), 2u);
  ASSERT_TRUE(ref.Gather(tokens, absl::MakeSpan(r)).ok());
  EXPECT_EQ(r, std::vector<float>(6, 0.0f)) << "records wait for Commit";
  ref.Commit();
  EXPECT_EQ(ref.pending(), 0u);
  ASSERT_TRUE(ref.Gather(tokens, absl::MakeSpan(r)).ok());
  EXPECT_EQ(r, (std::vector<float>{2, 2, 2, 2, 2, 2}));  // mean(1, 2, 3); token 1: 2
  // Past kWindow visits, a visit moves the row by 1 / kWindow of the gap.
  for (uint32_t k = 0; k < TokenReference::kWindow; ++k) {
    ASSERT_TRUE(ref.Record(0, 0, std::vector<int32_t>{1, 0}, std::vector<float>{2, 2, 2, 0, 0, 0}).ok());
    ref.Commit();
  }
  ASSERT_TRUE(ref.Record(0, 0, std::vector<int32_t>{1, 0}, std::vector<float>{18, 18, 18, 0, 0, 0}).ok());
  ref.Commit();
  ASSERT_TRUE(ref.Gather(std::vector<int32_t>{1, 0}, absl::MakeSpan(r)).ok());
  EXPECT_EQ(r[0], 3.0f);
  // Bad input: a token outside the vocabulary, wrong sizes.
  EXPECT_FALSE(ref.Gather(std::vector<int32_t>{5, 0}, absl::MakeSpan(r)).ok());
  EXPECT_FALSE(ref.Gather(std::vector<int32_t>{-1, 0}, absl::MakeSpan(r)).ok());
  EXPECT_FALSE(ref.Gather(std::vector<int32_t>{0}, absl::MakeSpan(r)).ok());
  EXPECT_FALSE(ref.Record(0, 0, std::vector<int32_t>{0, 9}, std::vector<float>(6)).ok());
  EXPECT_FALSE(ref.Record(0, 0, tokens, std::vector<float>(5)).ok());
}

TEST(TiledFirstVisitTest, AReferenceSubtractedFromAFirstVisitIsCheckedAndKeepsBothEndsBitIdentical) {
  const int64_t rows = 16, cols = 64;
  AqsgdLinkOptions o;
  o.quantizer.bits = 3;
  o.quantizer.min_compress_elements = 1;
  o.warmup_epochs = 0;
  o.first_visit = Tiled(3, TileRotation::kNone);
  o.first_visit->tile_grid = v1::TILE_GRID_MIDTREAD;
  auto sender = *AqsgdLinkCodec::Create(o), receiver = *AqsgdLinkCodec::Create(o);
  // The activation is mostly its reference: what is left is small.
  const std::vector<float> r = Gaussian(rows * cols, 11, 3.0f);
  std::vector<float> a = Gaussian(rows * cols, 12, 0.1f);
  for (size_t i = 0; i < a.size(); ++i) a[i] += r[i];
  std::vector<float> m_send(a.size()), m_recv(a.size()), m_plain(a.size()), m_plain_recv(a.size());
  v1::AqsgdRow with, without;
  ASSERT_TRUE(sender->EncodeRow({.sample_id = 3, .reference = r}, a, rows, cols, absl::MakeSpan(m_send), 1, &with).ok());
  ASSERT_TRUE(sender->EncodeRow({.sample_id = 3}, a, rows, cols, absl::MakeSpan(m_plain), 1, &without).ok());
  ASSERT_TRUE(with.has_reference_checksum());
  EXPECT_FALSE(without.has_reference_checksum());
  // The receiver needs the same reference: a missing or different one asks for a resend, m untouched.
  std::vector<float> other = r;
  other[7] += 1.0f;
  EXPECT_EQ(*receiver->DecodeRow(with, rows, cols, absl::MakeSpan(m_recv)), ReceiveResult::kResendNeeded);
  EXPECT_EQ(*receiver->DecodeRow(with, rows, cols, absl::MakeSpan(m_recv), std::nullopt, other),
            ReceiveResult::kResendNeeded);
  EXPECT_EQ(m_recv, std::vector<float>(a.size(), 0.0f));
  ASSERT_EQ(*receiver->DecodeRow(with, rows, cols, absl::MakeSpan(m_recv), std::nullopt, r), ReceiveResult::kApplied);
  EXPECT_EQ(std::memcmp(m_send.data(), m_recv.data(), 4 * a.size()), 0);
  ASSERT_EQ(*receiver->DecodeRow(without, rows, cols, absl::MakeSpan(m_plain_recv)), ReceiveResult::kApplied);
  EXPECT_EQ(std::memcmp(m_plain.data(), m_plain_recv.data(), 4 * a.size()), 0);
  // Quantizing what the reference leaves is far closer than quantizing a.
  EXPECT_LT(SquaredError(a, m_send) * 10, SquaredError(a, m_plain));
  // A resend (force_full) travels without the reference.
  v1::AqsgdRow resend;
  ASSERT_TRUE(sender->EncodeRow({.seen = true, .force_full = true, .sample_id = 3, .reference = r}, a, rows, cols,
                                absl::MakeSpan(m_send), 1, &resend).ok());
  EXPECT_FALSE(resend.has_reference_checksum());
  // A reference checksum on a DELTA row is malformed.
  v1::AqsgdRow delta;
  ASSERT_TRUE(sender->EncodeRow({.seen = true, .sample_id = 3}, a, rows, cols, absl::MakeSpan(m_send), 2, &delta).ok());
  ASSERT_EQ(delta.kind(), v1::AqsgdRow::KIND_DELTA);
  delta.set_reference_checksum(1);
  EXPECT_FALSE(receiver->DecodeRow(delta, rows, cols, absl::MakeSpan(m_recv), std::nullopt, r).ok());
}

TEST(TiledHostileInputTest, MalformedTiledAndEntropyMessagesAreRefusedWithoutTouchingTheOutput) {
  // Three values repeated: 8-bit codes that zstd shrinks.
  std::vector<float> x(200);
  for (size_t i = 0; i < 200; ++i) x[i] = static_cast<float>(i % 3);
  v1::EncodedTensor good;
  CodecOptions o = Tiled(8, TileRotation::kNone);
  o.entropy = true;
  ASSERT_TRUE(Encode(o, x, {200}, 1, &good).ok());
  ASSERT_EQ(good.entropy(), v1::ENTROPY_ZSTD);
  std::vector<float> out(200, 42.0f);
  auto refused = [&](const v1::EncodedTensor& m) {
    const absl::Status s = Decode(m, absl::MakeSpan(out));
    for (float v : out) EXPECT_EQ(v, 42.0f);
    return !s.ok();
  };
  v1::EncodedTensor m = good;
  m.set_bucket_size(48);  // not a power of two
  EXPECT_TRUE(refused(m));
  m = good;
  m.set_bucket_size(8192);
  EXPECT_TRUE(refused(m));
  m = good;
  m.mutable_scales()->pop_back();
  EXPECT_TRUE(refused(m));
  m = good;
  (*m.mutable_scales())[2 * 4] = 0x08;  // tile 3 rotated: the short one (192..199)
  EXPECT_TRUE(refused(m)) << "rotation bit on the short tile";
  m = good;
  (*m.mutable_scales())[1] = static_cast<char>(0x7c);  // scale of tile 0 = +inf
  EXPECT_TRUE(refused(m));
  m = good;
  m.set_bits(9);
  EXPECT_TRUE(refused(m));
  m = good;
  m.set_bits(1);  // the frame holds 8-bit codes
  EXPECT_TRUE(refused(m));
  m = good;
  m.mutable_payload()->push_back('x');  // bytes after the frame
  EXPECT_TRUE(refused(m));
  m = good;
  (*m.mutable_payload())[m.payload().size() / 2] ^= 0x5a;  // a corrupt frame
  (void)refused(m);  // may or may not decode, never crashes or writes partially
  m = good;
  m.set_num_elements(100);
  m.clear_shape();
  m.add_shape(100);  // the frame says 200 codes
  EXPECT_TRUE(refused(m));
  m = good;
  m.set_entropy(static_cast<v1::Entropy>(9));
  EXPECT_TRUE(refused(m));
  m = good;
  m.set_tile_order(static_cast<v1::TileOrder>(5));
  EXPECT_TRUE(refused(m));
  m = good;
  m.set_tile_grid(static_cast<v1::TileGrid>(3));
  EXPECT_TRUE(refused(m));
  // A midtread message at 1 bit has no grid.
  v1::EncodedTensor mt1;
  ASSERT_TRUE(Encode(Tiled(1, TileRotation::kNone), x, {200}, 1, &mt1).ok());
  mt1.set_tile_grid(v1::TILE_GRID_MIDTREAD);
  EXPECT_TRUE(refused(mt1));
  // A midtread code 0 (never written by an encoder) decodes, finite, just
  // past -scale, even at the largest scale.
  v1::EncodedTensor mt;
  CodecOptions mto = Tiled(2, TileRotation::kNone);
  mto.tile_grid = v1::TILE_GRID_MIDTREAD;
  std::vector<float> big(64, 65504.0f);
  ASSERT_TRUE(Encode(mto, big, {64}, 1, &mt).ok());
  mt.mutable_payload()->assign(mt.payload().size(), '\0');
  std::vector<float> low(64);
  ASSERT_TRUE(Decode(mt, absl::MakeSpan(low)).ok());
  for (float v : low) EXPECT_EQ(v, -131008.0f);
  // Entropy coding is for packed quantized codes only.
  v1::EncodedTensor raw;
  CodecOptions r;
  r.codec = v1::CODEC_RAW_F32;
  ASSERT_TRUE(Encode(r, x, {200}, 1, &raw).ok());
  raw.set_entropy(v1::ENTROPY_ZSTD);
  EXPECT_TRUE(refused(raw));
  raw.set_entropy(v1::ENTROPY_NONE);
  raw.set_tile_order(v1::TILES_DOWN_COLUMNS);
  EXPECT_TRUE(refused(raw));
  raw.set_tile_order(v1::TILES_ALONG_ROWS);
  raw.set_tile_grid(v1::TILE_GRID_MIDTREAD);
  EXPECT_TRUE(refused(raw));
  // NaN in, a clear error out.
  std::vector<float> bad = x;
  bad[70] = NAN;
  v1::EncodedTensor msg;
  EXPECT_FALSE(Encode(Tiled(3), bad, {200}, 1, &msg).ok());
  bad[70] = 1e6f;  // beyond the binary16 scale range
  EXPECT_FALSE(Encode(Tiled(3, TileRotation::kNone), bad, {200}, 1, &msg).ok());
}

}  // namespace
}  // namespace aqswarm::compression
