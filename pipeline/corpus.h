// The training data's identity: a tokenized corpus, its fixed sample windows,
// the train/validation split and the per-epoch, per-shard sample order. Every
// peer computes the same answers from (corpus, tokenizer, options, seed), so
// stores can prefetch exactly the rows the next micro-batches need (see
// docs/design/ARCHITECTURE.md, "Data identity").
//
//   AQSWARM_ASSIGN_OR_RETURN(auto tok, Tokenizer::Open("data/gpt2"));
//   CorpusOptions copts;
//   copts.source_path = "data/sotu";         // see CorpusOptions::source_path
//   copts.cache_dir = "data/cache";          // data/cache/sotu.tokens
//   AQSWARM_ASSIGN_OR_RETURN(auto corpus, TokenCorpus::Open(copts, *tok));
//   // (a job's data: pipeline/dataset.h OpenData, which does the above)
//
//   SamplePlanOptions popts;
//   popts.seq_len = 256;
//   popts.seed = job_seed;
//   popts.num_shards = 4;                    // data-parallel pipelines
//   popts.micro_batch_size = 8;
//   popts.micro_batches_per_step = 4;
//   popts.train_tokens = corpus->train_tokens();  // a prepared split, or -1
//   AQSWARM_ASSIGN_OR_RETURN(SamplePlan plan,
//                            SamplePlan::Create(corpus->num_tokens(), popts));
//   ShardSchedule sched = plan.Schedule(/*epoch=*/0, /*shard=*/my_pipeline);
//   for (int64_t step = 0; step < sched.num_steps(); ++step)
//     for (int m = 0; m < plan.micro_batches_per_step(); ++m) {
//       corpus->GatherBatch(sched.MicroBatch(step, m), plan.seq_len(), &inputs, &targets);
//       // row b: inputs = window[0..seq_len), targets = window[1..seq_len]
//     }
//
// Contracts (changing any of them changes sample ids or order: bump the cache
// version / job format, never silently):
//   * Documents: a directory's .txt and .jsonl files in byte-wise sorted name
//     order, a glob's matches in sorted path order, or one file. A .txt file
//     is one document; a .jsonl file one per line (the string field
//     `text_field`; blank lines skipped). Empty documents are skipped.
//     Text is bytes: invalid UTF-8 in a .txt file is kept (the tokenizer
//     takes any bytes); a .jsonl line that is not valid JSON (which must be
//     UTF-8) is an error naming FILE:LINE.
//   * Corpus tokens: the documents in order, each tokenized on its own,
//     joined with the tokenizer's eot_id() (GPT-2: <|endoftext|>, 50256).
//     A prepared directory (pipeline/token_shards.h) holds this stream
//     already, memory-mapped instead of read into memory.
//   * Sample i is the window tokens[i*seq_len, i*seq_len + seq_len + 1):
//     seq_len inputs plus the next-token target. num_samples =
//     (num_tokens - 1) / seq_len. No random cropping.
//   * Validation = the last ceil(validation_fraction * num_samples) ids;
//     train = the ids before them. A prepared dataset with a validation
//     split sets SamplePlanOptions::train_tokens instead: train = the ids
//     whose windows end inside the first train_tokens tokens.
//   * Epoch e's order = Fisher-Yates shuffle of the train ids with
//     Rng(EpochSeed(seed, e)) (common/random.h): same on every machine.
//   * Shard p of D is FIXED for the whole job (AQ-SGD keeps every sample's
//     previous message on its pipeline's links, so a pipeline must meet the
//     same samples every epoch): positions k with k % D == p of the
//     assignment permutation (EpochPermutation(kShardAssignmentEpoch)),
//     truncated to samples_per_shard() = floor(num_train / D) so every
//     pipeline runs the same number of steps; the < D left-over ids are never
//     trained on.
//   * Epoch e's order within shard p: Fisher-Yates of its members with
//     Rng(EpochSeed(seed, e) ^ Mix64(p + 1)).
//   * Step s of a shard covers its positions [s*B*M, (s+1)*B*M), micro-batch
//     m the B ids at [s*B*M + m*B, ...). A trailing partial step is dropped.
#ifndef AQSWARM_PIPELINE_CORPUS_H_
#define AQSWARM_PIPELINE_CORPUS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "pipeline/tokenizer.h"

