#include "pipeline/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <queue>
#include <sstream>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/checksum.h"
#include "nlohmann/json.hpp"

namespace aqswarm::pipeline {
namespace {

// GPT-2's pre-tokenizer (encoder.py). PCRE2's \s under UCP is \h|\v, which
// equals Unicode White_Space (what Python's `regex` uses) except for U+180E.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Memoised pieces; cleared when full so memory stays bounded on huge corpora.
constexpr size_t kMaxCacheEntries = 1 << 18;
// Pieces longer than this are not cached (rare, and would bloat the cache).
constexpr size_t kMaxCachedPieceBytes = 64;

constexpr char kReplacementChar[] = "\xEF\xBF\xBD";  // U+FFFD

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the
// other 68 bytes to U+0100.. in byte order, so every token is printable text.
std::vector<uint32_t> ByteToCodePoint() {
  std::vector<uint32_t> cp(256, 0);
  std::vector<bool> direct(256, false);
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) cp[b] = direct[b] ? b : next++;
  return cp;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    // Byte-level tokens only use code points < 0x144.
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Maps a token string of encoder.json (byte-to-unicode text) back to the raw
// bytes it stands for. False if it contains a code point outside the table.
bool TokenToBytes(std::string_view token, const absl::flat_hash_map<uint32_t, uint8_t>& inverse,
                  std::string* bytes) {
  bytes->clear();
  size_t i = 0;
  while (i < token.size()) {
    const auto c = static_cast<uint8_t>(token[i]);
    uint32_t cp;
    size_t len;
    if (c < 0x80) {
      cp = c, len = 1;
    } else if ((c & 0xE0) == 0xC0) {
      cp = c & 0x1F, len = 2;
    } else if ((c & 0xF0) == 0xE0) {
      cp = c & 0x0F, len = 3;
    } else {
      return false;
    }
    if (i + len > token.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<uint8_t>(token[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    auto it = inverse.find(cp);
    if (it == inverse.end()) return false;
    bytes->push_back(static_cast<char>(it->second));
    i += len;
  }
  return true;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open GPT-2 ", what, " '", path,
                                            "' (run scripts/fetch_data.sh to fetch it)"));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", what, " '", path, "'"));
  return ss.str();
}

// Debian's Abseil is built with its own string_view type, not an alias of
// std::string_view, so convert explicitly at the Abseil calls.
absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

struct Tokenizer::Impl {
  struct Merge {
    int32_t rank;
    int32_t result;
  };

  std::vector<std::string> id_to_bytes;  // raw bytes of each token
  int32_t byte_to_id[256] = {};
  absl::flat_hash_map<uint64_t, Merge> merges;  // PairKey(left, right) -> merge

  pcre2_code* regex = nullptr;

  mutable absl::Mutex mu;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache ABSL_GUARDED_BY(mu);

  ~Impl() {
    if (regex != nullptr) pcre2_code_free(regex);
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& encoder_path,
                                                           const std::string& vocab_path) {
  auto impl = std::make_unique<Impl>();

  const std::vector<uint32_t> byte_cp = ByteToCodePoint();
  absl::flat_hash_map<uint32_t, uint8_t> cp_to_byte;
  for (int b = 0; b < 256; ++b) cp_to_byte[byte_cp[b]] = static_cast<uint8_t>(b);

  // --- encoder.json: {"token": id, ...} with ids exactly 0..n-1.
  absl::StatusOr<std::string> encoder_text = ReadFile(encoder_path, "encoder.json");
  if (!encoder_text.ok()) return encoder_text.status();
  nlohmann::json encoder = nlohmann::json::parse(*encoder_text, /*cb=*/nullptr,
                                                 /*allow_exceptions=*/false);
  if (encoder.is_discarded() || !encoder.is_object() || encoder.empty()) {
    return absl::DataLossError(
        absl::StrCat("'", encoder_path, "' is not a JSON object of token -> id (corrupt?)"));
  }
  const size_t n = encoder.size();
  impl->id_to_bytes.resize(n);
  std::vector<bool> seen(n, false);
  absl::flat_hash_map<std::string, int32_t> token_to_id;  // encoder.json's own strings
  token_to_id.reserve(n);
  int32_t eot_id = -1;
  std::string bytes;
  for (const auto& [token, value] : encoder.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
        value.get<int64_t>() >= static_cast<int64_t>(n)) {
      return absl::DataLossError(absl::StrCat("'", encoder_path, "': token '", token,
                                              "' has an id outside 0..", n - 1));
    }
    const auto id = static_cast<int32_t>(value.get<int64_t>());
    if (seen[id]) {
      return absl::DataLossError(absl::StrCat("'", encoder_path, "': id ", id, " appears twice"));
    }
    seen[id] = true;
    if (!TokenToBytes(token, cp_to_byte, &bytes)) {
      return absl::DataLossError(absl::StrCat("'", encoder_path, "': token '", token,
                                              "' is not byte-level BPE text"));
    }
    impl->id_to_bytes[id] = bytes;
    token_to_id.emplace(token, id);
    if (token == "<|endoftext|>") eot_id = id;
  }
  for (int b = 0; b < 256; ++b) {
    std::string single;
    AppendUtf8(byte_cp[b], &single);
    auto it = token_to_id.find(single);
    if (it == token_to_id.end()) {
      return absl::DataLossError(
          absl::StrCat("'", encoder_path, "' lacks the single-byte token for byte ", b));
    }
    impl->byte_to_id[b] = it->second;
  }

  // --- vocab.bpe: "#version: 0.2", then "left right" per line, rank order.
  absl::StatusOr<std::string> vocab_text = ReadFile(vocab_path, "vocab.bpe");
  if (!vocab_text.ok()) return vocab_text.status();
  // Tokens that exist so far: merges must only use bytes or earlier merge
  // results. That makes rank order a valid merge order, which the heap-based
  // BPE in EncodePiece relies on to match GPT-2's reference exactly.
  std::vector<bool> formed(n, false);
  for (int b = 0; b < 256; ++b) formed[impl->byte_to_id[b]] = true;
  std::vector<std::pair<int32_t, int32_t>> merge_pairs;
  std::string_view rest = *vocab_text;
  int64_t line_no = 0;
  while (!rest.empty()) {
    const size_t eol = rest.find('\n');
    std::string_view line = rest.substr(0, eol);
    rest = eol == std::string_view::npos ? std::string_view() : rest.substr(eol + 1);
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos) {
      return absl::DataLossError(absl::StrCat("'", vocab_path, "' line ", line_no,
                                              ": expected two tokens separated by one space"));
    }
    const std::string left(line.substr(0, sp)), right(line.substr(sp + 1));
    auto l = token_to_id.find(left);
    auto r = token_to_id.find(right);
    auto m = token_to_id.find(left + right);
    if (l == token_to_id.end() || r == token_to_id.end() || m == token_to_id.end()) {
      return absl::DataLossError(absl::StrCat("'", vocab_path, "' line ", line_no, ": merge '",
                                              AsAbsl(line), "' uses or makes a token not in encoder.json"));
    }
    if (!formed[l->second] || !formed[r->second]) {
      return absl::DataLossError(absl::StrCat("'", vocab_path, "' line ", line_no, ": merge '",
                                              AsAbsl(line), "' uses a token no earlier merge makes"));
    }
    formed[m->second] = true;
    const auto rank = static_cast<int32_t>(merge_pairs.size());
    // A repeated pair keeps its first (lowest) rank, as in GPT-2's dict().
    impl->merges.try_emplace(PairKey(l->second, r->second), Impl::Merge{rank, m->second});
    merge_pairs.emplace_back(l->second, r->second);
  }
  if (merge_pairs.empty()) {
    return absl::DataLossError(absl::StrCat("'", vocab_path, "' has no merges"));
  }

  // --- The pre-tokenizer.
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  // MATCH_INVALID_UTF: arbitrary bytes are a valid subject; invalid sequences
  // simply never match, and Encode turns the gaps into pieces of their own.
  impl->regex = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kGpt2Pattern), PCRE2_ZERO_TERMINATED,
                              PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error_code,
                              &error_offset, nullptr);
  if (impl->regex == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return absl::InternalError(
        absl::StrCat("PCRE2 cannot compile GPT-2's pattern: ", reinterpret_cast<char*>(message)));
  }
  // JIT is ~5x faster; without it (unsupported CPU) matching still works.
  pcre2_jit_compile(impl->regex, PCRE2_JIT_COMPLETE);

