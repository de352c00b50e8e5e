#include "tests/testing/ports.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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
  while (true) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    close(fd);
    const int port = ntohs(a.sin_port);
    if (port > 0 && handed_out->insert(port).second) return port;
  }
}

}  // namespace aqswarm::testing
