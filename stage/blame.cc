#include "stage/blame.h"

#include <string>

#include "absl/strings/cord.h"

namespace aqswarm::stage {
namespace {

constexpr absl::string_view kBlameUrl = "type.googleapis.com/aqswarm.v1.Blame";

}  // namespace

absl::Status Blamed(absl::Status s, v1::Blame::Link link, v1::Blame::Kind kind, absl::string_view reason,
                    int64_t step) {
  if (s.ok()) return s;
  v1::Blame b;
  if (std::optional<v1::Blame> had = BlameOf(s)) {
    b = *had;
    if (b.link() == v1::Blame::LINK_UNSPECIFIED) b.set_link(link);
    if (b.step() < 0) b.set_step(step);
  } else {
    b.set_kind(kind);
    b.set_link(link);
    b.set_reason(std::string(reason));
    b.set_step(step);
  }
  s.SetPayload(kBlameUrl, absl::Cord(b.SerializeAsString()));
  return s;
}

absl::Status BlamedLinkError(absl::Status s, v1::Blame::Link link, int64_t step) {
  if (absl::IsDeadlineExceeded(s)) return Blamed(std::move(s), link, v1::Blame::SILENT, "timeout", step);
  return Blamed(std::move(s), link, v1::Blame::LINK_LOST, "link_lost", step);
}

std::optional<v1::Blame> BlameOf(const absl::Status& s) {
  const auto payload = s.GetPayload(kBlameUrl);
  if (!payload.has_value()) return std::nullopt;
  v1::Blame b;
  if (!b.ParseFromString(std::string(*payload))) return std::nullopt;
  return b;
}

}  // namespace aqswarm::stage
