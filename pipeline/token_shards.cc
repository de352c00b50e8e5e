#include "pipeline/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "common/checksum.h"
#include "common/data_identity.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "pipeline/corpus.h"

namespace aqswarm::pipeline {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kShardMagic[8] = {'A', 'Q', 'S', 'W', 'S', 'H', 'D', '\0'};
constexpr char kManifestFormat[] = "aqswarm-token-shards";

struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t bytes_per_id;
  uint64_t num_tokens;
  uint64_t reserved;
};
static_assert(sizeof(ShardHeader) == 32, "shard header layout");

std::string ShardName(size_t index) { return absl::StrFormat("shard-%05d.bin", index); }

absl::StatusOr<std::string> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path.string(), "'"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ManifestJson(const ShardManifest& m) {
  json j;
  j["format"] = kManifestFormat;
  j["version"] = kShardFormatVersion;
  j["documents"] = m.documents;
  j["tokens"] = m.tokens;
  j["train_tokens"] = m.train_tokens;
  j["dtype"] = m.bytes_per_id == 2 ? "uint16" : "uint32";
  j["vocab_size"] = m.vocab_size;
  j["eot_id"] = m.eot_id;
  j["tokenizer_hash"] = m.tokenizer_hash;
  j["text_field"] = m.text_field;
  j["sources"] = m.sources;
  j["shards"] = json::array();
  for (const ShardEntry& s : m.shards) j["shards"].push_back({{"file", s.file}, {"tokens", s.tokens}, {"xxh3", s.xxh3}});
  // File names need not be UTF-8: invalid bytes become U+FFFD rather than an exception.
  return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

constexpr char kStagedSuffix[] = ".partial";

// Buffers ids and writes them out one shard file at a time, each under a
// staged name (<shard>.partial) that Publish() renames into place once
// everything is written: a prepare that fails half-way leaves the previous
// dataset as it was (its manifest still names its own shards).
class ShardWriter {
 public:
  ShardWriter(fs::path dir, int32_t bytes_per_id, int64_t shard_tokens)
      : dir_(std::move(dir)), bytes_per_id_(bytes_per_id), shard_tokens_(shard_tokens) {}
  ~ShardWriter() {
    std::error_code ec;
    for (const ShardEntry& s : shards_) fs::remove(dir_ / (s.file + kStagedSuffix), ec);  // unpublished
  }

  absl::Status Append(absl::Span<const int32_t> ids) {
    for (int32_t id : ids) {
      if (bytes_per_id_ == 2) {
        const auto v = static_cast<uint16_t>(id);
        buffer_.append(reinterpret_cast<const char*>(&v), 2);
      } else {
        const auto v = static_cast<uint32_t>(id);
        buffer_.append(reinterpret_cast<const char*>(&v), 4);
      }
      if (++in_buffer_ == shard_tokens_) AQSWARM_RETURN_IF_ERROR(Flush());
    }
    return absl::OkStatus();
  }

  absl::Status Flush() {
    if (in_buffer_ == 0) return absl::OkStatus();
    ShardHeader h{};
    std::memcpy(h.magic, kShardMagic, sizeof(kShardMagic));
    h.version = kShardFormatVersion;
    h.bytes_per_id = static_cast<uint32_t>(bytes_per_id_);
    h.num_tokens = static_cast<uint64_t>(in_buffer_);
    const std::string name = ShardName(shards_.size());
    const std::string staged = (dir_ / (name + kStagedSuffix)).string();
    shards_.push_back({name, in_buffer_, ""});
    Checksummer sum;
    sum.Update(&h, sizeof(h));
    sum.Update(buffer_.data(), buffer_.size());
    shards_.back().xxh3 = HashHex(sum.Digest());
    std::ofstream out(staged, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&h), sizeof(h));
    out.write(buffer_.data(), static_cast<std::streamsize>(buffer_.size()));
    out.close();
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", staged));
    buffer_.clear();
    in_buffer_ = 0;
    return absl::OkStatus();
  }

  // Renames every staged shard into place (fsync, rename, fsync of the directory).
  absl::Status Publish() {
    for (const ShardEntry& s : shards_) {
      AQSWARM_RETURN_IF_ERROR(
          PublishFileAtomically((dir_ / (s.file + kStagedSuffix)).string(), (dir_ / s.file).string()));
    }
    return absl::OkStatus();
  }

  const std::vector<ShardEntry>& shards() const { return shards_; }

 private:
  const fs::path dir_;
  const int32_t bytes_per_id_;
  const int64_t shard_tokens_;
  std::string buffer_;
  int64_t in_buffer_ = 0;
  std::vector<ShardEntry> shards_;
};