  // --- Identity: canonical vocabulary + merges, independent of file layout.
  Checksummer sum(/*seed=*/0x61717377746f6bull);  // "aqswtok"
  for (const std::string& token : impl->id_to_bytes) {
    const auto len = static_cast<uint32_t>(token.size());
    sum.Update(&len, sizeof(len));
    sum.Update(token.data(), token.size());
  }
  for (const auto& [left, right] : merge_pairs) {
    const int32_t pair[2] = {left, right};
    sum.Update(pair, sizeof(pair));
  }

  auto tokenizer = std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  tokenizer->eot_id_ = eot_id;
  tokenizer->num_merges_ = static_cast<int32_t>(merge_pairs.size());
  tokenizer->checksum_ = sum.Digest();
  return tokenizer;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_to_bytes.size()); }

void Tokenizer::EncodePiece(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    out->push_back(impl_->byte_to_id[static_cast<uint8_t>(piece[0])]);
    return;
  }
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->cache.find(AsAbsl(piece));
    if (it != impl_->cache.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }

  // BPE over a linked list of symbols with a min-heap of candidate pairs
  // ordered by (rank, position): O(n log n), so a megabyte of spaces is no
  // problem. Because every merge only uses earlier-ranked results (checked in
  // Load), this equals GPT-2's "merge all occurrences of the best pair, left
  // to right, repeat" loop. Stale heap entries are skipped on pop.
  const int n = static_cast<int>(piece.size());
  std::vector<int32_t> id(n), prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    id[i] = impl_->byte_to_id[static_cast<uint8_t>(piece[i])];
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank, left, right, left_id, right_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto consider = [&](int left) {
    if (left < 0) return;
    const int right = next[left];
    if (right < 0) return;
    auto it = impl_->merges.find(PairKey(id[left], id[right]));
    if (it != impl_->merges.end()) {
      heap.push({it->second.rank, left, right, id[left], id[right]});
    }
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  std::vector<bool> alive(n, true);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right || id[c.left] != c.left_id ||
        id[c.right] != c.right_id) {
      continue;
    }
    id[c.left] = impl_->merges.find(PairKey(c.left_id, c.right_id))->second.result;
    alive[c.right] = false;
    next[c.left] = next[c.right];
    if (next[c.right] >= 0) prev[next[c.right]] = c.left;
    consider(prev[c.left]);
    consider(c.left);
  }
  const size_t start = out->size();
  for (int i = 0; i >= 0; i = next[i]) out->push_back(id[i]);

  if (cacheable) {
    absl::MutexLock lock(&impl_->mu);
    if (impl_->cache.size() >= kMaxCacheEntries) impl_->cache.clear();
    impl_->cache.emplace(std::string(piece), std::vector<int32_t>(out->begin() + start, out->end()));
  }
}

