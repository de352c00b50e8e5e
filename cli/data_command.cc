// `aqswarm data prepare` (pipeline/token_shards.h) and `aqswarm data identify`
// (pipeline/dataset.h): bring your own data.
#include <unistd.h>

#include <iostream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cli/command.h"
#include "common/data_identity.h"
#include "pipeline/dataset.h"
#include "pipeline/token_shards.h"

ABSL_DECLARE_FLAG(std::string, tokenizer);  // cli/tokenize_command.cc
ABSL_DECLARE_FLAG(std::string, out);        // cli/export_command.cc

ABSL_FLAG(std::vector<std::string>, input, {},
          "Inputs, comma-separated, read in this order: directories (their .txt and .jsonl files by name), globs "
          "(quote them), or .txt/.jsonl files.");
ABSL_FLAG(std::string, corpus, "", "What a job's data.corpus names: a directory, glob, file or prepared directory.");
ABSL_FLAG(std::string, text_field, "text", ".jsonl inputs: the string field holding each line's document.");
ABSL_FLAG(double, val_fraction, 0.0, "Documents (the last ones) held out for validation, in [0, 1).");
ABSL_FLAG(int32_t, threads, 0, "Tokenizing threads (0 = all cores). The output does not depend on it.");
ABSL_FLAG(int64_t, shard_tokens, 50'000'000, "Tokens per shard file.");

namespace aqswarm::cli {
namespace {

int Fail(const char* cmd, const absl::Status& s) {
  std::cerr << "aqswarm data " << cmd << ": " << s.message() << "\n";
  return 1;
}

int RunPrepare(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("prepare", absl::InvalidArgumentError("unexpected argument " + args[0]));
  if (absl::GetFlag(FLAGS_input).empty()) return Fail("prepare", absl::InvalidArgumentError("--input is required"));
  if (absl::GetFlag(FLAGS_out).empty()) return Fail("prepare", absl::InvalidArgumentError("--out is required"));
  if (absl::GetFlag(FLAGS_tokenizer).empty()) {
    return Fail("prepare", absl::InvalidArgumentError("--tokenizer is required"));
  }
  absl::StatusOr<std::unique_ptr<pipeline::Tokenizer>> tok = pipeline::Tokenizer::Open(absl::GetFlag(FLAGS_tokenizer));
  if (!tok.ok()) return Fail("prepare", tok.status());
  pipeline::PrepareOptions o;
  o.inputs = absl::GetFlag(FLAGS_input);
  o.text_field = absl::GetFlag(FLAGS_text_field);
  o.out_dir = absl::GetFlag(FLAGS_out);
  o.val_fraction = absl::GetFlag(FLAGS_val_fraction);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.shard_tokens = absl::GetFlag(FLAGS_shard_tokens);
  // A bar redrawn in place on a terminal; a line every 10 s otherwise.
  const bool tty = isatty(STDERR_FILENO) != 0;
  const absl::Time start = absl::Now();
  absl::Time last = start;
  o.progress = [&](int64_t docs, int64_t tokens, int64_t bytes) {
    const absl::Time now = absl::Now();
    if (!tty && now - last < absl::Seconds(10)) return;
    last = now;
    const double s = std::max(1e-3, absl::ToDoubleSeconds(now - start));
    std::cerr << absl::StrFormat(
        "%sprepare: %d documents, %d tokens, %.1f MB read (%.0f documents/s, %.0f tokens/s, %.1f MB/s)%s",
        tty ? "\r" : "", docs, tokens, bytes / 1e6, docs / s, tokens / s, bytes / 1e6 / s, tty ? "\x1b[K" : "\n");
  };
  absl::StatusOr<pipeline::ShardManifest> m = pipeline::PrepareShards(o, **tok);
  if (tty) std::cerr << "\n";
  if (!m.ok()) return Fail("prepare", m.status());
  absl::StatusOr<DataIdentity> id = pipeline::IdentifyData({o.out_dir, absl::GetFlag(FLAGS_tokenizer), "", ""});
  if (!id.ok()) return Fail("prepare", id.status());
  std::cout << absl::StrFormat(
      "aqswarm data prepare: %d documents, %d tokens (%d for training) in %d shard(s) of %s -> %s\n"
      "  \"data\": {\"corpus\": \"%s\", \"tokenizer\": \"%s\", \"datasetHash\": \"%s\", \"tokenizerHash\": \"%s\"}\n",
      m->documents, m->tokens, m->train_tokens, m->shards.size(), m->bytes_per_id == 2 ? "uint16" : "uint32",
      o.out_dir, o.out_dir, absl::GetFlag(FLAGS_tokenizer), id->dataset_hash, id->tokenizer_hash);
  return 0;
}

int RunIdentify(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail("identify", absl::InvalidArgumentError("unexpected argument " + args[0]));
  if (absl::GetFlag(FLAGS_corpus).empty()) return Fail("identify", absl::InvalidArgumentError("--corpus is required"));
  absl::StatusOr<DataIdentity> id = pipeline::IdentifyData(
      {absl::GetFlag(FLAGS_corpus), absl::GetFlag(FLAGS_tokenizer), absl::GetFlag(FLAGS_text_field), ""});
  if (!id.ok()) return Fail("identify", id.status());
  std::cout << absl::StrFormat("\"datasetHash\": \"%s\", \"tokenizerHash\": \"%s\"\n", id->dataset_hash,
                               id->tokenizer_hash);
  return 0;
}

}  // namespace

std::vector<Command> DataCommands() {
  return {
      {"data prepare",
       "Tokenize text (.txt, .jsonl) into memory-mapped token shards plus a manifest (docs/DATA.md).",
       "example: aqswarm data prepare --input data/sotu --tokenizer data/llama3 --out data/prepared/sotu-llama3 "
       "--val_fraction 0.05\n"
       "Prints the job's \"data\" fields for the result, with its hashes. Same inputs, same bytes out.",
       {"input", "tokenizer", "out", "text_field", "val_fraction", "threads", "shard_tokens"},
       RunPrepare},
      {"data identify",
       "Print the dataset and tokenizer hashes of a corpus (what the swarm checks at join).",
       "example: aqswarm data identify --corpus data/sotu --tokenizer data/gpt2\n"
       "Put them in the job as data.datasetHash / data.tokenizerHash to pin the data.",
       {"corpus", "tokenizer", "text_field"},
       RunIdentify},
  };
}

}  // namespace aqswarm::cli
