// RocksDB-specific behaviour: persistence, clean-shutdown detection, bytes
// flipped in blob files on disk, and clear errors when a store cannot open.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/rocksdb_message_store.h"
#include "storage/test_util.h"

namespace aqswarm::storage {
namespace {

using ::aqswarm::storage::testing::ConstSpans;
using ::aqswarm::storage::testing::RowValues;
using ::aqswarm::storage::testing::SameBits;
using ::aqswarm::storage::testing::ScratchDir;
using ::aqswarm::storage::testing::Spans;
using ::aqswarm::storage::testing::StoredValues;
using ::testing::HasSubstr;

RocksDbMessageStore::Options SmallOptions(const std::string& path) {
  RocksDbMessageStore::Options o;
  o.path = path;
  o.write_buffer_bytes = 1 << 20;
  o.min_blob_bytes = 1024;
  return o;
}

const LinkSpec kLink{{0, 3}, /*generation=*/4, /*rows=*/16, /*cols=*/64, RowPrecision::kFloat32};

void PutRows(MessageStore* store, uint64_t n, uint64_t version) {
  std::vector<uint64_t> samples;
  std::vector<std::vector<float>> rows;
  for (uint64_t s = 0; s < n; ++s) {
    samples.push_back(s);
    rows.push_back(RowValues(kLink, s, version));
  }
  ASSERT_TRUE(store->PutBatch(kLink, samples, ConstSpans(rows)).ok());
}

TEST(RocksDbMessageStoreTest, RowsPersistAndCleanShutdownIsRecognised) {
  ScratchDir dir;
  {
    auto store = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_FALSE((*store)->GetStats().opened_after_unclean_shutdown);  // fresh
    PutRows(store->get(), 20, 3);
    ASSERT_TRUE((*store)->Close().ok());
  }
  auto store = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_FALSE((*store)->GetStats().opened_after_unclean_shutdown);
  EXPECT_EQ((*store)->GetStats().live_rows, 20u);
  std::vector<uint64_t> samples = {0, 7, 19};
  std::vector<std::vector<float>> out(3, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(3);
  ASSERT_TRUE((*store)->GetBatch(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(reads[i].status.ok()) << reads[i].status;
    EXPECT_TRUE(SameBits(out[i], StoredValues(kLink, samples[i], 3)));
  }
  ASSERT_TRUE((*store)->Close().ok());
  // No marker -> the previous run did not close cleanly.
  std::filesystem::remove(dir.Sub("db") + "/" + RocksDbMessageStore::kCleanShutdownMarker);
  auto again = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*again)->GetStats().opened_after_unclean_shutdown);
}

TEST(RocksDbMessageStoreTest, BytesFlippedInBlobFilesAreDataLossNeverData) {
  ScratchDir dir;
  constexpr uint64_t kRows = 64;
  {
    auto store = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
    ASSERT_TRUE(store.ok()) << store.status();
    PutRows(store->get(), kRows, 1);
    ASSERT_TRUE((*store)->Close().ok());
  }
  // Flip one byte every 40 KiB inside every blob file (rows are ~4 KiB).
  int blob_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.Sub("db"))) {
    if (entry.path().extension() != ".blob") continue;
    ++blob_files;
    std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<int64_t>(entry.file_size());
    for (int64_t off = 4096; off < size - 64; off += 40 << 10) {
      f.seekg(off);
      char c = 0;
      f.read(&c, 1);
      c = static_cast<char>(c ^ 0x5a);
      f.seekp(off);
      f.write(&c, 1);
    }
  }
  ASSERT_GT(blob_files, 0);
  auto store = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<uint64_t> samples;
  for (uint64_t s = 0; s < kRows; ++s) samples.push_back(s);
  std::vector<std::vector<float>> out(kRows, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(kRows);
  ASSERT_TRUE((*store)->GetBatch(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
  uint64_t corrupt = 0;
  for (uint64_t s = 0; s < kRows; ++s) {
    if (reads[s].status.ok()) {
      EXPECT_TRUE(SameBits(out[s], StoredValues(kLink, s, 1))) << "sample " << s;
    } else {
      EXPECT_TRUE(absl::IsDataLoss(reads[s].status)) << "sample " << s << ": " << reads[s].status;
      ++corrupt;
    }
  }
  EXPECT_GT(corrupt, 0u);
  EXPECT_EQ((*store)->GetStats().rows_corrupt, corrupt);
}

TEST(RocksDbMessageStoreTest, OpenUnderARegularFileFailsNamingThePath) {
  ScratchDir dir;
  std::ofstream(dir.Sub("file")) << "not a directory";
  const std::string path = dir.Sub("file") + "/db";
  auto store = RocksDbMessageStore::Open(SmallOptions(path));
  ASSERT_FALSE(store.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(store.status())) << store.status();
  EXPECT_THAT(std::string(store.status().message()), HasSubstr(path));
}

TEST(RocksDbMessageStoreTest, SecondOpenOfTheSameDirectoryFailsWithLockMessage) {
  ScratchDir dir;
  auto first = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(dir.Sub("db")));
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("lock"));
}

TEST(RocksDbMessageStoreTest, RejectsEmptyPath) {
  EXPECT_TRUE(absl::IsInvalidArgument(RocksDbMessageStore::Open({}).status()));
}

}  // namespace
}  // namespace aqswarm::storage
