// Datasets people bring: .txt/.jsonl directories and globs, prepared token
// shards (pipeline/token_shards.h), and their identity (pipeline/dataset.h),
// with GPT-2's and Llama-3's real tokenizers.
#include "pipeline/dataset.h"

#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/data_test_util.h"
#include "pipeline/token_shards.h"

namespace aqswarm::pipeline {
namespace {

namespace fs = std::filesystem;
using ::aqswarm::pipeline::testing::DataDir;
using ::aqswarm::pipeline::testing::MakeTempDir;
using ::aqswarm::pipeline::testing::ReadFile;
using ::aqswarm::pipeline::testing::RequireDataFile;
using ::aqswarm::pipeline::testing::WriteFile;
using ::testing::HasSubstr;

class DatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(RequireDataFile(DataDir() + "/gpt2/encoder.json"));
    gpt2_ = *Tokenizer::Open(DataDir() + "/gpt2");
  }

  // Every sample window of `corpus`, in order (GatherBatch: what training reads).
  static std::vector<int32_t> Windows(const TokenCorpus& corpus, int64_t seq_len) {
    std::vector<int64_t> ids(corpus.NumSamples(seq_len));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
    std::vector<int32_t> in, target;
    corpus.GatherBatch(ids, seq_len, &in, &target);
    in.insert(in.end(), target.end() - 1, target.end());
    return in;
  }

  std::unique_ptr<Tokenizer> gpt2_;
};

TEST_F(DatasetTest, ADirectoryOfTxtAndJsonlFilesIsItsDocumentsInNameOrder) {
  const std::string dir = MakeTempDir("src");
  WriteFile(dir + "/b.jsonl", "{\"text\": \"Second doc.\"}\n\n{\"text\": \"Third\\ndoc.\", \"id\": 3}\r\n{\"text\": \"\"}\n");
  WriteFile(dir + "/a.txt", "First doc.");
  WriteFile(dir + "/c.txt", "");  // empty: skipped
  WriteFile(dir + "/notes.md", "ignored");
  auto corpus = TokenCorpus::Open({.source_path = dir}, *gpt2_);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  std::vector<int32_t> want = gpt2_->Encode("First doc.");
  for (const char* d : {"Second doc.", "Third\ndoc."}) {
    want.push_back(gpt2_->eot_id());
    gpt2_->EncodeAppend(d, &want);
  }
  EXPECT_EQ(std::vector<int32_t>((*corpus)->tokens().begin(), (*corpus)->tokens().end()), want);
  EXPECT_EQ((*corpus)->num_documents(), 3);
  EXPECT_EQ((*corpus)->train_tokens(), -1);
  // prepare streams .jsonl lines (CRLF, blank lines, empty texts) to the same stream.
  PrepareOptions p;
  p.inputs = {dir};
  p.out_dir = MakeTempDir("src-prepared");
  auto m = PrepareShards(p, *gpt2_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->documents, 3);
  EXPECT_EQ(m->sources, (std::vector<std::string>{"a.txt", "b.jsonl", "c.txt"}));
  auto prepared = TokenCorpus::Open({.source_path = p.out_dir}, *gpt2_);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(Windows(**prepared, 1), want);

  // A glob takes only what it matches; another text field reads other text.
  WriteFile(dir + "/d.jsonl", "{\"body\": \"Fourth.\"}\n");
  auto glob = TokenCorpus::Open({.source_path = dir + "/d*.jsonl", .text_field = "body"}, *gpt2_);
  ASSERT_TRUE(glob.ok()) << glob.status();
  EXPECT_EQ(std::vector<int32_t>((*glob)->tokens().begin(), (*glob)->tokens().end()), gpt2_->Encode("Fourth."));
  EXPECT_EQ(TokenCorpus::Open({.source_path = dir + "/zz*.jsonl"}, *gpt2_).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(DatasetTest, ABadJsonlLineIsAnErrorNamingFileAndLine) {
  const std::string dir = MakeTempDir("bad");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"text\": \"ok\"}\n{not json\n", "f.jsonl:2: not a JSON value"},
      {"{\"text\": \"ok\"}\n\n{\"title\": \"x\"}\n", "f.jsonl:3: no field 'text'"},
      {"{\"text\": 7}\n", "f.jsonl:1: field 'text' is number, not a string"},
      {"[\"text\"]\n", "f.jsonl:1: no field 'text'"},
      {"{\"text\": \"caf\xC3\"}\n", "f.jsonl:1: not a JSON value (or not UTF-8)"},
  };
  for (const auto& [content, want] : cases) {
    WriteFile(dir + "/f.jsonl", content);
    auto corpus = TokenCorpus::Open({.source_path = dir + "/f.jsonl"}, *gpt2_);
    EXPECT_EQ(corpus.status().code(), absl::StatusCode::kDataLoss) << content;
    EXPECT_THAT(corpus.status().message(), HasSubstr(want)) << content;
  }
  // Invalid UTF-8 in a .txt file is kept as bytes (the tokenizer takes any).
  WriteFile(dir + "/g.txt", "caf\xC3 ok");
  auto kept = TokenCorpus::Open({.source_path = dir + "/g.txt"}, *gpt2_);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(gpt2_->Decode((*kept)->tokens()), "caf\xC3 ok");
}

