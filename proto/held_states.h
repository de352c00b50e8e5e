// The held states of a v1::StageCheckpoints as {step, sha256} records,
// whichever form it came in: `states`, or the parallel lists peers and
// coordinator state dirs wrote before (legacy_steps, legacy_sha256).
#ifndef AQSWARM_PROTO_HELD_STATES_H_
#define AQSWARM_PROTO_HELD_STATES_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "proto/coordinator.pb.h"

namespace aqswarm::v1 {

// INVALID_ARGUMENT when both forms are set or the legacy lists differ in
// length (hashes may be absent: each "").
inline absl::StatusOr<std::vector<HeldState>> HeldStatesOf(const StageCheckpoints& c) {
  if (c.legacy_steps_size() == 0 && c.legacy_sha256_size() == 0) {
    return std::vector<HeldState>(c.states().begin(), c.states().end());
  }
  if (c.states_size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat("held: stage ", c.stage(), " lists its states twice"));
  }
  if (c.legacy_sha256_size() != 0 && c.legacy_sha256_size() != c.legacy_steps_size()) {
    return absl::InvalidArgumentError(absl::StrCat("held: stage ", c.stage(), " lists ", c.legacy_steps_size(),
                                                   " steps but ", c.legacy_sha256_size(), " sha256"));
  }
  std::vector<HeldState> out(c.legacy_steps_size());
  for (int i = 0; i < c.legacy_steps_size(); ++i) {
    out[i].set_step(c.legacy_steps(i));
    if (c.legacy_sha256_size() > 0) out[i].set_sha256(c.legacy_sha256(i));
  }
  return out;
}

}  // namespace aqswarm::v1

#endif  // AQSWARM_PROTO_HELD_STATES_H_
