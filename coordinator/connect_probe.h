// Whether a peer's process is gone: a TCP connect to a port it serves that
// the peer's host answers with a reset (ECONNREFUSED). The coordinator asks
// this of a peer whose neighbour reported their link lost
// (SwarmCoordinator::RemoveRefusingSuspects), to replace a killed peer
// without waiting out its lease. Anything else (a connect that succeeds,
// times out or finds no route) proves nothing and answers false.
#ifndef AQSWARM_COORDINATOR_CONNECT_PROBE_H_
#define AQSWARM_COORDINATOR_CONNECT_PROBE_H_

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace aqswarm::coordinator {

// `address`: HOST:PORT (hostname, dotted IPv4 or [IPv6]). True only when
// every address HOST resolves to refused the connection within `timeout`.
bool ConnectRefused(absl::string_view address, absl::Duration timeout);

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_CONNECT_PROBE_H_
