// Typed statuses of the stores: a full disk is a ResourceExhausted status
// that carries a payload saying so, so callers tell it from other
// ResourceExhausted statuses (a store's byte budget, memory) without
// reading messages.
//
//   if (storage::IsDiskFull(s)) ...   // say what bounds the store
#ifndef AQSWARM_STORAGE_STORE_STATUS_H_
#define AQSWARM_STORAGE_STORE_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace aqswarm::storage {

// ResourceExhausted with `message` and the disk-full payload.
absl::Status DiskFullError(absl::string_view message);
// Whether `s` is (or was propagated unchanged from) a DiskFullError.
bool IsDiskFull(const absl::Status& s);

}  // namespace aqswarm::storage

#endif  // AQSWARM_STORAGE_STORE_STATUS_H_
