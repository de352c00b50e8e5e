#include "pipeline/corpus.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/data_test_util.h"
#include "pipeline/tokenizer.h"

namespace aqswarm::pipeline {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using testing::DataDir;
using testing::MakeTempDir;
using testing::RequireDataFile;
using testing::WriteFile;
using testing::WriteTinyVocab;

std::vector<int32_t> Iota(int32_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

SamplePlanOptions PlanOptions(int64_t seq_len, double validation_fraction = 0.0) {
  SamplePlanOptions o;
  o.seq_len = seq_len;
  o.validation_fraction = validation_fraction;
  o.seed = 1234;
  return o;
}

// ---------------------------------------------------------------- windows

TEST(TokenCorpusTest, SamplesAreFixedOverlappingWindows) {
  auto corpus = TokenCorpus::FromTokens(Iota(17));
  // (17 - 1) / 4 = 4 windows of 5 tokens at offsets 0, 4, 8, 12.
  EXPECT_EQ(corpus->NumSamples(4), 4);
  EXPECT_THAT(corpus->Sample(0, 4), ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(corpus->Sample(1, 4), ElementsAre(4, 5, 6, 7, 8));
  EXPECT_THAT(corpus->Sample(3, 4), ElementsAre(12, 13, 14, 15, 16));
  // One token short of another window.
  EXPECT_EQ(TokenCorpus::FromTokens(Iota(16))->NumSamples(4), 3);
  EXPECT_EQ(TokenCorpus::FromTokens(Iota(4))->NumSamples(4), 0);
  EXPECT_EQ(TokenCorpus::FromTokens({})->NumSamples(4), 0);
}

TEST(TokenCorpusTest, GatherBatchSplitsInputsAndTargets) {
  auto corpus = TokenCorpus::FromTokens(Iota(17));
  std::vector<int32_t> inputs, targets;
  const std::vector<int64_t> ids = {2, 0};
  corpus->GatherBatch(ids, 4, &inputs, &targets);
  EXPECT_THAT(inputs, ElementsAre(8, 9, 10, 11, 0, 1, 2, 3));
  EXPECT_THAT(targets, ElementsAre(9, 10, 11, 12, 1, 2, 3, 4));
}

TEST(TokenCorpusDeathTest, OutOfRangeSampleAborts) {
  auto corpus = TokenCorpus::FromTokens(Iota(17));
  EXPECT_DEATH(corpus->Sample(4, 4), "out of range");
}

// ---------------------------------------------------------------- cache

class CorpusCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    vocab_dir_ = MakeTempDir("vocab");
    WriteTinyVocab(vocab_dir_, {{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}});
    auto tok = Tokenizer::Load(vocab_dir_ + "/encoder.json", vocab_dir_ + "/vocab.bpe");
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = std::move(tok).value();
    source_ = MakeTempDir("src");
    cache_ = MakeTempDir("cache");
    // Sorted order is a, b; the .md file is not part of the corpus.
    WriteFile(source_ + "/b.txt", "world");
    WriteFile(source_ + "/a.txt", "hello hello");
    WriteFile(source_ + "/notes.md", "ignored");
    options_.source_path = source_;
    options_.cache_dir = cache_;
  }

  std::vector<int32_t> Expected() const {
    std::vector<int32_t> ids = tok_->Encode("hello hello");
    ids.push_back(tok_->eot_id());
    tok_->EncodeAppend("world", &ids);
    return ids;
  }

  std::unique_ptr<TokenCorpus> OpenOk() {
    auto corpus = TokenCorpus::Open(options_, *tok_);
    EXPECT_TRUE(corpus.ok()) << corpus.status();
    return corpus.ok() ? std::move(corpus).value() : nullptr;
  }

  std::string vocab_dir_, source_, cache_;
  std::unique_ptr<Tokenizer> tok_;
  CorpusOptions options_;
};

TEST_F(CorpusCacheTest, DocumentsSortedAndJoinedWithEndOfText) {
  auto corpus = OpenOk();
  ASSERT_NE(corpus, nullptr);
  EXPECT_EQ(corpus->num_documents(), 2);
  EXPECT_THAT(corpus->tokens(), ElementsAreArray(Expected()));
  EXPECT_EQ(tok_->Decode(corpus->tokens()), "hello hello<|endoftext|>world");
  EXPECT_EQ(corpus->cache_path(), cache_ + "/" + std::filesystem::path(source_).filename().string() +
                                      ".tokens");
}

TEST_F(CorpusCacheTest, RoundTripsThroughCache) {
  auto first = OpenOk();
  ASSERT_NE(first, nullptr);
  EXPECT_FALSE(first->loaded_from_cache());
  ASSERT_TRUE(std::filesystem::exists(first->cache_path()));
  auto second = OpenOk();
  ASSERT_NE(second, nullptr);
  EXPECT_TRUE(second->loaded_from_cache());
  EXPECT_THAT(second->tokens(), ElementsAreArray(first->tokens()));
  EXPECT_EQ(second->source_checksum(), first->source_checksum());
}

TEST_F(CorpusCacheTest, CorruptCacheIsRebuiltNotTrusted) {
  auto first = OpenOk();
  ASSERT_NE(first, nullptr);
  const std::string path = first->cache_path();
  const std::string good = testing::ReadFile(path);

  // Flip a byte of the payload: the payload checksum catches it.
  std::string bad = good;
  bad[bad.size() - 2] ^= 0x40;
  WriteFile(path, bad);
  auto rebuilt = OpenOk();
  ASSERT_NE(rebuilt, nullptr);
  EXPECT_FALSE(rebuilt->loaded_from_cache());
  EXPECT_THAT(rebuilt->tokens(), ElementsAreArray(Expected()));
  EXPECT_EQ(testing::ReadFile(path), good) << "cache was not rewritten";
  EXPECT_TRUE(OpenOk()->loaded_from_cache());

  // Truncated, empty, garbage header, wrong count.
  for (const std::string& broken :
       {good.substr(0, good.size() - 4), std::string(), std::string(good.size(), 'x'),
        good.substr(0, 20)}) {
    WriteFile(path, broken);
    auto again = OpenOk();
    ASSERT_NE(again, nullptr);
    EXPECT_FALSE(again->loaded_from_cache());
    EXPECT_THAT(again->tokens(), ElementsAreArray(Expected()));
  }
}

TEST_F(CorpusCacheTest, StaleCacheIsRebuilt) {
  ASSERT_NE(OpenOk(), nullptr);
  // Source changed.
  WriteFile(source_ + "/b.txt", "hello world");
  auto changed = OpenOk();
  ASSERT_NE(changed, nullptr);
  EXPECT_FALSE(changed->loaded_from_cache());
  EXPECT_EQ(tok_->Decode(changed->tokens()), "hello hello<|endoftext|>hello world");
  EXPECT_TRUE(OpenOk()->loaded_from_cache());

  // Same files, another tokenizer: its cache entry is stale too.
  const std::string other_dir = MakeTempDir("vocab2");
  WriteTinyVocab(other_dir, {{"w", "o"}});
  auto other = Tokenizer::Load(other_dir + "/encoder.json", other_dir + "/vocab.bpe");
  ASSERT_TRUE(other.ok());
  auto retok = TokenCorpus::Open(options_, **other);
  ASSERT_TRUE(retok.ok()) << retok.status();
  EXPECT_FALSE((*retok)->loaded_from_cache());
  EXPECT_EQ((*other)->Decode((*retok)->tokens()), "hello hello<|endoftext|>hello world");
}

TEST_F(CorpusCacheTest, SingleFileSourceAndNoCache) {
  options_.source_path = source_ + "/a.txt";
  options_.cache_dir.clear();
  auto corpus = OpenOk();
  ASSERT_NE(corpus, nullptr);
  EXPECT_EQ(corpus->num_documents(), 1);
  EXPECT_EQ(corpus->cache_path(), "");
  EXPECT_THAT(corpus->tokens(), ElementsAreArray(tok_->Encode("hello hello")));
}

TEST_F(CorpusCacheTest, SourceErrors) {
  options_.source_path = source_ + "/missing";
  EXPECT_EQ(TokenCorpus::Open(options_, *tok_).status().code(), absl::StatusCode::kNotFound);
  options_.source_path = MakeTempDir("empty");
  auto empty = TokenCorpus::Open(options_, *tok_);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("no .txt files"));
  WriteFile(options_.source_path + "/zero.txt", "");
  EXPECT_EQ(TokenCorpus::Open(options_, *tok_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- plan

TEST(SamplePlanTest, SplitIsDisjointAndDeterministic) {
  // 1001 tokens, seq_len 10 -> 100 samples; 5% -> the last 5 validate.
  auto plan = SamplePlan::Create(1001, PlanOptions(10, 0.05));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_samples(), 100);
  EXPECT_EQ(plan->num_train_samples(), 95);
  EXPECT_EQ(plan->num_validation_samples(), 5);
  EXPECT_THAT(plan->ValidationIds(), ElementsAre(95, 96, 97, 98, 99));
  std::vector<int64_t> train = plan->TrainIds();
  ASSERT_EQ(train.size(), 95u);
  EXPECT_EQ(train.front(), 0);
  EXPECT_EQ(train.back(), 94);
  for (int64_t id : train) EXPECT_FALSE(plan->IsValidation(id));
  for (int64_t id : plan->ValidationIds()) EXPECT_TRUE(plan->IsValidation(id));
  // Any non-zero fraction rounds up to at least one validation sample.
  EXPECT_EQ(SamplePlan::Create(1001, PlanOptions(10, 0.001))->num_validation_samples(), 1);
  EXPECT_EQ(plan->SampleOffset(7), 70);
}

TEST(SamplePlanTest, EpochPermutationIsReproducibleAndAPermutation) {
  auto plan = SamplePlan::Create(100001, PlanOptions(10, 0.1));
  ASSERT_TRUE(plan.ok());
  std::vector<int64_t> p0 = plan->EpochPermutation(0);
  EXPECT_EQ(p0, plan->EpochPermutation(0));
  // A second plan object (another machine) agrees.
  EXPECT_EQ(p0, SamplePlan::Create(100001, PlanOptions(10, 0.1))->EpochPermutation(0));
  std::vector<int64_t> sorted = p0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, plan->TrainIds());
  EXPECT_NE(p0, plan->TrainIds()) << "not shuffled";
  EXPECT_NE(p0, plan->EpochPermutation(1));
  SamplePlanOptions other_seed = PlanOptions(10, 0.1);
  other_seed.seed = 4321;
  EXPECT_NE(p0, SamplePlan::Create(100001, other_seed)->EpochPermutation(0));
}

TEST(SamplePlanTest, EpochOrderIsPinned) {
  // The order is part of the data contract (peers of different builds must
  // agree); a change here changes every job's sample order, so it must be
  // deliberate.
  auto plan = SamplePlan::Create(11, PlanOptions(1));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(SamplePlan::EpochSeed(1234, 0), 0x9e17e35f6d9238edull);
  EXPECT_THAT(plan->EpochPermutation(0), ElementsAre(8, 6, 5, 7, 9, 4, 2, 0, 1, 3));
  EXPECT_THAT(plan->EpochPermutation(1), ElementsAre(0, 2, 3, 7, 9, 4, 1, 6, 8, 5));
}

TEST(SamplePlanTest, EpochPermutationIsRoughlyUniform) {
  // Position of id 0 over many epochs of a 4-sample train set: each of the 4
  // positions should appear ~1/4 of the time.
  auto plan = SamplePlan::Create(5, PlanOptions(1));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->num_train_samples(), 4);
  int counts[4] = {0, 0, 0, 0};
  for (int e = 0; e < 4000; ++e) {
    std::vector<int64_t> p = plan->EpochPermutation(e);
    ++counts[std::find(p.begin(), p.end(), 0) - p.begin()];
  }
  for (int c : counts) EXPECT_NEAR(c, 1000, 150);
}

