// Byte-level GPT-2 BPE tokenizer (the r50k_base encoding), read from the
// original `encoder.json` + `vocab.bpe` files (scripts/fetch_data.sh puts them
// in data/gpt2/). Token ids are identical to OpenAI's GPT-2 encoder and
// tiktoken's r50k_base for ordinary text: the golden cases of gpt-tokenizer's
// TestPlans.txt pass (tokenizer_test.cc).
//
//   AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok,
//       Tokenizer::Load("data/gpt2/encoder.json", "data/gpt2/vocab.bpe"));
//   std::vector<int32_t> ids = tok->Encode("Hello, world!");  // {15496, 11, 995, 0}
//   std::string text = tok->Decode(ids);                      // "Hello, world!"
//
// How it works, as in GPT-2's encoder.py:
//   1. Pre-tokenize with GPT-2's regex (PCRE2, UTF + UCP, JIT):
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   2. Start each piece as its UTF-8 bytes (each byte is a token via GPT-2's
//      byte-to-unicode table), then repeatedly merge the adjacent pair with the
//      lowest merge rank in vocab.bpe until no ranked pair is left.
//   3. Pieces are memoised (a bounded cache), since text repeats words a lot.
//
// Encode never fails: it takes arbitrary bytes. Invalid UTF-8 (which GPT-2's
// Python encoder never sees, as it works on decoded str) is not dropped: bytes
// the regex cannot match become pieces of their own, so Decode(Encode(x)) == x
// for every byte string x. Encode treats "<|endoftext|>" in the text as
// ordinary text (like tiktoken's encode_ordinary); corpus code inserts
// eot_id() between documents itself.
//
// Thread-safety: a loaded Tokenizer is immutable except for its internal,
// mutex-guarded cache; Encode and Decode may be called from any thread.
#ifndef AQSWARM_PIPELINE_TOKENIZER_H_
#define AQSWARM_PIPELINE_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace aqswarm::pipeline {

class Tokenizer {
 public:
  // Reads GPT-2's encoder.json (token string -> id; ids must be exactly
  // 0..n-1) and vocab.bpe ("#version" line, then one "a b" merge per line in
  // rank order). NotFound for a missing file, DataLoss for content that does
  // not parse or is inconsistent (e.g. a merge whose result is not a token).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& encoder_path,
                                                         const std::string& vocab_path);
  // The tokenizer a job names (DataSpec.tokenizer): a directory holding
  // GPT-2's encoder.json + vocab.bpe. NotFound names what is missing.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Open(const std::string& path);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text` (any bytes; see the header comment).
  std::vector<int32_t> Encode(std::string_view text) const;
  // Same, appended to `*out` (avoids a copy when tokenizing a corpus).
  void EncodeAppend(std::string_view text, std::vector<int32_t>* out) const;

  // The bytes the ids stand for. Ids outside [0, vocab_size()) (a model with
  // a padded vocabulary can sample them) decode to U+FFFD so that printing a
  // sample never fails. Decoding a prefix may end inside a UTF-8 character.
  std::string Decode(absl::Span<const int32_t> ids) const;

  // 50257 for GPT-2.
  int32_t vocab_size() const;
  // Id of "<|endoftext|>" (50256 for GPT-2); -1 if the vocabulary lacks it.
  int32_t eot_id() const { return eot_id_; }
  // Number of merges read from vocab.bpe (50000 for GPT-2).
  int32_t num_merges() const { return num_merges_; }
  // XXH3 of the vocabulary and merges in canonical form: two tokenizers with
  // the same checksum produce the same ids. Token caches are keyed by it.
  uint64_t checksum() const { return checksum_; }

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);

  // Appends the BPE ids of one pre-tokenized piece.
  void EncodePiece(std::string_view piece, std::vector<int32_t>* out) const;

  std::unique_ptr<Impl> impl_;
  int32_t eot_id_ = -1;
  int32_t num_merges_ = 0;
  uint64_t checksum_ = 0;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_TOKENIZER_H_
