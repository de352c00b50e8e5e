#include "pipeline/corpus.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/random.h"
#include "common/status_macros.h"

namespace aqswarm::pipeline {
namespace {

namespace fs = std::filesystem;

constexpr char kCacheMagic[8] = {'A', 'Q', 'S', 'W', 'T', 'O', 'K', '\0'};
constexpr uint64_t kSourceChecksumSeed = 0x736f75726365ull;  // "source"
constexpr uint64_t kPayloadChecksumSeed = 0x746f6b656e73ull;  // "tokens"

// On-disk header; see corpus.h. Fixed-width fields, no padding.
struct CacheHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t tokenizer_checksum;
  uint64_t source_checksum;
  uint64_t source_bytes;
  uint64_t num_tokens;
  uint64_t payload_checksum;
};
static_assert(sizeof(CacheHeader) == 56, "cache header layout");

struct Document {
  std::string name;
  std::string text;
};

struct Source {
  std::vector<Document> documents;
  uint64_t checksum = 0;
  uint64_t bytes = 0;
};

absl::StatusOr<std::string> ReadWholeFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path.string(), "'"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading '", path.string(), "'"));
  return ss.str();
}

// Reads the documents in their contractual order and fingerprints them (file
// names included, so renaming or reordering files invalidates the cache).
absl::StatusOr<Source> ReadSource(const std::string& source_path) {
  std::error_code ec;
  const fs::path root(source_path);
  const fs::file_status status = fs::status(root, ec);
  if (ec || !fs::exists(status)) {
    return absl::NotFoundError(
        absl::StrCat("corpus source '", source_path,
                     "' does not exist (for the SOTU corpus run scripts/fetch_data.sh)"));
  }
  std::vector<fs::path> files;
  if (fs::is_directory(status)) {
    for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
      if (entry.is_regular_file() && entry.path().extension() == ".txt") {
        files.push_back(entry.path());
      }
    }
    if (ec) return absl::InternalError(absl::StrCat("cannot list '", source_path, "': ", ec.message()));
    // Byte-wise name order: locale-independent, the same on every machine.
    std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) {
      return a.filename().string() < b.filename().string();
    });
    if (files.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("corpus directory '", source_path, "' has no .txt files"));
    }
  } else {
    files.push_back(root);
  }

  Source source;
  Checksummer sum(kSourceChecksumSeed);
  for (const fs::path& file : files) {
    AQSWARM_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(file));
    Document doc{file.filename().string(), std::move(text)};
    const uint64_t lengths[2] = {doc.name.size(), doc.text.size()};
    sum.Update(lengths, sizeof(lengths));
    sum.Update(doc.name.data(), doc.name.size());
    sum.Update(doc.text.data(), doc.text.size());
    source.bytes += doc.text.size();
    source.documents.push_back(std::move(doc));
  }
  source.checksum = sum.Digest();
  return source;
}

std::string DefaultCacheName(const std::string& source_path) {
  fs::path p = fs::path(source_path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "data/sotu/" -> "data/sotu"
  std::string name = p.stem().string();
  return name.empty() || name == "." ? "corpus" : name;
}

// Returns the cached tokens, or an error saying why the cache is unusable.
absl::StatusOr<std::vector<int32_t>> LoadCache(const std::string& path, uint64_t tokenizer_checksum,
                                               const Source& source) {
  AQSWARM_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path));
  CacheHeader h;
  if (bytes.size() < sizeof(h)) return absl::DataLossError("truncated header");
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (std::memcmp(h.magic, kCacheMagic, sizeof(kCacheMagic)) != 0) {
    return absl::DataLossError("bad magic");
  }
  if (h.version != kTokenCacheVersion || h.header_bytes != sizeof(h)) {
    return absl::FailedPreconditionError(absl::StrCat("format version ", h.version));
  }
  if (h.tokenizer_checksum != tokenizer_checksum) {
    return absl::FailedPreconditionError("made by another tokenizer");
  }
  if (h.source_checksum != source.checksum || h.source_bytes != source.bytes) {
    return absl::FailedPreconditionError("source changed since the cache was written");
  }
  if (h.num_tokens > (bytes.size() - sizeof(h)) / sizeof(int32_t) ||
      bytes.size() != sizeof(h) + h.num_tokens * sizeof(int32_t)) {
    return absl::DataLossError(
        absl::StrCat("size ", bytes.size(), " does not match ", h.num_tokens, " tokens"));
  }
  const char* payload = bytes.data() + sizeof(h);
  const size_t payload_bytes = h.num_tokens * sizeof(int32_t);
  if (Checksum64(payload, payload_bytes, kPayloadChecksumSeed) != h.payload_checksum) {
    return absl::DataLossError("payload checksum mismatch");
  }
  std::vector<int32_t> tokens(h.num_tokens);
  std::memcpy(tokens.data(), payload, payload_bytes);
  return tokens;
}