// Encodes `docs` on up to `threads` threads (each takes the next document
// not yet taken); ids[i] are docs[i]'s, so the result does not depend on the
// thread count.
std::vector<std::vector<int32_t>> EncodeAll(const std::vector<std::string>& docs, const Tokenizer& tok, int threads) {
  std::vector<std::vector<int32_t>> ids(docs.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < docs.size(); i = next++) tok.EncodeAppend(docs[i], &ids[i]);
  };
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(docs.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return ids;
}

}  // namespace

bool IsPreparedDataset(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / kShardManifestFile, ec);
}

absl::StatusOr<ShardManifest> ReadShardManifest(const std::string& dir, std::string* bytes) {
  const fs::path path = fs::path(dir) / kShardManifestFile;
  AQSWARM_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  auto bad = [&](const std::string& why) { return absl::DataLossError(absl::StrCat(path.string(), ": ", why)); };
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not JSON");
  if (!j.contains("format") || j["format"] != kManifestFormat) {
    return bad(absl::StrCat("not an aqswarm manifest (format is not '", kManifestFormat, "')"));
  }
  if (!j.contains("version") || j["version"] != kShardFormatVersion) {
    return bad(absl::StrCat("format version ", j.contains("version") ? j["version"].dump() : "(none)",
                            ", this build reads ", kShardFormatVersion));
  }
  ShardManifest m;
  try {
    m.documents = j.at("documents").get<int64_t>();
    m.tokens = j.at("tokens").get<int64_t>();
    m.train_tokens = j.at("train_tokens").get<int64_t>();
    const std::string dtype = j.at("dtype").get<std::string>();
    if (dtype != "uint16" && dtype != "uint32") return bad("dtype '" + dtype + "' is not uint16 or uint32");
    m.bytes_per_id = dtype == "uint16" ? 2 : 4;
    m.vocab_size = j.at("vocab_size").get<int32_t>();
    m.eot_id = j.at("eot_id").get<int32_t>();
    m.tokenizer_hash = j.at("tokenizer_hash").get<std::string>();
    m.text_field = j.at("text_field").get<std::string>();
    m.sources = j.at("sources").get<std::vector<std::string>>();
    int64_t sum = 0;
    for (const json& s : j.at("shards")) {
      ShardEntry e{s.at("file").get<std::string>(), s.at("tokens").get<int64_t>(), s.at("xxh3").get<std::string>()};
      if (e.file.empty() || e.file.find('/') != std::string::npos || e.file[0] == '.') {
        return bad("shard file '" + e.file + "' must be a plain name inside the directory");
      }
      if (e.tokens <= 0) return bad("shard " + e.file + " has no tokens");
      sum += e.tokens;
      m.shards.push_back(std::move(e));
    }
    if (sum != m.tokens) return bad(absl::StrCat("the shards hold ", sum, " tokens, not ", m.tokens));
  } catch (const json::exception& e) {
    return bad(absl::StrCat("missing or mistyped field: ", e.what()));
  }
  if (m.train_tokens < 0 || m.train_tokens > m.tokens) return bad("train_tokens outside [0, tokens]");
  if (!ValidateHashHex(m.tokenizer_hash, "tokenizer_hash").ok() || m.tokenizer_hash.empty()) {
    return bad("tokenizer_hash is not 16 hex digits");
  }
  if (bytes != nullptr) *bytes = std::move(text);
  return m;
}

MappedShards::~MappedShards() {
  for (const Map& m : maps_) munmap(const_cast<uint8_t*>(m.base), m.size);
}

