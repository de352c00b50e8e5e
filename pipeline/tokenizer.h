// Byte-level BPE tokenizers: GPT-2's original files (`encoder.json` +
// `vocab.bpe`) and Hugging Face `tokenizer.json` files of the GPT-2, Llama-3
// and Qwen families. scripts/fetch_data.sh puts GPT-2's files in data/gpt2/
// and Llama-3's and Qwen3's tokenizer.json in data/llama3/ and data/qwen3/.
//
//   AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok,
//       Tokenizer::Open("data/llama3"));      // or data/llama3/tokenizer.json, data/gpt2
//   std::vector<int32_t> ids = tok->Encode("Hello, world!");  // {9906, 11, 1917, 0}
//   std::string text = tok->Decode(ids);                      // "Hello, world!"
//
// Ids match the reference implementations exactly:
//   * GPT-2's files: OpenAI's encoder.py and tiktoken's r50k_base (the golden
//     cases of gpt-tokenizer's TestPlans.txt pass; tokenizer_test.cc).
//   * tokenizer.json: transformers.js (@lenml/tokenizers 3.7.2), i.e.
//     `tok.encode(text, {add_special_tokens: false})`, on the committed texts
//     of tests/data/tokenizer/ (tokenizer_json_test.cc) and on the whole
//     SOTU corpus (docs/DATA.md). Where Python's `tokenizers` and
//     transformers.js differ, this follows transformers.js:
//     regex `\s` is JavaScript's (it has U+FEFF, not U+0085), `\d` is [0-9],
//     and the `(?i:'s|'t|...)` contraction group matches ASCII case only.
//
// How it works, as in GPT-2's encoder.py and tokenizers' BPE model:
//   1. Normalize (tokenizer.json only: NFC/NFD/NFKC/NFKD as the file says;
//      Qwen uses NFC).
//   2. Pre-tokenize with the file's regexes (PCRE2, UTF + UCP, JIT). GPT-2:
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      tokenizer.json: its "Split" (behavior "Isolated"), "ByteLevel" (with
//      add_prefix_space / use_regex) and "Digits" pre-tokenizers in sequence.
//   3. With ignore_merges (Llama-3), a piece that is itself a token is that
//      token. Otherwise start the piece as its UTF-8 bytes (each byte is a
//      token via GPT-2's byte-to-unicode table) and repeatedly merge the
//      adjacent pair with the lowest merge rank (leftmost first) until no
//      ranked pair is left.
//   4. Pieces are memoised (a bounded cache), since text repeats words a lot.
//
// Special and other added tokens (e.g. "<|begin_of_text|>", "<|endoftext|>")
// are never produced from text by Encode: text that looks like one is
// ordinary text (like tiktoken's encode_ordinary); corpus code inserts
// eot_id() between documents itself. EncodeWithAddedTokens is what
// transformers.js's encode(text, {add_special_tokens: false}) does: added
// tokens written in the text become their ids (never BOS/EOS added).
//
// Encode never fails: it takes arbitrary bytes. Invalid UTF-8 (which the
// reference implementations never see, as they work on decoded strings) is
// not dropped or replaced: bytes the regex cannot match become pieces of
// their own and the normalizer leaves them alone, so Decode(Encode(x)) == x
// for every byte string x that normalization does not change (for GPT-2 and
// Llama-3: every x; for Qwen: every NFC x).
//
// Unsupported tokenizer.json content fails LoadHuggingFace (and Open) with
// Unimplemented naming it:
// model types other than BPE (WordPiece, Unigram, WordLevel), BPE that is not
// byte-level (no ByteLevel pre-tokenizer, byte_fallback, subword affixes,
// dropout), and normalizers, pre-tokenizers, Split behaviors and decoders
// other than those above. Post-processors are ignored (they only add
// BOS/EOS, which Encode never does).
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
  // Reads a Hugging Face tokenizer.json (byte-level BPE; see the header
  // comment for what is supported), and the tokenizer_config.json beside it
  // if present (only for eot_id()). NotFound for a missing file, DataLoss for
  // content that does not parse or is inconsistent (not JSON, no
  // model.vocab, a merge naming a token the vocabulary lacks), Unimplemented
  // for an unsupported model type, normalizer, pre-tokenizer or decoder.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHuggingFace(
      const std::string& tokenizer_json_path);
  // The tokenizer a job names (DataSpec.tokenizer): a tokenizer.json file, a
  // directory holding tokenizer.json, or a directory holding GPT-2's
  // encoder.json + vocab.bpe (tokenizer.json wins when a directory has
  // both). NotFound names what is missing.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Open(const std::string& path);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text` (any bytes; see the header comment).
  std::vector<int32_t> Encode(std::string_view text) const;
  // Same, appended to `*out` (avoids a copy when tokenizing a corpus).
  void EncodeAppend(std::string_view text, std::vector<int32_t>* out) const;
  // Like Encode, but added tokens (tokenizer.json "added_tokens", special or
  // not: "<|begin_of_text|>", "<think>", ...) written in the text become
  // their ids, longest match first, as transformers.js's
  // encode(text, {add_special_tokens: false}) does. The text between them is
  // encoded as by Encode. For GPT-2's files there are none: same as Encode.
  // Only for callers that mean it (chat templates, a job that asks for it):
  // training text must not be able to forge document boundaries.
  std::vector<int32_t> EncodeWithAddedTokens(std::string_view text) const;

  // The bytes the ids stand for (the ByteLevel decoder; an added token
  // decodes to its text; no clean-up of spaces before punctuation). Ids
  // outside [0, vocab_size()) or in a hole of the id space (a model with a
  // padded vocabulary can sample them) decode to U+FFFD so that printing a
  // sample never fails. Decoding a prefix may end inside a UTF-8 character.
  std::string Decode(absl::Span<const int32_t> ids) const;

  // Largest token id + 1, added tokens included: 50257 for GPT-2, 128256
  // for Llama-3, 151669 for Qwen3 (whose models pad their embedding to
  // 151936).
  int32_t vocab_size() const;
  // The document separator corpus code puts between documents: the id of
  // "<|endoftext|>" if the tokenizer has that token (GPT-2: 50256, Qwen3:
  // 151643), else of "<|end_of_text|>" (Llama-3: 128001), else the
  // eos_token of the tokenizer_config.json beside a tokenizer.json; -1 if
  // none of these exists.
  int32_t eot_id() const { return eot_id_; }
  // Number of merges (50000 for GPT-2, 280147 for Llama-3, 151387 for Qwen3).
  int32_t num_merges() const { return num_merges_; }
  // XXH3 of everything that decides ids, in canonical form: the vocabulary
  // and merges, and for tokenizer.json also the normalizer, the
  // pre-tokenizer (regexes included), ignore_merges and the added tokens.
  // Two tokenizers with the same checksum produce the same ids. Token caches
  // are keyed by it; GPT-2's files keep the checksum they always had.
  uint64_t checksum() const { return checksum_; }

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);

  // Normalizes, pre-tokenizes and BPE-encodes text (no added tokens).
  void EncodeText(std::string_view text, std::vector<int32_t>* out) const;
  // Pre-tokenizer step `step` onwards over `text`, then BPE per piece.
  void PreTokenizeAndEncode(size_t step, std::string_view text, std::vector<int32_t>* out) const;
  // Appends the BPE ids of one pre-tokenized piece.
  void EncodePiece(std::string_view piece, std::vector<int32_t>* out) const;

  std::unique_ptr<Impl> impl_;
  int32_t eot_id_ = -1;
  int32_t num_merges_ = 0;
  uint64_t checksum_ = 0;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_TOKENIZER_H_
