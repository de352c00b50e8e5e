// The identity of a job's training data: a hash of the dataset and one of the
// tokenizer (16 lowercase hex digits each, as `aqswarm data identify` prints
// them). AQ-SGD keeps state per sample id, so every peer of a swarm must read
// the same token stream: the coordinator refuses a peer whose hashes differ
// from the job's (DataSpec.dataset_hash / tokenizer_hash, or the first
// admitted peer's when the job names none).
//
//   DataIdentity want{"3f2a...", "9c01..."}, have = ...;
//   AQSWARM_RETURN_IF_ERROR(CheckDataIdentity(want, have, "peer 'p3'"));
#ifndef AQSWARM_COMMON_DATA_IDENTITY_H_
#define AQSWARM_COMMON_DATA_IDENTITY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace aqswarm {

struct DataIdentity {
  std::string dataset_hash;
  std::string tokenizer_hash;

  bool empty() const { return dataset_hash.empty() && tokenizer_hash.empty(); }
  bool operator==(const DataIdentity& o) const {
    return dataset_hash == o.dataset_hash && tokenizer_hash == o.tokenizer_hash;
  }
};

// A 64-bit hash as 16 lowercase hex digits.
std::string HashHex(uint64_t hash);

// OK for "" or 16 lowercase hex digits; InvalidArgument naming `field` otherwise.
absl::Status ValidateHashHex(absl::string_view hash, absl::string_view field);

// OK when `have` matches `want` in every hash `want` names (an empty hash in
// `want` matches anything). Otherwise FailedPrecondition naming each hash
// that differs, e.g. "peer 'p3': its dataset hash 0123... differs from the
// job's 4567... (its copy of the data is not the swarm's)".
absl::Status CheckDataIdentity(const DataIdentity& want, const DataIdentity& have, absl::string_view who);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_DATA_IDENTITY_H_
