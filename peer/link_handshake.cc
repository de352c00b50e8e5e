#include "peer/link_handshake.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "peer/peer_metrics.h"

namespace aqswarm::peer {
namespace {

const char* ModeName(v1::LinkCompression::Mode m) {
  switch (m) {
    case v1::LinkCompression::aqsgd: return "aqsgd";
    case v1::LinkCompression::directq: return "directq";
    default: return "fp32";
  }
}

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
  h.set_m_precision(job.compression().m_precision());
  h.set_plan(plan);
  h.set_link_protocol(kLinkProtocol);
  return h;
}

absl::StatusOr<std::unique_ptr<LinkConnection>> DialNext(const std::string& address, const v1::LinkHello& hello,
                                                         const rpc::ShapingOptions& shaping, const rpc::TlsOptions& tls,
                                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(50);
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<LinkConnection> down, LinkConnection::Dial(address, shaping, left, tls));
    v1::LinkFrame f;
    *f.mutable_hello() = hello;
    const absl::Status sent = down->Send(std::move(f));
    absl::StatusOr<v1::LinkFrame> answer =
        sent.ok() ? down->Receive([](auto& x) { return x.has_hello_ack(); }, left) : sent;
    // Why we dial again: the stream broke before an answer (the port may
    // still belong to an incarnation of the previous plan being stopped: it
    // took the connection, then died), or an end of an older plan said retry.
    absl::Status again;
    if (!answer.ok()) {
      if (!absl::IsUnavailable(answer.status())) return answer.status();
      again = answer.status();
    } else if (answer->hello_ack().accepted()) {
      return down;
    } else {
      again = absl::FailedPreconditionError(
          absl::StrCat("stage ", hello.boundary() + 1, " refused the link: ", answer->hello_ack().reason()));
      down->CloseSend();
      if (!answer->hello_ack().retry()) return again;
    }
    down.reset();
    if (absl::Now() + backoff > deadline) return again;
    AQSWARM_LOG(INFO) << "stage " << hello.boundary() << ": " << again.message() << "; dialing again";
    absl::SleepFor(backoff);  // retry backoff, not synchronisation
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

absl::StatusOr<LinkConnection*> AcceptPrevious(StageLinkServer& server, const v1::LinkHello& want,
                                               absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const uint64_t plan = want.plan();
  const uint32_t stage = want.boundary() + 1;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    AQSWARM_ASSIGN_OR_RETURN(LinkConnection * up, server.Accept(left));
    absl::StatusOr<v1::LinkFrame> first = up->Receive([](auto& x) { return x.has_hello(); }, left);
    if (absl::IsUnavailable(first.status())) {  // a dialer that died before its hello (a stale incarnation)
      server.Release(up);
      continue;
    }
    AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame hello, std::move(first));
    v1::LinkFrame ack;
    const v1::LinkHello& got = hello.hello();
    if (got.plan() < plan) {  // a stale dialer: not for us; keep waiting
      ack.mutable_hello_ack()->set_reason(absl::StrCat("plan ", got.plan(), " is older than this stage's ", plan));
      (void)up->Send(ack);
      server.Release(up);
      continue;
    }
    if (got.plan() > plan) {  // we are the stale end: the dialer should retry
      ack.mutable_hello_ack()->set_retry(true);
      ack.mutable_hello_ack()->set_reason(absl::StrCat("this stage runs plan ", plan, ", older than ", got.plan()));
      (void)up->Send(ack);
      return absl::AbortedError(absl::StrCat("stage ", stage - 1, " runs a newer plan (", got.plan(), " > ", plan,
                                             "): this incarnation is stale"));
    }
    const bool same = got.SerializeAsString() == want.SerializeAsString();
    ack.mutable_hello_ack()->set_accepted(same);
    if (!same) {
      ack.mutable_hello_ack()->set_reason(absl::StrCat("link parameters differ: got {", got.ShortDebugString(),
                                                       "}, expected {", want.ShortDebugString(), "}"));
    }
    AQSWARM_RETURN_IF_ERROR(up->Send(ack));
    if (!same) {
      CountRejectedMessage("link_hello_mismatch");
      return absl::FailedPreconditionError(ack.hello_ack().reason());
    }
    return up;
  }
}

}  // namespace aqswarm::peer