// Shards hold exactly the text source's token stream: every training window
// is the same, across shard boundaries, whatever the thread count.
TEST_F(DatasetTest, PreparedShardsGiveTheTextSourcesWindowsAndTheSameBytesForAnyThreadCount) {
  const std::string src = MakeTempDir("sotu6");
  std::vector<fs::path> speeches;
  for (const auto& e : fs::directory_iterator(DataDir() + "/sotu")) speeches.push_back(e.path());
  std::sort(speeches.begin(), speeches.end());
  for (int i = 0; i < 6; ++i) fs::copy_file(speeches[i], fs::path(src) / speeches[i].filename());
  auto text = TokenCorpus::Open({.source_path = src}, *gpt2_);
  ASSERT_TRUE(text.ok()) << text.status();

  std::string first_manifest;
  for (int threads : {1, 3}) {
    PrepareOptions p;
    p.inputs = {src};
    p.out_dir = MakeTempDir(absl::StrCat("out", threads));
    p.threads = threads;
    p.shard_tokens = 1000;  // many shards: windows cross their boundaries
    auto m = PrepareShards(p, *gpt2_);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->bytes_per_id, 2);  // GPT-2's 50257 ids fit uint16
    EXPECT_EQ(m->documents, 6);
    EXPECT_EQ(m->tokens, (*text)->num_tokens());
    EXPECT_GT(m->shards.size(), 5u);
    auto shards = TokenCorpus::Open({.source_path = p.out_dir}, *gpt2_);
    ASSERT_TRUE(shards.ok()) << shards.status();
    EXPECT_EQ((*shards)->num_tokens(), (*text)->num_tokens());
    EXPECT_EQ(Windows(**shards, 37), Windows(**text, 37));
    const std::string manifest = ReadFile(p.out_dir + "/manifest.json");
    if (first_manifest.empty()) first_manifest = manifest;
    EXPECT_EQ(manifest, first_manifest) << "threads " << threads << " changed the output";
  }
}

TEST_F(DatasetTest, Llama3ShardsAreUint32AndTheValidationSplitIsTheLastDocuments) {
  ASSERT_TRUE(RequireDataFile(DataDir() + "/llama3/tokenizer.json"));
  auto llama = Tokenizer::Open(DataDir() + "/llama3");
  ASSERT_TRUE(llama.ok()) << llama.status();
  const std::string src = MakeTempDir("docs");
  std::string jsonl;
  for (int i = 0; i < 4; ++i) jsonl += absl::StrCat("{\"text\": \"Document number ", i, " says hello.\"}\n");
  WriteFile(src + "/d.jsonl", jsonl);
  PrepareOptions p;
  p.inputs = {src + "/d.jsonl"};
  p.out_dir = MakeTempDir("out");
  p.val_fraction = 0.25;  // the last of 4 documents
  auto m = PrepareShards(p, **llama);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->bytes_per_id, 4);
  EXPECT_EQ(m->eot_id, 128001);
  std::vector<int32_t> want;
  for (int i = 0; i < 4; ++i) {
    if (i == 3) EXPECT_EQ(m->train_tokens, static_cast<int64_t>(want.size() + 1));
    if (i > 0) want.push_back(128001);
    (*llama)->EncodeAppend(absl::StrCat("Document number ", i, " says hello."), &want);
  }
  auto corpus = TokenCorpus::Open({.source_path = p.out_dir}, **llama);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ((*corpus)->train_tokens(), m->train_tokens);
  std::vector<int32_t> got(want.size());
  std::vector<int64_t> all = {0};
  std::vector<int32_t> in, target;
  (*corpus)->GatherBatch(all, static_cast<int64_t>(want.size()) - 1, &in, &target);
  in.push_back(target.back());
  EXPECT_EQ(in, want);

  SamplePlanOptions po;
  po.seq_len = 4;
  po.train_tokens = (*corpus)->train_tokens();
  auto plan = SamplePlan::Create((*corpus)->num_tokens(), po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_train_samples(), (m->train_tokens - 1) / 4);
  EXPECT_GT(plan->num_validation_samples(), 0);
}

