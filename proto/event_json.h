// The one writer and reader of progress events (proto/events.proto): one
// JSON object per line in protobuf's JSON mapping, proto field names, every
// scalar printed (zeros too), 64-bit integers as strings, non-finite doubles
// as "NaN" / "Infinity" / "-Infinity".
//
//   v1::StageEvent e;
//   e.mutable_eval()->set_step(3);
//   e.mutable_eval()->set_val_loss(4.2);
//   std::string line = events::ToJsonLine(e);   // {"eval":{"stage":0,...}}
//   AQSWARM_ASSIGN_OR_RETURN(v1::StageEvent back, events::ParseStageEvent(line));
//
// Python scripts read the same lines with scripts/aqswarm_events.py.
#ifndef AQSWARM_PROTO_EVENT_JSON_H_
#define AQSWARM_PROTO_EVENT_JSON_H_

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "google/protobuf/message.h"
#include "proto/events.pb.h"

namespace aqswarm::events {

// One line, no trailing newline.
std::string ToJsonLine(const google::protobuf::Message& event);

// Errors (InvalidArgument): not JSON, not an object of the message's shape,
// an unknown field, or no event kind set.
absl::StatusOr<v1::StageEvent> ParseStageEvent(absl::string_view line);
absl::StatusOr<v1::PeerEvent> ParsePeerEvent(absl::string_view line);
absl::StatusOr<v1::CoordinatorEvent> ParseCoordinatorEvent(absl::string_view line);

// A stage event as its peer daemon passes it on.
v1::PeerEvent FromStage(v1::StageEvent event);

}  // namespace aqswarm::events

#endif  // AQSWARM_PROTO_EVENT_JSON_H_
