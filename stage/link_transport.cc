#include "stage/link_transport.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/status.h"
#include "stage/blame.h"
#include "stage/stage_metrics.h"
#include "grpcpp/grpcpp.h"

namespace aqswarm::stage {

uint64_t FrameStep(const v1::LinkFrame& f) {
  switch (f.body_case()) {
    case v1::LinkFrame::kActivations: return f.activations().step();
    case v1::LinkFrame::kGradients: return f.gradients().step();
    case v1::LinkFrame::kResend: return f.resend().step();
    case v1::LinkFrame::kCommit: return f.commit().step();
    case v1::LinkFrame::kEvalResult: return f.eval_result().step();
    default: return 0;
  }
}

std::string CallerCertificateName(const grpc::ServerContext& ctx) {
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  const std::vector<grpc::string_ref> cn = auth->FindPropertyValues("x509_common_name");
  return cn.empty() ? "" : std::string(cn.front().data(), cn.front().size());
}

// ------------------------------------------------------------ LinkConnection

LinkConnection::LinkConnection(std::string name, const rpc::ShapingOptions& shaping, const LinkLimits& limits)
    : name_(std::move(name)),
      shaping_(shaping),
      clock_(shaping.clock_or_real()),
      limits_(limits),
      current_step_(limits.first_step),
      bandwidth_mbps_(shaping.bandwidth_mbps) {}

LinkConnection::~LinkConnection() = default;

void LinkConnection::StartWriter() { writer_ = std::thread([this] { WriterLoop(); }); }

void LinkConnection::StopThreads() {
  // The writer drains what is queued, then exits; a dead peer makes its
  // writes fail fast (the owner cancels the stream first when it must not wait).
  CloseSend();
  if (writer_.joinable()) writer_.join();
}

void LinkConnection::MarkBroken(const absl::Status& s) {
  absl::MutexLock l(&mu_);
  if (broken_.ok()) broken_ = s;
}

absl::Status LinkConnection::broken() {
  absl::MutexLock l(&mu_);
  return broken_;
}

absl::Status LinkConnection::Admit(const v1::LinkFrame& frame, size_t bytes) {
  const uint64_t step = FrameStep(frame);
  const uint64_t current = current_step_.load();
  // Counted, and blamed on the sender (the step protocol names the link and
  // the step: stage/blame.h).
  auto refuse = [](RejectReason reason, absl::Status s) {
    CountRejectedMessage(reason);
    return Blamed(std::move(s), v1::Blame::LINK_UNSPECIFIED, v1::Blame::REFUSED, RejectReasonName(reason), -1);
  };
  if (limits_.step_window > 0 && step > current && step - current > limits_.step_window) {
    return refuse(RejectReason::kLinkStepOutOfWindow,
                  absl::ResourceExhaustedError(absl::StrCat("link ", name_, ": a frame of step ", step,
                                                            " is more than ", limits_.step_window,
                                                            " steps ahead of this stage's step ", current)));
  }
  if (limits_.max_queued_frames > 0 && inbound_.size() >= limits_.max_queued_frames) {
    return refuse(RejectReason::kLinkFramesOverCap,
                  absl::ResourceExhaustedError(absl::StrCat("link ", name_, ": more than ", limits_.max_queued_frames,
                                                            " frames queued and not yet taken")));
  }
  if (limits_.max_queued_bytes > 0 && inbound_bytes_ + bytes > limits_.max_queued_bytes) {
    return refuse(RejectReason::kLinkBytesOverCap,
                  absl::ResourceExhaustedError(absl::StrCat("link ", name_, ": more than ", limits_.max_queued_bytes,
                                                            " bytes queued and not yet taken")));
  }
  return absl::OkStatus();
}

absl::Status LinkConnection::Send(v1::LinkFrame frame, absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto can_send = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return outbound_.size() < kMaxQueuedFrames || !broken_.ok() || send_closed_;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&can_send), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("link ", name_, ": send queue full for ", absl::FormatDuration(timeout)));
  }
  if (!broken_.ok()) return broken_;
  if (send_closed_) return absl::FailedPreconditionError(absl::StrCat("link ", name_, " is closed for sending"));
  outbound_.push_back({std::move(frame), clock_->Now(), bandwidth_mbps_.load()});
  return absl::OkStatus();
}

