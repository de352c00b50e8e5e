#include "tests/testing/ports.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
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

namespace {

// The kernel's range for port-0 binds (ip_local_port_range), or {} when it
// cannot be read.
std::pair<int, int> EphemeralRange() {
  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  int lo = 0, hi = 0;
  if (f >> lo >> hi && lo > 0 && hi >= lo) return {lo, hi};
  return {0, 0};
}

bool BindsOnLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

}  // namespace

int UniqueLoopbackPort() {
  static absl::Mutex mu(absl::kConstInit);
  static std::set<int>* handed_out = new std::set<int>();
  absl::MutexLock l(&mu);
  // Below the ephemeral range: a server another process binds on port 0 (a
  // daemon's state server, a gRPC client's socket) never takes it between
  // this check and the bind it is meant for.
  const auto [lo, hi] = EphemeralRange();
  const int first = 10000, last = lo - 1;
  if (lo > 0 && last - first >= 1000) {
    static std::mt19937* rng = new std::mt19937(static_cast<uint32_t>(getpid()) * 2654435761u ^
                                                static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
    std::uniform_int_distribution<int> pick(first, last);
    for (int tries = 0; tries < 10000; ++tries) {
      const int port = pick(*rng);
      if (!handed_out->count(port) && BindsOnLoopback(port)) {
        handed_out->insert(port);
        return port;
      }
    }
  }
  while (true) {  // no room below the range: a port the kernel picks
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