TEST(SamplePlanTest, ShardsAreDisjointAndCover) {
  SamplePlanOptions o = PlanOptions(8, 0.0);
  o.num_shards = 4;
  auto plan = SamplePlan::Create(8 * 400 + 1, o);  // 400 train samples
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->samples_per_shard(), 100);
  const std::vector<int64_t> assignment = plan->EpochPermutation(SamplePlan::kShardAssignmentEpoch);
  for (int64_t epoch : {0, 1, 7}) {
    std::set<int64_t> seen;
    for (int32_t shard = 0; shard < 4; ++shard) {
      ShardSchedule s = plan->Schedule(epoch, shard);
      EXPECT_EQ(s.epoch(), epoch);
      EXPECT_EQ(s.shard(), shard);
      ASSERT_EQ(s.ids().size(), 100u);
      std::set<int64_t> members(s.ids().begin(), s.ids().end());
      for (size_t k = 0; k < 100; ++k) {
        EXPECT_TRUE(members.count(assignment[k * 4 + shard])) << "membership is the strided assignment";
      }
      for (int64_t id : s.ids()) EXPECT_TRUE(seen.insert(id).second) << "id in two shards: " << id;
    }
    EXPECT_EQ(seen.size(), 400u);
  }
}

TEST(SamplePlanTest, ShardMembershipIsFixedAcrossEpochsButTheOrderIsNot) {
  // AQ-SGD keeps m(xi) per pipeline link: a pipeline must see the same
  // samples every epoch, in a new order.
  SamplePlanOptions o = PlanOptions(8, 0.0);
  o.num_shards = 2;
  auto plan = SamplePlan::Create(8 * 200 + 1, o);
  ASSERT_TRUE(plan.ok());
  for (int32_t shard = 0; shard < 2; ++shard) {
    ShardSchedule e0 = plan->Schedule(0, shard), e1 = plan->Schedule(1, shard);
    std::set<int64_t> a(e0.ids().begin(), e0.ids().end()), b(e1.ids().begin(), e1.ids().end());
    EXPECT_EQ(a, b);
    EXPECT_FALSE(std::equal(e0.ids().begin(), e0.ids().end(), e1.ids().begin()));
    // Reproducible: the same (seed, epoch, shard) gives the same order.
    ShardSchedule again = plan->Schedule(1, shard);
    EXPECT_TRUE(std::equal(again.ids().begin(), again.ids().end(), e1.ids().begin()));
  }
}

