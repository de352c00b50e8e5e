#include "common/ports.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <random>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace aqswarm {
namespace {

// The kernel's range for port-0 binds, or {0, 0} when it cannot be read.
std::pair<int, int> EphemeralRange() {
  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  int lo = 0, hi = 0;
  if (f >> lo >> hi && lo > 0 && hi >= lo) return {lo, hi};
  return {0, 0};
}

// Binds 127.0.0.1:port (0: any) and returns the port bound, or 0.
int BindLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  int bound = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    socklen_t len = sizeof(a);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) bound = ntohs(a.sin_port);
  }
  close(fd);
  return bound;
}

}  // namespace

int FreeLoopbackPort(const std::set<int>& avoid) {
  static absl::Mutex mu(absl::kConstInit);
  static std::mt19937* rng = nullptr;
  const int first = 10000, last = EphemeralRange().first - 1;
  if (last - first >= 1000) {
    absl::MutexLock l(&mu);
    if (rng == nullptr) {
      rng = new std::mt19937(static_cast<uint32_t>(getpid()) * 2654435761u ^
                             static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
    }
    std::uniform_int_distribution<int> pick(first, last);
    for (int tries = 0; tries < 10000; ++tries) {
      const int port = pick(*rng);
      if (!avoid.count(port) && BindLoopback(port) == port) return port;
    }
  }
  while (true) {
    const int port = BindLoopback(0);
    if (port > 0 && !avoid.count(port)) return port;
  }
}

}  // namespace aqswarm
