// Hugging Face tokenizer.json support of Tokenizer: Llama-3's and Qwen3's
// real files (data/, from scripts/fetch_data.sh) against the ids of the
// JavaScript reference (transformers.js; tests/data/tokenizer/, written by
// scripts/gen_tokenizer_reference.sh), plus hermetic tiny tokenizer.json
// files for the error paths and options.
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "pipeline/data_test_util.h"
#include "pipeline/tokenizer.h"

namespace aqswarm::pipeline {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::ByteTokens;
using testing::DataDir;
using testing::MakeTempDir;
using testing::RequireDataFile;
using testing::WriteFile;

std::string TestDataDir() { return std::string(AQSWARM_TEST_DATA_DIR) + "/tokenizer"; }

struct ReferenceCase {
  std::string name;
  std::string text;
  std::vector<int32_t> ids;           // transformers.js encode(text, {add_special_tokens: false})
  std::vector<int32_t> ids_ordinary;  // the same with added tokens treated as text
};

// texts.jsonl joined with <family>.jsonl, line by line (names must agree).
std::vector<ReferenceCase> ReadReference(const std::string& family) {
  std::vector<ReferenceCase> cases;
  std::ifstream texts(TestDataDir() + "/texts.jsonl");
  std::ifstream ids(TestDataDir() + "/" + family + ".jsonl");
  EXPECT_TRUE(texts && ids) << "missing " << TestDataDir() << "/texts.jsonl or " << family << ".jsonl";
  std::string text_line, ids_line;
  while (std::getline(texts, text_line)) {
    if (text_line.empty()) continue;
    if (!std::getline(ids, ids_line)) {
      ADD_FAILURE() << family << ".jsonl has fewer lines than texts.jsonl: rerun scripts/gen_tokenizer_reference.sh";
      break;
    }
    const nlohmann::json t = nlohmann::json::parse(text_line);
    const nlohmann::json r = nlohmann::json::parse(ids_line);
    EXPECT_EQ(t["name"], r["name"]) << family << ".jsonl is out of date: rerun scripts/gen_tokenizer_reference.sh";
    cases.push_back({t["name"].get<std::string>(), t["text"].get<std::string>(),
                     r["ids"].get<std::vector<int32_t>>(), r["ids_ordinary"].get<std::vector<int32_t>>()});
  }
  return cases;
}

// ------------------------------------------------------------ real files

// GPT-2's encoder.json + vocab.bpe as the tokenizer.json Hugging Face ships
// for GPT-2 (the generator script builds the same object for the reference).
std::string WriteGpt2TokenizerJson() {
  const std::string dir = DataDir() + "/gpt2";
  nlohmann::json j;
  j["version"] = "1.0";
  j["added_tokens"] = nlohmann::json::array({{{"id", 50256}, {"content", "<|endoftext|>"}, {"single_word", false},
                                              {"lstrip", false}, {"rstrip", false}, {"normalized", true},
                                              {"special", true}}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  j["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  nlohmann::json merges = nlohmann::json::array();
  std::ifstream bpe(dir + "/vocab.bpe");
  std::string line;
  for (bool first = true; std::getline(bpe, line); first = false) {
    if (line.empty() || (first && line.rfind("#version", 0) == 0)) continue;
    merges.push_back(line);
  }
  j["model"] = {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false},
                {"vocab", nlohmann::json::parse(testing::ReadFile(dir + "/encoder.json"))}, {"merges", merges}};
  const std::string path = std::filesystem::path(testing::TestScratchRoot()) / "gpt2_tokenizer.json";
  WriteFile(path, j.dump());
  return path;
}

class HfTokenizerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const bool gpt2 = GetParam() == "gpt2";
    const std::string path = DataDir() + "/" + GetParam() + (gpt2 ? "/encoder.json" : "/tokenizer.json");
    if (!RequireDataFile(path)) GTEST_FAIL() << GetParam() << " tokenizer files missing";
    auto& slot = Loaded()[GetParam()];
    if (slot == nullptr) {
      absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
          gpt2 ? Tokenizer::Open(WriteGpt2TokenizerJson()) : Tokenizer::Open(DataDir() + "/" + GetParam());
      ASSERT_TRUE(tok.ok()) << tok.status();
      slot = std::move(tok).value();
    }
    tok_ = slot.get();
    cases_ = ReadReference(GetParam());
    ASSERT_GE(cases_.size(), 60u);
  }
  static std::map<std::string, std::unique_ptr<Tokenizer>>& Loaded() {
    static auto* loaded = new std::map<std::string, std::unique_ptr<Tokenizer>>();
    return *loaded;
  }

  const Tokenizer* tok_ = nullptr;
  std::vector<ReferenceCase> cases_;
};

TEST_P(HfTokenizerTest, EncodeMatchesReferenceWithAddedTokensAsText) {
  for (const ReferenceCase& c : cases_) {
    EXPECT_EQ(tok_->Encode(c.text), c.ids_ordinary) << GetParam() << " text '" << c.name << "'";
  }
}

TEST_P(HfTokenizerTest, EncodeWithAddedTokensMatchesReference) {
  for (const ReferenceCase& c : cases_) {
    EXPECT_EQ(tok_->EncodeWithAddedTokens(c.text), c.ids) << GetParam() << " text '" << c.name << "'";
  }
}

// Texts that NFC (Qwen's normalizer) changes: decoding gives the NFC form.
const std::set<std::string>& NotNfcStable() {
  static const auto* names = new std::set<std::string>{
      "latin_diacritics_nfd", "hangul_nfd", "combining_marks", "angstrom_ohm_kelvin", "contraction_long_s"};
  return *names;
}

TEST_P(HfTokenizerTest, DecodeInvertsEncode) {
  const bool nfc = GetParam() == "qwen3";
  for (const ReferenceCase& c : cases_) {
    const std::string decoded = tok_->Decode(tok_->Encode(c.text));
    if (nfc && NotNfcStable().count(c.name) > 0) {
      EXPECT_NE(decoded, c.text) << "NFC should change '" << c.name << "'";
    } else {
      EXPECT_EQ(decoded, c.text) << GetParam() << " text '" << c.name << "'";
    }
    EXPECT_EQ(tok_->Decode(tok_->EncodeWithAddedTokens(c.text)), decoded) << c.name;
  }
}

TEST_P(HfTokenizerTest, SpecialTokenTextIsOrdinaryUnlessAsked) {
  struct Family {
    std::string text;
    int32_t first_added_id, begin_id;
  };
  const std::map<std::string, Family> families = {
      {"llama3", {"<|begin_of_text|>Hi<|end_of_text|>", 128000, 128000}},
      {"qwen3", {"<|im_start|>Hi<|endoftext|>", 151643, 151644}},
      {"gpt2", {"<|endoftext|>Hi<|endoftext|>", 50256, 50256}}};
  const Family& f = families.at(GetParam());
  const std::vector<int32_t> ordinary = tok_->Encode(f.text);
  EXPECT_THAT(ordinary, Not(Contains(tok_->eot_id())));
  for (const int32_t id : ordinary) EXPECT_LT(id, f.first_added_id) << "an added token from text";
  const std::vector<int32_t> with_added = tok_->EncodeWithAddedTokens(f.text);
  ASSERT_GE(with_added.size(), 3u);
  EXPECT_EQ(with_added.front(), f.begin_id);
  EXPECT_EQ(with_added.back(), tok_->eot_id());
  EXPECT_EQ(tok_->Decode(with_added), f.text);
  EXPECT_EQ(tok_->Decode(ordinary), f.text);
}

TEST_P(HfTokenizerTest, InvalidUtf8IsKeptByteForByte) {
  // Policy (tokenizer.h): Encode never fails and keeps every byte.
  const std::string text = std::string("ok \xff\xfe caf\xc3\xa9 \xc3 x\xe2\x82 \xed\xa0\x80 end\x80", 28);
  ASSERT_EQ(text.size(), 28u);
  const std::vector<int32_t> ids = tok_->Encode(text);
  EXPECT_EQ(tok_->Decode(ids), text);
  EXPECT_EQ(tok_->Decode(tok_->Encode(std::string_view("\xff", 1))), std::string("\xff", 1));
}

TEST_P(HfTokenizerTest, LongRunsRoundTrip) {
  // PCRE2's JIT stack and the O(n log n) BPE on 100 k-character runs (the
  // same inputs gave transformers.js's ids when checked by hand).
  for (const std::string& text : {"a" + std::string(100000, ' ') + "b", std::string(100000, '\n'),
                                  std::string(100000, 'a'), std::string(100000, '7'),
                                  std::string(50000, '\t') + "end"}) {
    const std::vector<int32_t> ids = tok_->Encode(text);
    EXPECT_LE(ids.size(), text.size());  // Qwen: one token per digit
    EXPECT_EQ(tok_->Decode(ids), text) << text.substr(0, 3);
  }
}

TEST_P(HfTokenizerTest, ConcurrentEncodeAgreesWithSerial) {
  std::vector<std::vector<int32_t>> serial;
  for (const ReferenceCase& c : cases_) serial.push_back(c.ids_ordinary);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (size_t i = 0; i < cases_.size(); ++i) {
          const size_t k = (i * 7 + t + round) % cases_.size();
          if (tok_->Encode(cases_[k].text) != serial[k]) ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST_P(HfTokenizerTest, ChecksumIsStableAcrossLoads) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> again = Tokenizer::LoadHuggingFace(
      GetParam() == "gpt2" ? WriteGpt2TokenizerJson() : DataDir() + "/" + GetParam() + "/tokenizer.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->checksum(), tok_->checksum());
  EXPECT_EQ((*again)->Encode("Hello, world!"), tok_->Encode("Hello, world!"));
}

INSTANTIATE_TEST_SUITE_P(Families, HfTokenizerTest, ::testing::Values("llama3", "qwen3", "gpt2"),
                         [](const auto& info) { return info.param; });

// GPT-2's own files (tiktoken's semantics) and GPT-2's tokenizer.json
// (transformers.js's) give the same ids except where JavaScript's \s differs
// from Unicode White_Space (U+FEFF, U+0085).
TEST(HfTokenizerShapeTest, Gpt2FilesAgreeWithGpt2TokenizerJson) {
  if (!RequireDataFile(DataDir() + "/gpt2/encoder.json")) return;
  auto files = Tokenizer::Open(DataDir() + "/gpt2");
  auto json = Tokenizer::Open(WriteGpt2TokenizerJson());
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ((*json)->vocab_size(), 50257);
  EXPECT_EQ((*json)->eot_id(), 50256);
  EXPECT_EQ((*json)->num_merges(), 50000);
  for (const ReferenceCase& c : ReadReference("gpt2")) {
    if (c.name == "whitespace_js_vs_unicode") continue;
    EXPECT_EQ((*files)->Encode(c.text), c.ids_ordinary) << c.name;
  }
}

TEST(HfTokenizerShapeTest, Llama3AndQwen3AndGpt2) {
  for (const char* f : {"/llama3/tokenizer.json", "/qwen3/tokenizer.json", "/gpt2/encoder.json"}) {
    if (!RequireDataFile(DataDir() + f)) return;
  }
  auto llama = Tokenizer::Open(DataDir() + "/llama3/tokenizer.json");  // the file form
  auto qwen = Tokenizer::Open(DataDir() + "/qwen3");                   // the directory form
  auto gpt2 = Tokenizer::Open(DataDir() + "/gpt2");                    // GPT-2's own files
  ASSERT_TRUE(llama.ok()) << llama.status();
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  EXPECT_EQ((*llama)->vocab_size(), 128256);
  EXPECT_EQ((*llama)->num_merges(), 280147);
  EXPECT_EQ((*llama)->eot_id(), 128001);  // <|end_of_text|>
  EXPECT_EQ((*qwen)->vocab_size(), 151669);
  EXPECT_EQ((*qwen)->num_merges(), 151387);
  EXPECT_EQ((*qwen)->eot_id(), 151643);  // <|endoftext|>
  EXPECT_EQ((*gpt2)->vocab_size(), 50257);
  EXPECT_EQ((*gpt2)->eot_id(), 50256);
  EXPECT_THAT((*llama)->Encode("Hello, world!"), ElementsAre(9906, 11, 1917, 0));
  EXPECT_THAT((*gpt2)->Encode("Hello, world!"), ElementsAre(15496, 11, 995, 0));
  EXPECT_NE((*llama)->checksum(), (*qwen)->checksum());
  EXPECT_NE((*llama)->checksum(), (*gpt2)->checksum());
  // Open of GPT-2's directory is Load of its two files: same tokenizer.
  auto loaded = Tokenizer::Load(DataDir() + "/gpt2/encoder.json", DataDir() + "/gpt2/vocab.bpe");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*gpt2)->checksum(), (*loaded)->checksum());
  // Llama-3 splits digit runs in threes, Qwen digit by digit.
  EXPECT_EQ((*llama)->Encode("1234567").size(), 3u);
  EXPECT_EQ((*qwen)->Encode("1234567").size(), 7u);
  // Decoding an id in no token's place (Qwen's padded embedding) never fails.
  EXPECT_EQ((*qwen)->Decode({151900, -1}), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

// ------------------------------------------------------ tiny hermetic files

// A byte-level BPE tokenizer.json: the 256 byte tokens (ids 0..255), one
// token per merge (256..), then the added token "<|endoftext|>".
nlohmann::json TinyTokenizerJson(const std::vector<std::pair<std::string, std::string>>& merges,
                                  bool array_merges = false) {
  nlohmann::json vocab = nlohmann::json::object();
  int id = 0;
  for (const std::string& t : ByteTokens()) vocab[t] = id++;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [left, right] : merges) {
    vocab[left + right] = id++;
    if (array_merges) {
      merge_list.push_back({left, right});
    } else {
      merge_list.push_back(left + " " + right);
    }
  }
  nlohmann::json j;
  j["version"] = "1.0";
  j["added_tokens"] = nlohmann::json::array(
      {{{"id", id}, {"content", "<|endoftext|>"}, {"special", true}, {"lstrip", false}, {"rstrip", false}}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"}};
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}};
  return j;
}

std::string WriteJson(const std::string& name, const nlohmann::json& j) {
  const std::string path = MakeTempDir(name) + "/tokenizer.json";
  WriteFile(path, j.dump());
  return path;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadJson(const std::string& name, const nlohmann::json& j) {
  return Tokenizer::LoadHuggingFace(WriteJson(name, j));
}

TEST(TinyHfTokenizerTest, MergesByRankAndBothMergeFormats) {
  const std::vector<std::pair<std::string, std::string>> merges = {{"a", "a"}, {"aa", "a"}, {"b", "c"}};
  auto strings = LoadJson("strings", TinyTokenizerJson(merges));
  auto arrays = LoadJson("arrays", TinyTokenizerJson(merges, /*array_merges=*/true));
  ASSERT_TRUE(strings.ok()) << strings.status();
  ASSERT_TRUE(arrays.ok()) << arrays.status();
  EXPECT_THAT((*strings)->Encode("aaaa"), ElementsAre(256, 256));
  EXPECT_THAT((*strings)->Encode("aaa bc"), ElementsAre(257, ' ', 258));
  EXPECT_EQ((*arrays)->Encode("aaaa bc"), (*strings)->Encode("aaaa bc"));
  EXPECT_EQ((*arrays)->checksum(), (*strings)->checksum());
  EXPECT_EQ((*strings)->vocab_size(), 260);
  EXPECT_EQ((*strings)->eot_id(), 259);
  EXPECT_EQ((*strings)->num_merges(), 3);
}

TEST(TinyHfTokenizerTest, IgnoreMergesMapsAWholePieceToItsToken) {
  nlohmann::json j = TinyTokenizerJson({{"a", "b"}});
  j["model"]["vocab"]["abc"] = 300;  // no merge makes it
  auto plain = LoadJson("plain", j);
  j["model"]["ignore_merges"] = true;
  auto ignoring = LoadJson("ignoring", j);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(ignoring.ok()) << ignoring.status();
  EXPECT_THAT((*plain)->Encode("abc"), ElementsAre(256, 'c'));
  EXPECT_THAT((*ignoring)->Encode("abc"), ElementsAre(300));
  EXPECT_NE((*plain)->checksum(), (*ignoring)->checksum());
  // Ids 258..299 are a hole.
  EXPECT_EQ((*plain)->vocab_size(), 301);
  EXPECT_EQ((*plain)->Decode({280}), "\xEF\xBF\xBD");
}

TEST(TinyHfTokenizerTest, ChecksumCoversRegexNormalizerAndAddedTokens) {
  const nlohmann::json base = TinyTokenizerJson({{"a", "a"}});
  auto tok = LoadJson("base", base);
  ASSERT_TRUE(tok.ok()) << tok.status();

  nlohmann::json split = base;
  split["pre_tokenizer"] = {{"type", "Sequence"},
                            {"pretokenizers",
                             {{{"type", "Split"}, {"pattern", {{"Regex", "\\p{L}+|\\s+|\\p{N}"}}}, {"behavior", "Isolated"}},
                              {{"type", "ByteLevel"}, {"use_regex", false}}}}};
  nlohmann::json nfc = base;
  nfc["normalizer"] = {{"type", "NFC"}};
  nlohmann::json added = base;
  added["added_tokens"].push_back({{"id", 500}, {"content", "<pad>"}, {"special", true}});
  std::set<uint64_t> sums = {(*tok)->checksum()};
  for (const auto& [name, j] : std::vector<std::pair<std::string, nlohmann::json>>{{"split", split}, {"nfc", nfc}, {"added", added}}) {
    auto other = LoadJson(name, j);
    ASSERT_TRUE(other.ok()) << name << ": " << other.status();
    EXPECT_TRUE(sums.insert((*other)->checksum()).second) << name << " did not change the checksum";
  }
  auto with_split = LoadJson("split2", split);
  ASSERT_TRUE(with_split.ok());
  EXPECT_THAT((*with_split)->Encode("aa12"), ElementsAre(256, '1', '2'));
  auto with_nfc = LoadJson("nfc2", nfc);
  ASSERT_TRUE(with_nfc.ok());
  EXPECT_EQ((*with_nfc)->Decode((*with_nfc)->Encode("e\xCC\x81")), "\xC3\xA9");  // e + U+0301 -> U+00E9
}

TEST(TinyHfTokenizerTest, AddedTokensOnlyWhenAskedLongestFirst) {
  nlohmann::json j = TinyTokenizerJson({});
  j["added_tokens"].push_back({{"id", 300}, {"content", "<|end"}, {"special", true}});
  j["added_tokens"].push_back({{"id", 301}, {"content", "<x>"}, {"special", false}, {"rstrip", true}});
  auto tok = LoadJson("added", j);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->EncodeWithAddedTokens("a<|endoftext|>b<|end"), ElementsAre('a', 256, 'b', 300));
  EXPECT_THAT((*tok)->EncodeWithAddedTokens("<x>  b"), ElementsAre(301, 'b'));  // rstrip
  EXPECT_THAT((*tok)->Encode("<x>"), ElementsAre('<', 'x', '>'));
}

TEST(HfTokenizerErrorTest, UnsupportedModelTypesAreNamed) {
  for (const char* type : {"WordPiece", "Unigram", "WordLevel"}) {
    nlohmann::json j = TinyTokenizerJson({});
    j["model"]["type"] = type;
    auto tok = LoadJson(type, j);
    ASSERT_FALSE(tok.ok()) << type;
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr(type));
  }
}

TEST(HfTokenizerErrorTest, NonByteLevelAndUnsupportedPartsAreNamed) {
  struct Case {
    std::string name, expected;
    std::function<void(nlohmann::json*)> edit;
  };
  const std::vector<Case> cases = {
      {"metaspace", "Metaspace", [](nlohmann::json* j) { (*j)["pre_tokenizer"] = {{"type", "Metaspace"}}; }},
      {"no_byte_level", "ByteLevel",
       [](nlohmann::json* j) {
         (*j)["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Isolated"}};
       }},
      {"lowercase", "Lowercase", [](nlohmann::json* j) { (*j)["normalizer"] = {{"type", "Lowercase"}}; }},
      {"behavior", "MergedWithPrevious",
       [](nlohmann::json* j) {
         (*j)["pre_tokenizer"] = {{"type", "Sequence"},
                                  {"pretokenizers",
                                   {{{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "MergedWithPrevious"}},
                                    {{"type", "ByteLevel"}}}}};
       }},
      {"byte_fallback", "byte_fallback", [](nlohmann::json* j) { (*j)["model"]["byte_fallback"] = true; }},
      {"decoder", "Metaspace", [](nlohmann::json* j) { (*j)["decoder"] = {{"type", "Metaspace"}}; }},
  };
  for (const Case& c : cases) {
    nlohmann::json j = TinyTokenizerJson({});
    c.edit(&j);
    auto tok = LoadJson(c.name, j);
    ASSERT_FALSE(tok.ok()) << c.name;
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented) << c.name << ": " << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr(c.expected)) << c.name;
  }
}