TEST(SamplePlanTest, UnevenShardsAreTruncatedToEqualLength) {
  SamplePlanOptions o = PlanOptions(1, 0.0);
  o.num_shards = 3;
  auto plan = SamplePlan::Create(11, o);  // 10 train samples -> 3 each, 1 left over
  ASSERT_TRUE(plan.ok());
  std::set<int64_t> seen;
  for (int32_t shard = 0; shard < 3; ++shard) {
    ShardSchedule s = plan->Schedule(0, shard);
    EXPECT_EQ(s.ids().size(), 3u);
    seen.insert(s.ids().begin(), s.ids().end());
  }
  EXPECT_EQ(seen.size(), 9u);
  EXPECT_EQ(seen.count(plan->EpochPermutation(SamplePlan::kShardAssignmentEpoch).back()), 0u)
      << "the tail of the assignment is the left-over";
}

TEST(SamplePlanTest, MicroBatchLayout) {
  SamplePlanOptions o = PlanOptions(4, 0.0);
  o.num_shards = 2;
  o.micro_batch_size = 3;
  o.micro_batches_per_step = 2;
  auto plan = SamplePlan::Create(4 * 30 + 1, o);  // 30 train, 15 per shard, 6 per step
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->steps_per_epoch(), 2);  // 3 samples per shard left over
  ShardSchedule s = plan->Schedule(3, 1);
  EXPECT_EQ(s.num_steps(), 2);
  for (int64_t step = 0; step < 2; ++step) {
    EXPECT_THAT(s.Step(step), ElementsAreArray(s.ids().subspan(step * 6, 6)));
    for (int32_t m = 0; m < 2; ++m) {
      EXPECT_THAT(s.MicroBatch(step, m), ElementsAreArray(s.ids().subspan(step * 6 + m * 3, 3)));
    }
  }
}

