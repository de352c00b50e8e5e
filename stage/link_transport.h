// StageLink transport: one bidi gRPC stream between adjacent stages, with
// user-space link shaping (the kernel here has no netem).
//
// Both ends hold a LinkConnection:
//   upstream (stage j):    auto c = LinkConnection::Dial("127.0.0.1:5001", shaping, timeout);
//   downstream (stage j+1): auto server = StageLinkServer::Start("127.0.0.1:0", shaping);
//                           auto c = server->Accept(timeout);
//   c->Send(frame);                                   // queued; a writer thread ships it
//   c->Receive([](const v1::LinkFrame& f) { return f.has_gradients(); }, timeout);
//
// Shaping (per direction): a frame of N serialized bytes occupies the
// sending direction's rpc::EmulatedWire (rpc/link_shaping.h) for N*8/bandwidth seconds from when it was
// queued or the previous frame left the wire, whichever is later (a FIFO
// wire). The writer sends it at once, stamped with how long its wire time
// still runs (LinkFrame.hold_micros); the receiver holds it until then, plus
// latency_ms. No thread sleeps per frame: a held frame simply is not due yet
// (Has/Receive skip it, NextDue says when it comes due).
//
// Receive() returns the first queued frame that matches; frames that do not
// match stay queued in arrival order for later calls (the protocol lets a
// resend answer overtake later micro-batches). Every wait is bounded. When the
// peer goes away (process killed, stream cancelled) pending and later
// Receive/Send calls fail with Unavailable naming the link.
//
// Mutual TLS: pass rpc::TlsOptions (rpc/tls.h) to Dial and Start; both ends
// need certificates from the same swarm CA. Default: plaintext.
//
// Bounds on what the far end can make this end hold (LinkLimits): the
// largest frame (gRPC refuses a bigger one with RESOURCE_EXHAUSTED), the
// frames and bytes queued and not yet received, and a step window (a frame
// of a step past the current one + `step_window` is refused). A frame over
// a bound ends the link: it breaks with RESOURCE_EXHAUSTED naming the bound,
// the stream stops being read and is cancelled (a server returns that
// status to the dialer), and the refusal is counted
// (aqswarm_peer_rejected_messages_total{reason=link_*}).
//
// Who may become the upstream (LinkServerOptions): with `check_hello` set,
// every connection must send a LinkHello as its first frame within
// `hello_timeout`; the check's LinkHelloAck is sent back and only an
// accepted connection becomes the link; the others are answered, cancelled
// and counted while the server keeps waiting. With `expected_peer` set under
// mutual TLS, a client whose certificate's subject CN is not that name is
// refused with PERMISSION_DENIED before it can send anything.
//
// Thread-safety: Send and Receive may be called from different threads.
#ifndef AQSWARM_STAGE_LINK_TRANSPORT_H_
#define AQSWARM_STAGE_LINK_TRANSPORT_H_

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "stage/stage_link.h"
#include "rpc/channel.h"
#include "rpc/link_shaping.h"
#include "rpc/tls.h"
#include "proto/link.grpc.pb.h"

namespace aqswarm::stage {

// What one end of a link lets the far end make it hold. 0 = unbounded.
struct LinkLimits {
  // Largest serialized frame accepted. Default: rpc::kMaxFrameBytes.
  int max_frame_bytes = rpc::kMaxFrameBytes;
  // Frames / serialized bytes that have arrived and were not yet received.
  size_t max_queued_frames = 0;
  uint64_t max_queued_bytes = 0;
  // A frame of a step greater than the current step (first_step, then
  // SetStep) + step_window is refused; hellos and acks carry no step.
  uint64_t step_window = 0;
  uint64_t first_step = 0;
};

// The step a frame belongs to (0 for a hello or an ack).
uint64_t FrameStep(const v1::LinkFrame& frame);

// Under mutual TLS, the subject CN of the certificate the client of `ctx`
// presented; empty under plaintext (or when it has none).
std::string CallerCertificateName(const grpc::ServerContext& ctx);

class LinkConnection : public StageLink {
 public:
  ~LinkConnection() override;

  // Connects to a StageLinkServer, retrying until `timeout`.
  // `limits` bound what the far end's frames can make this end hold.
  // `reverse`: this end is the downstream stage and dials its upstream's
  // downstream slot (StageLinkReverse).
  static absl::StatusOr<std::unique_ptr<LinkConnection>> Dial(const std::string& target, const rpc::ShapingOptions& shaping,
                                                              absl::Duration timeout, const rpc::TlsOptions& tls = {},
                                                              const LinkLimits& limits = {}, bool reverse = false);