TEST(HfTokenizerErrorTest, BadContentIsDataLossNamingTheProblem) {
  {
    const std::string path = MakeTempDir("notjson") + "/tokenizer.json";
    WriteFile(path, "{\"model\": {\"type\": \"BPE\", ");
    auto tok = Tokenizer::LoadHuggingFace(path);
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("not a JSON object"));
  }
  {
    nlohmann::json j = TinyTokenizerJson({});
    j["model"].erase("vocab");
    auto tok = LoadJson("novocab", j);
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("model.vocab"));
  }
  {
    nlohmann::json j = TinyTokenizerJson({{"a", "b"}});
    j["model"]["merges"].push_back("a zzz");
    auto tok = LoadJson("badmerge", j);
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("lacks: 'zzz'"));
  }
  {
    nlohmann::json j = TinyTokenizerJson({});
    j["model"]["vocab"].erase("a");
    auto tok = LoadJson("nobyte", j);
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("byte 97"));
  }
  {
    nlohmann::json j = TinyTokenizerJson({});
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
                            {{"type", "ByteLevel"}}}}};
    auto tok = LoadJson("badregex", j);
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("(unclosed"));
  }
}

TEST(HfTokenizerErrorTest, MissingFilesAreNotFound) {
  const std::string empty_dir = MakeTempDir("empty");
  auto in_dir = Tokenizer::Open(empty_dir);
  EXPECT_EQ(in_dir.status().code(), absl::StatusCode::kNotFound) << in_dir.status();
  EXPECT_THAT(std::string(in_dir.status().message()), HasSubstr("tokenizer.json"));
  auto no_file = Tokenizer::LoadHuggingFace(empty_dir + "/tokenizer.json");
  EXPECT_EQ(no_file.status().code(), absl::StatusCode::kNotFound) << no_file.status();
  auto no_path = Tokenizer::Open(empty_dir + "/nothing/here");
  EXPECT_EQ(no_path.status().code(), absl::StatusCode::kNotFound) << no_path.status();
}

}  // namespace
}  // namespace aqswarm::pipeline
