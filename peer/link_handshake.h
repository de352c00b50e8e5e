// Opening a stage link: the upstream stage dials and sends a LinkHello, the
// downstream stage accepts and answers a LinkHelloAck. The two hellos must
// be equal: same job, pipeline, boundary, AQ-SGD generation, shapes, codec
// and plan. Ends of different swarm plans are different incarnations: a
// dialer of an older plan is refused and the acceptor keeps waiting; an
// acceptor of an older plan tells the dialer to retry and ends itself (it
// is about to be stopped).
//
//   v1::LinkHello h = LinkHelloFor(job, pipeline, /*boundary=*/stage, generation, plan);
//   upstream:   AQSWARM_ASSIGN_OR_RETURN(auto down, DialNext(next_address, h, shaping, tls, timeout));
//   downstream: AQSWARM_ASSIGN_OR_RETURN(LinkConnection* up, AcceptPrevious(server, h, timeout));
#ifndef AQSWARM_PEER_LINK_HANDSHAKE_H_
#define AQSWARM_PEER_LINK_HANDSHAKE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "peer/link_transport.h"
#include "proto/job.pb.h"

namespace aqswarm::peer {

// LinkHello::link_protocol of this build (proto/link.proto).
inline constexpr uint32_t kLinkProtocol = 2;

// The hello of the link between stages `boundary` and `boundary` + 1.
v1::LinkHello LinkHelloFor(const v1::JobSpec& job, int pipeline, int boundary, uint64_t generation, uint64_t plan);

// Dials `address` and exchanges hellos; an acceptor of an older plan (or a
// stream that broke before its answer) is dialed again, backing off, until
// `timeout`. A refusal for any other reason is final.
absl::StatusOr<std::unique_ptr<LinkConnection>> DialNext(const std::string& address, const v1::LinkHello& hello,
                                                         const rpc::ShapingOptions& shaping, const rpc::TlsOptions& tls,
                                                         absl::Duration timeout);

// Accepts the upstream stage's connection whose hello equals `want`; dialers
// of an older plan (and ones that die before their hello) are refused and
// it keeps waiting. Errors: Aborted when the dialer runs a newer plan (this
// end is stale), FailedPrecondition when the parameters differ.
absl::StatusOr<LinkConnection*> AcceptPrevious(StageLinkServer& server, const v1::LinkHello& want,
                                               absl::Duration timeout);

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_LINK_HANDSHAKE_H_
