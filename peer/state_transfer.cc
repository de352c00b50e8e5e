#include "peer/state_transfer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/status.h"
#include "grpcpp/grpcpp.h"
#include "stage/stage_metrics.h"

namespace aqswarm::peer {

namespace {

// Where a fetch's bytes come from: a file (read chunk by chunk at offsets)
// or memory.
class SnapshotReader {
 public:
  static absl::StatusOr<SnapshotReader> Open(StateSnapshot snap) {
    SnapshotReader r;
    r.step_ = snap.step;
    if (snap.path.empty()) {
      r.bytes_ = std::move(snap.bytes);
      r.size_ = r.bytes_.size();
      return r;
    }
    r.fd_ = ::open(snap.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (r.fd_ < 0) return FileError(errno, absl::StrCat("opening ", snap.path));
    struct stat st;
    if (::fstat(r.fd_, &st) != 0) return FileError(errno, absl::StrCat("stat of ", snap.path));
    r.size_ = static_cast<uint64_t>(st.st_size);
    r.path_ = snap.path;
    return r;
  }
  SnapshotReader() = default;
  SnapshotReader(SnapshotReader&& o) noexcept { *this = std::move(o); }
  SnapshotReader& operator=(SnapshotReader&& o) noexcept {
    std::swap(fd_, o.fd_);
    bytes_ = std::move(o.bytes_);
    path_ = std::move(o.path_);
    size_ = o.size_;
    step_ = o.step_;
    return *this;
  }
  ~SnapshotReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  uint64_t size() const { return size_; }
  uint64_t step() const { return step_; }
  // Bytes [off, off + len) into *out.
  absl::Status Read(uint64_t off, size_t len, std::string* out) const {
    if (fd_ < 0) {
      out->assign(bytes_, off, len);
      return absl::OkStatus();
    }
    out->resize(len);
    size_t done = 0;
    while (done < len) {
      const ssize_t n = ::pread(fd_, out->data() + done, len - done, static_cast<off_t>(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return FileError(errno, absl::StrCat("reading ", path_));
      if (n == 0) return absl::DataLossError(absl::StrCat(path_, " shrank while it was being served"));
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

 private:
  int fd_ = -1;
  std::string bytes_, path_;
  uint64_t size_ = 0, step_ = 0;
};

}  // namespace

class StateTransferServer::Service final : public v1::StateTransfer::Service {
 public:
  Service(StateProvider provider, size_t chunk, int max_fetches)
      : provider_(std::move(provider)), chunk_(chunk), max_fetches_(max_fetches) {}

  grpc::Status Fetch(grpc::ServerContext* ctx, const v1::StateRequest* req,
                     grpc::ServerWriter<v1::StateChunk>* writer) override {
    // Admission: each fetch holds a file, a chunk and a sending thread.
    if (active_.fetch_add(1) >= max_fetches_) {
      active_.fetch_sub(1);
      refused_busy_.fetch_add(1);
      stage::CountStateTransferRefused("busy");
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("this peer serves at most ", max_fetches_,
                                       " state fetches at once; try another source or again later"));
    }
    const grpc::Status s = Serve(ctx, *req, writer);
    active_.fetch_sub(1);
    return s;
  }

  grpc::Status Probe(grpc::ServerContext*, const v1::ProbeRequest* req, v1::ProbeResponse* resp) override {
    resp->set_received_bytes(req->payload().size());
    return grpc::Status::OK;
  }

  uint64_t refused_busy() const { return refused_busy_.load(); }

 private:
  grpc::Status Serve(grpc::ServerContext* ctx, const v1::StateRequest& req, grpc::ServerWriter<v1::StateChunk>* writer) {
    absl::StatusOr<StateSnapshot> snap = provider_(req);
    if (!snap.ok()) return rpc::ToGrpc(snap.status());
    absl::StatusOr<SnapshotReader> reader = SnapshotReader::Open(*std::move(snap));
    if (!reader.ok()) return rpc::ToGrpc(reader.status());
    const uint64_t total = reader->size();
    Checksummer sum;
    std::string data;
    uint64_t off = 0;
    do {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "joiner went away");
      const size_t len = static_cast<size_t>(std::min<uint64_t>(chunk_, total - off));
      if (absl::Status rs = reader->Read(off, len, &data); !rs.ok()) return rpc::ToGrpc(rs);
      sum.Update(data.data(), data.size());
      v1::StateChunk c;
      c.set_total_bytes(total);
      c.set_offset(off);
      c.set_step(reader->step());
      off += len;
      if (off == total) c.set_checksum(sum.Digest());
      c.set_data(std::move(data));
      if (!writer->Write(c)) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "joiner went away");
      data = std::move(*c.mutable_data());
    } while (off < total);
    return grpc::Status::OK;
  }

  StateProvider provider_;
  const size_t chunk_;
  const int max_fetches_;
  std::atomic<int> active_{0};
  std::atomic<uint64_t> refused_busy_{0};
};

absl::StatusOr<std::unique_ptr<StateTransferServer>> StateTransferServer::Start(const std::string& listen,
                                                                                StateProvider provider,
                                                                                size_t chunk_bytes,
                                                                                const rpc::TlsOptions& tls,
                                                                                int max_concurrent_fetches) {
  if (max_concurrent_fetches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_concurrent_fetches must be >= 1, got ", max_concurrent_fetches));
  }
  std::unique_ptr<StateTransferServer> s(new StateTransferServer());
  s->service_ = std::make_unique<Service>(std::move(provider), std::clamp<size_t>(chunk_bytes, 1, 2 << 20),
                                          max_concurrent_fetches);
  rpc::ServerOptions o;
  o.listen = listen;
  o.tls = tls;
  o.max_receive_bytes = kMaxProbeBytes + (64 << 10);  // a probe's payload and its framing
  AQSWARM_ASSIGN_OR_RETURN(rpc::StartedServer started, rpc::StartServer(o, {s->service_.get()}));
  s->server_ = std::move(started.server);
  s->port_ = started.port;
  return s;
}

uint64_t StateTransferServer::refused_busy() const { return service_->refused_busy(); }

StateTransferServer::~StateTransferServer() {
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }
}

namespace {

// Streams a fetch into `sink`, checking every chunk (see the header).
// Returns the state's step; *bytes and *sha256 describe what was passed on.
absl::StatusOr<uint64_t> FetchInto(const std::string& target, const v1::StateRequest& request,
                                   const FetchOptions& options, const std::function<absl::Status(absl::string_view)>& sink,
                                   uint64_t* bytes, std::string* sha256) {
  AQSWARM_ASSIGN_OR_RETURN(auto channel, rpc::MakeChannel(target, options.tls, rpc::BulkChannel()));
  auto stub = v1::StateTransfer::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options.timeout));
  auto reader = stub->Fetch(&ctx, request);
  v1::StateChunk c;
  uint64_t total = 0, received = 0, step = 0;
  bool first = true, done = false;
  Checksummer sum;
  Sha256 sha;
  absl::Status bad;
  const char* reason = "";
  auto refuse = [&](const char* why, absl::Status s) {
    reason = why;
    bad = std::move(s);
  };
  while (reader->Read(&c)) {
    if (done) {
      refuse("bad_chunk", absl::DataLossError("state transfer: data after the last chunk"));
      break;
    }
    if (first) {
      total = c.total_bytes();
      if (total > options.max_bytes) {
        refuse("too_large", absl::ResourceExhaustedError(absl::StrCat(
                                "state transfer: the sender declares ", total, " bytes, over the limit of ",
                                options.max_bytes)));
        break;
      }
      step = c.step();
      first = false;
    }
    if (c.total_bytes() != total || c.offset() != received || c.data().size() > total - received ||
        c.step() != step) {
      refuse("bad_chunk",
             absl::DataLossError(absl::StrCat("state transfer: chunk at offset ", c.offset(), " (", c.data().size(),
                                              " bytes, total ", c.total_bytes(), ", step ", c.step(),
                                              ") does not continue the ", received, " bytes received of ", total,
                                              " (step ", step, ")")));
      break;
    }
    sum.Update(c.data().data(), c.data().size());
    sha.Update(c.data());
    if (absl::Status s = sink(c.data()); !s.ok()) {
      bad = std::move(s);
      break;
    }
    received += c.data().size();
    if (received == total) {
      if (c.checksum() != sum.Digest()) {
        refuse("checksum", absl::DataLossError("state transfer: checksum of the received state does not match"));
        break;
      }
      done = true;
    }
  }
  if (!bad.ok()) {
    if (*reason != '\0') {
      stage::CountStateTransferRefused(reason);
      stage::CountRejectedMessage(stage::RejectReason::kStateChunkInvalid);
    }
    ctx.TryCancel();
    reader->Finish().ok();
    return bad;
  }
  AQSWARM_RETURN_IF_ERROR(rpc::FromGrpc(reader->Finish(), absl::StrCat("state transfer from ", target)));
  if (first || !done) {
    stage::CountStateTransferRefused("truncated");
    return absl::DataLossError(absl::StrCat("state transfer from ", target, " ended after ", received, " of ",
                                            total, " bytes"));
  }
  *bytes = received;
  *sha256 = sha.HexDigest();
  if (!options.expected_sha256.empty() && *sha256 != options.expected_sha256) {
    stage::CountStateTransferRefused("sha256_mismatch");
    return absl::DataLossError(absl::StrCat("state transfer from ", target, ": the state's SHA-256 is ", *sha256,
                                            ", its holders reported ", options.expected_sha256));
  }
  return step;
}

}  // namespace

