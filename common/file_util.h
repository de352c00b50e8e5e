// Removing a directory tree without std::filesystem's recursive iterators.
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
#ifndef AQSWARM_COMMON_FILE_UTIL_H_
#define AQSWARM_COMMON_FILE_UTIL_H_

#include <string>

#include "absl/status/status.h"

namespace aqswarm {

// Removes `path` and, if it is a directory, everything below it. Symbolic
// links are removed, never followed. A missing path is success. On failure
// removes what it can and returns the first error, naming the file.
absl::Status RemoveTree(const std::string& path);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_FILE_UTIL_H_
