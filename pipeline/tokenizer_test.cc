#include "pipeline/tokenizer.h"

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/random.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/data_test_util.h"

namespace aqswarm::pipeline {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::DataDir;
using testing::MakeTempDir;
using testing::RequireDataFile;
using testing::WriteFile;
using testing::WriteTinyVocab;

// ---------------------------------------------------------------- GPT-2 files

class Gpt2TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string enc = DataDir() + "/gpt2/encoder.json";
    const std::string bpe = DataDir() + "/gpt2/vocab.bpe";
    if (!std::filesystem::exists(enc) || !std::filesystem::exists(bpe)) return;
    auto loaded = Tokenizer::Load(enc, bpe);
    if (loaded.ok()) tokenizer_ = std::move(loaded).value().release();
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override {
    if (!RequireDataFile(DataDir() + "/gpt2/encoder.json") ||
        !RequireDataFile(DataDir() + "/gpt2/vocab.bpe")) {
      GTEST_FAIL() << "GPT-2 tokenizer files missing";
    }
    ASSERT_NE(tokenizer_, nullptr) << "Tokenizer::Load failed on " << DataDir() << "/gpt2";
  }
  static const Tokenizer& tok() { return *tokenizer_; }

  static Tokenizer* tokenizer_;
};
Tokenizer* Gpt2TokenizerTest::tokenizer_ = nullptr;

TEST_F(Gpt2TokenizerTest, VocabularyShape) {
  EXPECT_EQ(tok().vocab_size(), 50257);
  EXPECT_EQ(tok().num_merges(), 50000);
  EXPECT_EQ(tok().eot_id(), 50256);
  EXPECT_EQ(tok().Decode({50256}), "<|endoftext|>");
}

TEST_F(Gpt2TokenizerTest, KnownIds) {
  EXPECT_THAT(tok().Encode("Hello, world!"), ElementsAre(15496, 11, 995, 0));
  EXPECT_THAT(tok().Encode(""), ElementsAre());
  // Special tokens in text are ordinary text (encode_ordinary semantics).
  EXPECT_NE(tok().Encode("<|endoftext|>").size(), 1u);
}

struct GoldenCase {
  std::string encoding;
  std::string text;
  std::vector<int32_t> ids;
};

