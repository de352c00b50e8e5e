// User-space link shaping (the kernel here has no netem): what a slow link's
// bandwidth and latency would do to the frames one sender writes.
//
// EmulatedWire is one sending direction, a FIFO: a frame's bytes start when
// it was queued or when the previous frame's last byte left, whichever is
// later (the sender thread's wake-up and write latencies are not wire time),
// and take bytes * 8 / bandwidth_mbps (the rate the frame was queued under;
// <= 0: no time). Reserve() books the frame's wire time and returns when its
// last byte leaves (now, when unshaped or when the wire is behind);
// Transmit() also sleeps until then. The stage links Reserve (the receiver
// holds the frame until then: stage/link_transport.h); the gradient exchange
// Transmits. One per sender thread.
//
//   rpc::EmulatedWire wire(clock);                  // default: the real clock
//   const absl::Time done = wire.Reserve(frame_bytes, queued_at, 100.0);
#ifndef AQSWARM_RPC_LINK_SHAPING_H_
#define AQSWARM_RPC_LINK_SHAPING_H_

#include <cstddef>

#include "absl/time/time.h"
#include "rpc/clock.h"

namespace aqswarm::rpc {

struct ShapingOptions {
  // Link bandwidth in Mbit/s (10^6 bits); 0 = unshaped. Default: 0.
  double bandwidth_mbps = 0;
  // One-way latency in milliseconds. Default: 0.
  double latency_ms = 0;
  // The clock the emulated wire runs on: wire times, holds and latency are
  // read from it (tests: a FakeClock; timeouts stay on the real clock).
  // Not owned. Default: null, the real clock.
  const Clock* clock = nullptr;
  const Clock* clock_or_real() const { return clock != nullptr ? clock : RealClock::Get(); }
};

class EmulatedWire {
 public:
  explicit EmulatedWire(const Clock* clock = RealClock::Get()) : clock_(clock) {}
  absl::Time Reserve(size_t bytes, absl::Time queued, double bandwidth_mbps);
  absl::Time Transmit(size_t bytes, absl::Time queued, double bandwidth_mbps);

 private:
  const Clock* clock_;
  absl::Time wire_free_ = absl::InfinitePast();
};

}  // namespace aqswarm::rpc

#endif  // AQSWARM_RPC_LINK_SHAPING_H_
