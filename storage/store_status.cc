#include "storage/store_status.h"

#include "absl/strings/cord.h"

namespace aqswarm::storage {
namespace {

constexpr absl::string_view kDiskFull = "type.aqswarm/storage.DiskFull";

}  // namespace

absl::Status DiskFullError(absl::string_view message) {
  absl::Status s = absl::ResourceExhaustedError(message);
  s.SetPayload(kDiskFull, absl::Cord("1"));
  return s;
}

bool IsDiskFull(const absl::Status& s) {
  return absl::IsResourceExhausted(s) && s.GetPayload(kDiskFull).has_value();
}

}  // namespace aqswarm::storage
