// A job's data as one thing: the tokenizer, the token corpus and their
// identity (the hashes the swarm checks at join, common/data_identity.h).
// Stages, `aqswarm pipeline`, the peer daemon and `aqswarm data` open data
// only through here.
//
//   DataSource src{.corpus = "data/prepared/sotu-llama3", .tokenizer = "data/llama3"};
//   AQSWARM_ASSIGN_OR_RETURN(OpenedData data, OpenData(src));
//   // data.corpus->GatherBatch(...), data.identity.dataset_hash
//   AQSWARM_ASSIGN_OR_RETURN(DataIdentity id, IdentifyData(src));   // what a peer reports at join
//
// The dataset hash: a prepared dataset's is the XXH3 of its manifest.json
// (which lists every shard's XXH3 and the tokenizer's hash); a text source's
// is TokenCorpus::source_checksum() (file names without directories, their
// bytes, the .jsonl text field): the same on every machine holding the same
// files, wherever they are. The tokenizer hash is Tokenizer::checksum().
#ifndef AQSWARM_PIPELINE_DATASET_H_
#define AQSWARM_PIPELINE_DATASET_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/data_identity.h"
#include "pipeline/corpus.h"
#include "pipeline/tokenizer.h"

namespace aqswarm::pipeline {

// DataSpec's fields (proto/job.proto); empty means the default.
struct DataSource {
  std::string corpus;      // default: data/sotu
  std::string tokenizer;   // default: data/gpt2
  std::string text_field;  // default: text
  std::string cache_dir;   // default: <corpus>/../cache (text sources only)
};

struct OpenedData {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<TokenCorpus> corpus;  // corpus->train_tokens() >= 0: the data fixes
                                        // the split (SamplePlanOptions::train_tokens)
  DataIdentity identity;
};

// Loads the tokenizer and the corpus (tokenizing text or using its cache;
// mapping a prepared dataset's shards after checking them).
absl::StatusOr<OpenedData> OpenData(const DataSource& source);

// The identity alone: a prepared dataset's manifest is read and checked
// against the tokenizer without touching its shards; a text source is read
// (not tokenized).
absl::StatusOr<DataIdentity> IdentifyData(const DataSource& source);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_DATASET_H_