namespace aqswarm::pipeline {

struct CorpusOptions {
  // A directory (its .txt and .jsonl files, non-recursive, sorted by name),
  // a glob of such files, one .txt or .jsonl file, or a prepared dataset
  // (a directory holding manifest.json). Required.
  std::string source_path;
  // .jsonl documents: the string field holding the text. Default: "text".
  std::string text_field = "text";
  // Where the token cache lives; created if missing. Empty: no cache
  // (tokenize every time). Default: empty.
  std::string cache_dir;
  // Cache file base name: <cache_dir>/<cache_name>.tokens. Default (empty):
  // the last component of source_path without its extension.
  std::string cache_name;
};

class MappedShards;

// The files a text source names, in contract order: a directory's .txt and
// .jsonl files by name, a glob's matches (sorted), or the one file.
// NotFound for a missing source or a glob matching nothing;
// InvalidArgument for a directory without such files.
absl::StatusOr<std::vector<std::string>> ListTextSource(const std::string& source_path);

// The documents of one file's `content` (see the contract above); `file`
// names it in errors: DataLoss "FILE:LINE: ..." for a .jsonl line that is not
// a JSON object with a string `text_field`.
absl::StatusOr<std::vector<std::string>> SplitDocuments(const std::string& file, const std::string& content,
                                                        const std::string& text_field);

// Line `line` (1-based) of .jsonl file `file`: its document ("" for a blank
// line or an empty text), or DataLoss "FILE:LINE: ..." (SplitDocuments, line
// by line, for readers that stream a file).
absl::StatusOr<std::string> ParseJsonlLine(const std::string& file, int64_t line, std::string_view text,
                                           const std::string& text_field);

// What TokenCorpus::source_checksum() is for a text source, without
// tokenizing: reads every file and checks its documents (the errors of Open).
absl::StatusOr<uint64_t> TextSourceChecksum(const std::string& source_path, const std::string& text_field);

// A tokenized corpus: ids in memory (int32; ~4 bytes per token, 8.5 MB for
// the SOTU corpus), or a prepared dataset's shards memory-mapped.
// Immutable after Open; thread-safe to read.
class TokenCorpus {
 public:
  // Loads the token cache if it is valid for this source and tokenizer;
  // otherwise tokenizes the source and (re)writes the cache. A cache that is
  // truncated, corrupt (payload checksum), from another tokenizer or from
  // another version of the source is never trusted: it is rebuilt.
  // NotFound if the source is missing; InvalidArgument if it has no text.
  static absl::StatusOr<std::unique_ptr<TokenCorpus>> Open(const CorpusOptions& options,
                                                           const Tokenizer& tokenizer);
  // A corpus from given ids (tests, synthetic data). No cache.
  static std::unique_ptr<TokenCorpus> FromTokens(std::vector<int32_t> tokens);
  ~TokenCorpus();

  // The ids when held in memory (empty for a prepared dataset).
  absl::Span<const int32_t> tokens() const { return tokens_; }
  int64_t num_tokens() const;
  // A prepared dataset's validation split: tokens before its validation
  // documents (SamplePlanOptions::train_tokens); -1 for other sources.
  int64_t train_tokens() const { return train_tokens_; }
  // Number of documents joined (files; 0 for FromTokens).
  int64_t num_documents() const { return num_documents_; }
  // XXH3 over the source's file names and bytes (the cache's staleness key).
  uint64_t source_checksum() const { return source_checksum_; }
  // True if Open used the cache rather than tokenizing.
  bool loaded_from_cache() const { return loaded_from_cache_; }
  // Path of the cache file ("" without a cache).
  const std::string& cache_path() const { return cache_path_; }

  // Number of windows of seq_len + 1 tokens: (num_tokens - 1) / seq_len.
  int64_t NumSamples(int64_t seq_len) const;
  // The seq_len + 1 tokens of sample `id` of an in-memory corpus. Aborts if
  // id is out of range (ids come from a SamplePlan made for this corpus: a
  // bad id is a bug) or the corpus is a prepared dataset (use GatherBatch).
  absl::Span<const int32_t> Sample(int64_t id, int64_t seq_len) const;
  // Gathers a batch row-major: inputs[b*seq_len + t] = Sample(ids[b])[t],
  // targets[b*seq_len + t] = Sample(ids[b])[t + 1]. Resizes both.
  void GatherBatch(absl::Span<const int64_t> ids, int64_t seq_len, std::vector<int32_t>* inputs,
                   std::vector<int32_t>* targets) const;

 private:
  TokenCorpus() = default;