// TestPlans.txt: blocks of "EncodingName: X", "Sample: <text>", "Encoded: [..]"
// separated by blank lines. A sample may span lines until "Encoded: ".
std::vector<GoldenCase> ParseTestPlans(const std::string& contents) {
  std::vector<GoldenCase> cases;
  std::vector<absl::string_view> lines = absl::StrSplit(contents, '\n');
  for (size_t i = 0; i < lines.size(); ++i) {
    absl::string_view line = lines[i];
    if (!absl::ConsumePrefix(&line, "EncodingName: ")) continue;
    GoldenCase c;
    c.encoding = std::string(line);
    if (++i >= lines.size()) break;
    absl::string_view sample = lines[i];
    if (!absl::ConsumePrefix(&sample, "Sample: ")) continue;
    c.text = std::string(sample);
    while (++i < lines.size() && !absl::StartsWith(lines[i], "Encoded: ")) {
      c.text += "\n" + std::string(lines[i]);
    }
    if (i >= lines.size()) break;
    absl::string_view encoded = lines[i];
    absl::ConsumePrefix(&encoded, "Encoded: [");
    absl::ConsumeSuffix(&encoded, "]");
    for (absl::string_view num : absl::StrSplit(encoded, ',', absl::SkipWhitespace())) {
      int32_t id = -1;
      EXPECT_TRUE(absl::SimpleAtoi(num, &id)) << "bad id '" << num << "'";
      c.ids.push_back(id);
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

TEST_F(Gpt2TokenizerTest, GoldenCasesFromGptTokenizer) {
  const std::string path = DataDir() + "/gpt2/TestPlans.txt";
  ASSERT_TRUE(RequireDataFile(path));
  std::vector<GoldenCase> all = ParseTestPlans(testing::ReadFile(path));
  ASSERT_EQ(all.size(), 313u) << "TestPlans.txt format changed?";
  // Only r50k_base is GPT-2's encoding; the others (p50k, cl100k, o200k) use
  // other vocabularies or patterns.
  int applied = 0;
  for (const GoldenCase& c : all) {
    if (c.encoding != "r50k_base") continue;
    ++applied;
    EXPECT_EQ(tok().Encode(c.text), c.ids) << "text: '" << c.text << "'";
    EXPECT_EQ(tok().Decode(c.ids), c.text);
  }
  EXPECT_EQ(applied, 64);
  RecordProperty("golden_cases_applied", applied);
}

TEST_F(Gpt2TokenizerTest, RoundTripsUtf8AndOddWhitespace) {
  const std::vector<std::string> texts = {
      "",
      " ",
      "   leading and trailing   ",
      "tabs\tand\nnewlines\r\n\r\nand\n\n\n   \n",
      "non-breaking\u00a0space, ideographic\u3000space, em\u2003space",
      "emoji 😀🎉 family 👨‍👩‍👧‍👦 flags 🇺🇸🇯🇵 skin 👍🏽",
      "中文字符与日本語のテキスト, 한국어 텍스트",
      "مرحبا بالعالم — שלום עולם",
      "combining: e\u0301 a\u0308 n\u0303; zero-width\u200bjoiner",
      "numbers 1234567890 3.14159 1e-9 ½ ² ٣",
      "code: if (x != y) { return a[i] << 2; } // comment",
      "it's they're we've I'm you'll he'd 'S 'T",
      std::string(5000, ' ') + "x" + std::string(3, '\n'),
      std::string("nul\0inside", 10),
      "control \x01\x02\x7f chars",
  };
  for (const std::string& t : texts) {
    EXPECT_EQ(tok().Decode(tok().Encode(t)), t) << "text: '" << t << "'";
  }
}

TEST_F(Gpt2TokenizerTest, RoundTripsInvalidUtf8AndRandomBytes) {
  for (const std::string& t : {std::string("\xff\xfe"), std::string("ab\xc3(cd"),
                               std::string("\xe2\x82"), std::string("ok \xed\xa0\x80 surrogate")}) {
    EXPECT_EQ(tok().Decode(tok().Encode(t)), t);
  }
  Rng rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::string t(rng.Uniform(64), '\0');
    for (char& c : t) c = static_cast<char>(rng.Uniform(256));
    EXPECT_EQ(tok().Decode(tok().Encode(t)), t) << "trial " << trial;
  }
}

TEST_F(Gpt2TokenizerTest, LongWhitespaceRunIsFast) {
  const std::string spaces(1 << 20, ' ');
  const auto start = std::chrono::steady_clock::now();
  std::vector<int32_t> ids = tok().Encode(spaces);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(tok().Decode(ids), spaces);
  EXPECT_LT(seconds, 5.0) << "BPE must not be quadratic in the piece length";
}

TEST_F(Gpt2TokenizerTest, ConcurrentEncodeAgreesWithSerial) {
  // The piece cache is shared: threads racing on it must not change results.
  std::vector<std::string> texts;
  Rng rng(11);
  for (int i = 0; i < 8; ++i) {
    std::string t;
    for (int w = 0; w < 2000; ++w) t += " w" + std::to_string(rng.Uniform(500));
    texts.push_back(t);
  }
  std::vector<std::vector<int32_t>> serial;
  for (const auto& t : texts) serial.push_back(tok().Encode(t));
  std::vector<std::vector<int32_t>> parallel(texts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < texts.size(); ++i) {
    threads.emplace_back([&, i] { parallel[i] = tok().Encode(texts[i]); });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(parallel, serial);
}

TEST_F(Gpt2TokenizerTest, DecodeOutOfRangeIdIsReplacementChar) {
  EXPECT_EQ(tok().Decode({15496, 50300, -1}), "Hello\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST_F(Gpt2TokenizerTest, ThroughputOnSotu) {
  // Cold cache: a fresh tokenizer, so this measures BPE, not memoisation.
  const std::string dir = DataDir() + "/sotu";
  ASSERT_TRUE(RequireDataFile(dir));
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) {
    text += testing::ReadFile(f.string());
    if (text.size() > (2 << 20)) break;
  }
  auto fresh = Tokenizer::Load(DataDir() + "/gpt2/encoder.json", DataDir() + "/gpt2/vocab.bpe");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const auto start = std::chrono::steady_clock::now();
  std::vector<int32_t> ids = (*fresh)->Encode(text);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double mb_per_s = text.size() / 1e6 / seconds;
  std::cout << "tokenized " << text.size() << " bytes -> " << ids.size() << " tokens in "
            << seconds << " s: " << mb_per_s << " MB/s\n";
  RecordProperty("tokenize_mb_per_s", std::to_string(mb_per_s));
  EXPECT_EQ((*fresh)->Decode(ids), text);
  // Generous floor (sanitizer or loaded CI machines); typical is far higher.
  EXPECT_GT(mb_per_s, 0.2);
}

// ---------------------------------------------------------------- hermetic

TEST(TinyTokenizerTest, MergesByRankLeftToRight) {
  const std::string dir = MakeTempDir("vocab");
  // ids: 0..255 bytes, 256 "aa", 257 "aaa", 258 "ab", 259 eot.
  WriteTinyVocab(dir, {{"a", "a"}, {"aa", "a"}, {"a", "b"}});
  auto tok = Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const int32_t a = 'a', b = 'b';  // single bytes in byte order
  EXPECT_THAT((*tok)->Encode("a"), ElementsAre(a));
  EXPECT_THAT((*tok)->Encode("aa"), ElementsAre(256));
  EXPECT_THAT((*tok)->Encode("aaa"), ElementsAre(257));
  // Rank 0 "a a" first, left to right: (aa)(aa), and "aa aa" is no merge.
  EXPECT_THAT((*tok)->Encode("aaaa"), ElementsAre(256, 256));
  // In "aab", rank 0 "a a" merges before rank 2 "a b".
  EXPECT_THAT((*tok)->Encode("aab"), ElementsAre(256, b));
  EXPECT_THAT((*tok)->Encode("ab"), ElementsAre(258));
  EXPECT_THAT((*tok)->Encode("aaab"), ElementsAre(257, b));
  EXPECT_THAT((*tok)->Encode("ba"), ElementsAre(b, a));
  EXPECT_EQ((*tok)->eot_id(), 259);
  EXPECT_EQ((*tok)->vocab_size(), 260);
}

TEST(TinyTokenizerTest, ChecksumNamesTheVocabulary) {
  const std::string d1 = MakeTempDir("v1"), d2 = MakeTempDir("v2"), d3 = MakeTempDir("v3");
  WriteTinyVocab(d1, {{"a", "a"}});
  WriteTinyVocab(d2, {{"a", "a"}});
  WriteTinyVocab(d3, {{"a", "b"}});
  auto t1 = Tokenizer::Load(d1 + "/encoder.json", d1 + "/vocab.bpe");
  auto t2 = Tokenizer::Load(d2 + "/encoder.json", d2 + "/vocab.bpe");
  auto t3 = Tokenizer::Load(d3 + "/encoder.json", d3 + "/vocab.bpe");
  ASSERT_TRUE(t1.ok() && t2.ok() && t3.ok());
  EXPECT_EQ((*t1)->checksum(), (*t2)->checksum());
  EXPECT_NE((*t1)->checksum(), (*t3)->checksum());
}

TEST(TokenizerLoadTest, MissingEncoderIsNotFound) {
  const std::string dir = MakeTempDir("vocab");
  WriteTinyVocab(dir, {{"a", "a"}});
  auto tok = Tokenizer::Load(dir + "/nope.json", dir + "/vocab.bpe");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr("nope.json"));
  EXPECT_THAT(tok.status().message(), HasSubstr("fetch_data.sh"));
}

TEST(TokenizerLoadTest, MissingVocabIsNotFound) {
  const std::string dir = MakeTempDir("vocab");
  WriteTinyVocab(dir, {{"a", "a"}});
  auto tok = Tokenizer::Load(dir + "/encoder.json", dir + "/nope.bpe");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
}

TEST(TokenizerLoadTest, CorruptJsonIsDataLoss) {
  const std::string dir = MakeTempDir("vocab");
  WriteTinyVocab(dir, {{"a", "a"}});
  std::string json = testing::ReadFile(dir + "/encoder.json");
  WriteFile(dir + "/encoder.json", json.substr(0, json.size() / 2));  // truncated
  auto tok = Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
  EXPECT_THAT(tok.status().message(), HasSubstr("encoder.json"));

  WriteFile(dir + "/encoder.json", "[1, 2, 3]");
  EXPECT_EQ(Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe").status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(TokenizerLoadTest, EncoderWithGapsOrDuplicateIdsIsDataLoss) {
  const std::string dir = MakeTempDir("vocab");
  WriteTinyVocab(dir, {{"a", "a"}});
  nlohmann::json enc = nlohmann::json::parse(testing::ReadFile(dir + "/encoder.json"));
  enc["aa"] = 5;  // duplicate of byte 5's id
  WriteFile(dir + "/encoder.json", enc.dump());
  EXPECT_EQ(Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe").status().code(),
            absl::StatusCode::kDataLoss);
  enc["aa"] = "256";  // not a number
  WriteFile(dir + "/encoder.json", enc.dump());
  EXPECT_EQ(Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe").status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(TokenizerLoadTest, BadMergesAreDataLoss) {
  const std::string dir = MakeTempDir("vocab");
  WriteTinyVocab(dir, {{"a", "a"}, {"aa", "a"}});
  // A merge whose result is not a token.
  WriteFile(dir + "/vocab.bpe", "#version: 0.2\nx y\n");
  auto tok = Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(tok.status().message(), HasSubstr("line 2"));
  // A malformed line.
  WriteFile(dir + "/vocab.bpe", "#version: 0.2\na a a\n");
  EXPECT_EQ(Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe").status().code(),
            absl::StatusCode::kDataLoss);
  // A merge using a token made only later.
  WriteFile(dir + "/vocab.bpe", "#version: 0.2\naa a\na a\n");
  EXPECT_EQ(Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe").status().code(),
            absl::StatusCode::kDataLoss);
  // No merges at all.
  WriteFile(dir + "/vocab.bpe", "#version: 0.2\n");
  EXPECT_EQ(Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe").status().code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace aqswarm::pipeline
