#include "common/file_util.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace aqswarm {
namespace {

// nftw's callback has no user pointer: the walk's first error, per thread.
thread_local absl::Status* walk_error = nullptr;

absl::Status ErrnoError(int err, const std::string& what) {
  return absl::Status(absl::ErrnoToStatusCode(err), absl::StrCat("RemoveTree: ", what, ": ", std::strerror(err)));
}

void Record(const char* what, const char* path, int err) {
  if (walk_error->ok()) {
    *walk_error = ErrnoError(err, absl::StrCat("cannot ", what, " ", path));
  }
}

int RemoveEntry(const char* path, const struct stat* /*st*/, int type, struct FTW* /*ftw*/) {
  // Depth-first: a directory comes after its entries. FTW_DNR: unreadable,
  // so its entries stay and so will it; rmdir below reports that.
  if (type == FTW_DNR) Record("read directory", path, EACCES);
  if (std::remove(path) != 0 && errno != ENOENT) Record("remove", path, errno);
  return 0;  // keep going: remove what can be removed
}

}  // namespace

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoError(errno, absl::StrCat("cannot stat ", path));
  }
  absl::Status error;
  walk_error = &error;
  const int rc = ::nftw(path.c_str(), RemoveEntry, /*nopenfd=*/16, FTW_DEPTH | FTW_PHYS);
  const int err = errno;
  walk_error = nullptr;
  if (rc != 0 && error.ok()) error = ErrnoError(err, absl::StrCat("cannot walk ", path));
  return error;
}

}  // namespace aqswarm
