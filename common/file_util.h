// Files: removing a directory tree without std::filesystem's recursive
// iterators, and writing a file so that a crash leaves either the old file or
// the whole new one.
//
// PyTorch's CUDA wheels (the libtorch the CUDA build links, docs/CUDA.md)
// export their statically linked copy of libstdc++'s std::filesystem
// (pytorch/pytorch#133437). A binary built with another GCC then binds
// std::filesystem::remove_all to that copy, whose iterator layout differs
// from the inline half compiled into the binary, and crashes (SIGSEGV in
// remove_all, seen in the launcher and in tests). PyTorch itself stopped
// using <filesystem> for the same reason; this is the POSIX equivalent.
//
//   AQSWARM_RETURN_IF_ERROR(RemoveTree(dir));   // like remove_all(dir)
//
// Atomic writes: the new contents go to a temporary file in the same
// directory, which is fsynced, renamed over the target, and then the
// directory is fsynced so the rename itself survives a crash. Readers see the
// old file or the whole new one, never a torn one.
//
//   AQSWARM_RETURN_IF_ERROR(WriteFileAtomically(path, bytes, 0644));
//   // A file another writer produced (a stream, a library call) at tmp:
//   AQSWARM_RETURN_IF_ERROR(PublishFileAtomically(tmp, path));
//
// Thread-safety: all functions are thread-safe; concurrent writers of the same
// path each publish a whole file, the last rename wins.
#ifndef AQSWARM_COMMON_FILE_UTIL_H_
#define AQSWARM_COMMON_FILE_UTIL_H_

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace aqswarm {

// Removes `path` and, if it is a directory, everything below it. Symbolic
// links are removed, never followed. A missing path is success. On failure
// removes what it can and returns the first error, naming the file.
absl::Status RemoveTree(const std::string& path);

// Writes `contents` to `path` atomically (a temp file `path`.tmp.XXXXXX in the
// same directory, fsync, rename, fsync of the directory) with permission bits
// `mode` (umask does not apply; the temp file is 0600 until then, so a secret
// is never readable by others). On failure the temp file is removed and the
// error names `path`: NotFound (e.g. a missing directory), PermissionDenied,
// or Internal.
// An errno of a file operation as a status: ENOENT NotFound, EACCES/EPERM
// PermissionDenied, anything else Internal; "<what>: <strerror>".
absl::Status FileError(int err, absl::string_view what);

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents, mode_t mode);

// Publishes a file already written (and closed) at `tmp_path`, in the same
// directory as `path`, as `path`: fsyncs it, renames it over `path` and
// fsyncs the directory. Its mode is left as it is. On failure `tmp_path` is
// removed and the error names the file. Errors as for WriteFileAtomically.
absl::Status PublishFileAtomically(const std::string& tmp_path, const std::string& path);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_FILE_UTIL_H_