std::deque<LinkConnection::Inbound>::iterator LinkConnection::FindDue(
    const std::function<bool(const v1::LinkFrame&)>& match, absl::Time now, absl::Time* held_until) {
  *held_until = absl::InfiniteFuture();
  for (auto it = inbound_.begin(); it != inbound_.end(); ++it) {
    if (!match(it->frame)) continue;
    if (it->due <= now) return it;
    *held_until = std::min(*held_until, it->due);  // still on its wire: stays put
  }
  return inbound_.end();
}

absl::Status LinkConnection::EndedStatus() const {
  return !broken_.ok() ? broken_ : absl::UnavailableError(absl::StrCat("link ", name_, " was closed by the peer"));
}

absl::StatusOr<v1::LinkFrame> LinkConnection::Receive(const std::function<bool(const v1::LinkFrame&)>& match,
                                                      absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock l(&mu_);
  while (true) {
    const absl::Time now = clock_->Now();  // the wire's time: when held frames come due
    const absl::Time real_now = absl::Now();  // the timeout's
    absl::Time held_until;
    if (auto it = FindDue(match, now, &held_until); it != inbound_.end()) {
      v1::LinkFrame f = std::move(it->frame);
      inbound_bytes_ -= std::min<uint64_t>(inbound_bytes_, it->bytes);
      inbound_.erase(it);
      return f;
    }
    if (reader_done_ && held_until == absl::InfiniteFuture()) return EndedStatus();
    if (real_now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("link ", name_, ": expected frame did not arrive within ",
                                                      absl::FormatDuration(timeout)));
    }
    const size_t seen = inbound_.size();
    const bool done = reader_done_;
    auto changed = [this, seen, done]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return inbound_.size() != seen || reader_done_ != done;
    };
    const absl::Time held_wake =
        held_until == absl::InfiniteFuture() ? absl::InfiniteFuture() : real_now + (held_until - now);
    mu_.AwaitWithDeadline(absl::Condition(&changed), std::min(deadline, held_wake));
  }
}

absl::StatusOr<bool> LinkConnection::Has(const std::function<bool(const v1::LinkFrame&)>& match) {
  absl::MutexLock l(&mu_);
  absl::Time held_until;
  if (FindDue(match, clock_->Now(), &held_until) != inbound_.end()) return true;
  if (reader_done_ && held_until == absl::InfiniteFuture()) return EndedStatus();
  return false;
}

absl::Time LinkConnection::NextDue(absl::Time after) {
  absl::MutexLock l(&mu_);
  absl::Time next = absl::InfiniteFuture();
  for (const Inbound& in : inbound_) {
    if (in.due > after) next = std::min(next, in.due);
  }
  return next;
}

void LinkConnection::NotifyArrivals(FrameArrivals* arrivals) {
  absl::MutexLock l(&mu_);
  arrivals_ = arrivals;
}

void LinkConnection::CloseSend() {
  absl::MutexLock l(&mu_);
  send_closed_ = true;
}

absl::Status LinkConnection::WaitClosed(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reader_done_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("link ", name_, ": peer did not close within ",
                                                    absl::FormatDuration(timeout)));
  }
  return broken_;
}

void LinkConnection::WaitWriterDone() {
  absl::MutexLock l(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return writer_done_; };
  mu_.Await(absl::Condition(&done));
}

bool LinkConnection::WaitWriterDone(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return writer_done_; };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

