#include "proto/event_json.h"

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"

namespace aqswarm::events {
namespace {

template <typename Event>
absl::StatusOr<Event> Parse(absl::string_view line) {
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
  Event e;
  google::protobuf::util::JsonParseOptions o;
  o.ignore_unknown_fields = false;
  const auto s = google::protobuf::util::JsonStringToMessage(std::string(line), &e, o);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("not a ", Event::descriptor()->name(), " line (",
                                                   s.message().as_string(), "): ", line.substr(0, 200)));
  }
  if (e.kind_case() == Event::KIND_NOT_SET) {
    return absl::InvalidArgumentError(absl::StrCat("a ", Event::descriptor()->name(), " without a kind: ",
                                                   line.substr(0, 200)));
  }
  return e;
}

}  // namespace

std::string ToJsonLine(const google::protobuf::Message& event) {
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  std::string out;
  // Printing a message we built cannot fail (no Any, no unresolvable types).
  (void)google::protobuf::util::MessageToJsonString(event, &out, o);
  return out;
}

absl::StatusOr<v1::StageEvent> ParseStageEvent(absl::string_view line) { return Parse<v1::StageEvent>(line); }
absl::StatusOr<v1::PeerEvent> ParsePeerEvent(absl::string_view line) { return Parse<v1::PeerEvent>(line); }
absl::StatusOr<v1::CoordinatorEvent> ParseCoordinatorEvent(absl::string_view line) {
  return Parse<v1::CoordinatorEvent>(line);
}

v1::PeerEvent FromStage(v1::StageEvent event) {
  v1::PeerEvent p;
  *p.mutable_stage() = std::move(event);
  return p;
}

}  // namespace aqswarm::events