  // Queues a frame. Blocks while `max_queued_frames` are waiting (flow
  // control) up to `timeout`. Fails once the link is broken or closed. The
  // frame is shaped at the bandwidth set when it was queued.
  //
  // Shaping: the writer books the frame's time on its rpc::EmulatedWire and writes
  // it at once, stamped with how long that wire time still runs
  // (LinkFrame.hold_micros); the receiving end holds it until then. So a
  // frame is usable exactly when its last byte would have arrived, but no
  // thread sleeps per frame: a stage busy computing meanwhile finds it ready
  // without a timer wake-up. The sender's queue therefore does
  // not back up behind a slow wire; what bounds the frames in flight is the
  // stage schedule.
  absl::Status Send(v1::LinkFrame frame, absl::Duration timeout = absl::Seconds(600)) override;
  // The first frame (in arrival order) that `match`es and is due, waiting
  // up to `timeout`.
  absl::StatusOr<v1::LinkFrame> Receive(const Match& match, absl::Duration timeout) override;
  // Whether a due frame that `match`es has arrived (Receive would return it
  // at once). Fails like Receive once the link has ended and holds none
  // that matches.
  absl::StatusOr<bool> Has(const Match& match) override;
  // The earliest time after `after` at which a frame that has arrived comes
  // due (its emulated wire time ends); InfiniteFuture if none. A waiter on
  // FrameArrivals bounds its wait by it, since a held frame coming due does
  // not notify. Pass the time taken before the Has checks the wait follows:
  // a frame that came due between those checks and this call is then
  // reported (a time already past, so the wait ends at once) instead of
  // looking like a frame that was never held, whose wake-up is lost.
  absl::Time NextDue(absl::Time after) override;
  // From now on every frame that arrives, and the link's end, notify
  // `arrivals` (nullptr: none). It must outlive this link or be replaced.
  void NotifyArrivals(FrameArrivals* arrivals) override;
  // No more sends: flushes queued frames, then half-closes. Idempotent.
  void CloseSend();
  // Waits (bounded) until the peer has closed its side too; returns the
  // stream's final status.
  absl::Status WaitClosed(absl::Duration timeout);

  // Shapes the frames queued from now on at `mbps` (0 = unshaped) instead of
  // rpc::ShapingOptions::bandwidth_mbps (benchmarks that change a link's rate
  // from step to step: JobSpec shaping.bandwidth_schedule_mbps).
  void SetBandwidth(double mbps) override { bandwidth_mbps_ = mbps; }
  uint64_t bytes_sent() const override { return bytes_sent_.load(); }
  // Passive bandwidth measurement of real traffic: bytes of frames of at
  // least kBusyFrameBytes and the seconds the link spent sending them (from
  // when the writer took the frame, or the previous frame left, to when the
  // write returned or, on a shaped link, its emulated wire time ended).
  // busy_bytes / busy_seconds is the achieved send rate while busy.
  static constexpr size_t kBusyFrameBytes = 16 << 10;
  uint64_t busy_bytes() const { return busy_bytes_.load(); }
  double busy_seconds() const { return busy_micros_.load() * 1e-6; }
  uint64_t bytes_received() const { return bytes_received_.load(); }
  const std::string& name() const { return name_; }
  // The step this end works on: frames of later steps than it +
  // LinkLimits::step_window are refused (see LinkLimits).
  void SetStep(uint64_t step) { current_step_ = step; }

 protected:
  LinkConnection(std::string name, const rpc::ShapingOptions& shaping, const LinkLimits& limits = {});
  // Transport hooks (client or server stream).
  virtual bool WriteFrame(const v1::LinkFrame& frame) = 0;
  virtual bool ReadFrame(v1::LinkFrame* frame) = 0;
  virtual void FinishWrites() = 0;
  // Runs the reader until the stream ends; then marks the link closed with
  // `final_status()`.
  void ReaderLoop();
  virtual absl::Status FinalStatus() = 0;
  // Stops the stream (the reader's pending read returns). Thread-safe.
  virtual void Cancel() = 0;
  // After the reader refused a frame (LinkLimits) and stopped reading: a
  // client cancels its stream; a server returns the refusal from its handler.
  virtual void StopOnRefusal() { Cancel(); }
  void StartWriter();
  // Blocks until the writer thread has exited (sends closed and drained, or
  // the stream broke).
  void WaitWriterDone();
  // The same, at most `timeout`; false if the writer still runs.
  bool WaitWriterDone(absl::Duration timeout);
  void StopThreads();
  void MarkBroken(const absl::Status& s);
  // The first failure (OK while none). A server returns it to the dialer.
  absl::Status broken();

  const std::string name_;

 private:
  void WriterLoop();

