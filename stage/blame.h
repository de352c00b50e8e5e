// Whom a stage's error blames: a v1::Blame carried as a payload of the
// absl::Status that ends the stage, set where the error is found (a refused
// frame, a neighbour that stopped sending) and read once, by the stage's
// main, into ErrorEvent.blame (with the neighbour's id and name from the
// launch). The peer daemon reports it to the coordinator, which keeps
// strikes per peer (coordinator/swarm_coordinator.h, ReportBlame).
//
//   return Blamed(absl::InvalidArgumentError("..."), v1::Blame::UPSTREAM, v1::Blame::REFUSED,
//                 "activation_nonfinite", step);
//   if (std::optional<v1::Blame> b = BlameOf(status)) ...
#ifndef AQSWARM_STAGE_BLAME_H_
#define AQSWARM_STAGE_BLAME_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/events.pb.h"

namespace aqswarm::stage {

// `s` with a blame payload; an error that already blames someone keeps its
// blame, except that an unset link or step (-1) is filled in (a link
// transport refuses a frame without knowing which link or step it serves).
// OK stays OK.
absl::Status Blamed(absl::Status s, v1::Blame::Link link, v1::Blame::Kind kind, absl::string_view reason,
                    int64_t step);
// A link's error as the step protocol sees it: a timeout is SILENT, a
// refusal the transport already blamed keeps its kind, anything else
// (closed, reset, unreachable) is LINK_LOST.
absl::Status BlamedLinkError(absl::Status s, v1::Blame::Link link, int64_t step);
// The blame `s` carries, if any.
std::optional<v1::Blame> BlameOf(const absl::Status& s);

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_BLAME_H_
