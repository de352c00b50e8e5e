// Opening a stage link: the upstream stage dials and sends a LinkHello, the
// downstream stage's StageLinkServer vets it and answers a LinkHelloAck. The
// two hellos must be equal: same job, pipeline, boundary, AQ-SGD generation,
// shapes, codec and plan. Only the upstream the assignment names may open
// the link: under mutual TLS the server refuses any other certificate name
// (LinkServerOptions::expected_peer) and the dialer checks the downstream's
// certificate (DialNext's `expected_peer`). A connection that is not that
// peer, says nothing within the hello deadline, or sends a hello that does
// not match is answered in a few words (never the expected hello), dropped
// and counted, while the stage keeps waiting for its upstream until
// link_timeout. Plans: a dialer of an older plan is refused for good (it is
// about to be stopped); a dialer of a newer plan is refused with `retry`
// (this end is the stale one: its daemon learns the new plan from the
// coordinator and restarts it, and the dialer gets the new incarnation).
//
//   v1::LinkHello h = LinkHelloFor(job, pipeline, /*boundary=*/stage, generation, plan);
//   upstream:   AQSWARM_ASSIGN_OR_RETURN(auto down, DialNext(next_address, h, shaping, tls, timeout, "peer-b"));
//   downstream: LinkServerOptions so = UpstreamServerOptions(h, "peer-a", shaping, tls, LinkLimitsFor(job, 0));
//               AQSWARM_ASSIGN_OR_RETURN(auto server, StageLinkServer::StartWith(listen, so));
//               AQSWARM_ASSIGN_OR_RETURN(LinkConnection* up, AcceptPrevious(*server, timeout));
#ifndef AQSWARM_STAGE_LINK_HANDSHAKE_H_
#define AQSWARM_STAGE_LINK_HANDSHAKE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "stage/link_transport.h"
#include "proto/job.pb.h"

namespace aqswarm::stage {

// LinkHello::link_protocol of this build (proto/link.proto).
inline constexpr uint32_t kLinkProtocol = 2;

// The hello of the link between stages `boundary` and `boundary` + 1.
v1::LinkHello LinkHelloFor(const v1::JobSpec& job, int pipeline, int boundary, uint64_t generation, uint64_t plan);

// The bounds of a link of `job` (stage/link_transport.h LinkLimits): the
// largest frame is an activation or gradient batch as float32
// (micro_batch_size x seq_len x d_model x 4 bytes), or with tied
// embeddings the head's dense gradient (vocab_size x (d_model + 1) x 4
// bytes), plus headroom; queues hold a few steps of frames; frames more
// than kLinkStepWindow steps ahead of `first_step` (then of SetStep) are
// refused.
inline constexpr uint64_t kLinkStepWindow = 4;
LinkLimits LinkLimitsFor(const v1::JobSpec& job, uint64_t first_step);

// The answer to a dialer's hello when this end expects `want`; refusals are
// counted by reason (link_plan_older, link_plan_newer, link_hello_mismatch).
// A mismatch's reason names the fields that differ, never their values;
// `*detail` (optional) gets the values, for this end's log and errors.
v1::LinkHelloAck CheckHello(const v1::LinkHello& got, const v1::LinkHello& want, std::string* detail = nullptr);

// A StageLinkServer slot's options for a stage that expects the hello `want`
// from the peer named `expected_peer` (its certificate name; "" = any): its
// upstream, or for a reversed link its downstream.
LinkServerOptions UpstreamServerOptions(const v1::LinkHello& want, const std::string& expected_peer,
                                        const rpc::ShapingOptions& shaping, const rpc::TlsOptions& tls,
                                        const LinkLimits& limits);

// Dials `address` and exchanges hellos; an acceptor of an older plan (or a
// stream that broke before its answer, or an acceptor busy vetting other
// connections) is dialed again, backing off, until `timeout`. A refusal for
// any other reason is final. Under mutual TLS a
// non-empty `expected_peer` is the certificate name the downstream must
// present (checked against its certificate's DNS names).
absl::StatusOr<std::unique_ptr<LinkConnection>> DialNext(const std::string& address, const v1::LinkHello& hello,
                                                         const rpc::ShapingOptions& shaping, const rpc::TlsOptions& tls,
                                                         absl::Duration timeout, const std::string& expected_peer = "",
                                                         const LinkLimits& limits = {});

// Waits until the server (started with UpstreamServerOptions) has accepted
// its upstream, at most `timeout`; refused connections do not end the wait.
absl::StatusOr<LinkConnection*> AcceptPrevious(StageLinkServer& server, absl::Duration timeout);

// A reversed link (the downstream cannot accept connections): the
// downstream dials its upstream's downstream slot (StageLinkReverse) with
// the same hello the upstream would send (`hello.boundary` is the
// upstream's stage), retrying as DialNext does; `expected_peer` names the
// upstream. The upstream serves that slot (StageLinkServer::StartSlots with
// UpstreamServerOptions for the downstream's hello) and takes the link with
// AcceptNext.
absl::StatusOr<std::unique_ptr<LinkConnection>> DialPrevious(const std::string& address, const v1::LinkHello& hello,
                                                             const rpc::ShapingOptions& shaping,
                                                             const rpc::TlsOptions& tls, absl::Duration timeout,
                                                             const std::string& expected_peer = "",
                                                             const LinkLimits& limits = {});
absl::StatusOr<LinkConnection*> AcceptNext(StageLinkServer& server, absl::Duration timeout);

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_LINK_HANDSHAKE_H_