void LinkConnection::WriterLoop() {
  rpc::EmulatedWire wire(clock_);
  absl::Time last_done = absl::InfinitePast();
  while (true) {
    v1::LinkFrame frame;
    absl::Time queued;
    double mbps;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !outbound_.empty() || send_closed_ || !broken_.ok();
      };
      mu_.Await(absl::Condition(&ready));
      if (!broken_.ok() || outbound_.empty()) break;  // broken, or closed and drained
      frame = std::move(outbound_.front().frame);
      queued = outbound_.front().queued;
      mbps = outbound_.front().mbps;
      outbound_.pop_front();
    }
    const size_t bytes = frame.ByteSizeLong() + 16;  // + the timestamp and hold set below
    const absl::Time busy_from = std::max(clock_->Now(), last_done);
    // No sleep: the frame goes now, and the receiver holds it until its last
    // byte would have left this wire (see Send).
    const absl::Time wire_done = wire.Reserve(bytes, queued, mbps);
    const absl::Time now = clock_->Now();
    frame.set_sent_unix_micros(absl::ToUnixMicros(wire_done));
    frame.set_hold_micros(wire_done > now ? absl::ToInt64Microseconds(wire_done - now) : 0);
    bytes_sent_ += frame.ByteSizeLong();  // before the write: the peer may read it first
    if (!WriteFrame(frame)) {
      absl::MutexLock l(&mu_);
      if (broken_.ok()) {
        broken_ = absl::UnavailableError(absl::StrCat("link ", name_, ": write failed (peer gone)"));
        broken_by_write_ = true;
      }
      break;
    }
    last_done = std::max(clock_->Now(), wire_done);
    if (bytes >= kBusyFrameBytes) {
      busy_bytes_ += bytes;
      busy_micros_ += absl::ToInt64Microseconds(last_done - busy_from);
    }
  }
  FinishWrites();
  absl::MutexLock l(&mu_);
  writer_done_ = true;
}

void LinkConnection::ReaderLoop() {
  v1::LinkFrame frame;
  while (ReadFrame(&frame)) {
    const size_t bytes = frame.ByteSizeLong();
    bytes_received_ += bytes;
    // Held for the rest of its wire time (bounded like the latency below: a
    // corrupt hold must not park a frame for ever).
    const absl::Time due = clock_->Now() + absl::Microseconds(std::clamp<int64_t>(frame.hold_micros(), 0, 60'000'000));
    if (shaping_.latency_ms > 0) {
        // The sender's clock is trusted no further than its (bounded) hold
      // plus the configured latency.
      const int64_t latency_us = static_cast<int64_t>(shaping_.latency_ms * 1000);
      const int64_t at = frame.sent_unix_micros() + latency_us;
      const int64_t wait = at - absl::ToUnixMicros(clock_->Now());
      const int64_t most = std::clamp<int64_t>(frame.hold_micros(), 0, 60'000'000) + latency_us;
      if (wait > 0) clock_->SleepFor(absl::Microseconds(std::min<int64_t>(wait, most)));
    }
    bool refused = false;
    {
      // Notified under the lock: once NotifyArrivals(nullptr) returns, no
      // notification of the counter it replaced is under way.
      absl::MutexLock l(&mu_);
      if (absl::Status admitted = Admit(frame, bytes); !admitted.ok()) {
        if (broken_.ok()) broken_ = admitted;
        refused = true;
      } else {
        inbound_.push_back({std::move(frame), due, bytes});
        inbound_bytes_ += bytes;
        if (arrivals_ != nullptr) arrivals_->Notify();
      }
    }
    if (refused) {
      // Not read any further: the stream ends with the refusal.
      StopOnRefusal();
      break;
    }
    frame = v1::LinkFrame();
  }
  absl::Status final_status = FinalStatus();
  absl::MutexLock l(&mu_);
  if ((broken_.ok() || broken_by_write_) && !final_status.ok()) broken_ = final_status;
  reader_done_ = true;
  if (arrivals_ != nullptr) arrivals_->Notify();
}

// ------------------------------------------------------------ client side

namespace {

class ClientLink final : public LinkConnection {
 public:
  ClientLink(const std::string& target, const rpc::ShapingOptions& shaping, const LinkLimits& limits)
      : LinkConnection(absl::StrCat("to ", target), shaping, limits), max_frame_bytes_(limits.max_frame_bytes) {}

  ~ClientLink() override {
    CloseSend();
    // Give an orderly close a moment, then cancel.
    if (stream_ != nullptr && absl::IsDeadlineExceeded(WaitClosed(absl::Seconds(5)))) context_.TryCancel();
    StopThreads();
    if (reader_.joinable()) reader_.join();
  }