TEST(SamplePlanTest, BadOptionsAreInvalidArgument) {
  EXPECT_EQ(SamplePlan::Create(100, PlanOptions(0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SamplePlan::Create(100, PlanOptions(4, 1.0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SamplePlan::Create(100, PlanOptions(4, -0.1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  SamplePlanOptions o = PlanOptions(4);
  o.num_shards = 0;
  EXPECT_EQ(SamplePlan::Create(100, o).status().code(), absl::StatusCode::kInvalidArgument);
  // Too small: 2 samples cannot give 4 shards a step each.
  o.num_shards = 4;
  auto small = SamplePlan::Create(9, o);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(small.status().message(), HasSubstr("too small"));
}

// ---------------------------------------------------------------- real data

TEST(SotuCorpusTest, TokenizesTheFetchedCorpus) {
  const std::string enc = DataDir() + "/gpt2/encoder.json";
  const std::string bpe = DataDir() + "/gpt2/vocab.bpe";
  const std::string sotu = DataDir() + "/sotu";
  if (!RequireDataFile(enc) || !RequireDataFile(bpe) || !RequireDataFile(sotu)) return;
  auto tok = Tokenizer::Load(enc, bpe);
  ASSERT_TRUE(tok.ok()) << tok.status();
  CorpusOptions options;
  options.source_path = sotu;
  // In the build tree, so later runs exercise the cache and stay fast.
  options.cache_dir = AQSWARM_TEST_CACHE_DIR;
  auto corpus = TokenCorpus::Open(options, **tok);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ((*corpus)->num_documents(), 233);
  // ~10.8 MB of English: ~2.1 M GPT-2 tokens.
  EXPECT_GT((*corpus)->num_tokens(), 2'000'000);
  EXPECT_LT((*corpus)->num_tokens(), 2'600'000);
  const auto eots = std::count((*corpus)->tokens().begin(), (*corpus)->tokens().end(), 50256);
  EXPECT_EQ(eots, 232);
  std::cout << (*corpus)->num_tokens() << " tokens, from cache: "
            << (*corpus)->loaded_from_cache() << "\n";
  SamplePlanOptions p;
  p.seq_len = 256;
  p.num_shards = 2;
  p.micro_batch_size = 8;
  p.micro_batches_per_step = 4;
  auto plan = SamplePlan::Create((*corpus)->num_tokens(), p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GT(plan->steps_per_epoch(), 100);
  ShardSchedule s = plan->Schedule(0, 1);
  std::vector<int32_t> inputs, targets;
  (*corpus)->GatherBatch(s.MicroBatch(0, 0), plan->seq_len(), &inputs, &targets);
  EXPECT_EQ(inputs.size(), 8u * 256);
}

}  // namespace
}  // namespace aqswarm::pipeline