// Writes to a temporary name, then publishes it (fsync, rename, fsync of the
// directory: PublishFileAtomically): a reader (another process on the same
// machine) sees the old file or the whole new one, never a torn one, and so
// does the next run after a crash.
absl::Status WriteCache(const std::string& path, uint64_t tokenizer_checksum, const Source& source,
                        const std::vector<int32_t>& tokens) {
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create cache dir: ", ec.message()));
  CacheHeader h;
  std::memcpy(h.magic, kCacheMagic, sizeof(kCacheMagic));
  h.version = kTokenCacheVersion;
  h.header_bytes = sizeof(h);
  h.tokenizer_checksum = tokenizer_checksum;
  h.source_checksum = source.checksum;
  h.source_bytes = source.bytes;
  h.num_tokens = tokens.size();
  h.payload_checksum =
      Checksum64(tokens.data(), tokens.size() * sizeof(int32_t), kPayloadChecksumSeed);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&h), sizeof(h));
    out.write(reinterpret_cast<const char*>(tokens.data()),
              static_cast<std::streamsize>(tokens.size() * sizeof(int32_t)));
    out.close();
    if (!out) {
      fs::remove(tmp, ec);
      return absl::InternalError(absl::StrCat("cannot write '", tmp, "'"));
    }
  }
  return PublishFileAtomically(tmp, path);
}

}  // namespace

// ---------------------------------------------------------------- TokenCorpus

absl::StatusOr<std::unique_ptr<TokenCorpus>> TokenCorpus::Open(const CorpusOptions& options,
                                                               const Tokenizer& tokenizer) {
  if (options.source_path.empty()) {
    return absl::InvalidArgumentError("CorpusOptions.source_path is required");
  }
  AQSWARM_ASSIGN_OR_RETURN(Source source, ReadSource(options.source_path));

  auto corpus = std::unique_ptr<TokenCorpus>(new TokenCorpus());
  corpus->num_documents_ = static_cast<int64_t>(source.documents.size());
  corpus->source_checksum_ = source.checksum;
  if (!options.cache_dir.empty()) {
    const std::string name =
        options.cache_name.empty() ? DefaultCacheName(options.source_path) : options.cache_name;
    corpus->cache_path_ = (fs::path(options.cache_dir) / (name + ".tokens")).string();
    std::error_code ec;
    if (fs::exists(corpus->cache_path_, ec)) {
      absl::StatusOr<std::vector<int32_t>> cached =
          LoadCache(corpus->cache_path_, tokenizer.checksum(), source);
      if (cached.ok()) {
        corpus->tokens_ = *std::move(cached);
        corpus->loaded_from_cache_ = true;
        return corpus;
      }
      AQSWARM_LOG(WARNING) << "token cache " << corpus->cache_path_
                           << " not used, rebuilding: " << cached.status().message();
    }
  }

  if (source.documents.size() > 1 && tokenizer.eot_id() < 0) {
    return absl::FailedPreconditionError(
        "tokenizer has no <|endoftext|> token to separate documents");
  }
  std::vector<int32_t>& tokens = corpus->tokens_;
  tokens.reserve(source.bytes / 4 + source.documents.size());
  for (size_t i = 0; i < source.documents.size(); ++i) {
    if (i > 0) tokens.push_back(tokenizer.eot_id());
    tokenizer.EncodeAppend(source.documents[i].text, &tokens);
  }
  if (corpus->tokens_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("corpus source '", options.source_path, "' has no text"));
  }
  if (!corpus->cache_path_.empty()) {
    // The cache only saves time: a read-only disk must not stop training.
    absl::Status written = WriteCache(corpus->cache_path_, tokenizer.checksum(), source, tokens);
    if (!written.ok()) {
      AQSWARM_LOG(WARNING) << "token cache not written: " << written.message();
    }
  }
  return corpus;
}

