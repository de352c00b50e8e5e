// Fixed loopback ports for local swarms (tests and `aqswarm bench churn`):
// a peer daemon's --listen and --exchange_listen cannot be 0, since its
// stage child binds them again on every restart.
#ifndef AQSWARM_COMMON_PORTS_H_
#define AQSWARM_COMMON_PORTS_H_

#include <set>

namespace aqswarm {

// A loopback port that binds right now and is not in `avoid`. Below the
// kernel's ephemeral range (ip_local_port_range) when there is room, so a
// server some other process binds on port 0 never takes it before the bind
// it is meant for; picked at random there, so concurrent callers rarely
// meet. Else a port the kernel hands out.
int FreeLoopbackPort(const std::set<int>& avoid);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_PORTS_H_
