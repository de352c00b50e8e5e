#include "peer/link_transport.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/status.h"
#include "peer/peer_metrics.h"
#include "grpcpp/grpcpp.h"

namespace aqswarm::peer {
namespace {




}  // namespace

// ------------------------------------------------------------ LinkConnection

LinkConnection::LinkConnection(std::string name, const rpc::ShapingOptions& shaping)
    : name_(std::move(name)), shaping_(shaping), clock_(shaping.clock_or_real()), bandwidth_mbps_(shaping.bandwidth_mbps) {}

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
      MarkBroken(absl::UnavailableError(absl::StrCat("link ", name_, ": write failed (peer gone)")));
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
    bytes_received_ += frame.ByteSizeLong();
    // Held for the rest of its wire time (bounded like the latency below: a
    // corrupt hold must not park a frame for ever).
    const absl::Time due = clock_->Now() + absl::Microseconds(std::clamp<int64_t>(frame.hold_micros(), 0, 60'000'000));
    if (shaping_.latency_ms > 0) {
      const int64_t at = frame.sent_unix_micros() + static_cast<int64_t>(shaping_.latency_ms * 1000);
      const int64_t wait = at - absl::ToUnixMicros(clock_->Now());
      if (wait > 0) clock_->SleepFor(absl::Microseconds(std::min<int64_t>(wait, 60'000'000)));
    }
    {
      // Notified under the lock: once NotifyArrivals(nullptr) returns, no
      // notification of the counter it replaced is under way.
      absl::MutexLock l(&mu_);
      inbound_.push_back({std::move(frame), due});
      if (arrivals_ != nullptr) arrivals_->Notify();
    }
    frame = v1::LinkFrame();
  }
  absl::Status final_status = FinalStatus();
  absl::MutexLock l(&mu_);
  if (broken_.ok() && !final_status.ok()) broken_ = final_status;
  reader_done_ = true;
  if (arrivals_ != nullptr) arrivals_->Notify();
}

// ------------------------------------------------------------ client side

namespace {

class ClientLink final : public LinkConnection {
 public:
  ClientLink(const std::string& target, const rpc::ShapingOptions& shaping)
      : LinkConnection(absl::StrCat("to ", target), shaping) {}

  ~ClientLink() override {
    CloseSend();
    // Give an orderly close a moment, then cancel.
    if (stream_ != nullptr && absl::IsDeadlineExceeded(WaitClosed(absl::Seconds(5)))) context_.TryCancel();
    StopThreads();
    if (reader_.joinable()) reader_.join();
  }