  std::vector<int32_t> tokens_;
  std::unique_ptr<MappedShards> shards_;  // a prepared dataset instead of tokens_
  int64_t train_tokens_ = -1;
  int64_t num_documents_ = 0;
  uint64_t source_checksum_ = 0;
  bool loaded_from_cache_ = false;
  std::string cache_path_;
};

// Cache file format, little-endian (host order; every supported host is LE):
//   char[8]  magic "AQSWTOK\0"
//   uint32   version (kTokenCacheVersion)
//   uint32   header bytes (56)
//   uint64   tokenizer checksum (Tokenizer::checksum())
//   uint64   source checksum, uint64 source bytes
//   uint64   token count
//   uint64   XXH3 of the token payload
//   int32    tokens[count]
inline constexpr uint32_t kTokenCacheVersion = 2;

struct SamplePlanOptions {
  // Input tokens per sample (a sample holds seq_len + 1). Required, > 0.
  int64_t seq_len = 0;
  // Fraction of samples (the last ones) held out for validation, in [0, 1).
  // Default: 0.05.
  double validation_fraction = 0.05;
  // Job seed: with the epoch number, fixes the epoch permutation. Default: 0.
  uint64_t seed = 0;
  // Data-parallel pipelines sharing the train set. Default: 1.
  int32_t num_shards = 1;
  // Samples per micro-batch (B). Default: 1.
  int32_t micro_batch_size = 1;
  // Micro-batches per optimizer step (M). Default: 1.
  int32_t micro_batches_per_step = 1;
  // >= 0: the split is fixed by the data (TokenCorpus::train_tokens()):
  // train = ids whose window [i*T, i*T+T+1) ends within the first
  // train_tokens tokens, validation = the ids after them, and
  // validation_fraction is not used. Default: -1.
  int64_t train_tokens = -1;
};

// The sample order of one (epoch, shard): what a pipeline trains on, in order.
class ShardSchedule {
 public:
  int64_t epoch() const { return epoch_; }
  int32_t shard() const { return shard_; }
  // All ids of the shard for this epoch (samples_per_shard of them).
  absl::Span<const int64_t> ids() const { return ids_; }
  // Full steps this epoch (a trailing partial step is dropped).
  int64_t num_steps() const { return num_steps_; }
  // The B*M ids of `step`, micro-batch after micro-batch.
  absl::Span<const int64_t> Step(int64_t step) const;
  // The B ids of micro-batch `micro` of `step`.
  absl::Span<const int64_t> MicroBatch(int64_t step, int32_t micro) const;

 private:
  friend class SamplePlan;
  int64_t epoch_ = 0;
  int32_t shard_ = 0;
  int64_t num_steps_ = 0;
  int32_t micro_batch_size_ = 1;
  int32_t micro_batches_per_step_ = 1;
  std::vector<int64_t> ids_;
};

// Pure arithmetic over (num_tokens, options): sample ids, split, epoch order,
// shards, micro-batches. Cheap to copy; thread-safe (all const).
class SamplePlan {
 public:
  // InvalidArgument for bad options or a corpus too small for one train
  // sample per shard and step.
  static absl::StatusOr<SamplePlan> Create(int64_t num_tokens, const SamplePlanOptions& options);

  int64_t seq_len() const { return options_.seq_len; }
  int32_t num_shards() const { return options_.num_shards; }
  int32_t micro_batch_size() const { return options_.micro_batch_size; }
  int32_t micro_batches_per_step() const { return options_.micro_batches_per_step; }
  const SamplePlanOptions& options() const { return options_; }

  int64_t num_samples() const { return num_samples_; }
  int64_t num_train_samples() const { return num_train_; }
  int64_t num_validation_samples() const { return num_samples_ - num_train_; }
  bool IsValidation(int64_t id) const { return id >= num_train_ && id < num_samples_; }
  // First token of sample `id` in the corpus.
  int64_t SampleOffset(int64_t id) const { return id * options_.seq_len; }

  // Train ids 0..num_train-1 / validation ids, ascending.
  std::vector<int64_t> TrainIds() const;
  std::vector<int64_t> ValidationIds() const;
  // The train ids shuffled for `epoch` (depends only on seed and epoch).
  std::vector<int64_t> EpochPermutation(int64_t epoch) const;
  // floor(num_train / num_shards): the same for every shard.
  int64_t samples_per_shard() const { return num_train_ / options_.num_shards; }
  // samples_per_shard / (B*M).
  int64_t steps_per_epoch() const;
  // Shard `shard`'s ordered ids for `epoch` with its step layout.
  ShardSchedule Schedule(int64_t epoch, int32_t shard) const;
  // The fixed members of shard `shard` (in assignment order).
  std::vector<int64_t> ShardMembers(int32_t shard) const;
  // The "epoch" whose permutation assigns samples to shards.
  static constexpr int64_t kShardAssignmentEpoch = -1;

  // The seed of epoch `epoch`'s Rng: Mix64 of (seed, epoch).
  static uint64_t EpochSeed(uint64_t seed, int64_t epoch);

 private:
  SamplePlan() = default;

  SamplePlanOptions options_;
  int64_t num_samples_ = 0;
  int64_t num_train_ = 0;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_CORPUS_H_