  absl::Status Connect(const std::string& target, absl::Duration timeout, const rpc::TlsOptions& tls, bool reverse) {
    // Its own TCP connection (the shaping is per link); a vanished
    // neighbour on an idle link is found within ~20 s (keepalive).
    rpc::ChannelPreset preset = rpc::LinkChannel();
    if (max_frame_bytes_ > 0) preset.max_receive_bytes = max_frame_bytes_;
    auto channel = rpc::MakeChannel(target, tls, preset);
    if (!channel.ok()) return channel.status();
    channel_ = *std::move(channel);
    const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
    if (!channel_->WaitForConnected(deadline)) {
      // A TLS mismatch (one end plaintext, or another CA) looks like an
      // unreachable peer from here: say which mode we used.
      return absl::UnavailableError(absl::StrCat("cannot reach the ", reverse ? "previous" : "next", " stage at ",
                                                 target, " within ",
                                                 absl::FormatDuration(timeout), " over ", rpc::DescribeTls(tls),
                                                 tls.enabled() ? " (is it up, with mTLS and the same CA?)"
                                                               : " (is it up, without TLS?)"));
    }
    if (reverse) {
      reverse_stub_ = v1::StageLinkReverse::NewStub(channel_);
      stream_ = reverse_stub_->Connect(&context_);
    } else {
      stub_ = v1::StageLink::NewStub(channel_);
      stream_ = stub_->Connect(&context_);
    }
    if (stream_ == nullptr) return absl::UnavailableError(absl::StrCat("cannot open a stream to ", target));
    StartWriter();
    reader_ = std::thread([this] { ReaderLoop(); });
    return absl::OkStatus();
  }

 protected:
  bool WriteFrame(const v1::LinkFrame& f) override { return stream_->Write(f); }
  bool ReadFrame(v1::LinkFrame* f) override { return stream_->Read(f); }
  void FinishWrites() override { stream_->WritesDone(); }
  absl::Status FinalStatus() override { return rpc::FromGrpc(stream_->Finish(), absl::StrCat("link ", name_)); }
  void Cancel() override { context_.TryCancel(); }

 private:
  const int max_frame_bytes_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::StageLink::Stub> stub_;
  std::unique_ptr<v1::StageLinkReverse::Stub> reverse_stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> stream_;
  std::thread reader_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LinkConnection>> LinkConnection::Dial(const std::string& target,
                                                                     const rpc::ShapingOptions& shaping,
                                                                     absl::Duration timeout,
                                                                     const rpc::TlsOptions& tls,
                                                                     const LinkLimits& limits, bool reverse) {
  auto link = std::make_unique<ClientLink>(target, shaping, limits);
  absl::Status s = link->Connect(target, timeout, tls, reverse);
  if (!s.ok()) return s;
  return std::unique_ptr<LinkConnection>(std::move(link));
}

// ------------------------------------------------------------ server side

namespace {

class ServerLink final : public LinkConnection {
 public:
  ServerLink(grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream,
             const rpc::ShapingOptions& shaping, const LinkLimits& limits)
      : LinkConnection(absl::StrCat("from ", ctx->peer()), shaping, limits), ctx_(ctx), stream_(stream) {}
  ~ServerLink() override { StopThreads(); }

  // Runs on the gRPC handler thread for the life of the stream: reads until
  // the upstream half-closes or vanishes (or a frame is refused, or
  // Release/Shutdown cancels it), then waits until this stage has closed its
  // own sends and the writer drained (the stream must stay valid meanwhile).
  // Returns the status the dialer gets: the refusal of its frames, else OK.
  grpc::Status Serve() {
    StartWriter();
    ReaderLoop();
    const absl::Status b = broken();
    const bool refused = absl::IsResourceExhausted(b) || absl::IsInvalidArgument(b);
    // A refused dialer that does not read our last frames is not waited for.
    if (refused && !WaitWriterDone(absl::Seconds(2))) Cancel();
    WaitWriterDone();
    return refused ? rpc::ToGrpc(b) : grpc::Status::OK;
  }

  void Cancel() override { ctx_->TryCancel(); }