std::unique_ptr<TokenCorpus> TokenCorpus::FromTokens(std::vector<int32_t> tokens) {
  auto corpus = std::unique_ptr<TokenCorpus>(new TokenCorpus());
  corpus->tokens_ = std::move(tokens);
  corpus->source_checksum_ =
      Checksum64(corpus->tokens_.data(), corpus->tokens_.size() * sizeof(int32_t));
  return corpus;
}

int64_t TokenCorpus::NumSamples(int64_t seq_len) const {
  AQSWARM_CHECK(seq_len > 0) << "seq_len " << seq_len;
  return num_tokens() < 1 ? 0 : (num_tokens() - 1) / seq_len;
}

absl::Span<const int32_t> TokenCorpus::Sample(int64_t id, int64_t seq_len) const {
  AQSWARM_CHECK(id >= 0 && id < NumSamples(seq_len))
      << "sample " << id << " out of range for " << num_tokens() << " tokens, seq_len " << seq_len;
  return absl::MakeConstSpan(tokens_).subspan(id * seq_len, seq_len + 1);
}

void TokenCorpus::GatherBatch(absl::Span<const int64_t> ids, int64_t seq_len,
                              std::vector<int32_t>* inputs, std::vector<int32_t>* targets) const {
  inputs->resize(ids.size() * seq_len);
  targets->resize(ids.size() * seq_len);
  for (size_t b = 0; b < ids.size(); ++b) {
    absl::Span<const int32_t> w = Sample(ids[b], seq_len);
    std::copy(w.begin(), w.end() - 1, inputs->begin() + b * seq_len);
    std::copy(w.begin() + 1, w.end(), targets->begin() + b * seq_len);
  }
}

// ---------------------------------------------------------------- ShardSchedule

absl::Span<const int64_t> ShardSchedule::Step(int64_t step) const {
  AQSWARM_CHECK(step >= 0 && step < num_steps_) << "step " << step << " of " << num_steps_;
  const int64_t per_step = int64_t{micro_batch_size_} * micro_batches_per_step_;
  return absl::MakeConstSpan(ids_).subspan(step * per_step, per_step);
}

absl::Span<const int64_t> ShardSchedule::MicroBatch(int64_t step, int32_t micro) const {
  AQSWARM_CHECK(micro >= 0 && micro < micro_batches_per_step_)
      << "micro-batch " << micro << " of " << micro_batches_per_step_;
  return Step(step).subspan(int64_t{micro} * micro_batch_size_, micro_batch_size_);
}

// ---------------------------------------------------------------- SamplePlan

