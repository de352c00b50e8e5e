#include "common/file_util.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

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

}  // namespace

absl::Status FileError(int err, absl::string_view what) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

namespace {

// fsyncs the directory holding `path`, so a rename into it is durable. Best
// effort, as it always was: the rename has happened either way.
void SyncDirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

// Renames `tmp` over `path` and syncs the directory; removes `tmp` on failure.
absl::Status RenameIntoPlace(const std::string& tmp, const std::string& path) {
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return FileError(err, absl::StrCat("renaming into ", path));
  }
  SyncDirOf(path);
  return absl::OkStatus();
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

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents, mode_t mode) {
  std::string tmp = path + ".tmp.XXXXXX";
  // mkstemp creates the file 0600, so a secret is never readable by others,
  // not even for a moment.
  int fd = ::mkstemp(tmp.data());
  if (fd < 0) return FileError(errno, absl::StrCat("creating a temporary file for ", path));
  auto fail = [&](absl::string_view what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return FileError(err, absl::StrCat(what, " ", path));
  };
  if (::fchmod(fd, mode) != 0) return fail("setting the mode of");
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("writing");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return fail("syncing");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return FileError(err, absl::StrCat("closing ", path));
  }
  return RenameIntoPlace(tmp, path);
}

absl::Status PublishFileAtomically(const std::string& tmp_path, const std::string& path) {
  const int fd = ::open(tmp_path.c_str(), O_RDONLY);
  if (fd < 0) {
    const int err = errno;
    ::unlink(tmp_path.c_str());
    return FileError(err, absl::StrCat("opening ", tmp_path, " to publish it as ", path));
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp_path.c_str());
    return FileError(err, absl::StrCat("syncing ", tmp_path, " before publishing it as ", path));
  }
  ::close(fd);
  return RenameIntoPlace(tmp_path, path);
}

}  // namespace aqswarm