 protected:
  bool WriteFrame(const v1::LinkFrame& f) override { return stream_->Write(f); }
  bool ReadFrame(v1::LinkFrame* f) override { return stream_->Read(f); }
  void FinishWrites() override {}
  absl::Status FinalStatus() override {
    if (ctx_->IsCancelled()) return absl::UnavailableError(absl::StrCat("link ", name_, " was cancelled (peer gone)"));
    return absl::OkStatus();
  }
  void StopOnRefusal() override {}  // Serve returns the refusal

 private:
  grpc::ServerContext* ctx_;
  grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream_;
};

// Cancels `ctx` unless Disarm() comes within `timeout`: bounds a read on the
// handler thread.
class Watchdog {
 public:
  // `on_fire` runs just before the cancel.
  Watchdog(grpc::ServerContext* ctx, absl::Duration timeout, std::function<void()> on_fire)
      : thread_([this, ctx, timeout, on_fire = std::move(on_fire)] {
          absl::MutexLock l(&mu_);
          auto disarmed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return disarmed_; };
          if (!mu_.AwaitWithTimeout(absl::Condition(&disarmed), timeout)) {
            fired_ = true;
            on_fire();
            ctx->TryCancel();
          }
        }) {}
  ~Watchdog() { Disarm(); }
  // Returns whether it fired first.
  bool Disarm() {
    {
      absl::MutexLock l(&mu_);
      disarmed_ = true;
    }
    if (thread_.joinable()) thread_.join();
    absl::MutexLock l(&mu_);
    return fired_;
  }

 private:
  absl::Mutex mu_;
  bool disarmed_ ABSL_GUARDED_BY(mu_) = false;
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace

// One slot of a StageLinkServer: the link with one neighbour (`role`:
// "upstream" or "downstream"), vetted as LinkServerOptions say.
class StageLinkServer::Service {
 public:
  Service(const LinkServerOptions& options, std::string role) : o_(options), role_(std::move(role)) {}

  grpc::Status Connect(grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream) {
    if (!o_.expected_peer.empty() && o_.tls.enabled()) {
      const std::string caller = CallerCertificateName(*ctx);
      if (caller != o_.expected_peer) {
        CountRejectedMessage(RejectReason::kLinkWrongPeer);
        AQSWARM_LOG(WARNING) << "StageLink: refused a connection from " << ctx->peer() << " (certificate '" << caller
                             << "'): not the upstream this stage expects";
        return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "not the upstream peer this stage expects");
      }
    }
    if (grpc::Status s = Admit(); !s.ok()) return s;
    grpc::Status vetted = Vet(ctx, stream);
    std::shared_ptr<ServerLink> link;
    {
      absl::MutexLock l(&mu_);
      --candidates_;
      if (vetted.ok() && link_ == nullptr && !shutdown_) {
        link = std::make_shared<ServerLink>(ctx, stream, o_.shaping, o_.limits);
        link_ = link;
      } else if (vetted.ok()) {  // another dialer took the link meanwhile
        CountRejectedMessage(role_ == "upstream" ? RejectReason::kSecondUpstream : RejectReason::kSecondDownstream);
        vetted = grpc::Status(grpc::StatusCode::ALREADY_EXISTS, AlreadyLinked());
      }
    }
    if (link == nullptr) {
      if (o_.check_hello && vetted.error_code() == grpc::StatusCode::ALREADY_EXISTS) {
        v1::LinkFrame ack;
        ack.mutable_hello_ack()->set_reason(AlreadyLinked());
        stream->Write(ack);
      }
      return vetted;
    }
    if (o_.check_hello) {
      v1::LinkFrame ack;
      ack.mutable_hello_ack()->set_accepted(true);
      (void)link->Send(ack);  // queued first; a failure breaks the link, which the stage's next call reports
    }
    return link->Serve();
  }

