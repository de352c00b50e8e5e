#include "pipeline/dataset.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/status_macros.h"
#include "pipeline/token_shards.h"

namespace aqswarm::pipeline {
namespace {

DataSource WithDefaults(DataSource s) {
  if (s.corpus.empty()) s.corpus = "data/sotu";
  if (s.tokenizer.empty()) s.tokenizer = "data/gpt2";
  if (s.text_field.empty()) s.text_field = "text";
  if (s.cache_dir.empty()) {
    s.cache_dir = (std::filesystem::path(s.corpus).lexically_normal().parent_path() / "cache").string();
  }
  return s;
}

CorpusOptions CorpusOptionsFor(const DataSource& s) {
  CorpusOptions o;
  o.source_path = s.corpus;
  o.text_field = s.text_field;
  o.cache_dir = s.cache_dir;
  return o;
}

}  // namespace

absl::StatusOr<OpenedData> OpenData(const DataSource& given) {
  const DataSource s = WithDefaults(given);
  OpenedData d;
  AQSWARM_ASSIGN_OR_RETURN(d.tokenizer, Tokenizer::Open(s.tokenizer));
  AQSWARM_ASSIGN_OR_RETURN(d.corpus, TokenCorpus::Open(CorpusOptionsFor(s), *d.tokenizer));
  d.identity = {HashHex(d.corpus->source_checksum()), HashHex(d.tokenizer->checksum())};
  return d;
}

absl::StatusOr<DataIdentity> IdentifyData(const DataSource& given) {
  const DataSource s = WithDefaults(given);
  AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Open(s.tokenizer));
  const std::string tokenizer_hash = HashHex(tokenizer->checksum());
  if (IsPreparedDataset(s.corpus)) {
    std::string bytes;
    AQSWARM_ASSIGN_OR_RETURN(ShardManifest m, ReadShardManifest(s.corpus, &bytes));
    if (m.tokenizer_hash != tokenizer_hash) {
      return absl::FailedPreconditionError(
          absl::StrCat("prepared dataset ", s.corpus, " was tokenized by tokenizer ", m.tokenizer_hash, ", not by ",
                       s.tokenizer, " (", tokenizer_hash, ")"));
    }
    return DataIdentity{HashHex(Checksum64(bytes.data(), bytes.size())), tokenizer_hash};
  }
  // A text source: one read of its files (parsing .jsonl lines, so a bad
  // line fails here as it would in training), no tokenizing.
  AQSWARM_ASSIGN_OR_RETURN(uint64_t checksum, TextSourceChecksum(s.corpus, s.text_field));
  return DataIdentity{HashHex(checksum), tokenizer_hash};
}

}  // namespace aqswarm::pipeline