TEST_F(DatasetTest, TheIdentityIsTheContentWhereverItIsAndNamesATokenizerMismatch) {
  const std::string a = MakeTempDir("a"), b = MakeTempDir("b");
  for (const std::string& d : {a, b}) {
    WriteFile(d + "/x.txt", "The same words.");
    WriteFile(d + "/y.jsonl", "{\"text\": \"More words.\"}\n");
  }
  auto ia = IdentifyData({.corpus = a, .tokenizer = DataDir() + "/gpt2", .cache_dir = MakeTempDir("cache-a")});
  auto ib = IdentifyData({.corpus = b, .tokenizer = DataDir() + "/gpt2", .cache_dir = MakeTempDir("cache-b")});
  ASSERT_TRUE(ia.ok() && ib.ok()) << ia.status() << ib.status();
  EXPECT_EQ(*ia, *ib);
  EXPECT_EQ(ia->dataset_hash.size(), 16u);
  EXPECT_EQ(ia->tokenizer_hash, HashHex(gpt2_->checksum()));
  WriteFile(b + "/x.txt", "The same words!");  // one byte
  auto changed = IdentifyData({.corpus = b, .tokenizer = DataDir() + "/gpt2", .cache_dir = MakeTempDir("cache-c")});
  ASSERT_TRUE(changed.ok());
  EXPECT_NE(changed->dataset_hash, ia->dataset_hash);
  EXPECT_EQ(changed->tokenizer_hash, ia->tokenizer_hash);
  auto field = IdentifyData({.corpus = a, .tokenizer = DataDir() + "/gpt2", .text_field = "body",
                             .cache_dir = MakeTempDir("cache-d")});
  EXPECT_FALSE(field.ok()) << "y.jsonl has no 'body' field";

  // A prepared dataset: its manifest's hash; opened with another tokenizer, an error naming both.
  PrepareOptions p;
  p.inputs = {a};
  p.out_dir = MakeTempDir("prepared");
  ASSERT_TRUE(PrepareShards(p, *gpt2_).ok());
  auto opened = OpenData({.corpus = p.out_dir, .tokenizer = DataDir() + "/gpt2"});
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto prepared = IdentifyData({.corpus = p.out_dir, .tokenizer = DataDir() + "/gpt2"});
  ASSERT_TRUE(prepared.ok());
  EXPECT_EQ(opened->identity, *prepared);
  ASSERT_TRUE(RequireDataFile(DataDir() + "/llama3/tokenizer.json"));
  auto wrong = IdentifyData({.corpus = p.out_dir, .tokenizer = DataDir() + "/llama3"});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong.status().message(), HasSubstr(prepared->tokenizer_hash));
  EXPECT_EQ(OpenData({.corpus = p.out_dir, .tokenizer = DataDir() + "/llama3"}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(DatasetTest, ATruncatedCorruptForeignOrMissingShardIsRefusedNamingIt) {
  const std::string src = MakeTempDir("src");
  WriteFile(src + "/x.txt", std::string(3000, 'a') + " words and more words");
  PrepareOptions p;
  p.inputs = {src};
  p.shard_tokens = 100;
  auto prepare = [&](const std::string& name) {
    p.out_dir = MakeTempDir(name);
    EXPECT_TRUE(PrepareShards(p, *gpt2_).ok());
    return p.out_dir;
  };
  auto refused = [&](const std::string& dir, absl::StatusCode code, const std::string& want) {
    auto corpus = TokenCorpus::Open({.source_path = dir}, *gpt2_);
    EXPECT_EQ(corpus.status().code(), code) << corpus.status();
    EXPECT_THAT(corpus.status().message(), HasSubstr(want));
  };
  std::string dir = prepare("truncated");
  fs::resize_file(dir + "/shard-00001.bin", fs::file_size(dir + "/shard-00001.bin") - 2);
  refused(dir, absl::StatusCode::kDataLoss, "shard-00001.bin: is ");

  dir = prepare("flipped");
  {
    std::fstream f(dir + "/shard-00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x7f');
  }
  refused(dir, absl::StatusCode::kDataLoss, "shard-00000.bin: XXH3");

  dir = prepare("foreign");
  WriteFile(dir + "/shard-00000.bin", std::string(fs::file_size(dir + "/shard-00001.bin"), 'z'));
  refused(dir, absl::StatusCode::kDataLoss, "not an aqswarm token shard");

  dir = prepare("missing");
  fs::remove(dir + "/shard-00002.bin");
  refused(dir, absl::StatusCode::kNotFound, "shard-00002.bin is missing");

  dir = prepare("manifest");
  WriteFile(dir + "/manifest.json", "{not json");
  refused(dir, absl::StatusCode::kDataLoss, "manifest.json: not JSON");
  WriteFile(dir + "/manifest.json", "{\"format\": \"aqswarm-token-shards\", \"version\": 1}");
  refused(dir, absl::StatusCode::kDataLoss, "missing or mistyped field");
}

TEST_F(DatasetTest, ASourceWithoutTextIsAnErrorButAnEmptyFileBesideTextIsSkipped) {
  const std::string dir = MakeTempDir("empty");
  WriteFile(dir + "/a.txt", "");
  WriteFile(dir + "/b.jsonl", "\n  \n{\"text\": \"\"}\n");
  auto none = TokenCorpus::Open({.source_path = dir}, *gpt2_);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
  EXPECT_THAT(none.status().message(), HasSubstr("has no text"));
  PrepareOptions p;
  p.inputs = {dir};
  p.out_dir = MakeTempDir("empty-out");
  EXPECT_EQ(PrepareShards(p, *gpt2_).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(IsPreparedDataset(p.out_dir)) << "no manifest for nothing";

  WriteFile(dir + "/c.txt", "Words.");
  auto some = TokenCorpus::Open({.source_path = dir}, *gpt2_);
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_EQ(std::vector<int32_t>((*some)->tokens().begin(), (*some)->tokens().end()), gpt2_->Encode("Words."));

  const std::string nothing = MakeTempDir("no-text-files");
  WriteFile(nothing + "/readme.md", "not a corpus file");
  EXPECT_EQ(TokenCorpus::Open({.source_path = nothing}, *gpt2_).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenCorpus::Open({.source_path = nothing + "/missing.jsonl"}, *gpt2_).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(DatasetTest, ASingleJsonlFileReadsItsTextFieldAndItIsPartOfTheIdentity) {
  const std::string dir = MakeTempDir("single");
  WriteFile(dir + "/c.jsonl", "{\"body\": \"One.\", \"text\": \"ignored\"}\n{\"body\": \"Two.\"}");  // no final newline
  auto corpus = TokenCorpus::Open({.source_path = dir + "/c.jsonl", .text_field = "body"}, *gpt2_);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  std::vector<int32_t> want = gpt2_->Encode("One.");
  want.push_back(gpt2_->eot_id());
  gpt2_->EncodeAppend("Two.", &want);
  EXPECT_EQ(std::vector<int32_t>((*corpus)->tokens().begin(), (*corpus)->tokens().end()), want);

  auto body = IdentifyData({.corpus = dir + "/c.jsonl", .tokenizer = DataDir() + "/gpt2", .text_field = "body"});
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(body->dataset_hash, HashHex((*corpus)->source_checksum())) << "identify = what training reads";
  WriteFile(dir + "/d.jsonl", "{\"body\": \"One.\", \"text\": \"One.\"}\n");
  auto as_body = IdentifyData({.corpus = dir + "/d.jsonl", .tokenizer = DataDir() + "/gpt2", .text_field = "body"});
  auto as_text = IdentifyData({.corpus = dir + "/d.jsonl", .tokenizer = DataDir() + "/gpt2"});
  ASSERT_TRUE(as_body.ok() && as_text.ok());
  EXPECT_NE(as_body->dataset_hash, as_text->dataset_hash) << "the same bytes read through another field";
}

// Sample i is tokens [i*T, i*T+T+1) of the stream whatever the shard size:
// windows spanning one, two or many shards come out the same.
TEST_F(DatasetTest, WindowsAreTheSameForAnyShardSizeAndPreparingAgainWritesTheSameBytes) {
  const std::string src = MakeTempDir("small");
  WriteFile(src + "/a.txt", "The quick brown fox jumps over the lazy dog.");
  WriteFile(src + "/b.jsonl", "{\"text\": \"Pack my box with five dozen liquor jugs.\"}\n{\"text\": \"Sphinx of black quartz.\"}\n");
  auto text = TokenCorpus::Open({.source_path = src}, *gpt2_);
  ASSERT_TRUE(text.ok()) << text.status();
  ASSERT_GT((*text)->num_tokens(), 20);
  const std::string out = MakeTempDir("resharded");
  for (int64_t shard_tokens : {1, 3, 7, 1000, 3}) {
    PrepareOptions p;
    p.inputs = {src};
    p.out_dir = out;  // the same directory each time: older shards must go
    p.shard_tokens = shard_tokens;
    auto m = PrepareShards(p, *gpt2_);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(static_cast<int64_t>(m->shards.size()), ((*text)->num_tokens() + shard_tokens - 1) / shard_tokens);
    int64_t files = 0;
    for (const auto& e : fs::directory_iterator(out)) files += e.path().extension() == ".bin";
    EXPECT_EQ(files, static_cast<int64_t>(m->shards.size())) << "stale shards left behind";
    auto shards = TokenCorpus::Open({.source_path = out}, *gpt2_);
    ASSERT_TRUE(shards.ok()) << shards.status();
    for (int64_t seq_len : {1, 4, 9}) {
      EXPECT_EQ(Windows(**shards, seq_len), Windows(**text, seq_len)) << shard_tokens << " tokens per shard, T " << seq_len;
    }
  }
  // The last two runs had the same inputs and options: the same bytes.
  const std::string again = MakeTempDir("again");
  PrepareOptions p;
  p.inputs = {src};
  p.out_dir = again;
  p.shard_tokens = 3;
  ASSERT_TRUE(PrepareShards(p, *gpt2_).ok());
  for (const auto& e : fs::directory_iterator(out)) {
    EXPECT_EQ(ReadFile(e.path().string()), ReadFile(again + "/" + e.path().filename().string())) << e.path();
  }
}

TEST_F(DatasetTest, TheValidationSplitHoldsOutWholeLastDocumentsAndThePlanTrainsOnlyBeforeIt) {
  const std::string src = MakeTempDir("split");
  std::string jsonl;
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (int i = 0; i < 10; ++i) {
    const std::string doc = absl::StrCat("Document ", i, " has a few words in it, number ", i, ".");
    jsonl += absl::StrCat("{\"text\": \"", doc, "\"}\n");
    if (i > 0) ++at;
    starts.push_back(at);
    at += static_cast<int64_t>(gpt2_->Encode(doc).size());
  }
  WriteFile(src + "/d.jsonl", jsonl);
  PrepareOptions p;
  p.inputs = {src};
  p.out_dir = MakeTempDir("split-out");
  p.val_fraction = 0.25;  // ceil(2.5) = the last 3 documents
  auto m = PrepareShards(p, *gpt2_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->tokens, at);
  EXPECT_EQ(m->train_tokens, starts[7]);
  auto opened = OpenData({.corpus = p.out_dir, .tokenizer = DataDir() + "/gpt2"});
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_EQ(opened->corpus->train_tokens(), starts[7]);
  SamplePlanOptions po;
  po.seq_len = 5;
  po.validation_fraction = 0.5;  // not used: the data fixes the split
  po.train_tokens = opened->corpus->train_tokens();
  auto plan = SamplePlan::Create(opened->corpus->num_tokens(), po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t last_train = plan->num_train_samples() - 1;
  EXPECT_LE(plan->SampleOffset(last_train) + po.seq_len + 1, starts[7]) << "a train window reads validation text";
  EXPECT_GT(plan->SampleOffset(last_train + 1) + po.seq_len + 1, starts[7]) << "a train window was dropped";
  EXPECT_EQ(plan->num_samples(), (at - 1) / 5);

  // No split in the data (val_fraction 0): the job's validation_fraction applies as for text.
  p.val_fraction = 0;
  p.out_dir = MakeTempDir("nosplit-out");
  ASSERT_TRUE(PrepareShards(p, *gpt2_).ok());
  auto whole = TokenCorpus::Open({.source_path = p.out_dir}, *gpt2_);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ((*whole)->train_tokens(), -1);
  p.val_fraction = 1;
  EXPECT_EQ(PrepareShards(p, *gpt2_).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(DatasetTest, AManifestThatDisagreesWithItsShardsIsRefused) {
  const std::string src = MakeTempDir("src");
  WriteFile(src + "/x.txt", "Some words for a few tokens, and then some more words.");
  PrepareOptions p;
  p.inputs = {src};
  p.shard_tokens = 5;
  p.out_dir = MakeTempDir("m");
  ASSERT_TRUE(PrepareShards(p, *gpt2_).ok());
  const std::string good = ReadFile(p.out_dir + "/manifest.json");
  auto refused_with = [&](const std::string& from, const std::string& to, const std::string& want) {
    const size_t at = good.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    std::string edited = good;
    edited.replace(at, from.size(), to);
    WriteFile(p.out_dir + "/manifest.json", edited);
    auto corpus = TokenCorpus::Open({.source_path = p.out_dir}, *gpt2_);
    EXPECT_EQ(corpus.status().code(), absl::StatusCode::kDataLoss) << from << " -> " << to;
    EXPECT_THAT(corpus.status().message(), HasSubstr(want)) << from << " -> " << to;
  };
  const auto m = ReadShardManifest(p.out_dir);
  ASSERT_TRUE(m.ok());
  refused_with(m->shards[1].xxh3, "0123456789abcdef", "shard-00001.bin: XXH3");
  refused_with("\"version\": 1", "\"version\": 9", "format version 9");
  refused_with("\"version\": 1", "\"version\": \"1\"", "format version \"1\"");
  refused_with("\"format\": \"aqswarm-token-shards\"", "\"format\": 7", "not an aqswarm manifest");
  refused_with(absl::StrCat("\"documents\": ", m->documents), "\"documents\": \"many\"", "missing or mistyped field");
  refused_with("\"dtype\": \"uint16\"", "\"dtype\": \"uint32\"", "shard-00000.bin: 2 bytes per id");
  refused_with("\"dtype\": \"uint16\"", "\"dtype\": \"int8\"", "dtype 'int8'");
  refused_with("\"file\": \"shard-00000.bin\"", "\"file\": \"../x.bin\"", "must be a plain name");
  refused_with(absl::StrCat("\"tokens\": ", m->tokens), absl::StrCat("\"tokens\": ", m->tokens + 1),
               absl::StrCat("the shards hold ", m->tokens, " tokens"));
  WriteFile(p.out_dir + "/manifest.json", good);
  EXPECT_TRUE(TokenCorpus::Open({.source_path = p.out_dir}, *gpt2_).ok());
}

TEST_F(DatasetTest, AFileNameThatIsNotUtf8IsPreparedAndTheManifestStaysJson) {
  const std::string src = MakeTempDir("latin1");
  WriteFile(src + "/caf\xE9.txt", "Some text.");
  PrepareOptions p;
  p.inputs = {src};
  p.out_dir = MakeTempDir("latin1-out");
  auto m = PrepareShards(p, *gpt2_);
  ASSERT_TRUE(m.ok()) << m.status();
  auto read = ReadShardManifest(p.out_dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->sources, std::vector<std::string>{"caf\xEF\xBF\xBD.txt"});  // U+FFFD
  EXPECT_TRUE(TokenCorpus::Open({.source_path = p.out_dir}, *gpt2_).ok());
}

TEST_F(DatasetTest, AFailedPrepareLeavesThePreviousDatasetAsItWas) {
  const std::string src = MakeTempDir("src");
  WriteFile(src + "/a.jsonl", "{\"text\": \"A first document with some words.\"}\n");
  PrepareOptions p;
  p.inputs = {src};
  p.out_dir = MakeTempDir("kept");
  p.shard_tokens = 2;
  ASSERT_TRUE(PrepareShards(p, *gpt2_).ok());
  std::map<std::string, std::string> before;
  for (const auto& e : fs::directory_iterator(p.out_dir)) before[e.path().filename().string()] = ReadFile(e.path());

  // Enough documents for shards to be written before b.jsonl's bad line is read.
  std::string many;
  for (int i = 0; i < 5000; ++i) many += absl::StrCat("{\"text\": \"Document ", i, ".\"}\n");
  WriteFile(src + "/a.jsonl", many);
  WriteFile(src + "/b.jsonl", "{\"text\": \"fine\"}\n{\"text\": null}\n");
  p.shard_tokens = 1000;
  auto failed = PrepareShards(p, *gpt2_);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(failed.status().message(), HasSubstr("b.jsonl:2: field 'text' is null"));
  std::map<std::string, std::string> after;
  for (const auto& e : fs::directory_iterator(p.out_dir)) after[e.path().filename().string()] = ReadFile(e.path());
  EXPECT_EQ(after, before) << "a failed prepare changed (or left staged files in) the directory";
  EXPECT_TRUE(TokenCorpus::Open({.source_path = p.out_dir}, *gpt2_).ok());
}

}  // namespace
}  // namespace aqswarm::pipeline
