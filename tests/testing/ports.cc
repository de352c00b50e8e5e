#include "tests/testing/ports.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/ports.h"
#include "proto/event_json.h"

namespace aqswarm::testing {

absl::StatusOr<int> ListeningPort(Subprocess& child, absl::Duration timeout) {
  std::string line;
  if (absl::Status s = child.ReadLine(&line, timeout); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("no listening line: ", s.message()));
  }
  if (absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line); e.ok() && e->has_listening()) {
    return static_cast<int>(e->listening().port());
  }
  if (absl::StatusOr<v1::CoordinatorEvent> e = events::ParseCoordinatorEvent(line); e.ok() && e->has_listening()) {
    return static_cast<int>(e->listening().port());
  }
  return absl::InvalidArgumentError(absl::StrCat("the first line is not a listening event: ", line));
}

int UniqueLoopbackPort() {
  static absl::Mutex mu(absl::kConstInit);
  static std::set<int>* handed_out = new std::set<int>();
  absl::MutexLock l(&mu);
  const int port = FreeLoopbackPort(*handed_out);
  handed_out->insert(port);
  return port;
}

}  // namespace aqswarm::testing
