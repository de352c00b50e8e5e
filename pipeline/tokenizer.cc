#include "pipeline/tokenizer.h"

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
#include "pipeline/tokenizer_internal.h"

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

}  // namespace

namespace tokenizer_internal {

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

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

absl::StatusOr<pcre2_code*> CompileRegex(const std::string& pattern, const std::string& what) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  // MATCH_INVALID_UTF: arbitrary bytes are a valid subject; invalid sequences
  // simply never match, and Encode turns the gaps into pieces of their own.
  // DOLLAR_ENDONLY: `$` is the end of the text, as in JavaScript and Rust.
  pcre2_code* regex = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF |
                                        PCRE2_DOLLAR_ENDONLY,
                                    &error_code, &error_offset, nullptr);
  if (regex == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat("cannot compile ", what, " /", pattern,
                                                   "/ at offset ", error_offset, ": ",
                                                   reinterpret_cast<char*>(message)));
  }
  // JIT is ~5x faster; without it (unsupported CPU) matching still works.
  pcre2_jit_compile(regex, PCRE2_JIT_COMPLETE);
  return regex;
}

}  // namespace tokenizer_internal

namespace {

using tokenizer_internal::AppendUtf8;
using tokenizer_internal::ByteToCodePoint;
using tokenizer_internal::PairKey;
using tokenizer_internal::TokenToBytes;

constexpr char kReplacementChar[] = "\xEF\xBF\xBD";  // U+FFFD

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

}  // namespace

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

  // --- The pre-tokenizer: GPT-2's regex; gaps (invalid UTF-8) byte by byte.
  absl::StatusOr<pcre2_code*> regex =
      tokenizer_internal::CompileRegex(kGpt2Pattern, "GPT-2's pre-tokenizer pattern");
  if (!regex.ok()) return absl::InternalError(regex.status().message());
  PreTokenizeStep step;
  step.regex = *regex;
  step.gap_is_one_piece = false;
  impl->steps.push_back(std::move(step));
  impl->id_valid.assign(n, true);

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
  if (impl_->ignore_merges) {
    auto it = impl_->piece_to_id.find(AsAbsl(piece));
    if (it != impl_->piece_to_id.end()) {
      out->push_back(it->second);
      return;
    }
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
  // ordered by (rank, position of the left symbol's first byte): O(n log n),
  // so a megabyte of spaces is no problem. This is exactly the order of
  // tokenizers' and transformers.js's BPE (transformers.js scores a pair
  // rank + position / length). For GPT-2's files every merge only uses
  // earlier-ranked results (checked in Load), so it also equals GPT-2's
  // "merge all occurrences of the best pair, left to right, repeat" loop.
  // Stale heap entries are skipped on pop.
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

void Tokenizer::PreTokenizeAndEncode(size_t step_index, std::string_view text,
                                     std::vector<int32_t>* out) const {
  if (text.empty()) return;
  if (step_index == impl_->steps.size()) {
    EncodePiece(text, out);
    return;
  }
  const PreTokenizeStep& step = impl_->steps[step_index];
  if (step.kind == PreTokenizeStep::Kind::kPrefixSpace) {
    if (text.front() == ' ') {
      PreTokenizeAndEncode(step_index + 1, text, out);
    } else {
      std::string spaced;
      spaced.reserve(text.size() + 1);
      spaced.push_back(' ');
      spaced.append(text);
      PreTokenizeAndEncode(step_index + 1, spaced, out);
    }
    return;
  }
  auto emit_gap = [&](size_t from, size_t to) {
    if (from >= to) return;
    if (step.gap_is_one_piece) {
      PreTokenizeAndEncode(step_index + 1, text.substr(from, to - from), out);
    } else {
      for (size_t b = from; b < to; ++b) PreTokenizeAndEncode(step_index + 1, text.substr(b, 1), out);
    }
  };
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match_data(
      pcre2_match_data_create_from_pattern(step.regex, nullptr), &pcre2_match_data_free);
  pcre2_match_data* match = match_data.get();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;     // start of text not yet emitted
  size_t search = 0;  // where the next match may start
  while (search < text.size()) {
    const int rc = pcre2_match(step.regex, subject, text.size(), search, 0, match, nullptr);
    if (rc < 0) {
      // PCRE2_ERROR_NOMATCH: the rest is a gap (for GPT-2's pattern: only
      // invalid UTF-8). Any other error (resource limits on pathological
      // input): keep the text as a gap rather than lose it.
      break;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
    const size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {
      // An empty match (possible only with a tokenizer.json pattern): no
      // piece; search again one character on, as JavaScript's matchAll does.
      search = begin + 1;
      while (search < text.size() && (static_cast<uint8_t>(text[search]) & 0xC0) == 0x80) ++search;
      continue;
    }
    // Bytes skipped over are a gap: GPT-2's files: invalid UTF-8, each byte
    // its own piece (so they round-trip; GPT-2 would never see them).
    emit_gap(pos, begin);
    PreTokenizeAndEncode(step_index + 1, text.substr(begin, end - begin), out);
    pos = search = end;
  }
  emit_gap(pos, text.size());
}

void Tokenizer::EncodeText(std::string_view text, std::vector<int32_t>* out) const {
  if (impl_->normalizers.empty()) {
    PreTokenizeAndEncode(0, text, out);
    return;
  }
  // ASCII is invariant under every normalization form: skip the copy.
  bool ascii = true;
  for (const char c : text) {
    if (static_cast<uint8_t>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) {
    PreTokenizeAndEncode(0, text, out);
    return;
  }
  std::string normalized(text), next;
  for (const NormalizationForm form : impl_->normalizers) {
    tokenizer_internal::NormalizeUnicode(form, normalized, &next);
    normalized.swap(next);
  }
  PreTokenizeAndEncode(0, normalized, out);
}

void Tokenizer::EncodeAppend(std::string_view text, std::vector<int32_t>* out) const {
  EncodeText(text, out);
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  EncodeAppend(text, &ids);
  return ids;
}

namespace {

// JavaScript's String.prototype.trimStart/trimEnd whitespace (what
// transformers.js strips next to an lstrip/rstrip added token).
bool IsJsWhitespace(uint32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000: case 0xFEFF:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

// Decodes the UTF-8 character starting at text[i] (0 and length 1 if invalid).
uint32_t DecodeAt(std::string_view text, size_t i, size_t* len) {
  const auto c = static_cast<uint8_t>(text[i]);
  size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
  if (n == 0 || i + n > text.size()) {
    *len = 1;
    return 0;
  }
  uint32_t cp = n == 1 ? c : c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    const auto cc = static_cast<uint8_t>(text[i + k]);
    if ((cc & 0xC0) != 0x80) {
      *len = 1;
      return 0;
    }
    cp = (cp << 6) | (cc & 0x3F);
  }
  *len = n;
  return cp;
}

std::string_view TrimJsWhitespaceStart(std::string_view s) {
  size_t len = 0;
  while (!s.empty() && IsJsWhitespace(DecodeAt(s, 0, &len))) s.remove_prefix(len);
  return s;
}

std::string_view TrimJsWhitespaceEnd(std::string_view s) {
  while (!s.empty()) {
    size_t start = s.size() - 1;
    while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80 && s.size() - start < 4) --start;
    size_t len = 0;
    const uint32_t cp = DecodeAt(s, start, &len);
    if (start + len != s.size() || !IsJsWhitespace(cp)) break;
    s.remove_suffix(len);
  }
  return s;
}

}  // namespace

std::vector<int32_t> Tokenizer::EncodeWithAddedTokens(std::string_view text) const {
  std::vector<int32_t> ids;
  if (impl_->added_tokens.empty()) {
    EncodeAppend(text, &ids);
    return ids;
  }
  // Split into text and added tokens (leftmost, longest first: the order of
  // impl_->added_tokens), as transformers.js's DictionarySplitter does.
  struct Section {
    std::string_view text;
    const Impl::AddedToken* token;  // null for text
  };
  std::vector<Section> sections;
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const Impl::AddedToken* found = nullptr;
    if (impl_->added_first_byte[static_cast<uint8_t>(text[i])]) {
      for (const Impl::AddedToken& token : impl_->added_tokens) {
        if (text.compare(i, token.content.size(), token.content) == 0) {
          found = &token;
          break;
        }
      }
    }
    if (found == nullptr) {
      ++i;
      continue;
    }
    if (i > start) sections.push_back({text.substr(start, i - start), nullptr});
    sections.push_back({text.substr(i, found->content.size()), found});
    i += found->content.size();
    start = i;
  }
  if (start < text.size()) sections.push_back({text.substr(start), nullptr});
  for (size_t k = 0; k < sections.size(); ++k) {
    if (sections[k].token == nullptr) continue;
    if (sections[k].token->lstrip && k > 0 && sections[k - 1].token == nullptr) {
      sections[k - 1].text = TrimJsWhitespaceEnd(sections[k - 1].text);
    }
    if (sections[k].token->rstrip && k + 1 < sections.size() && sections[k + 1].token == nullptr) {
      sections[k + 1].text = TrimJsWhitespaceStart(sections[k + 1].text);
    }
  }
  for (const Section& section : sections) {
    if (section.token != nullptr) {
      ids.push_back(section.token->id);
    } else {
      EncodeText(section.text, &ids);
    }
  }
  return ids;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids) const {
  std::string text;
  for (const int32_t id : ids) {
    if (id >= 0 && id < vocab_size() && impl_->id_valid[id]) {
      text += impl_->id_to_bytes[id];
    } else {
      text += kReplacementChar;
    }
  }
  return text;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Open(const std::string& path) {
  const std::filesystem::path p(path);
  std::error_code ec;
  if (std::filesystem::is_regular_file(p, ec)) return LoadHuggingFace(path);
  if (!std::filesystem::is_directory(p, ec)) {
    return absl::NotFoundError(absl::StrCat(
        "tokenizer ", path, ": no such file or directory (expected a tokenizer.json, a directory "
        "holding one, or a directory holding GPT-2's encoder.json + vocab.bpe)"));
  }
  if (std::filesystem::exists(p / "tokenizer.json", ec)) {
    return LoadHuggingFace((p / "tokenizer.json").string());
  }
  if (!std::filesystem::exists(p / "encoder.json", ec) && !std::filesystem::exists(p / "vocab.bpe", ec)) {
    return absl::NotFoundError(absl::StrCat("tokenizer directory ", path,
                                            " holds neither tokenizer.json nor GPT-2's encoder.json + "
                                            "vocab.bpe (run scripts/fetch_data.sh to fetch them)"));
  }
  return Load((p / "encoder.json").string(), (p / "vocab.bpe").string());
}

}  // namespace aqswarm::pipeline