absl::StatusOr<StateSnapshot> FetchState(const std::string& target, const v1::StateRequest& request,
                                         const FetchOptions& options) {
  StateSnapshot out;
  uint64_t bytes = 0;
  std::string sha;
  // The buffer grows with what arrived (never reserved from the sender's claim).
  AQSWARM_ASSIGN_OR_RETURN(out.step, FetchInto(target, request, options,
                                               [&](absl::string_view d) {
                                                 out.bytes.append(d.data(), d.size());
                                                 return absl::OkStatus();
                                               },
                                               &bytes, &sha));
  return out;
}

absl::StatusOr<FetchedState> FetchStateToFile(const std::string& target, const v1::StateRequest& request,
                                              const std::string& path, const FetchOptions& options) {
  std::string tmp = path + ".fetch.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return FileError(errno, absl::StrCat("creating a temporary file for ", path));
  FetchedState out;
  absl::StatusOr<uint64_t> step = FetchInto(
      target, request, options,
      [&](absl::string_view d) -> absl::Status {
        size_t done = 0;
        while (done < d.size()) {
          const ssize_t n = ::write(fd, d.data() + done, d.size() - done);
          if (n < 0 && errno == EINTR) continue;
          if (n < 0) return FileError(errno, absl::StrCat("writing ", tmp));
          done += static_cast<size_t>(n);
        }
        return absl::OkStatus();
      },
      &out.bytes, &out.sha256);
  absl::Status s = step.status();
  if (s.ok() && ::fchmod(fd, 0644) != 0) s = FileError(errno, absl::StrCat("setting the mode of ", tmp));
  if (::close(fd) != 0 && s.ok()) s = FileError(errno, absl::StrCat("closing ", tmp));
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  AQSWARM_RETURN_IF_ERROR(PublishFileAtomically(tmp, path));
  out.step = *step;
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
  double seconds = std::max(absl::ToDoubleSeconds(transfer - rtt), 1e-6);
  if (options.uplink_mbps > 0) seconds = std::max(seconds, options.payload_bytes * 8 / (options.uplink_mbps * 1e6));
  return LinkProbeResult{std::min(1e12, static_cast<double>(options.payload_bytes) / seconds),
                         std::min(60.0, absl::ToDoubleSeconds(rtt))};
}

}  // namespace aqswarm::peer
