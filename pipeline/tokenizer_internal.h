// Private to tokenizer.cc and tokenizer_json.cc: the loaded form of a
// byte-level BPE tokenizer, whichever file format it came from. tokenizer.cc
// owns the encoding machinery (pre-tokenizer steps, BPE, cache); the loaders
// (GPT-2 files in tokenizer.cc, tokenizer.json in tokenizer_json.cc) fill an
// Impl and hand it to Tokenizer::Finish.
#ifndef AQSWARM_PIPELINE_TOKENIZER_INTERNAL_H_
#define AQSWARM_PIPELINE_TOKENIZER_INTERNAL_H_

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "pipeline/tokenizer.h"

namespace aqswarm::pipeline {

// Debian's Abseil is built with its own string_view type, not an alias of
// std::string_view, so convert explicitly at the Abseil calls.
inline absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Unicode normalization forms (tokenizer.json "normalizer").
enum class NormalizationForm { kNfc, kNfd, kNfkc, kNfkd };

// One step of the pre-tokenizer; each step splits every piece the previous
// step produced (tokenizer.json "Sequence").
struct PreTokenizeStep {
  enum class Kind {
    kSplit,        // split by `regex`
    kPrefixSpace,  // ByteLevel add_prefix_space: " " before a piece not starting with one
  };
  Kind kind = Kind::kSplit;
  pcre2_code* regex = nullptr;  // owned (freed by Impl)
  // Text between two matches: true: one piece (tokenizer.json: transformers.js
  // keeps it for "Isolated" splits; match-only steps never leave any for valid
  // UTF-8 with the supported patterns). false: one piece per byte (GPT-2's
  // files: such gaps are invalid UTF-8 only).
  bool gap_is_one_piece = true;
  std::string describe;  // canonical description, part of the checksum
};

struct Tokenizer::Impl {
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  struct AddedToken {
    std::string content;  // raw UTF-8 text
    int32_t id;
    bool lstrip, rstrip;  // strip whitespace left/right of it (added-token mode)
  };

  std::vector<std::string> id_to_bytes;  // raw bytes of each token
  std::vector<bool> id_valid;            // false: a hole in the id space
  int32_t byte_to_id[256] = {};
  absl::flat_hash_map<uint64_t, Merge> merges;  // PairKey(left, right) -> merge

  std::vector<NormalizationForm> normalizers;  // applied in order
  std::vector<PreTokenizeStep> steps;
  // ignore_merges: a whole piece that is a token (raw bytes) maps to its id.
  bool ignore_merges = false;
  absl::flat_hash_map<std::string, int32_t> piece_to_id;
  // Added tokens, longest first (EncodeWithAddedTokens); first_bytes marks
  // the bytes any of them starts with.
  std::vector<AddedToken> added_tokens;
  bool added_first_byte[256] = {};

  mutable absl::Mutex mu;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache ABSL_GUARDED_BY(mu);

  ~Impl() {
    for (PreTokenizeStep& step : steps) {
      if (step.regex != nullptr) pcre2_code_free(step.regex);
    }
  }
};

namespace tokenizer_internal {

// GPT-2's bytes_to_unicode(): byte -> code point of its printable stand-in.
std::vector<uint32_t> ByteToCodePoint();
void AppendUtf8(uint32_t cp, std::string* out);
// Maps a byte-level token string back to raw bytes; false if it contains a
// code point outside the table.
bool TokenToBytes(std::string_view token, const absl::flat_hash_map<uint32_t, uint8_t>& inverse,
                  std::string* bytes);
uint64_t PairKey(int32_t left, int32_t right);
// Compiles a PCRE2 pattern (UTF, UCP, invalid UTF-8 allowed, JIT when
// possible). InvalidArgument with PCRE2's message on a bad pattern.
absl::StatusOr<pcre2_code*> CompileRegex(const std::string& pattern, const std::string& what);
// Normalizes `text` (which may hold invalid UTF-8: only its valid runs are
// normalized, other bytes are kept) into *out. Defined in tokenizer_json.cc.
void NormalizeUnicode(NormalizationForm form, std::string_view text, std::string* out);

}  // namespace tokenizer_internal
}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_TOKENIZER_INTERNAL_H_