absl::StatusOr<SamplePlan> SamplePlan::Create(int64_t num_tokens, const SamplePlanOptions& options) {
  if (options.seq_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len must be > 0, got ", options.seq_len));
  }
  if (!(options.validation_fraction >= 0.0 && options.validation_fraction < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("validation_fraction must be in [0, 1), got ",
                                                   options.validation_fraction));
  }
  if (options.num_shards < 1 || options.micro_batch_size < 1 ||
      options.micro_batches_per_step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards, micro_batch_size and micro_batches_per_step must be >= 1, got ",
                     options.num_shards, ", ", options.micro_batch_size, ", ",
                     options.micro_batches_per_step));
  }
  SamplePlan plan;
  plan.options_ = options;
  plan.num_samples_ = num_tokens < 1 ? 0 : (num_tokens - 1) / options.seq_len;
  // IEEE double arithmetic: the same result on every conforming machine.
  const auto num_validation = static_cast<int64_t>(
      std::ceil(options.validation_fraction * static_cast<double>(plan.num_samples_)));
  plan.num_train_ = plan.num_samples_ - num_validation;
  const int64_t per_step = int64_t{options.micro_batch_size} * options.micro_batches_per_step;
  if (plan.num_train_ / options.num_shards < per_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "corpus too small: ", num_tokens, " tokens give ", plan.num_samples_,
        " samples of seq_len ", options.seq_len, ", ", plan.num_train_, " for training; ",
        options.num_shards, " shards need at least ", per_step, " each for one step"));
  }
  return plan;
}

uint64_t SamplePlan::EpochSeed(uint64_t seed, int64_t epoch) {
  return Mix64(Mix64(seed) ^ static_cast<uint64_t>(epoch));
}

std::vector<int64_t> SamplePlan::TrainIds() const {
  std::vector<int64_t> ids(num_train_);
  for (int64_t i = 0; i < num_train_; ++i) ids[i] = i;
  return ids;
}

std::vector<int64_t> SamplePlan::ValidationIds() const {
  std::vector<int64_t> ids;
  ids.reserve(num_validation_samples());
  for (int64_t i = num_train_; i < num_samples_; ++i) ids.push_back(i);
  return ids;
}

std::vector<int64_t> SamplePlan::EpochPermutation(int64_t epoch) const {
  std::vector<int64_t> ids = TrainIds();
  // Fisher-Yates: uniform over permutations, and a pure function of the Rng
  // stream, which is a pure function of (seed, epoch).
  Rng rng(EpochSeed(options_.seed, epoch));
  for (int64_t i = num_train_ - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.Uniform(static_cast<uint64_t>(i) + 1));
    std::swap(ids[i], ids[j]);
  }
  return ids;
}

int64_t SamplePlan::steps_per_epoch() const {
  return samples_per_shard() /
         (int64_t{options_.micro_batch_size} * options_.micro_batches_per_step);
}

std::vector<int64_t> SamplePlan::ShardMembers(int32_t shard) const {
  AQSWARM_CHECK(shard >= 0 && shard < options_.num_shards)
      << "shard " << shard << " of " << options_.num_shards;
  const std::vector<int64_t> assignment = EpochPermutation(kShardAssignmentEpoch);
  const int64_t n = samples_per_shard();
  std::vector<int64_t> ids;
  ids.reserve(n);
  for (int64_t k = 0; k < n; ++k) ids.push_back(assignment[k * options_.num_shards + shard]);
  return ids;
}

ShardSchedule SamplePlan::Schedule(int64_t epoch, int32_t shard) const {
  ShardSchedule s;
  s.epoch_ = epoch;
  s.shard_ = shard;
  s.micro_batch_size_ = options_.micro_batch_size;
  s.micro_batches_per_step_ = options_.micro_batches_per_step;
  s.num_steps_ = steps_per_epoch();
  s.ids_ = ShardMembers(shard);
  // This epoch's order of the shard's (fixed) members: Fisher-Yates keyed by
  // (seed, epoch, shard).
  Rng rng(EpochSeed(options_.seed, epoch) ^ Mix64(static_cast<uint64_t>(shard) + 1));
  for (int64_t i = static_cast<int64_t>(s.ids_.size()) - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.Uniform(static_cast<uint64_t>(i) + 1));
    std::swap(s.ids_[i], s.ids_[j]);
  }
  return s;
}

}  // namespace aqswarm::pipeline
