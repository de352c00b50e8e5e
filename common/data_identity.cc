#include "common/data_identity.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace aqswarm {

std::string HashHex(uint64_t hash) { return absl::StrFormat("%016x", hash); }

absl::Status ValidateHashHex(absl::string_view hash, absl::string_view field) {
  if (hash.empty()) return absl::OkStatus();
  bool ok = hash.size() == 16;
  for (char c : hash) ok = ok && (absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f'));
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be 16 lowercase hex digits (as `aqswarm data identify` prints), not '",
                     hash.substr(0, 40), hash.size() > 40 ? "..." : "", "'"));
  }
  return absl::OkStatus();
}

absl::Status CheckDataIdentity(const DataIdentity& want, const DataIdentity& have, absl::string_view who) {
  std::vector<std::string> diffs;
  auto check = [&](const std::string& w, const std::string& h, const char* what) {
    if (w.empty() || w == h) return;
    diffs.push_back(h.empty() ? absl::StrCat("it reports no ", what, " hash (the job's is ", w, ")")
                              : absl::StrCat("its ", what, " hash ", h, " differs from the job's ", w));
  };
  check(want.dataset_hash, have.dataset_hash, "dataset");
  check(want.tokenizer_hash, have.tokenizer_hash, "tokenizer");
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      who, ": ", absl::StrJoin(diffs, "; "),
      " -- its copy of the job's data.corpus / data.tokenizer is not the swarm's (`aqswarm data identify` "
      "prints the hashes of a local copy)"));
}

}  // namespace aqswarm
