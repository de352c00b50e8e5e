#include "stage/link_handshake.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/text_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "stage/stage_metrics.h"

namespace aqswarm::stage {
namespace {

// The proto's name of the mode: "fp32", "directq", "aqsgd", "tiled".
std::string ModeName(v1::LinkCompression::Mode m) { return v1::LinkCompression::Mode_Name(m); }

}  // namespace

v1::LinkHello LinkHelloFor(const v1::JobSpec& job, int pipeline, int boundary, uint64_t generation, uint64_t plan) {
  v1::LinkHello h;
  h.set_job_name(job.name());
  h.set_pipeline(pipeline);
  h.set_boundary(boundary);
  h.set_generation(generation);
  h.set_seq_len(job.model().seq_len());
  h.set_d_model(job.model().d_model());
  h.set_micro_batch_size(job.micro_batch_size());
  h.set_micro_batches_per_step(job.micro_batches_per_step());
  h.set_mode(ModeName(job.compression().mode()));
  h.set_fw_bits(job.compression().fw_bits());
  h.set_bw_bits(job.compression().bw_bits());
  h.set_m_precision(v1::LinkCompression::MPrecision::Value_Name(job.compression().m_precision()));
  h.set_plan(plan);
  h.set_link_protocol(kLinkProtocol);
  return h;
}

LinkLimits LinkLimitsFor(const v1::JobSpec& job, uint64_t first_step) {
  const uint64_t b = job.micro_batch_size(), t = job.model().seq_len(), d = job.model().d_model();
  const uint64_t m = job.micro_batches_per_step();
  const uint64_t batch = b * t * d * 4;
  uint64_t largest = batch;
  if (job.model().tie_embeddings()) {
    // The head's gradient of the tied embedding is dense: every vocabulary
    // row (4 bytes of row index and d float32 values).
    largest = std::max(largest, static_cast<uint64_t>(job.model().vocab_size()) * (d * 4 + 4));
  }
  // Headroom: headers, row metadata, ids, a resend's ids.
  const uint64_t frame = largest + largest / 4 + (1 << 20);
  LinkLimits l;
  l.max_frame_bytes = static_cast<int>(std::min<uint64_t>(frame, std::numeric_limits<int>::max()));
  // Two steps of micro-batches (a neighbour runs at most a step ahead), the
  // evaluation batches, and their resends and commits.
  const uint64_t frames = 4 * (m + job.eval_batches()) + 64;
  l.max_queued_frames = frames;
  l.max_queued_bytes = std::max<uint64_t>(64ull << 20, (2 * m + 8) * static_cast<uint64_t>(l.max_frame_bytes));
  l.step_window = kLinkStepWindow;
  l.first_step = first_step;
  return l;
}

v1::LinkHelloAck CheckHello(const v1::LinkHello& got, const v1::LinkHello& want, std::string* detail) {
  v1::LinkHelloAck ack;
  if (got.plan() < want.plan()) {  // a stale dialer, about to be stopped
    CountRejectedMessage(RejectReason::kLinkPlanOlder);
    ack.set_reason("the dialer's plan is older than this stage's");
    return ack;
  }
  if (got.plan() > want.plan()) {  // this end is stale: its daemon restarts it on the new plan
    CountRejectedMessage(RejectReason::kLinkPlanNewer);
    ack.set_retry(true);
    ack.set_reason("this stage does not run that plan yet");
    return ack;
  }
  if (got.SerializeAsString() != want.SerializeAsString()) {
    CountRejectedMessage(RejectReason::kLinkHelloMismatch);
    std::vector<std::string> names, values;
    const google::protobuf::Descriptor* d = v1::LinkHello::descriptor();
    for (int i = 0; i < d->field_count(); ++i) {
      const google::protobuf::FieldDescriptor* fd = d->field(i);
      std::string g, w;
      google::protobuf::TextFormat::PrintFieldValueToString(got, fd, -1, &g);
      google::protobuf::TextFormat::PrintFieldValueToString(want, fd, -1, &w);
      if (g == w) continue;
      names.push_back(fd->name());
      // The dialer's values are bounded by the frame limit; shown cut short.
      values.push_back(absl::StrCat(fd->name(), " ", g.substr(0, 64), ", expected ", w));
    }
    ack.set_reason(absl::StrCat("link parameters differ: ", absl::StrJoin(names, ", ")));
    if (detail != nullptr) *detail = absl::StrJoin(values, "; ");
    return ack;
  }
  ack.set_accepted(true);
  return ack;
}

LinkServerOptions UpstreamServerOptions(const v1::LinkHello& want, const std::string& expected_peer,
                                        const rpc::ShapingOptions& shaping, const rpc::TlsOptions& tls,
                                        const LinkLimits& limits) {
  LinkServerOptions o;
  o.shaping = shaping;
  o.tls = tls;
  o.limits = limits;
  o.expected_peer = expected_peer;
  o.check_hello = [want](const v1::LinkHello& got, std::string* detail) { return CheckHello(got, want, detail); };
  return o;
}

namespace {

// DialNext (`reverse` false) and DialPrevious (true): dial, send the hello,
// wait for the answer; again on a retryable refusal until `timeout`.
absl::StatusOr<std::unique_ptr<LinkConnection>> DialAndGreet(const std::string& address, const v1::LinkHello& hello,
                                                             const rpc::ShapingOptions& shaping,
                                                             const rpc::TlsOptions& tls, absl::Duration timeout,
                                                             const std::string& expected_peer, const LinkLimits& limits,
                                                             bool reverse) {
  rpc::TlsOptions checked = tls;
  // The far end's certificate must carry the name the assignment gives
  // it (certificates name their process in a DNS subjectAltName).
  if (tls.enabled() && !expected_peer.empty()) checked.target_name_override = expected_peer;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(50);
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    absl::StatusOr<std::unique_ptr<LinkConnection>> dialed =
        LinkConnection::Dial(address, shaping, left, checked, limits, reverse);
    if (!dialed.ok() && !checked.target_name_override.empty()) {
      return absl::Status(dialed.status().code(),
                          absl::StrCat(dialed.status().message(), " (or its certificate does not name '",
                                       expected_peer, "', the peer the assignment names)"));
    }
    AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<LinkConnection> down, std::move(dialed));
    v1::LinkFrame f;
    *f.mutable_hello() = hello;
    const absl::Status sent = down->Send(std::move(f));
    absl::StatusOr<v1::LinkFrame> answer =
        sent.ok() ? down->Receive([](auto& x) { return x.has_hello_ack(); }, left) : sent;
    // Why we dial again: the stream broke before an answer (the port may
    // still belong to an incarnation of the previous plan being stopped: it
    // took the connection, then died), the acceptor was busy vetting other
    // connections, or an end of an older plan said retry.
    absl::Status again;
    if (!answer.ok()) {
      if (!absl::IsUnavailable(answer.status()) && !absl::IsResourceExhausted(answer.status())) {
        return answer.status();
      }
      again = answer.status();
    } else if (answer->hello_ack().accepted()) {
      return down;
    } else {
      again = absl::FailedPreconditionError(absl::StrCat("stage ", reverse ? hello.boundary() : hello.boundary() + 1,
                                                         " refused the link: ", answer->hello_ack().reason()));
      down->CloseSend();
      if (!answer->hello_ack().retry()) return again;
    }
    down.reset();
    if (absl::Now() + backoff > deadline) return again;
    AQSWARM_LOG(INFO) << "stage " << (reverse ? hello.boundary() + 1 : hello.boundary()) << ": " << again.message()
                      << "; dialing again";
    absl::SleepFor(backoff);  // retry backoff, not synchronisation
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<LinkConnection>> DialNext(const std::string& address, const v1::LinkHello& hello,
                                                         const rpc::ShapingOptions& shaping, const rpc::TlsOptions& tls,
                                                         absl::Duration timeout, const std::string& expected_peer,
                                                         const LinkLimits& limits) {
  return DialAndGreet(address, hello, shaping, tls, timeout, expected_peer, limits, /*reverse=*/false);
}

absl::StatusOr<std::unique_ptr<LinkConnection>> DialPrevious(const std::string& address, const v1::LinkHello& hello,
                                                             const rpc::ShapingOptions& shaping,
                                                             const rpc::TlsOptions& tls, absl::Duration timeout,
                                                             const std::string& expected_peer,
                                                             const LinkLimits& limits) {
  return DialAndGreet(address, hello, shaping, tls, timeout, expected_peer, limits, /*reverse=*/true);
}

absl::StatusOr<LinkConnection*> AcceptPrevious(StageLinkServer& server, absl::Duration timeout) {
  return server.Accept(timeout);
}

absl::StatusOr<LinkConnection*> AcceptNext(StageLinkServer& server, absl::Duration timeout) {
  return server.AcceptDownstream(timeout);
}

}  // namespace aqswarm::stage
