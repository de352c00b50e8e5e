// Why a stage process refused a message from the network: one enum, one
// name table. The names are the `reason` label of
// aqswarm_peer_rejected_messages_total (stage/stage_metrics.h) and what the
// docs and dashboards say (docs/SECURITY.md).
#ifndef AQSWARM_STAGE_REJECT_REASON_H_
#define AQSWARM_STAGE_REJECT_REASON_H_

#include "absl/strings/string_view.h"

namespace aqswarm::stage {

enum class RejectReason : int {
  // StageLink (stage/link_handshake.h, stage/link_transport.h)
  kLinkHelloMismatch,      // the hello names another job, slot or generation
  kLinkPlanOlder,          // the hello's plan is older than ours: a stale incarnation
  kLinkPlanNewer,          // newer than ours: we are the stale one
  kLinkWrongPeer,          // under mTLS, not the certificate the assignment names
  kLinkHelloSilent,        // no hello in time
  kLinkNotHello,           // the first frame is no hello
  kLinkTooManyCandidates,  // more would-be neighbours than the slot vets at once
  kSecondUpstream,         // the slot already has its upstream
  kSecondDownstream,       // the slot already has its downstream
  kLinkFramesOverCap,      // more frames held than the link's limits allow
  kLinkBytesOverCap,       // more bytes held than the link's limits allow
  kLinkStepOutOfWindow,    // a frame too far ahead of or behind this stage's step
  // The step protocol (stage/step_protocol.h)
  kActivationInvalid,
  kActivationNonfinite,
  kGradientInvalid,
  kGradientNonfinite,
  kNormInvalid,
  kResendInvalid,
  // The replicas' exchange (stage/gradient_exchange.h, stage/exchange_mailbox.h)
  kDpChunkInvalid,
  kDpWrongGroup,
  kDpWrongPeer,
  kDpDuplicateChunk,
  kDpStepOutOfWindow,
  kDpMailboxFull,
  // StateTransfer (peer/state_transfer.h)
  kStateChunkInvalid,
};
inline constexpr int kNumRejectReasons = static_cast<int>(RejectReason::kStateChunkInvalid) + 1;

// The metric label, e.g. "link_hello_mismatch".
absl::string_view RejectReasonName(RejectReason r);

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_REJECT_REASON_H_
