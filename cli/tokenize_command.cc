// `aqswarm tokenize`: text -> token ids (and back) with the tokenizer a job
// names (pipeline/tokenizer.h): a Hugging Face tokenizer.json, a directory
// holding one, or a directory with GPT-2's encoder.json + vocab.bpe.
//
//   echo 'Hello, world!' | aqswarm tokenize --tokenizer data/llama3
//   [9906,11,1917,0]
//   echo '[9906,11,1917,0]' | aqswarm tokenize --tokenizer data/llama3 --decode
//   Hello, world!
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "cli/command.h"
#include "nlohmann/json.hpp"
#include "pipeline/tokenizer.h"

ABSL_FLAG(std::string, tokenizer, "",
          "Tokenizer: a Hugging Face tokenizer.json, a directory holding one, or a directory with GPT-2's "
          "encoder.json + vocab.bpe (e.g. data/llama3, data/qwen3, data/gpt2).");
ABSL_FLAG(bool, decode, false, "Read one JSON array of ids per line and print the text they stand for.");
ABSL_FLAG(bool, jsonl, false,
          "Texts are JSON: when encoding, each input line is a JSON string or an object with a \"text\" "
          "field (so a text can hold newlines); when decoding, each text is printed as a JSON string.");
ABSL_FLAG(bool, added_tokens, false,
          "Encode added tokens written in the text (\"<|endoftext|>\", \"<|begin_of_text|>\", ...) as their "
          "ids, as transformers.js's encode(text, {add_special_tokens: false}) does. Default: they are "
          "ordinary text.");
ABSL_FLAG(bool, stats, false,
          "At the end, print texts, bytes, tokens and the encoding time and rate (tokens/second, encoding "
          "alone: no loading, parsing or printing) to stderr (scripts/bench_tokenizer.sh).");

namespace aqswarm::cli {
namespace {

int Fail(int64_t line_no, const std::string& message) {
  std::cerr << "aqswarm tokenize: stdin line " << line_no << ": " << message << "\n";
  return 1;
}

int RunTokenize(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::cerr << "aqswarm tokenize: unexpected argument " << args[0] << " (texts are read from stdin)\n";
    return 2;
  }
  const std::string path = absl::GetFlag(FLAGS_tokenizer);
  if (path.empty()) {
    std::cerr << "aqswarm tokenize: --tokenizer is required\n";
    return 2;
  }
  absl::StatusOr<std::unique_ptr<pipeline::Tokenizer>> tok = pipeline::Tokenizer::Open(path);
  if (!tok.ok()) {
    std::cerr << "aqswarm tokenize: " << tok.status().message() << "\n";
    return 1;
  }
  const bool decode = absl::GetFlag(FLAGS_decode);
  const bool json = absl::GetFlag(FLAGS_jsonl);
  const bool added = absl::GetFlag(FLAGS_added_tokens);
  const bool stats = absl::GetFlag(FLAGS_stats);
  int64_t total_bytes = 0, total_tokens = 0;
  std::chrono::steady_clock::duration encode_time{};

  std::ios::sync_with_stdio(false);
  std::string line, out;
  std::vector<int32_t> ids;
  int64_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    out.clear();
    if (decode) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.is_array()) return Fail(line_no, "expected a JSON array of token ids");
      ids.clear();
      for (const nlohmann::json& id : j) {
        if (!id.is_number_integer()) return Fail(line_no, absl::StrCat("not a token id: ", id.dump()));
        ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
      const std::string text = (*tok)->Decode(ids);
      out = json ? nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) : text;
    } else {
      std::string text = line;
      if (json) {
        const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_string()) {
          text = j.get<std::string>();
        } else if (j.is_object() && j.contains("text") && j["text"].is_string()) {
          text = j["text"].get<std::string>();
        } else {
          return Fail(line_no, "with --jsonl, expected a JSON string or an object with a \"text\" string");
        }
      }
      const auto start = std::chrono::steady_clock::now();
      ids = added ? (*tok)->EncodeWithAddedTokens(text) : (*tok)->Encode(text);
      encode_time += std::chrono::steady_clock::now() - start;
      total_bytes += static_cast<int64_t>(text.size());
      total_tokens += static_cast<int64_t>(ids.size());
      out.push_back('[');
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i > 0) out.push_back(',');
        absl::StrAppend(&out, ids[i]);
      }
      out.push_back(']');
    }
    out.push_back('\n');
    std::cout << out;
  }
  std::cout.flush();
  if (!std::cout) {
    std::cerr << "aqswarm tokenize: cannot write to stdout\n";
    return 1;
  }
  if (stats && !decode) {
    const double seconds = std::chrono::duration<double>(encode_time).count();
    std::cerr << "texts=" << line_no << " bytes=" << total_bytes << " tokens=" << total_tokens
              << " seconds=" << seconds << " tokens_per_second="
              << static_cast<int64_t>(seconds > 0 ? static_cast<double>(total_tokens) / seconds : 0) << "\n";
  }
  return 0;
}

}  // namespace

std::vector<Command> TokenizeCommands() {
  return {{"tokenize",
           "Print the token ids of each stdin line as a JSON array (--decode: the reverse).",
           "Each input line is one text; its trailing newline is not part of it (a \\r before it is). No\n"
           "BOS/EOS is added, and added tokens such as <|endoftext|> written in the text are ordinary text\n"
           "unless --added_tokens. With --jsonl, input lines are JSON strings (or {\"text\": ...} objects,\n"
           "e.g. a .jsonl corpus), so texts can hold newlines.",
           {"tokenizer", "decode", "jsonl", "added_tokens", "stats"},
           RunTokenize}};
}

}  // namespace aqswarm::cli