  absl::StatusOr<LinkConnection*> Accept(absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return link_ != nullptr || shutdown_; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout) || link_ == nullptr) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the ", role_, " stage did not connect within ", absl::FormatDuration(timeout),
          refused_ == 0 ? std::string()
                        : absl::StrCat("; ", refused_, " connection(s) refused, the last: ", last_refusal_)));
    }
    return link_.get();
  }

  // Whether `connection` was this slot's (then it is released).
  bool Release(LinkConnection* connection) {
    std::shared_ptr<ServerLink> link;
    {
      absl::MutexLock l(&mu_);
      if (link_.get() != connection) return false;
      link.swap(link_);
    }
    link->CloseSend();
    link->Cancel();  // not read any more
    return true;
  }

  void Shutdown() {
    std::shared_ptr<ServerLink> link;
    {
      absl::MutexLock l(&mu_);
      shutdown_ = true;
      link = link_;
    }
    if (link) link->CloseSend();
  }

 private:
  std::string AlreadyLinked() const { return absl::StrCat("this stage already has an ", role_, " neighbour"); }

  // Counts a connection being vetted; refuses one over the caps.
  grpc::Status Admit() {
    absl::MutexLock l(&mu_);
    if (shutdown_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "this stage is shutting down");
    if (link_ != nullptr) {
      CountRejectedMessage(role_ == "upstream" ? RejectReason::kSecondUpstream : RejectReason::kSecondDownstream);
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, AlreadyLinked());
    }
    if (candidates_ >= std::max(1, o_.max_candidates)) {
      CountRejectedMessage(RejectReason::kLinkTooManyCandidates);
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many connections waiting to be vetted");
    }
    ++candidates_;
    return grpc::Status::OK;
  }

  // With a hello check, on the handler thread: the first frame must be a
  // hello, within hello_timeout, that the check accepts. A refused hello is
  // answered (a few words, and whether to retry) before the refusal ends
  // the stream.
  grpc::Status Vet(grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream) {
    grpc::Status s = VetFirstFrame(ctx, stream);
    if (!s.ok()) {
      absl::MutexLock l(&mu_);
      ++refused_;
      // A refused hello already left its reason, with this end's detail.
      if (s.error_code() != grpc::StatusCode::FAILED_PRECONDITION) last_refusal_ = s.error_message();
    }
    return s;
  }
  grpc::Status VetFirstFrame(grpc::ServerContext* ctx,
                             grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream) {
    if (!o_.check_hello) return grpc::Status::OK;
    v1::LinkFrame first;
    bool read;
    {
      const std::string who = ctx->peer();
      Watchdog watchdog(ctx, o_.hello_timeout, [this, who] {
        CountRejectedMessage(RejectReason::kLinkHelloSilent);
        AQSWARM_LOG(WARNING) << "StageLink: " << who << " sent no hello within "
                             << absl::FormatDuration(o_.hello_timeout) << "; dropped";
      });
      read = stream->Read(&first);
      if (watchdog.Disarm()) return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "no hello in time");
    }
    if (!read) return grpc::Status(grpc::StatusCode::CANCELLED, "the dialer went away before its hello");
    if (!first.has_hello()) {
      CountRejectedMessage(RejectReason::kLinkNotHello);
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the first frame must be a hello");
    }
    v1::LinkFrame ack;
    std::string detail;
    *ack.mutable_hello_ack() = o_.check_hello(first.hello(), &detail);
    if (ack.hello_ack().accepted()) return grpc::Status::OK;
    const std::string why = detail.empty() ? ack.hello_ack().reason() : absl::StrCat(ack.hello_ack().reason(), " (", detail, ")");
    AQSWARM_LOG(WARNING) << "StageLink: refused " << ctx->peer() << ": " << why;
    stream->Write(ack);
    {
      absl::MutexLock l(&mu_);
      last_refusal_ = why;  // Vet keeps it: the detail stays on this end
    }
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, ack.hello_ack().reason());
  }

  const LinkServerOptions o_;
  const std::string role_;
  absl::Mutex mu_;
  std::shared_ptr<ServerLink> link_ ABSL_GUARDED_BY(mu_);
  int candidates_ ABSL_GUARDED_BY(mu_) = 0;
  int refused_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_refusal_ ABSL_GUARDED_BY(mu_);  // why, with this end's detail (never sent)
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<std::unique_ptr<StageLinkServer>> StageLinkServer::Start(const std::string& listen,
                                                                        const rpc::ShapingOptions& shaping,
                                                                        const rpc::TlsOptions& tls) {
  LinkServerOptions o;
  o.shaping = shaping;
  o.tls = tls;
  return StartWith(listen, o);
}

