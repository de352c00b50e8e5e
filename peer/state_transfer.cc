#include "peer/state_transfer.h"

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/status_macros.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/status.h"
#include "grpcpp/grpcpp.h"
#include "peer/peer_metrics.h"

namespace aqswarm::peer {

class StateTransferServer::Service final : public v1::StateTransfer::Service {
 public:
  Service(StateProvider provider, size_t chunk) : provider_(std::move(provider)), chunk_(chunk) {}

  grpc::Status Fetch(grpc::ServerContext* ctx, const v1::StateRequest* req,
                     grpc::ServerWriter<v1::StateChunk>* writer) override {
    absl::StatusOr<StateSnapshot> snap = provider_(*req);
    if (!snap.ok()) {
      return rpc::ToGrpc(snap.status());
    }
    const std::string& b = snap->bytes;
    const uint64_t sum = Checksum64(b.data(), b.size());
    size_t off = 0;
    do {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "joiner went away");
      const size_t len = std::min(chunk_, b.size() - off);
      v1::StateChunk c;
      c.set_total_bytes(b.size());
      c.set_offset(off);
      c.set_step(snap->step);
      c.set_data(b.substr(off, len));
      off += len;
      if (off == b.size()) c.set_checksum(sum);
      if (!writer->Write(c)) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "joiner went away");
    } while (off < b.size());
    return grpc::Status::OK;
  }

  grpc::Status Probe(grpc::ServerContext*, const v1::ProbeRequest* req, v1::ProbeResponse* resp) override {
    resp->set_received_bytes(req->payload().size());
    return grpc::Status::OK;
  }

 private:
  StateProvider provider_;
  size_t chunk_;
};

absl::StatusOr<std::unique_ptr<StateTransferServer>> StateTransferServer::Start(const std::string& listen,
                                                                                StateProvider provider,
                                                                                size_t chunk_bytes,
                                                                                const rpc::TlsOptions& tls) {
  std::unique_ptr<StateTransferServer> s(new StateTransferServer());
  s->service_ = std::make_unique<Service>(std::move(provider), std::max<size_t>(chunk_bytes, 1));
  rpc::ServerOptions o;
  o.listen = listen;
  o.tls = tls;
  o.max_receive_bytes = kMaxProbeBytes + (64 << 10);  // a probe's payload and its framing
  AQSWARM_ASSIGN_OR_RETURN(rpc::StartedServer started, rpc::StartServer(o, {s->service_.get()}));
  s->server_ = std::move(started.server);
  s->port_ = started.port;
  return s;
}

StateTransferServer::~StateTransferServer() {
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }
}

absl::StatusOr<StateSnapshot> FetchState(const std::string& target, const v1::StateRequest& request,
                                         const FetchOptions& options) {
  AQSWARM_ASSIGN_OR_RETURN(auto channel, rpc::MakeChannel(target, options.tls, rpc::BulkChannel()));
  auto stub = v1::StateTransfer::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options.timeout));
  auto reader = stub->Fetch(&ctx, request);
  StateSnapshot out;
  v1::StateChunk c;
  uint64_t total = 0;
  bool first = true, done = false;
  absl::Status bad;
  while (reader->Read(&c)) {
    if (done) {
      bad = absl::DataLossError("state transfer: data after the last chunk");
      break;
    }
    if (first) {
      total = c.total_bytes();
      if (total > options.max_bytes) {
        bad = absl::ResourceExhaustedError(absl::StrCat("state transfer: ", total, " bytes exceed the limit of ",
                                                        options.max_bytes));
        break;
      }
      out.bytes.reserve(total);
      out.step = c.step();
      first = false;
    }
    if (c.total_bytes() != total || c.offset() != out.bytes.size() || c.data().size() > total - out.bytes.size() ||
        c.step() != out.step) {
      bad = absl::DataLossError(absl::StrCat("state transfer: chunk at offset ", c.offset(), " (", c.data().size(),
                                             " bytes, total ", c.total_bytes(), ") does not continue the ",
                                             out.bytes.size(), " bytes received"));
      break;
    }
    out.bytes += c.data();
    if (out.bytes.size() == total) {
      if (c.checksum() != Checksum64(out.bytes.data(), out.bytes.size())) {
        bad = absl::DataLossError("state transfer: checksum of the received state does not match");
        break;
      }
      done = true;
    }
  }
  if (!bad.ok()) {
    CountRejectedMessage("state_chunk_invalid");
    ctx.TryCancel();
    reader->Finish().ok();
    return bad;
  }
  AQSWARM_RETURN_IF_ERROR(rpc::FromGrpc(reader->Finish(), absl::StrCat("state transfer from ", target)));
  if (first || !done) {
    return absl::DataLossError(absl::StrCat("state transfer from ", target, " ended after ", out.bytes.size(), " of ",
                                            total, " bytes"));
  }
  return out;
}

absl::StatusOr<LinkProbeResult> ProbeLink(const std::string& target, const ProbeOptions& options) {
  if (options.payload_bytes < 1 || options.payload_bytes > kMaxProbeBytes) {
    return absl::InvalidArgumentError(absl::StrCat("probe payload must be in [1, ", kMaxProbeBytes, "] bytes"));
  }
  if (options.rounds < 1 || options.rounds > 100) return absl::InvalidArgumentError("probe rounds must be in [1, 100]");
  AQSWARM_ASSIGN_OR_RETURN(auto channel, rpc::MakeChannel(target, options.tls, rpc::BulkChannel()));
  auto stub = v1::StateTransfer::NewStub(channel);
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options.timeout);
  // Returns the call's wall time.
  auto timed_call = [&](const v1::ProbeRequest& req) -> absl::StatusOr<absl::Duration> {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    v1::ProbeResponse resp;
    const absl::Time start = absl::Now();
    AQSWARM_RETURN_IF_ERROR(rpc::FromGrpc(stub->Probe(&ctx, req, &resp), absl::StrCat("link probe to ", target)));
    const absl::Duration took = absl::Now() - start;
    if (resp.received_bytes() != req.payload().size()) {
      return absl::DataLossError(absl::StrCat("link probe to ", target, ": it received ", resp.received_bytes(),
                                              " of ", req.payload().size(), " bytes"));
    }
    return took;
  };
  v1::ProbeRequest empty, full;
  full.mutable_payload()->assign(options.payload_bytes, '\x5a');
  AQSWARM_RETURN_IF_ERROR(timed_call(empty).status());  // connects (TLS handshake, HTTP/2 setup): not timed
  absl::Duration rtt = absl::InfiniteDuration(), transfer = absl::InfiniteDuration();
  for (int i = 0; i < options.rounds; ++i) {
    AQSWARM_ASSIGN_OR_RETURN(absl::Duration e, timed_call(empty));
    rtt = std::min(rtt, e);
  }
  for (int i = 0; i < options.rounds; ++i) {
    AQSWARM_ASSIGN_OR_RETURN(absl::Duration t, timed_call(full));
    transfer = std::min(transfer, t);
  }
  const double seconds = std::max(absl::ToDoubleSeconds(transfer - rtt), 1e-6);
  return LinkProbeResult{std::min(1e12, static_cast<double>(options.payload_bytes) / seconds),
                         std::min(60.0, absl::ToDoubleSeconds(rtt))};
}

}  // namespace aqswarm::peer
