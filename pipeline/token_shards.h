// Prepared datasets: token shards plus a manifest, written once by
// `aqswarm data prepare` and memory-mapped by training, so a corpus larger
// than RAM trains and every peer reads the same token stream.
//
//   PrepareOptions p;
//   p.inputs = {"data/sotu"};                 // directories, globs, .txt/.jsonl files
//   p.out_dir = "data/prepared/sotu-llama3";
//   p.val_fraction = 0.05;
//   AQSWARM_ASSIGN_OR_RETURN(ShardManifest m, PrepareShards(p, *tokenizer));
//
//   AQSWARM_ASSIGN_OR_RETURN(auto shards, MappedShards::Open("data/prepared/sotu-llama3"));
//   std::vector<int32_t> window(seq_len + 1);
//   shards->Copy(/*offset=*/id * seq_len, window.size(), window.data());
//
// Layout of a prepared directory:
//   manifest.json       the identity: format version, documents, tokens,
//                       train_tokens (the validation split), dtype, vocab
//                       size, eot id, tokenizer hash, text field, source
//                       file names, and every shard's file, token count and
//                       XXH3. Its own XXH3 is the dataset hash.
//   shard-00000.bin ... header (32 bytes, little-endian: char[8]
//                       "AQSWSHD\0", uint32 version 1, uint32 bytes per id
//                       (2 = uint16 when the vocabulary fits, else 4 =
//                       uint32), uint64 token count, uint64 0) + the ids.
// The token stream is the concatenation of the shards: the documents of the
// inputs in order (a directory's files sorted by name), each tokenized on
// its own, joined with the tokenizer's eot id; the last ceil(val_fraction x
// documents) documents form its tail [train_tokens, tokens).
//
// Thread-safety: MappedShards is immutable after Open; Copy is thread-safe.
#ifndef AQSWARM_PIPELINE_TOKEN_SHARDS_H_
#define AQSWARM_PIPELINE_TOKEN_SHARDS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/tokenizer.h"

namespace aqswarm::pipeline {

inline constexpr char kShardManifestFile[] = "manifest.json";
inline constexpr uint32_t kShardFormatVersion = 1;

struct ShardEntry {
  std::string file;    // name inside the prepared directory
  int64_t tokens = 0;
  std::string xxh3;    // of the whole file, 16 hex digits
};

struct ShardManifest {
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t train_tokens = 0;    // tokens before the validation documents
  int32_t bytes_per_id = 2;    // 2 (uint16) or 4 (uint32)
  int32_t vocab_size = 0;
  int32_t eot_id = -1;
  std::string tokenizer_hash;  // Tokenizer::checksum(), 16 hex digits
  std::string text_field;      // of the .jsonl inputs
  std::vector<std::string> sources;  // input file names (no directories)
  std::vector<ShardEntry> shards;
};

// True when `dir` holds a manifest.json (a prepared dataset).
bool IsPreparedDataset(const std::string& dir);

// Parses and checks <dir>/manifest.json; DataLoss naming the file and field
// when it does not parse or is inconsistent. `bytes`, if given, receives the
// file's bytes (the dataset hash is their XXH3).
absl::StatusOr<ShardManifest> ReadShardManifest(const std::string& dir, std::string* bytes = nullptr);

class MappedShards {
 public:
  // Maps every shard read-only and checks its header and size against the
  // manifest and its XXH3 (one sequential read of the whole dataset: at disk
  // speed, the price of refusing a truncated, corrupt or foreign shard).
  // DataLoss naming the file otherwise.
  static absl::StatusOr<std::unique_ptr<MappedShards>> Open(const std::string& dir);
  ~MappedShards();
  MappedShards(const MappedShards&) = delete;
  MappedShards& operator=(const MappedShards&) = delete;

  const ShardManifest& manifest() const { return manifest_; }
  int64_t num_tokens() const { return manifest_.tokens; }
  // Tokens [offset, offset + count) of the stream as int32 (crossing shard
  // boundaries as needed). Aborts when the range is outside the stream (the
  // caller's sample plan was made for this dataset: a bad range is a bug).
  void Copy(int64_t offset, int64_t count, int32_t* out) const;

 private:
  struct Map {
    const uint8_t* base = nullptr;  // the whole file
    size_t size = 0;
    int64_t first = 0;              // stream offset of its first token
    int64_t tokens = 0;
  };
  MappedShards() = default;
  ShardManifest manifest_;
  std::vector<Map> maps_;
};

struct PrepareOptions {
  // Directories, globs or .txt/.jsonl files, read in this order. Required.
  std::vector<std::string> inputs;
  // .jsonl: the string field holding a document. Default: "text".
  std::string text_field = "text";
  // Written (created if missing; existing shards and manifest replaced). Required.
  std::string out_dir;
  // Documents (the last ones) held out for validation, in [0, 1). Default: 0.
  double val_fraction = 0;
  // Tokenizing threads; 0 = the machine's cores. Output does not depend on it.
  int threads = 0;
  // Tokens per shard. Default: 50M (100 MB of uint16).
  int64_t shard_tokens = 50'000'000;
  // Called now and then with (documents, tokens, input bytes) done so far.
  std::function<void(int64_t, int64_t, int64_t)> progress;
};

// Tokenizes the inputs and writes the shards and the manifest. Memory: one
// .txt file (a document) or a batch of .jsonl lines (streamed) plus one
// shard's ids at a time. Re-running with the same inputs and tokenizer
// writes byte-identical files; a run that fails leaves the directory as it
// was (new shards are staged as <shard>.partial until every input was read).
absl::StatusOr<ShardManifest> PrepareShards(const PrepareOptions& options, const Tokenizer& tokenizer);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_TOKEN_SHARDS_H_