absl::StatusOr<std::unique_ptr<MappedShards>> MappedShards::Open(const std::string& dir) {
  auto out = std::unique_ptr<MappedShards>(new MappedShards());
  AQSWARM_ASSIGN_OR_RETURN(out->manifest_, ReadShardManifest(dir));
  int64_t first = 0;
  for (const ShardEntry& e : out->manifest_.shards) {
    const std::string path = (fs::path(dir) / e.file).string();
    auto bad = [&](const std::string& why) { return absl::DataLossError(absl::StrCat("shard ", path, ": ", why)); };
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError(absl::StrCat("shard ", path, " is missing (", std::strerror(errno), ")"));
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(ShardHeader))) {
      close(fd);
      return bad("truncated (shorter than its header)");
    }
    void* base = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return bad(absl::StrCat("cannot map: ", std::strerror(errno)));
    Map map{static_cast<const uint8_t*>(base), static_cast<size_t>(st.st_size), first, e.tokens};
    out->maps_.push_back(map);  // unmapped by the destructor from here on
    ShardHeader h;
    std::memcpy(&h, map.base, sizeof(h));
    if (std::memcmp(h.magic, kShardMagic, sizeof(kShardMagic)) != 0) return bad("not an aqswarm token shard");
    if (h.version != kShardFormatVersion) return bad(absl::StrCat("format version ", h.version));
    if (static_cast<int32_t>(h.bytes_per_id) != out->manifest_.bytes_per_id) {
      return bad(absl::StrCat(h.bytes_per_id, " bytes per id, the manifest says ", out->manifest_.bytes_per_id));
    }
    if (static_cast<int64_t>(h.num_tokens) != e.tokens) {
      return bad(absl::StrCat("holds ", h.num_tokens, " tokens, the manifest says ", e.tokens));
    }
    if (map.size != sizeof(h) + static_cast<size_t>(e.tokens) * h.bytes_per_id) {
      return bad(absl::StrCat("is ", map.size, " bytes, ", e.tokens, " tokens need ",
                              sizeof(h) + static_cast<size_t>(e.tokens) * h.bytes_per_id, " (truncated?)"));
    }
    madvise(base, map.size, MADV_SEQUENTIAL);
    const std::string hash = HashHex(Checksum64(map.base, map.size));
    madvise(base, map.size, MADV_RANDOM);
    if (hash != e.xxh3) return bad(absl::StrCat("XXH3 ", hash, " differs from the manifest's ", e.xxh3, " (corrupt?)"));
    first += e.tokens;
  }
  return out;
}

void MappedShards::Copy(int64_t offset, int64_t count, int32_t* out) const {
  AQSWARM_CHECK(offset >= 0 && count >= 0 && offset + count <= manifest_.tokens)
      << "tokens [" << offset << ", " << offset + count << ") of " << manifest_.tokens;
  auto it = std::upper_bound(maps_.begin(), maps_.end(), offset,
                             [](int64_t o, const Map& m) { return o < m.first; });
  size_t shard = static_cast<size_t>(it - maps_.begin()) - 1;
  while (count > 0) {
    const Map& m = maps_[shard];
    const int64_t from = offset - m.first;
    const int64_t n = std::min(count, m.tokens - from);
    const uint8_t* p = m.base + sizeof(ShardHeader) + from * manifest_.bytes_per_id;
    if (manifest_.bytes_per_id == 2) {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        out[i] = v;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        uint32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = static_cast<int32_t>(v);
      }
    }
    out += n;
    offset += n;
    count -= n;
    ++shard;
  }
}

