#include "pipeline/corpus.h"

#include <glob.h>
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
#include "common/data_identity.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "pipeline/token_shards.h"

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

bool IsGlob(const std::string& path) { return path.find_first_of("*?[") != std::string::npos; }

// Reads the documents in their contractual order and fingerprints them (file
// names included, so renaming or reordering files invalidates the cache;
// the text field too when a .jsonl file is read).
absl::StatusOr<Source> ReadSource(const std::string& source_path, const std::string& text_field) {
  AQSWARM_ASSIGN_OR_RETURN(std::vector<std::string> files, ListTextSource(source_path));
  Source source;
  Checksummer sum(kSourceChecksumSeed);
  bool jsonl = false;
  for (const std::string& file : files) {
    AQSWARM_ASSIGN_OR_RETURN(std::string content, ReadWholeFile(file));
    const std::string name = fs::path(file).filename().string();
    const uint64_t lengths[2] = {name.size(), content.size()};
    sum.Update(lengths, sizeof(lengths));
    sum.Update(name.data(), name.size());
    sum.Update(content.data(), content.size());
    source.bytes += content.size();
    jsonl |= fs::path(file).extension() == ".jsonl";
    AQSWARM_ASSIGN_OR_RETURN(std::vector<std::string> docs, SplitDocuments(file, content, text_field));
    for (std::string& d : docs) source.documents.push_back(Document{name, std::move(d)});
  }
  if (jsonl) {
    const uint64_t length = text_field.size();
    sum.Update(&length, sizeof(length));
    sum.Update(text_field.data(), text_field.size());
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

absl::StatusOr<std::vector<std::string>> ListTextSource(const std::string& source_path) {
  std::vector<std::string> files;
  if (IsGlob(source_path)) {
    glob_t g;
    const int rc = glob(source_path.c_str(), 0, nullptr, &g);
    if (rc == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) {
        std::error_code ec;
        if (fs::is_regular_file(g.gl_pathv[i], ec)) files.emplace_back(g.gl_pathv[i]);
      }
    }
    globfree(&g);
    if (files.empty()) return absl::NotFoundError(absl::StrCat("corpus glob '", source_path, "' matches no file"));
    std::sort(files.begin(), files.end());
    return files;
  }
  std::error_code ec;
  const fs::path root(source_path);
  const fs::file_status status = fs::status(root, ec);
  if (ec || !fs::exists(status)) {
    return absl::NotFoundError(
        absl::StrCat("corpus source '", source_path,
                     "' does not exist (for the SOTU corpus run scripts/fetch_data.sh)"));
  }
  if (!fs::is_directory(status)) return std::vector<std::string>{source_path};
  std::vector<fs::path> paths;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
    const fs::path ext = entry.path().extension();
    if (entry.is_regular_file() && (ext == ".txt" || ext == ".jsonl")) paths.push_back(entry.path());
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list '", source_path, "': ", ec.message()));
  // Byte-wise name order: locale-independent, the same on every machine.
  std::sort(paths.begin(), paths.end(), [](const fs::path& a, const fs::path& b) {
    return a.filename().string() < b.filename().string();
  });
  if (paths.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("corpus directory '", source_path, "' has no .txt files (nor .jsonl)"));
  }
  for (const fs::path& p : paths) files.push_back(p.string());
  return files;
}

absl::StatusOr<std::vector<std::string>> SplitDocuments(const std::string& file, const std::string& content,
                                                        const std::string& text_field) {
  std::vector<std::string> docs;
  if (fs::path(file).extension() != ".jsonl") {
    if (!content.empty()) docs.push_back(content);
    return docs;
  }
  size_t start = 0;
  for (int64_t line = 1; start < content.size(); ++line) {
    size_t end = content.find('\n', start);
    if (end == std::string::npos) end = content.size();
    AQSWARM_ASSIGN_OR_RETURN(std::string doc,
                             ParseJsonlLine(file, line, std::string_view(content).substr(start, end - start), text_field));
    start = end + 1;
    if (!doc.empty()) docs.push_back(std::move(doc));
  }
  return docs;
}

