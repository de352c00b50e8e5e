#include "common/malloc_tuning.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"

namespace aqswarm {
namespace {

// A freed 64 MiB block stays in the heap for the next allocation instead of
// going back to the kernel (glibc's defaults mmap and munmap a block that
// size: its dynamic threshold stops at 32 MiB).
TEST(MallocTuningTest, FreedLargeBlocksStayInTheHeap) {
  ASSERT_TRUE(KeepFreedMemoryForReuse());
  constexpr size_t kBytes = size_t{64} << 20;
  char* p = static_cast<char*>(std::malloc(kBytes));
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, kBytes);
  const struct mallinfo2 before = mallinfo2();
  std::free(p);
  const struct mallinfo2 after = mallinfo2();
  EXPECT_EQ(after.hblkhd, before.hblkhd) << "the block was mmapped";
  EXPECT_GE(after.fordblks, kBytes) << "the freed block left the heap";
}

}  // namespace
}  // namespace aqswarm