  const rpc::ShapingOptions shaping_;
  const rpc::Clock* const clock_;  // shaping_'s: wire times and holds
  absl::Mutex mu_;
  struct Outbound {
    v1::LinkFrame frame;
    absl::Time queued;  // when Send took it: it may use the wire from then on
    double mbps;        // the link's bandwidth then
  };
  std::deque<Outbound> outbound_ ABSL_GUARDED_BY(mu_);
  struct Inbound {
    v1::LinkFrame frame;
    absl::Time due;  // arrival + its hold: Has/Receive see it from then on
    size_t bytes = 0;
  };
  std::deque<Inbound> inbound_ ABSL_GUARDED_BY(mu_);
  uint64_t inbound_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // serialized bytes of inbound_
  const LinkLimits limits_;
  std::atomic<uint64_t> current_step_;
  // The first due frame that matches (inbound_.end() if none); *held_until:
  // when the earliest matching frame still held comes due (InfiniteFuture:
  // none).
  std::deque<Inbound>::iterator FindDue(const std::function<bool(const v1::LinkFrame&)>& match, absl::Time now,
                                        absl::Time* held_until) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks a frame that just arrived against the limits_; not OK: refused
  // (counted).
  absl::Status Admit(const v1::LinkFrame& frame, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why a link that ended holds nothing more for a waiter.
  absl::Status EndedStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool send_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool writer_done_ ABSL_GUARDED_BY(mu_) = false;
  bool reader_done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);  // first failure, sticky
  // broken_ is only this end's failed write: the peer's own reason for
  // ending the stream (its final status) replaces it once the reader has it.
  bool broken_by_write_ ABSL_GUARDED_BY(mu_) = false;
  FrameArrivals* arrivals_ ABSL_GUARDED_BY(mu_) = nullptr;
  static constexpr size_t kMaxQueuedFrames = 64;
  std::thread writer_;
  std::atomic<double> bandwidth_mbps_;
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> busy_bytes_{0};
  std::atomic<int64_t> busy_micros_{0};
};

struct LinkServerOptions {
  rpc::ShapingOptions shaping;
  rpc::TlsOptions tls;
  LinkLimits limits;
  // When set, a connection becomes the link only once its first frame, a
  // LinkHello arriving within hello_timeout, gets an accepting answer from
  // it (the answer is sent either way). A refusal may set `*detail`: what
  // this end logs and names in Accept's timeout error (never sent). Default:
  // none (the first connection is the link at once).
  std::function<v1::LinkHelloAck(const v1::LinkHello&, std::string* detail)> check_hello;
  absl::Duration hello_timeout = absl::Seconds(5);
  // Under mutual TLS: the certificate name (subject CN) the upstream must
  // present. Default: "" (any certificate of the swarm CA).
  std::string expected_peer;
  // Connections being vetted at once; more are refused (RESOURCE_EXHAUSTED).
  int max_candidates = 8;
};

// Serves a stage's links on one port: exactly one connection per slot. The
// upstream slot (service StageLink) takes the upstream neighbour's dial; the
// downstream slot (service StageLinkReverse) takes the downstream
// neighbour's when that one cannot accept connections and dials instead
// (a reversed link, proto/link.proto).
class StageLinkServer {
 public:
  // `listen` like "127.0.0.1:0"; port() tells the bound port.
  static absl::StatusOr<std::unique_ptr<StageLinkServer>> Start(const std::string& listen,
                                                                const rpc::ShapingOptions& shaping,
                                                                const rpc::TlsOptions& tls = {});
  // The upstream slot only.
  static absl::StatusOr<std::unique_ptr<StageLinkServer>> StartWith(const std::string& listen,
                                                                    const LinkServerOptions& options);
  // Either slot or both (at least one); both share `tls`, which must agree.
  static absl::StatusOr<std::unique_ptr<StageLinkServer>> StartSlots(
      const std::string& listen, const std::optional<LinkServerOptions>& upstream,
      const std::optional<LinkServerOptions>& downstream);
  ~StageLinkServer();
  int port() const { return port_; }
  // Waits for the upstream stage to connect. The timeout error counts the
  // connections refused meanwhile and says why the last one was.
  absl::StatusOr<LinkConnection*> Accept(absl::Duration timeout);
  // The same for the downstream stage of a reversed link.
  absl::StatusOr<LinkConnection*> AcceptDownstream(absl::Duration timeout);
  // Closes an accepted connection that was refused (e.g. a stale
  // incarnation) and stops reading it (the stream is cancelled), so that
  // the next Accept can take another one.
  void Release(LinkConnection* connection);
  // Stops serving: our side of the streams closes after queued frames are
  // sent; the neighbours get `grace` to finish their side, then are cancelled.
  void Shutdown(absl::Duration grace = absl::Seconds(5));

 private:
  class Service;
  StageLinkServer() = default;
  std::unique_ptr<Service> upstream_, downstream_;
  std::vector<std::unique_ptr<grpc::Service>> adapters_;  // the gRPC services, calling the slots
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_LINK_TRANSPORT_H_