absl::StatusOr<std::string> ParseJsonlLine(const std::string& file, int64_t line, std::string_view text,
                                           const std::string& text_field) {
  const std::string field = text_field.empty() ? "text" : text_field;
  if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
  if (text.find_first_not_of(" \t") == std::string_view::npos) return std::string();  // blank line
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::DataLossError(absl::StrCat(file, ":", line, ": not a JSON value (or not UTF-8)"));
  }
  if (!j.is_object() || !j.contains(field)) {
    return absl::DataLossError(absl::StrCat(file, ":", line, ": no field '", field, "' (data.textField)"));
  }
  if (!j[field].is_string()) {
    return absl::DataLossError(
        absl::StrCat(file, ":", line, ": field '", field, "' is ", j[field].type_name(), ", not a string"));
  }
  return j[field].get<std::string>();
}

absl::StatusOr<uint64_t> TextSourceChecksum(const std::string& source_path, const std::string& text_field) {
  AQSWARM_ASSIGN_OR_RETURN(Source source, ReadSource(source_path, text_field));
  return source.checksum;
}

// ---------------------------------------------------------------- TokenCorpus

absl::StatusOr<std::unique_ptr<TokenCorpus>> TokenCorpus::Open(const CorpusOptions& options,
                                                               const Tokenizer& tokenizer) {
  if (options.source_path.empty()) {
    return absl::InvalidArgumentError("CorpusOptions.source_path is required");
  }
  if (IsPreparedDataset(options.source_path)) {
    std::string manifest_bytes;
    AQSWARM_ASSIGN_OR_RETURN(ShardManifest m, ReadShardManifest(options.source_path, &manifest_bytes));
    if (m.tokenizer_hash != HashHex(tokenizer.checksum())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "prepared dataset ", options.source_path, " was tokenized by tokenizer ", m.tokenizer_hash,
          ", not by the given one (", HashHex(tokenizer.checksum()), "): name the tokenizer it was prepared with"));
    }
    auto corpus = std::unique_ptr<TokenCorpus>(new TokenCorpus());
    AQSWARM_ASSIGN_OR_RETURN(corpus->shards_, MappedShards::Open(options.source_path));
    corpus->num_documents_ = m.documents;
    corpus->train_tokens_ = m.train_tokens < m.tokens ? m.train_tokens : -1;
    corpus->source_checksum_ = Checksum64(manifest_bytes.data(), manifest_bytes.size());
    return corpus;
  }
  AQSWARM_ASSIGN_OR_RETURN(Source source, ReadSource(options.source_path, options.text_field));

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

TokenCorpus::~TokenCorpus() = default;

int64_t TokenCorpus::num_tokens() const {
  return shards_ != nullptr ? shards_->num_tokens() : static_cast<int64_t>(tokens_.size());
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
  AQSWARM_CHECK(shards_ == nullptr) << "Sample() of a prepared dataset: use GatherBatch";
  return absl::MakeConstSpan(tokens_).subspan(id * seq_len, seq_len + 1);
}

void TokenCorpus::GatherBatch(absl::Span<const int64_t> ids, int64_t seq_len,
                              std::vector<int32_t>* inputs, std::vector<int32_t>* targets) const {
  inputs->resize(ids.size() * seq_len);
  targets->resize(ids.size() * seq_len);
  if (shards_ != nullptr) {
    std::vector<int32_t> w(seq_len + 1);
    for (size_t b = 0; b < ids.size(); ++b) {
      AQSWARM_CHECK(ids[b] >= 0 && ids[b] < NumSamples(seq_len))
          << "sample " << ids[b] << " out of range for " << num_tokens() << " tokens, seq_len " << seq_len;
      shards_->Copy(ids[b] * seq_len, seq_len + 1, w.data());
      std::copy(w.begin(), w.end() - 1, inputs->begin() + b * seq_len);
      std::copy(w.begin() + 1, w.end(), targets->begin() + b * seq_len);
    }
    return;
  }
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
  if (options.train_tokens >= 0) {
    if (options.train_tokens > num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("train_tokens ", options.train_tokens, " is beyond the corpus's ", num_tokens, " tokens"));
    }
    plan.num_train_ = std::min(plan.num_samples_,
                               options.train_tokens < 1 ? 0 : (options.train_tokens - 1) / options.seq_len);
  } else {
    // IEEE double arithmetic: the same result on every conforming machine.
    const auto num_validation = static_cast<int64_t>(
        std::ceil(options.validation_fraction * static_cast<double>(plan.num_samples_)));
    plan.num_train_ = plan.num_samples_ - num_validation;
  }
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
