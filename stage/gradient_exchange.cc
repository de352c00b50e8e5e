#include "stage/gradient_exchange.h"

#include <deque>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "stage/stage_metrics.h"
#include "grpcpp/grpcpp.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/status.h"

namespace aqswarm::stage {

struct GrpcReplicaExchange::Peer {
  int rank = 0;
  absl::Mutex mu;
  // Where the replica is; Retarget replaces them and bumps `target`.
  std::string address ABSL_GUARDED_BY(mu);
  std::shared_ptr<v1::GradientExchange::Stub> stub ABSL_GUARDED_BY(mu);
  uint64_t target ABSL_GUARDED_BY(mu) = 0;
  grpc::ClientContext* pushing ABSL_GUARDED_BY(mu) = nullptr;  // the push in flight, cancelled by Retarget
  std::string peer_name ABSL_GUARDED_BY(mu);  // under mutual TLS: the certificate its chunks must come with
  uint64_t incarnation ABSL_GUARDED_BY(mu) = 0;  // Retarget's
  struct Queued {
    v1::ExchangeChunk chunk;
    absl::Time queued;  // when Send took it
    double mbps;        // the exchange's bandwidth then
  };
  std::deque<Queued> queue ABSL_GUARDED_BY(mu);
  // The chunks of the newest step delivered to the current target: a
  // replica that takes its place (Retarget) gets them again, since the
  // one that vanished may have been mid-round.
  std::vector<v1::ExchangeChunk> delivered ABSL_GUARDED_BY(mu);
  bool closing ABSL_GUARDED_BY(mu) = false;
  absl::Status failed ABSL_GUARDED_BY(mu);
  std::atomic<uint64_t> bytes_sent{0};
  std::thread thread;
};

class GrpcReplicaExchange::Service final : public v1::GradientExchange::Service {
 public:
  explicit Service(GrpcReplicaExchange* owner) : owner_(owner) {}
  grpc::Status Push(grpc::ServerContext* ctx, const v1::ExchangeChunk* chunk, v1::ExchangeAck*) override {
    return rpc::ToGrpc(owner_->Deliver(*chunk, CallerCertificateName(*ctx)));
  }

 private:
  GrpcReplicaExchange* owner_;
};

GrpcReplicaExchange::GrpcReplicaExchange(const ReplicaExchangeOptions& options)
    : options_(options),
      mailbox_(options.group, options.rank, options.size, options.max_buffered_bytes, options.step_window) {
  for (int r = 0; r < options.size; ++r) {
    auto p = std::make_unique<Peer>();
    p->rank = r;
    if (!options.peer_names.empty()) p->peer_name = options.peer_names[r];
    if (r < static_cast<int>(options.incarnations.size())) p->incarnation = options.incarnations[r];
    peers_.push_back(std::move(p));
  }
}

absl::StatusOr<std::unique_ptr<GrpcReplicaExchange>> GrpcReplicaExchange::Start(const ReplicaExchangeOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(absl::StrCat("replica rank ", o.rank, " outside [0, ", o.size, ")"));
  }
  if (!o.peer_names.empty() && static_cast<int>(o.peer_names.size()) != o.size) {
    return absl::InvalidArgumentError(absl::StrCat(o.peer_names.size(), " replica peer names for ", o.size,
                                                   " replicas"));
  }
  std::unique_ptr<GrpcReplicaExchange> ex(new GrpcReplicaExchange(o));
  ex->service_ = std::make_unique<Service>(ex.get());
  rpc::ServerOptions so;
  so.listen = o.listen;
  so.tls = o.tls;
  so.max_receive_bytes = rpc::kMaxFrameBytes;
  so.accept_keepalive = true;  // the replicas' channels are link channels
  AQSWARM_ASSIGN_OR_RETURN(rpc::StartedServer started, rpc::StartServer(so, {ex->service_.get()}));
  ex->server_ = std::move(started.server);
  ex->port_ = started.port;
  return ex;
}

absl::Status GrpcReplicaExchange::Connect(const std::vector<std::string>& addresses) {
  if (static_cast<int>(addresses.size()) != options_.size) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", options_.size, " replica addresses, got ",
                                                   addresses.size()));
  }
  if (connected_) return absl::FailedPreconditionError("already connected");
  for (int r = 0; r < options_.size; ++r) {
    if (r == options_.rank) continue;
    Peer* p = peers_[r].get();
    AQSWARM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                             rpc::MakeChannel(addresses[r], options_.tls, rpc::LinkChannel()));
    {
      absl::MutexLock l(&p->mu);
      p->address = addresses[r];
      p->stub = v1::GradientExchange::NewStub(channel);
    }
    p->thread = std::thread([this, p] { SenderLoop(p); });
  }
  connected_ = true;
  return absl::OkStatus();
}

