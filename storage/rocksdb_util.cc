#include "storage/rocksdb_util.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "storage/rocksdb_crc32c.h"
#include "storage/store_status.h"

namespace aqswarm::storage::internal {

absl::Status FromRocksDb(const rocksdb::Status& s, absl::string_view context) {
  if (s.ok()) return absl::OkStatus();
  const std::string msg = absl::StrCat(context, ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsInvalidArgument()) return absl::InvalidArgumentError(msg);
  if (s.IsNotSupported()) return absl::UnimplementedError(msg);
  if (s.IsBusy() || s.IsTryAgain() || s.IsShutdownInProgress()) return absl::UnavailableError(msg);
  if (s.IsTimedOut()) return absl::DeadlineExceededError(msg);
  if (s.IsAborted()) return absl::AbortedError(msg);
  if (s.IsIOError()) {
    if (s.IsNoSpace()) return DiskFullError(absl::StrCat(msg, " (disk full)"));
    const std::string text = s.ToString();
    if (absl::StrContains(absl::AsciiStrToLower(text), "lock")) {
      return absl::FailedPreconditionError(
          absl::StrCat(msg, " (is another process or store object using this directory?)"));
    }
    if (absl::StrContains(text, "Permission denied") ||
        absl::StrContains(text, "Read-only file system")) {
      return absl::PermissionDeniedError(msg);
    }
  }
  return absl::InternalError(msg);
}

absl::StatusOr<std::unique_ptr<rocksdb::DB>> OpenRocksDb(const rocksdb::Options& options,
                                                        const std::string& path,
                                                        absl::string_view what) {
  const std::string context = absl::StrCat("cannot open ", what, " at '", path, "'");
  // The CRC32C that RocksDB will use (rocksdb_crc32c.h), checked once against
  // the standard check value. This call is also what links the override into
  // every binary that opens a DB.
  static const bool crc32c_ok = Crc32cExtend(0, "123456789", 9) == 0xE3069283u;
  if (!crc32c_ok) return absl::InternalError(absl::StrCat(context, ": CRC32C self-test failed"));
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(context, ": empty path"));
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) {
    const std::string msg = absl::StrCat(context, ": cannot create directory: ", ec.message());
    if (ec == std::errc::permission_denied || ec == std::errc::read_only_file_system) {
      return absl::PermissionDeniedError(msg);
    }
    if (ec == std::errc::no_space_on_device) return DiskFullError(msg);
    return absl::FailedPreconditionError(msg);
  }
  if (!std::filesystem::is_directory(path, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(context, ": not a directory"));
  }
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, path, &db);
  if (!s.ok()) return FromRocksDb(s, context);
  return std::unique_ptr<rocksdb::DB>(db);
}

}  // namespace aqswarm::storage::internal
