// glibc malloc settings for long-running training processes (stages).
//
// By default glibc serves allocations above 128 KiB (raised adaptively, at
// most to 32 MiB) with mmap and returns them with munmap, and trims a heap
// whose free top exceeds twice that threshold. A stage allocates and frees
// the same tensor and buffer sizes every micro-batch, so memory went back to
// the kernel and came back as fresh zeroed pages over and over: measured on
// the slow-network bench's 4-stage pipeline, ~440 K page faults per cell
// (DirectQ) and ~550 K (AQ-SGD), against ~125 K and ~190 K with the heap
// kept (measured when this was added, commit 0cbd9fa; the bench's setup is in
// docs/METHODOLOGY.md, slow networks).
//
//   KeepFreedMemoryForReuse();  // first thing in a stage process
//
// A stage's peak working set stays mapped (it is reached every step anyway).
#ifndef AQSWARM_COMMON_MALLOC_TUNING_H_
#define AQSWARM_COMMON_MALLOC_TUNING_H_

#include <cstddef>

namespace aqswarm {

// Serves allocations up to `mmap_threshold` bytes from the heap and trims
// only beyond `trim_threshold` bytes of free top. Left alone where the
// MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variables set
// them. Returns false where mallopt refused (not glibc).
bool KeepFreedMemoryForReuse(size_t mmap_threshold = size_t{256} << 20,
                             size_t trim_threshold = size_t{1} << 30);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_MALLOC_TUNING_H_