absl::Status GrpcReplicaExchange::Retarget(int rank, const std::string& address, const std::string& peer_name,
                                          uint64_t incarnation) {
  if (!connected_ || rank < 0 || rank >= options_.size || rank == options_.rank) {
    return absl::InvalidArgumentError(absl::StrCat("cannot retarget replica ", rank));
  }
  Peer* p = peers_[rank].get();
  {
    absl::MutexLock l(&p->mu);
    if (p->address == address && p->peer_name == peer_name && incarnation == p->incarnation) return absl::OkStatus();
  }
  AQSWARM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                           rpc::MakeChannel(address, options_.tls, rpc::LinkChannel()));
  absl::MutexLock l(&p->mu);
  p->address = address;
  p->peer_name = peer_name;
  p->incarnation = incarnation;
  p->stub = v1::GradientExchange::NewStub(channel);
  p->target += 1;
  p->failed = absl::OkStatus();
  if (p->pushing != nullptr) p->pushing->TryCancel();
  const absl::Time now = options_.shaping.clock_or_real()->Now();
  for (auto it = p->delivered.rbegin(); it != p->delivered.rend(); ++it) {
    p->queue.push_front({std::move(*it), now, options_.shaping.bandwidth_mbps});
  }
  p->delivered.clear();
  return absl::OkStatus();
}

GrpcReplicaExchange::~GrpcReplicaExchange() {
  for (auto& p : peers_) {
    {
      absl::MutexLock l(&p->mu);
      p->closing = true;
    }
    if (p->thread.joinable()) p->thread.join();
  }
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }
}

uint64_t GrpcReplicaExchange::bytes_sent() const {
  uint64_t n = 0;
  for (const auto& p : peers_) n += p->bytes_sent.load();
  return n;
}

absl::Status GrpcReplicaExchange::Send(int to, const v1::ExchangeChunk& chunk) {
  if (to < 0 || to >= options_.size || to == options_.rank || !connected_) {
    return absl::InvalidArgumentError(absl::StrCat("cannot send to replica ", to));
  }
  Peer* p = peers_[to].get();
  absl::MutexLock l(&p->mu);
  auto room = [p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu) { return p->queue.size() < 256 || !p->failed.ok(); };
  if (!p->mu.AwaitWithTimeout(absl::Condition(&room), options_.timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("replica ", to, " at ", p->address, " is not draining chunks"));
  }
  if (!p->failed.ok()) return p->failed;
  v1::ExchangeChunk c = chunk;
  c.set_group(options_.group);
  const auto& schedule = options_.bandwidth_schedule_mbps;
  const double mbps = schedule.empty() ? options_.shaping.bandwidth_mbps : schedule[c.step() % schedule.size()];
  p->queue.push_back({std::move(c), options_.shaping.clock_or_real()->Now(), mbps});
  return absl::OkStatus();
}