  absl::Status Connect(const std::string& target, absl::Duration timeout, const rpc::TlsOptions& tls) {
    // Its own TCP connection (the shaping is per link); a vanished
    // neighbour on an idle link is found within ~20 s (keepalive).
    auto channel = rpc::MakeChannel(target, tls, rpc::LinkChannel());
    if (!channel.ok()) return channel.status();
    channel_ = *std::move(channel);
    const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
    if (!channel_->WaitForConnected(deadline)) {
      // A TLS mismatch (one end plaintext, or another CA) looks like an
      // unreachable peer from here: say which mode we used.
      return absl::UnavailableError(absl::StrCat("cannot reach the next stage at ", target, " within ",
                                                 absl::FormatDuration(timeout), " over ", rpc::DescribeTls(tls),
                                                 tls.enabled() ? " (is it up, with mTLS and the same CA?)"
                                                               : " (is it up, without TLS?)"));
    }
    stub_ = v1::StageLink::NewStub(channel_);
    stream_ = stub_->Connect(&context_);
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

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::StageLink::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> stream_;
  std::thread reader_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LinkConnection>> LinkConnection::Dial(const std::string& target,
                                                                     const rpc::ShapingOptions& shaping,
                                                                     absl::Duration timeout,
                                                                     const rpc::TlsOptions& tls) {
  auto link = std::make_unique<ClientLink>(target, shaping);
  absl::Status s = link->Connect(target, timeout, tls);
  if (!s.ok()) return s;
  return std::unique_ptr<LinkConnection>(std::move(link));
}

// ------------------------------------------------------------ server side

namespace {

class ServerLink final : public LinkConnection {
 public:
  ServerLink(grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream,
             const rpc::ShapingOptions& shaping)
      : LinkConnection(absl::StrCat("from ", ctx->peer()), shaping), ctx_(ctx), stream_(stream) {}
  ~ServerLink() override { StopThreads(); }


  // Runs on the gRPC handler thread for the life of the stream: reads until
  // the upstream half-closes or vanishes, then waits until this stage has
  // closed its own sends and the writer drained (the stream must stay valid
  // meanwhile).
  void Serve() {
    StartWriter();
    ReaderLoop();
    WaitWriterDone();
  }

 protected:
  bool WriteFrame(const v1::LinkFrame& f) override { return stream_->Write(f); }
  bool ReadFrame(v1::LinkFrame* f) override { return stream_->Read(f); }
  void FinishWrites() override {}
  absl::Status FinalStatus() override {
    if (ctx_->IsCancelled()) return absl::UnavailableError(absl::StrCat("link ", name_, " was cancelled (peer gone)"));
    return absl::OkStatus();
  }

 private:
  grpc::ServerContext* ctx_;
  grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream_;
};

}  // namespace

class StageLinkServer::Service final : public v1::StageLink::Service {
 public:
  explicit Service(const rpc::ShapingOptions& shaping) : shaping_(shaping) {}

  grpc::Status Connect(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream) override {
    auto link = std::make_shared<ServerLink>(ctx, stream, shaping_);
    {
      absl::MutexLock l(&mu_);
      if (link_ != nullptr || shutdown_) {
        if (link_ != nullptr) CountRejectedMessage("second_upstream");
        return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                            "this stage already has an upstream neighbour (or is shutting down)");
      }
      link_ = link;
    }
    link->Serve();
    return grpc::Status::OK;
  }

  absl::StatusOr<LinkConnection*> Accept(absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return link_ != nullptr || shutdown_; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout) || link_ == nullptr) {
      return absl::DeadlineExceededError(absl::StrCat("the upstream stage did not connect within ",
                                                      absl::FormatDuration(timeout)));
    }
    return link_.get();
  }

  void Release(LinkConnection* connection) {
    std::shared_ptr<ServerLink> link;
    {
      absl::MutexLock l(&mu_);
      if (link_.get() != connection) return;
      link.swap(link_);
    }
    link->CloseSend();
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
  const rpc::ShapingOptions shaping_;
  absl::Mutex mu_;
  std::shared_ptr<ServerLink> link_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<std::unique_ptr<StageLinkServer>> StageLinkServer::Start(const std::string& listen,
                                                                        const rpc::ShapingOptions& shaping,
                                                                        const rpc::TlsOptions& tls) {
  std::unique_ptr<StageLinkServer> s(new StageLinkServer());
  s->service_ = std::make_unique<Service>(shaping);
  rpc::ServerOptions o;
  o.listen = listen;
  o.tls = tls;
  o.max_receive_bytes = o.max_send_bytes = rpc::kMaxFrameBytes;
  o.accept_keepalive = true;
  AQSWARM_ASSIGN_OR_RETURN(rpc::StartedServer started, rpc::StartServer(o, {s->service_.get()}));
  s->server_ = std::move(started.server);
  s->port_ = started.port;
  return s;
}

absl::StatusOr<LinkConnection*> StageLinkServer::Accept(absl::Duration timeout) { return service_->Accept(timeout); }

void StageLinkServer::Release(LinkConnection* connection) { service_->Release(connection); }

void StageLinkServer::Shutdown(absl::Duration grace) {
  if (server_ == nullptr) return;
  service_->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(grace));
  server_->Wait();
  server_.reset();
}

StageLinkServer::~StageLinkServer() { Shutdown(); }

}  // namespace aqswarm::peer
