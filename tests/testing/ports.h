// Ports in tests. A child process that binds a server reports the port it
// got on its first line (a listening event, proto/events.proto); tests start
// it on port 0 and read that line instead of guessing a free port first.
//
//   auto child = Subprocess::Spawn({kBinary, "coordinator", "--listen=127.0.0.1:0", ...});
//   ASSERT_OK_AND_ASSIGN(int port, ListeningPort(**child, absl::Seconds(60)));
//
// Only the fixed ports a peer daemon needs (its stage child binds them again
// on every restart, so they cannot be 0) come from UniqueLoopbackPort.
#ifndef AQSWARM_TESTS_TESTING_PORTS_H_
#define AQSWARM_TESTS_TESTING_PORTS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/subprocess.h"

namespace aqswarm::testing {

// Reads the child's next line, which must be a listening event of a stage
// ({"listening":{"port":N,...}}) or of the coordinator (the same key), and
// returns its port. Errors: no line within `timeout`, or another line
// (the line is in the message).
absl::StatusOr<int> ListeningPort(Subprocess& child, absl::Duration timeout);

// A loopback port that was free a moment ago and that no other call in this
// process returned (common/ports.h: below the ephemeral range).
int UniqueLoopbackPort();

}  // namespace aqswarm::testing

#endif  // AQSWARM_TESTS_TESTING_PORTS_H_
