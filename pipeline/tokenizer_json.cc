// Hugging Face tokenizer.json (byte-level BPE) -> Tokenizer::Impl, following
// transformers.js (@lenml/tokenizers 3.7.2, src/tokenizers/tokenizers.js),
// whose ids tests/data/tokenizer/ holds. The encoding itself is shared with
// GPT-2's files (tokenizer.cc).
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "nlohmann/json.hpp"
#include "pipeline/tokenizer.h"
#include "pipeline/tokenizer_internal.h"

namespace aqswarm::pipeline {
namespace tokenizer_internal {
namespace {

// Length of the valid UTF-8 character at text[i], 0 if invalid (overlong
// forms, surrogates and code points above U+10FFFF are invalid).
size_t ValidUtf8CharLength(std::string_view text, size_t i) {
  const auto c = static_cast<uint8_t>(text[i]);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp, min;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, cp = c & 0x1F, min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3, cp = c & 0x0F, min = 0x800;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, cp = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    const auto cc = static_cast<uint8_t>(text[i + k]);
    if ((cc & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (cc & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

const icu::Normalizer2* IcuNormalizer(NormalizationForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (form) {
    case NormalizationForm::kNfc: n = icu::Normalizer2::getNFCInstance(status); break;
    case NormalizationForm::kNfd: n = icu::Normalizer2::getNFDInstance(status); break;
    case NormalizationForm::kNfkc: n = icu::Normalizer2::getNFKCInstance(status); break;
    case NormalizationForm::kNfkd: n = icu::Normalizer2::getNFKDInstance(status); break;
  }
  return U_SUCCESS(status) ? n : nullptr;
}

}  // namespace

void NormalizeUnicode(NormalizationForm form, std::string_view text, std::string* out) {
  out->clear();
  const icu::Normalizer2* normalizer = IcuNormalizer(form);
  if (normalizer == nullptr) {  // ICU data missing: cannot happen with libicu
    out->assign(text);
    return;
  }
  icu::StringByteSink<std::string> sink(out);
  size_t i = 0;
  while (i < text.size()) {
    // A maximal run of valid UTF-8 is normalized; an invalid byte is kept.
    size_t end = i, len;
    while (end < text.size() && (len = ValidUtf8CharLength(text, end)) > 0) end += len;
    if (end > i) {
      const icu::StringPiece run(text.data() + i, static_cast<int32_t>(end - i));
      UErrorCode status = U_ZERO_ERROR;
      if (normalizer->isNormalizedUTF8(run, status) && U_SUCCESS(status)) {
        out->append(text.data() + i, end - i);
      } else {
        status = U_ZERO_ERROR;
        const size_t before = out->size();
        normalizer->normalizeUTF8(0, run, sink, nullptr, status);
        if (U_FAILURE(status)) {
          out->resize(before);
          out->append(text.data() + i, end - i);
        }
      }
      i = end;
    } else {
      out->push_back(text[i++]);
    }
  }
}

}  // namespace tokenizer_internal

namespace {

using nlohmann::json;
using tokenizer_internal::CompileRegex;

// JavaScript's \s (ECMAScript WhiteSpace + LineTerminator), as a class body.
constexpr char kJsWhitespace[] =
    R"(\t\n\x{0B}\f\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF})";

// transformers.js's ByteLevel pre-tokenizer pattern (use_regex).
constexpr char kByteLevelPattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Rewrites a tokenizer.json regex the way transformers.js builds its
// RegExp(pattern, "gu"), into a PCRE2 pattern with the same meaning:
// its two textual fixes (escaped #&~ unescaped; the case-insensitive
// contraction group, which JavaScript cannot parse, spelled with ASCII case
// classes), then JavaScript's meaning of \s \S \d \D \w \W and `.`, and
// \uXXXX / \u{X} escapes.
absl::StatusOr<std::string> JsRegexToPcre(const std::string& js) {
  std::string pattern;
  for (size_t i = 0; i < js.size(); ++i) {
    if (js[i] == '\\' && i + 1 < js.size() && (js[i + 1] == '#' || js[i + 1] == '&' || js[i + 1] == '~')) {
      continue;  // drop the backslash, keep the character
    }
    pattern.push_back(js[i]);
  }
  const std::string kCaseInsensitive = "(?i:'s|'t|'re|'ve|'m|'ll|'d)";
  const std::string kAsciiCase = "(?:'([sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))";
  for (size_t at = pattern.find(kCaseInsensitive); at != std::string::npos;
       at = pattern.find(kCaseInsensitive, at + kAsciiCase.size())) {
    pattern.replace(at, kCaseInsensitive.size(), kAsciiCase);
  }

  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      auto negated_in_class = [&]() {
        return absl::UnimplementedError(absl::StrCat("regex /", js, "/: \\", std::string(1, e),
                                                     " inside a character class is not supported"));
      };
      switch (e) {
        case 's': out += in_class ? std::string(kJsWhitespace) : absl::StrCat("[", kJsWhitespace, "]"); break;
        case 'S':
          if (in_class) return negated_in_class();
          out += absl::StrCat("[^", kJsWhitespace, "]");
          break;
        case 'd': out += in_class ? "0-9" : "[0-9]"; break;
        case 'D':
          if (in_class) return negated_in_class();
          out += "[^0-9]";
          break;
        case 'w': out += in_class ? "A-Za-z0-9_" : "[A-Za-z0-9_]"; break;
        case 'W':
          if (in_class) return negated_in_class();
          out += "[^A-Za-z0-9_]";
          break;
        case 'u':
          if (i + 1 < pattern.size() && pattern[i + 1] == '{') {
            const size_t close = pattern.find('}', i + 1);
            if (close == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("regex /", js, "/: unterminated \\u{"));
            out += absl::StrCat("\\x{", pattern.substr(i + 2, close - i - 2), "}");
            i = close;
          } else if (i + 4 < pattern.size()) {
            out += absl::StrCat("\\x{", pattern.substr(i + 1, 4), "}");
            i += 4;
          } else {
            return absl::InvalidArgumentError(absl::StrCat("regex /", js, "/: short \\u escape"));
          }
          break;
        default:
          out.push_back('\\');
          out.push_back(e);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      continue;
    }
    if (in_class && c == ']') in_class = false;
    if (!in_class && c == '.') {
      out += R"([^\n\r\x{2028}\x{2029}])";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

// Escapes a literal string (Split's {"String": ...}) for PCRE2.
std::string QuoteRegex(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}/").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

std::string TypeOf(const json& j) {
  if (j.is_object() && j.contains("type") && j["type"].is_string()) return j["type"].get<std::string>();
  return "";
}

absl::Status AddNormalizer(const json& j, const std::string& path,
                           std::vector<NormalizationForm>* out, std::string* describe) {
  if (j.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(j);
  if (type == "Sequence" && j.contains("normalizers") && j["normalizers"].is_array()) {
    for (const json& n : j["normalizers"]) {
      absl::Status status = AddNormalizer(n, path, out, describe);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }
  static const std::pair<const char*, NormalizationForm> kForms[] = {
      {"NFC", NormalizationForm::kNfc},
      {"NFD", NormalizationForm::kNfd},
      {"NFKC", NormalizationForm::kNfkc},
      {"NFKD", NormalizationForm::kNfkd}};
  for (const auto& [name, form] : kForms) {
    if (type == name) {
      out->push_back(form);
      absl::StrAppend(describe, "normalizer ", name, ";");
      return absl::OkStatus();
    }
  }
  return absl::UnimplementedError(absl::StrCat(
      "tokenizer ", path, ": normalizer '", type.empty() ? j.dump() : type,
      "' is not supported (supported: NFC, NFD, NFKC, NFKD and a Sequence of them)"));
}

absl::Status AddSplit(const std::string& pcre, bool gap_is_one_piece, const std::string& path,
                      const std::string& what, std::vector<PreTokenizeStep>* steps) {
  absl::StatusOr<pcre2_code*> regex = CompileRegex(pcre, absl::StrCat("tokenizer ", path, ": ", what));
  if (!regex.ok()) return regex.status();
  PreTokenizeStep step;
  step.kind = PreTokenizeStep::Kind::kSplit;
  step.regex = *regex;
  step.gap_is_one_piece = gap_is_one_piece;
  step.describe = absl::StrCat("split /", pcre, "/;");
  steps->push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status AddPreTokenizer(const json& j, const std::string& path,
                             std::vector<PreTokenizeStep>* steps, bool* byte_level) {
  const std::string type = TypeOf(j);
  if (type == "Sequence" && j.contains("pretokenizers") && j["pretokenizers"].is_array()) {
    for (const json& p : j["pretokenizers"]) {
      absl::Status status = AddPreTokenizer(p, path, steps, byte_level);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }
  if (type == "Split") {
    const json& pattern = j.value("pattern", json());
    const std::string behavior = j.value("behavior", std::string("Isolated"));
    if (behavior != "Isolated") {
      return absl::UnimplementedError(absl::StrCat("tokenizer ", path, ": Split behavior '", behavior,
                                                   "' is not supported (only Isolated)"));
    }
    std::string pcre;
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      absl::StatusOr<std::string> translated = JsRegexToPcre(pattern["Regex"].get<std::string>());
      if (!translated.ok()) {
        return absl::Status(translated.status().code(),
                            absl::StrCat("tokenizer ", path, ": ", translated.status().message()));
      }
      pcre = *translated;
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      pcre = QuoteRegex(pattern["String"].get<std::string>());
    } else {
      return absl::DataLossError(absl::StrCat("tokenizer ", path,
                                              ": Split pre-tokenizer without a Regex or String pattern"));
    }
    // invert (keep only the matches) differs from Isolated only in text no
    // match covers, which Encode keeps either way (never drops text).
    return AddSplit(pcre, /*gap_is_one_piece=*/true, path, "Split pattern", steps);
  }
  if (type == "ByteLevel") {
    *byte_level = true;
    if (j.value("add_prefix_space", false)) {
      PreTokenizeStep step;
      step.kind = PreTokenizeStep::Kind::kPrefixSpace;
      step.describe = "prefix space;";
      steps->push_back(std::move(step));
    }
    if (j.value("use_regex", true)) {
      absl::StatusOr<std::string> pcre = JsRegexToPcre(kByteLevelPattern);
      if (!pcre.ok()) return pcre.status();
      return AddSplit(*pcre, true, path, "ByteLevel pattern", steps);
    }
    return absl::OkStatus();
  }
  if (type == "Digits") {
    const bool individual = j.value("individual_digits", false);
    return AddSplit(individual ? "[^0-9]+|[0-9]" : "[^0-9]+|[0-9]+", true, path, "Digits pattern", steps);
  }
  return absl::UnimplementedError(absl::StrCat(
      "tokenizer ", path, ": pre-tokenizer '", type.empty() ? j.dump() : type,
      "' is not supported (supported: ByteLevel, Split with behavior Isolated, Digits, and a "
      "Sequence of them)"));
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open tokenizer file '", path,
                                            "' (run scripts/fetch_data.sh for data/llama3 and data/qwen3)"));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading '", path, "'"));
  return ss.str();
}

bool IsUnsetOrEmpty(const json& model, const char* key) {
  if (!model.contains(key) || model[key].is_null()) return true;
  return model[key].is_string() && model[key].get<std::string>().empty();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::LoadHuggingFace(
    const std::string& tokenizer_json_path) {
  const std::string& path = tokenizer_json_path;
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) return text.status();
  const json root = json::parse(*text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::DataLossError(absl::StrCat("tokenizer ", path, " is not a JSON object (not a tokenizer.json?)"));
  }

  // --- The model: byte-level BPE only.
  if (!root.contains("model") || !root["model"].is_object()) {
    return absl::DataLossError(absl::StrCat("tokenizer ", path, " has no \"model\" object"));
  }
  const json& model = root["model"];
  std::string type = TypeOf(model);
  if (type.empty() && model.contains("merges")) type = "BPE";  // older files omit it
  if (type != "BPE") {
    return absl::UnimplementedError(absl::StrCat(
        "tokenizer ", path, ": model type '", type.empty() ? "(none)" : type,
        "' is not supported (only byte-level BPE, as GPT-2, Llama-3 and Qwen use)"));
  }
  if (model.value("byte_fallback", false)) {
    return absl::UnimplementedError(absl::StrCat("tokenizer ", path,
                                                 ": BPE with byte_fallback (SentencePiece-style) is not supported"));
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!IsUnsetOrEmpty(model, key)) {
      return absl::UnimplementedError(absl::StrCat("tokenizer ", path, ": BPE with ", key, " is not supported"));
    }
  }
  if (model.contains("dropout") && model["dropout"].is_number() && model["dropout"].get<double>() != 0) {
    return absl::UnimplementedError(absl::StrCat("tokenizer ", path, ": BPE dropout is not supported"));
  }
  if (!model.contains("vocab") || !model["vocab"].is_object() || model["vocab"].empty()) {
    return absl::DataLossError(absl::StrCat("tokenizer ", path, ": missing model.vocab (token -> id object)"));
  }
  if (!model.contains("merges") || !model["merges"].is_array()) {
    return absl::DataLossError(absl::StrCat("tokenizer ", path, ": missing model.merges (array)"));
  }

  auto impl = std::make_unique<Impl>();
  std::string config;  // canonical description of everything but vocab/merges

  // --- Normalizer, pre-tokenizer, decoder.
  if (absl::Status s = AddNormalizer(root.value("normalizer", json()), path, &impl->normalizers, &config);
      !s.ok()) {
    return s;
  }
  bool byte_level = false;
  const json pre = root.value("pre_tokenizer", json());
  if (!pre.is_null()) {
    if (absl::Status s = AddPreTokenizer(pre, path, &impl->steps, &byte_level); !s.ok()) return s;
  }
  if (!byte_level) {
    return absl::UnimplementedError(absl::StrCat(
        "tokenizer ", path, ": BPE without a ByteLevel pre-tokenizer (not byte-level BPE) is not supported"));
  }
  for (const PreTokenizeStep& step : impl->steps) config += step.describe;
  const json decoder = root.value("decoder", json());
  if (!decoder.is_null() && TypeOf(decoder) != "ByteLevel") {
    return absl::UnimplementedError(absl::StrCat("tokenizer ", path, ": decoder '",
                                                 TypeOf(decoder).empty() ? decoder.dump() : TypeOf(decoder),
                                                 "' is not supported (only ByteLevel)"));
  }
  impl->ignore_merges = model.value("ignore_merges", false);
  if (impl->ignore_merges) config += "ignore_merges;";

  // --- Vocabulary: byte-level token strings -> ids, then added tokens (which
  // win on a clash, as in transformers.js).
  constexpr int64_t kMaxId = (int64_t{1} << 24) - 1;
  absl::flat_hash_map<std::string, int32_t> token_to_id;
  token_to_id.reserve(model["vocab"].size() + 512);
  int32_t max_id = -1;
  for (const auto& [token, value] : model["vocab"].items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > kMaxId) {
      return absl::DataLossError(absl::StrCat("tokenizer ", path, ": model.vocab token '", token,
                                              "' has no valid id (an integer in 0..", kMaxId, ")"));
    }
    const auto id = static_cast<int32_t>(value.get<int64_t>());
    token_to_id[token] = id;
    max_id = std::max(max_id, id);
  }
  const json added = root.value("added_tokens", json::array());
  if (!added.is_array()) {
    return absl::DataLossError(absl::StrCat("tokenizer ", path, ": added_tokens is not an array"));
  }
  for (const json& a : added) {
    if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
        !a["content"].is_string() || a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() > kMaxId ||
        a["content"].get<std::string>().empty()) {
      return absl::DataLossError(absl::StrCat("tokenizer ", path, ": bad added_tokens entry ", a.dump(),
                                              " (needs a non-empty content and an id)"));
    }
    Impl::AddedToken token{a["content"].get<std::string>(), static_cast<int32_t>(a["id"].get<int64_t>()),
                           a.value("lstrip", false), a.value("rstrip", false)};
    token_to_id[token.content] = token.id;
    max_id = std::max(max_id, token.id);
    absl::StrAppend(&config, "added ", token.id, " ", token.content.size(), ":", token.content, " ",
                    token.lstrip, token.rstrip, ";");
    impl->added_tokens.push_back(std::move(token));
  }

  const std::vector<uint32_t> byte_cp = tokenizer_internal::ByteToCodePoint();
  absl::flat_hash_map<uint32_t, uint8_t> cp_to_byte;
  for (int b = 0; b < 256; ++b) cp_to_byte[byte_cp[b]] = static_cast<uint8_t>(b);

  const size_t n = static_cast<size_t>(max_id) + 1;
  impl->id_to_bytes.assign(n, std::string());
  impl->id_valid.assign(n, false);
  std::vector<bool> is_added(n, false);
  for (const Impl::AddedToken& token : impl->added_tokens) {
    impl->id_to_bytes[token.id] = token.content;  // decodes to its text
    impl->id_valid[token.id] = true;
    is_added[token.id] = true;
  }
  std::string bytes;
  for (const auto& [token, id] : token_to_id) {
    if (is_added[id]) {
      // Byte-level text of an added token: what a piece must look like to be
      // it under ignore_merges (transformers.js looks pieces up in one map).
      if (impl->ignore_merges && tokenizer_internal::TokenToBytes(token, cp_to_byte, &bytes)) {
        impl->piece_to_id.try_emplace(bytes, id);
      }
      continue;
    }
    if (!tokenizer_internal::TokenToBytes(token, cp_to_byte, &bytes)) {
      return absl::DataLossError(absl::StrCat("tokenizer ", path, ": model.vocab token '", token, "' (id ", id,
                                              ") is not byte-level BPE text"));
    }
    if (impl->id_valid[id]) {
      return absl::DataLossError(absl::StrCat("tokenizer ", path, ": id ", id, " appears twice in model.vocab"));
    }
    impl->id_to_bytes[id] = bytes;
    impl->id_valid[id] = true;
    if (impl->ignore_merges) impl->piece_to_id.try_emplace(bytes, id);
  }
  for (int b = 0; b < 256; ++b) {
    std::string single;
    tokenizer_internal::AppendUtf8(byte_cp[b], &single);
    auto it = token_to_id.find(single);
    if (it == token_to_id.end()) {
      return absl::DataLossError(absl::StrCat("tokenizer ", path, ": model.vocab lacks the byte-level token for byte ",
                                              b, " (not a byte-level BPE vocabulary)"));
    }
    impl->byte_to_id[b] = it->second;
  }

  // --- Merges, by rank; a repeated pair takes its last rank (as a JavaScript
  // Map and Rust's HashMap built from the list do).
  const json& merges = model["merges"];
  std::vector<std::pair<int32_t, int32_t>> merge_pairs;
  merge_pairs.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        return absl::DataLossError(absl::StrCat("tokenizer ", path, ": merge ", rank, " '", s,
                                                "' is not two tokens separated by one space"));
      }
      left = s.substr(0, sp), right = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>(), right = m[1].get<std::string>();
    } else {
      return absl::DataLossError(absl::StrCat("tokenizer ", path, ": merge ", rank, " ", m.dump(),
                                              " is neither \"a b\" nor [\"a\", \"b\"]"));
    }
    const std::string merged = left + right;
    for (const std::string* t : std::initializer_list<const std::string*>{&left, &right, &merged}) {
      if (!token_to_id.contains(*t)) {
        return absl::DataLossError(absl::StrCat("tokenizer ", path, ": merge ", rank, " ", m.dump(),
                                                " names a token model.vocab lacks: '", *t, "'"));
      }
    }
    const int32_t l = token_to_id[left], r = token_to_id[right];
    impl->merges.insert_or_assign(tokenizer_internal::PairKey(l, r),
                                  Impl::Merge{static_cast<int32_t>(rank), token_to_id[merged]});
    merge_pairs.emplace_back(l, r);
  }

  // --- Added tokens, longest first, for EncodeWithAddedTokens.
  std::stable_sort(impl->added_tokens.begin(), impl->added_tokens.end(),
                   [](const Impl::AddedToken& a, const Impl::AddedToken& b) {
                     return a.content.size() > b.content.size();
                   });
  for (const Impl::AddedToken& token : impl->added_tokens) {
    impl->added_first_byte[static_cast<uint8_t>(token.content[0])] = true;
  }

  // --- The document separator (see eot_id() in the header).
  int32_t eot_id = -1;
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>"}) {
    auto it = token_to_id.find(name);
    if (it != token_to_id.end()) {
      eot_id = it->second;
      break;
    }
  }
  if (eot_id < 0) {
    const std::filesystem::path config_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
    std::ifstream in(config_path);
    if (in) {
      const json tc = json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (tc.is_object() && tc.contains("eos_token")) {
        const json& eos = tc["eos_token"];
        std::string name = eos.is_string() ? eos.get<std::string>()
                           : (eos.is_object() && eos.contains("content") && eos["content"].is_string())
                               ? eos["content"].get<std::string>()
                               : std::string();
        auto it = token_to_id.find(name);
        if (it != token_to_id.end()) eot_id = it->second;
      }
    }
  }

  // --- Identity: the GPT-2 files' canonical vocabulary + merges, then
  // everything else that decides ids.
  Checksummer sum(/*seed=*/0x61717377746f6bull);  // "aqswtok"
  for (size_t id = 0; id < n; ++id) {
    const uint32_t len = impl->id_valid[id] ? static_cast<uint32_t>(impl->id_to_bytes[id].size()) : 0xFFFFFFFFu;
    sum.Update(&len, sizeof(len));
    sum.Update(impl->id_to_bytes[id].data(), impl->id_to_bytes[id].size());
  }
  for (const auto& [left, right] : merge_pairs) {
    const int32_t pair[2] = {left, right};
    sum.Update(pair, sizeof(pair));
  }
  const std::string tag = "tokenizer.json v1;";
  sum.Update(tag.data(), tag.size());
  sum.Update(config.data(), config.size());

  auto tokenizer = std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  tokenizer->eot_id_ = eot_id;
  tokenizer->num_merges_ = static_cast<int32_t>(merge_pairs.size());
  tokenizer->checksum_ = sum.Digest();
  return tokenizer;
}

}  // namespace aqswarm::pipeline