namespace {

// A slot's gRPC face: `Base` is the generated service (StageLink or
// StageLinkReverse), `Slot` the slot it hands the stream to.
template <class Base, class Slot>
class SlotAdapter final : public Base {
 public:
  explicit SlotAdapter(Slot* slot) : slot_(slot) {}
  grpc::Status Connect(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream) override {
    return slot_->Connect(ctx, stream);
  }

 private:
  Slot* slot_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StageLinkServer>> StageLinkServer::StartWith(const std::string& listen,
                                                                            const LinkServerOptions& options) {
  return StartSlots(listen, options, std::nullopt);
}

absl::StatusOr<std::unique_ptr<StageLinkServer>> StageLinkServer::StartSlots(
    const std::string& listen, const std::optional<LinkServerOptions>& upstream,
    const std::optional<LinkServerOptions>& downstream) {
  if (!upstream.has_value() && !downstream.has_value()) {
    return absl::InvalidArgumentError("a StageLinkServer serves at least one slot");
  }
  if (upstream.has_value() && downstream.has_value() &&
      (upstream->tls.dir != downstream->tls.dir || upstream->tls.name != downstream->tls.name)) {
    return absl::InvalidArgumentError("both slots of a StageLinkServer must use the same TLS options");
  }
  std::unique_ptr<StageLinkServer> s(new StageLinkServer());
  std::vector<grpc::Service*> services;
  int max_frame = 0;
  if (upstream.has_value()) {
    s->upstream_ = std::make_unique<Service>(*upstream, "upstream");
    s->adapters_.push_back(std::make_unique<SlotAdapter<v1::StageLink::Service, Service>>(s->upstream_.get()));
    max_frame = std::max(max_frame, upstream->limits.max_frame_bytes);
  }
  if (downstream.has_value()) {
    s->downstream_ = std::make_unique<Service>(*downstream, "downstream");
    s->adapters_.push_back(
        std::make_unique<SlotAdapter<v1::StageLinkReverse::Service, Service>>(s->downstream_.get()));
    max_frame = std::max(max_frame, downstream->limits.max_frame_bytes);
  }
  for (auto& a : s->adapters_) services.push_back(a.get());
  rpc::ServerOptions o;
  o.listen = listen;
  o.tls = upstream.has_value() ? upstream->tls : downstream->tls;
  o.max_receive_bytes = max_frame > 0 ? max_frame : rpc::kMaxFrameBytes;
  o.max_send_bytes = rpc::kMaxFrameBytes;
  o.accept_keepalive = true;
  AQSWARM_ASSIGN_OR_RETURN(rpc::StartedServer started, rpc::StartServer(o, services));
  s->server_ = std::move(started.server);
  s->port_ = started.port;
  return s;
}

absl::StatusOr<LinkConnection*> StageLinkServer::Accept(absl::Duration timeout) {
  if (upstream_ == nullptr) return absl::FailedPreconditionError("this StageLinkServer has no upstream slot");
  return upstream_->Accept(timeout);
}

absl::StatusOr<LinkConnection*> StageLinkServer::AcceptDownstream(absl::Duration timeout) {
  if (downstream_ == nullptr) return absl::FailedPreconditionError("this StageLinkServer has no downstream slot");
  return downstream_->Accept(timeout);
}

void StageLinkServer::Release(LinkConnection* connection) {
  if (upstream_ != nullptr && upstream_->Release(connection)) return;
  if (downstream_ != nullptr) downstream_->Release(connection);
}

void StageLinkServer::Shutdown(absl::Duration grace) {
  if (server_ == nullptr) return;
  if (upstream_ != nullptr) upstream_->Shutdown();
  if (downstream_ != nullptr) downstream_->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(grace));
  server_->Wait();
  server_.reset();
}

StageLinkServer::~StageLinkServer() { Shutdown(); }

}  // namespace aqswarm::stage
