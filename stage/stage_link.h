// One end of the link between adjacent pipeline stages, as the step
// protocol (stage/step_protocol.h) sees it: frames out, frames in by match.
// Implementations: LinkConnection (stage/link_transport.h: a gRPC stream with
// link shaping) and InProcessStageLink (stage/in_process_stage_link.h: a
// queue pair, for tests of the protocol without gRPC).
//
// Receive() returns the first frame (in arrival order) that matches and is
// due; frames that do not match stay queued for later calls. Every wait is
// bounded. Once the far end goes away, pending and later calls fail with
// Unavailable naming the link (frames that had arrived are still returned).
//
// Thread-safety: every method may be called from any thread.
#ifndef AQSWARM_STAGE_STAGE_LINK_H_
#define AQSWARM_STAGE_STAGE_LINK_H_

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/link.pb.h"

namespace aqswarm::stage {

// Counts the frames that arrive on the links that notify it (and their
// ends), so that one thread can wait for the next frame on any of them:
//
//   up->NotifyArrivals(&arrivals);  down->NotifyArrivals(&arrivals);
//   const uint64_t seen = arrivals.count();
//   if (!*up->Has(a) && !*down->Has(b)) arrivals.WaitPast(seen, deadline);
class FrameArrivals {
 public:
  uint64_t count() const;
  // Waits until count() != seen; false if the deadline came first.
  bool WaitPast(uint64_t seen, absl::Time deadline) const;
  // Waits until count() >= n; false if the deadline came first.
  bool WaitFor(uint64_t n, absl::Time deadline) const;
  void Notify();

 private:
  mutable absl::Mutex mu_;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

class StageLink {
 public:
  using Match = std::function<bool(const v1::LinkFrame&)>;
  virtual ~StageLink() = default;

  // Queues a frame for the far end; blocks (up to `timeout`) under flow
  // control. Fails once the link is broken or closed.
  virtual absl::Status Send(v1::LinkFrame frame, absl::Duration timeout) = 0;
  // The first due frame that matches, waiting up to `timeout`.
  virtual absl::StatusOr<v1::LinkFrame> Receive(const Match& match, absl::Duration timeout) = 0;
  // Whether Receive(match) would return at once. Fails like Receive once the
  // link has ended and holds no matching frame.
  virtual absl::StatusOr<bool> Has(const Match& match) = 0;
  // The earliest time after `after` at which a frame that has arrived comes
  // due (a shaped link holds frames until their emulated wire time ends);
  // InfiniteFuture if none. A held frame coming due does not notify, so a
  // waiter on FrameArrivals bounds its wait by this; `after` is the time the
  // waiter took before its Has checks, so that a frame that came due in
  // between is reported (a time already past) rather than lost.
  virtual absl::Time NextDue(absl::Time after) = 0;
  // From now on every arriving frame, and the link's end, notify `arrivals`
  // (nullptr: none). It must outlive this link or be replaced; once this
  // returns, the counter it replaced is not notified any more.
  virtual void NotifyArrivals(FrameArrivals* arrivals) = 0;
  // Shapes frames queued from now on at `mbps` (0 = unshaped).
  virtual void SetBandwidth(double mbps) = 0;
  // Serialized bytes sent so far.
  virtual uint64_t bytes_sent() const = 0;
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_STAGE_LINK_H_