void GrpcReplicaExchange::SenderLoop(Peer* p) {
  rpc::EmulatedWire wire(options_.shaping.clock_or_real());
  // One push to the replica's current target, cancellable by Retarget;
  // `target` says which target it went to.
  auto push = [this, p](const v1::ExchangeChunk& c, absl::Time give_up, uint64_t* target) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(give_up - absl::Now()));
    ctx.set_wait_for_ready(true);
    std::shared_ptr<v1::GradientExchange::Stub> stub;
    {
      absl::MutexLock l(&p->mu);
      stub = p->stub;
      *target = p->target;
      p->pushing = &ctx;
    }
    v1::ExchangeAck ack;
    grpc::Status s = stub->Push(&ctx, c, &ack);
    absl::MutexLock l(&p->mu);
    p->pushing = nullptr;
    return s;
  };
  auto retargeted = [p](uint64_t target) {
    absl::MutexLock l(&p->mu);
    return p->target != target;
  };
  while (true) {
    v1::ExchangeChunk c;
    absl::Time queued;
    double mbps;
    {
      absl::MutexLock l(&p->mu);
      auto ready = [p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu) { return !p->queue.empty() || p->closing; };
      p->mu.Await(absl::Condition(&ready));
      if (p->queue.empty()) return;
      c = std::move(p->queue.front().chunk);
      queued = p->queue.front().queued;
      mbps = p->queue.front().mbps;
      p->queue.pop_front();
    }
    const absl::Time now = wire.Transmit(c.ByteSizeLong() + 8, queued, mbps);
    c.set_sent_unix_micros(absl::ToUnixMicros(now));
    // Counted once on the wire, before the push: the receiver can finish its
    // all-reduce (and a caller read bytes_sent()) before this push's ack.
    p->bytes_sent += c.ByteSizeLong();
    uint64_t target = 0;
    absl::Time give_up = absl::Now() + options_.timeout;
    grpc::Status s = push(c, give_up, &target);
    // A replica of another group refused it: under a swarm that is an old
    // incarnation still listening where the current one will; retry until
    // the timeout (see ReplicaExchangeOptions::group). A replica moved
    // elsewhere (Retarget) gets the chunk at its new address.
    for (absl::Duration backoff = absl::Milliseconds(50);; backoff = std::min(backoff * 2, absl::Seconds(1))) {
      if (!s.ok() && retargeted(target)) {
        give_up = absl::Now() + options_.timeout;
        s = push(c, give_up, &target);
        continue;
      }
      // With keep_delivered a successor may take the vanished replica's
      // place (Retarget): a lost connection is retried until the timeout too.
      const bool retry = s.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
                         (options_.keep_delivered && s.error_code() == grpc::StatusCode::UNAVAILABLE);
      if (!retry || absl::Now() + backoff >= give_up) break;
      {
        absl::MutexLock l(&p->mu);
        if (p->closing) return;
      }
      absl::SleepFor(backoff);  // retry backoff, not synchronisation
      s = push(c, give_up, &target);
    }
    // First chunk wins: a replica that holds this key already needs no copy
    // (a successor may get chunks its predecessor had sent).
    if (s.ok() || s.error_code() == grpc::StatusCode::ALREADY_EXISTS) {
      absl::MutexLock l(&p->mu);
      if (options_.keep_delivered && p->target == target) {
        if (!p->delivered.empty() && p->delivered.back().step() != c.step()) p->delivered.clear();
        p->delivered.push_back(std::move(c));
      }
      continue;
    }
    {
      // Sticky until the replica is retargeted (or this exchange closes).
      absl::MutexLock l(&p->mu);
      if (p->target != target) {
        p->queue.push_front({std::move(c), queued, mbps});
        continue;
      }
      p->failed = absl::UnavailableError(absl::StrCat("replica ", p->rank, " at ", p->address,
                                                      " unreachable: ", s.error_message()));
      p->queue.clear();
      auto woken = [p, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu) { return p->closing || p->target != target; };
      p->mu.Await(absl::Condition(&woken));
      if (p->closing) return;
    }
  }
}

absl::Status GrpcReplicaExchange::Deliver(v1::ExchangeChunk chunk, const std::string& caller) {
  if (options_.tls.enabled() && chunk.group() == options_.group && chunk.from_rank() < peers_.size()) {
    Peer* p = peers_[chunk.from_rank()].get();
    absl::MutexLock l(&p->mu);
    if (!p->peer_name.empty() && caller != p->peer_name) {
      CountRejectedMessage(RejectReason::kDpWrongPeer);
      return absl::PermissionDeniedError(absl::StrCat("a chunk of rank ", chunk.from_rank(),
                                                      " from a peer that is not that replica"));
    }
  }
  if (chunk.group() == options_.group && options_.shaping.latency_ms > 0) {
    // One-way latency: the sender's timestamp is trusted no further than
    // the configured latency (a handler never waits longer).
    const absl::Duration latency = absl::Milliseconds(options_.shaping.latency_ms);
    const absl::Time due = absl::FromUnixMicros(chunk.sent_unix_micros()) + latency;
    const rpc::Clock* clock = options_.shaping.clock_or_real();
    const absl::Duration wait = due - clock->Now();
    if (wait > absl::ZeroDuration()) clock->SleepFor(std::min(wait, latency));
  }
  return mailbox_.Deliver(std::move(chunk));
}

absl::StatusOr<v1::ExchangeChunk> GrpcReplicaExchange::Receive(int from, uint64_t step, uint32_t round,
                                                              v1::ExchangeChunk::Phase phase, uint32_t bucket,
                                                              uint32_t chunk) {
  Peer* p = !connected_ || from < 0 || from >= options_.size ? nullptr : peers_[from].get();
  return mailbox_.Take(from, step, round, phase, bucket, chunk, options_.timeout, [p]() {
    if (p == nullptr) return absl::OkStatus();
    absl::MutexLock pl(&p->mu);
    return p->failed;
  });
}

}  // namespace aqswarm::stage
