// RocksDB at the boundary: converts rocksdb::Status to absl::Status and opens
// a DB directory with errors a human can act on (which path, and why: not
// writable, not a directory, locked by another process, disk full). Shared by
// RocksDbMessageStore and StateStore; nothing outside storage/ sees RocksDB.
#ifndef AQSWARM_STORAGE_ROCKSDB_UTIL_H_
#define AQSWARM_STORAGE_ROCKSDB_UTIL_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rocksdb/db.h"
#include "rocksdb/status.h"

namespace aqswarm::storage::internal {

// Corruption -> DataLoss, NotFound -> NotFound, IOError: no space ->
// ResourceExhausted, lock held -> FailedPrecondition, permission ->
// PermissionDenied, otherwise Internal; the rest by meaning. `context` (e.g.
// "open message store at /x") prefixes the message.
absl::Status FromRocksDb(const rocksdb::Status& s, absl::string_view context);

// Creates `path` (and parents) and opens the DB there; `what` names the store
// in error messages ("message store", "state store").
absl::StatusOr<std::unique_ptr<rocksdb::DB>> OpenRocksDb(const rocksdb::Options& options,
                                                        const std::string& path,
                                                        absl::string_view what);

}  // namespace aqswarm::storage::internal

#endif  // AQSWARM_STORAGE_ROCKSDB_UTIL_H_