absl::StatusOr<ShardManifest> PrepareShards(const PrepareOptions& o, const Tokenizer& tokenizer) {
  if (o.inputs.empty()) return absl::InvalidArgumentError("no inputs");
  if (o.out_dir.empty()) return absl::InvalidArgumentError("no output directory");
  if (!(o.val_fraction >= 0 && o.val_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("val_fraction ", o.val_fraction, " is outside [0, 1)"));
  }
  if (o.shard_tokens < 1) return absl::InvalidArgumentError("shard_tokens must be >= 1");
  if (tokenizer.eot_id() < 0) return absl::FailedPreconditionError("the tokenizer has no token to separate documents");
  std::vector<std::string> files;
  for (const std::string& input : o.inputs) {
    AQSWARM_ASSIGN_OR_RETURN(std::vector<std::string> listed, ListTextSource(input));
    files.insert(files.end(), listed.begin(), listed.end());
  }
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create ", o.out_dir, ": ", ec.message()));

  ShardManifest m;
  m.vocab_size = tokenizer.vocab_size();
  m.eot_id = tokenizer.eot_id();
  m.bytes_per_id = m.vocab_size <= 65536 ? 2 : 4;
  m.tokenizer_hash = HashHex(tokenizer.checksum());
  m.text_field = o.text_field.empty() ? "text" : o.text_field;
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ShardWriter writer(o.out_dir, m.bytes_per_id, o.shard_tokens);
  std::vector<int64_t> doc_starts;  // stream offset of each document's first token
  int64_t bytes_read = 0;
  // Documents are encoded in batches (across files: a directory of many small
  // files keeps every thread busy) and written in document order.
  constexpr size_t kBatchDocs = 4096;
  constexpr size_t kBatchBytes = size_t{64} << 20;
  std::vector<std::string> batch;
  size_t batch_bytes = 0;
  auto encode_batch = [&]() -> absl::Status {
    std::vector<std::vector<int32_t>> ids = EncodeAll(batch, tokenizer, threads);
    for (const std::vector<int32_t>& d : ids) {
      if (!doc_starts.empty()) {
        const int32_t eot = tokenizer.eot_id();
        AQSWARM_RETURN_IF_ERROR(writer.Append(absl::MakeConstSpan(&eot, 1)));
        ++m.tokens;
      }
      doc_starts.push_back(m.tokens);
      AQSWARM_RETURN_IF_ERROR(writer.Append(d));
      m.tokens += static_cast<int64_t>(d.size());
    }
    batch.clear();
    batch_bytes = 0;
    if (o.progress) o.progress(static_cast<int64_t>(doc_starts.size()), m.tokens, bytes_read);
    return absl::OkStatus();
  };
  auto add = [&](std::string doc) -> absl::Status {
    if (doc.empty()) return absl::OkStatus();
    batch_bytes += doc.size();
    batch.push_back(std::move(doc));
    if (batch.size() >= kBatchDocs || batch_bytes >= kBatchBytes) return encode_batch();
    return absl::OkStatus();
  };
  for (const std::string& file : files) {
    m.sources.push_back(fs::path(file).filename().string());
    if (fs::path(file).extension() != ".jsonl") {  // one document: read whole
      AQSWARM_ASSIGN_OR_RETURN(std::string content, ReadFile(file));
      bytes_read += static_cast<int64_t>(content.size());
      AQSWARM_RETURN_IF_ERROR(add(std::move(content)));
      continue;
    }
    // A .jsonl file streams line by line: it may be larger than memory.
    std::ifstream in(file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", file, "'"));
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      bytes_read += static_cast<int64_t>(line.size()) + 1;
      AQSWARM_ASSIGN_OR_RETURN(std::string doc, ParseJsonlLine(file, n, line, m.text_field));
      AQSWARM_RETURN_IF_ERROR(add(std::move(doc)));
    }
    if (in.bad()) return absl::DataLossError(absl::StrCat("error reading '", file, "'"));
  }
  if (!batch.empty()) AQSWARM_RETURN_IF_ERROR(encode_batch());
  AQSWARM_RETURN_IF_ERROR(writer.Flush());
  m.documents = static_cast<int64_t>(doc_starts.size());
  if (m.tokens == 0) return absl::InvalidArgumentError("the inputs hold no text");
  // IEEE double arithmetic: the same split on every machine.
  const auto held_out = static_cast<int64_t>(std::ceil(o.val_fraction * static_cast<double>(m.documents)));
  m.train_tokens = held_out == 0 ? m.tokens : doc_starts[m.documents - held_out];
  m.shards = writer.shards();

  // Replace the previous dataset: its manifest goes first (a directory
  // without one is no dataset), then the new shards take their names, then
  // any older shard beyond them goes, then the new manifest appears.
  const fs::path manifest_path = fs::path(o.out_dir) / kShardManifestFile;
  fs::remove(manifest_path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot remove ", manifest_path.string(), ": ", ec.message()));
  AQSWARM_RETURN_IF_ERROR(writer.Publish());
  std::set<std::string> ours;
  for (const ShardEntry& s : m.shards) ours.insert(s.file);
  for (const auto& entry : fs::directory_iterator(o.out_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool shard_like = name.rfind("shard-", 0) == 0 &&
                            (entry.path().extension() == ".bin" || entry.path().extension() == kStagedSuffix);
    if (shard_like && ours.count(name) == 0) fs::remove(entry.path(), ec);
  }
  AQSWARM_RETURN_IF_ERROR(WriteFileAtomically(manifest_path.string(), ManifestJson(m), 0644));
  return m;
}

}  // namespace aqswarm::pipeline