void Tokenizer::EncodeAppend(std::string_view text, std::vector<int32_t>* out) const {
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match_data(
      pcre2_match_data_create_from_pattern(impl_->regex, nullptr), &pcre2_match_data_free);
  pcre2_match_data* match = match_data.get();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos < text.size()) {
    const int rc = pcre2_match(impl_->regex, subject, text.size(), pos, 0, match, nullptr);
    if (rc < 0) {
      // PCRE2_ERROR_NOMATCH: only unmatchable (invalid UTF-8) bytes remain.
      // Any other error (resource limits on pathological input): degrade to
      // byte pieces rather than lose text.
      for (; pos < text.size(); ++pos) EncodePiece(text.substr(pos, 1), out);
      break;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
    const size_t begin = ovector[0], end = ovector[1];
    // Bytes skipped over are invalid UTF-8: each becomes its own piece, so
    // they round-trip (GPT-2 would never see them).
    for (; pos < begin; ++pos) EncodePiece(text.substr(pos, 1), out);
    if (end == begin) {  // cannot happen with this pattern; guard the loop anyway
      EncodePiece(text.substr(pos, 1), out);
      ++pos;
      continue;
    }
    EncodePiece(text.substr(begin, end - begin), out);
    pos = end;
  }
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  EncodeAppend(text, &ids);
  return ids;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids) const {
  std::string text;
  for (const int32_t id : ids) {
    if (id >= 0 && id < vocab_size()) {
      text += impl_->id_to_bytes[id];
    } else {
      text += kReplacementChar;
    }
  }
  return text;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Open(const std::string& path) {
  const std::filesystem::path dir(path);
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("tokenizer ", path, ": not a directory"));
  }
  return Load((dir / "encoder.json").string(), (dir / "vocab.bpe").string());
}

}  // namespace aqswarm::pipeline
