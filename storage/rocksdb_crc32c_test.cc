#include "storage/rocksdb_crc32c.h"

#include <dlfcn.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/random.h"
#include "gtest/gtest.h"

namespace aqswarm::storage::internal {
namespace {

std::string RandomBytes(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(rng.Next() & 0xff);
  return s;
}

TEST(RocksDbCrc32cTest, KnownValues) {
  // The CRC32C check value (RFC 3720 / iSCSI): CRC32C("123456789").
  EXPECT_EQ(Crc32cExtend(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cExtend(0, "", 0), 0u);
  // 32 zero bytes (RFC 3720 B.4).
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32cExtend(0, zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(RocksDbCrc32cTest, ExtendContinues) {
  const std::string data = RandomBytes(3 * 4096 * 2 + 123, 1);
  const uint32_t whole = Crc32cExtend(0, data.data(), data.size());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{12288}, size_t{12289},
                     data.size() - 1, data.size()}) {
    const uint32_t first = Crc32cExtend(0, data.data(), cut);
    EXPECT_EQ(Crc32cExtend(first, data.data() + cut, data.size() - cut), whole) << "cut " << cut;
  }
}

// The override must compute exactly what librocksdb's own implementation
// computes, for every length (both sides of the three-stream blocks), every
// alignment and any starting value.
TEST(RocksDbCrc32cTest, MatchesTheLibrary) {
  Crc32cExtendFn library = LibraryCrc32cExtend();
  if (library == nullptr) GTEST_SKIP() << "librocksdb does not export rocksdb::crc32c::Extend";
  // The library's function, not the override.
  ASSERT_NE(reinterpret_cast<void*>(library),
            ::dlsym(RTLD_DEFAULT, "_ZN7rocksdb6crc32c6ExtendEjPKcm"));
  const std::string data = RandomBytes((1 << 20) + 64, 2);
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t base : {size_t{4096}, size_t{8192}, size_t{3 * 4096}, size_t{6 * 4096},
                      size_t{196648}, size_t{1} << 20}) {
    for (size_t d = 0; d <= 9; ++d) {
      if (base >= d) lengths.push_back(base - d);
      if (base + d <= (size_t{1} << 20)) lengths.push_back(base + d);
    }
  }
  Rng rng(3);
  for (size_t n : lengths) {
    for (size_t offset = 0; offset < 8; ++offset) {
      const uint32_t init = offset == 0 ? 0u : static_cast<uint32_t>(rng.Next());
      ASSERT_EQ(Crc32cExtend(init, data.data() + offset, n),
                library(init, data.data() + offset, n))
          << "length " << n << " offset " << offset << " init " << init;
    }
  }
}

// librocksdb calls rocksdb::crc32c::Extend through the dynamic linker; in
// this binary (as in aqswarm) that name resolves to the override.
TEST(RocksDbCrc32cTest, OverrideIsBound) {
  if (LibraryCrc32cExtend() == nullptr) GTEST_SKIP() << "librocksdb does not export it";
  EXPECT_TRUE(Crc32cOverrideBound());
  using Fn = uint32_t (*)(uint32_t, const char*, size_t);
  auto bound = reinterpret_cast<Fn>(::dlsym(RTLD_DEFAULT, "_ZN7rocksdb6crc32c6ExtendEjPKcm"));
  ASSERT_NE(bound, nullptr);
  EXPECT_EQ(bound(0, "123456789", 9), 0xE3069283u);
}

}  // namespace
}  // namespace aqswarm::storage::internal
