// RocksDB-specific behaviour: persistence, clean-shutdown detection, bytes
// flipped in blob files on disk, and clear errors when a store cannot open.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/rocksdb_message_store.h"
#include "storage/rocksdb_util.h"
#include "storage/store_status.h"
#include "storage/test_util.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::storage {
namespace {

using ::aqswarm::storage::testing::ConstSpans;
using ::aqswarm::storage::testing::RowValues;
using ::aqswarm::storage::testing::SameBits;
using ::aqswarm::testing::ScratchDir;
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

// Reads samples [0, n) of kLink and checks each is exactly the row
// StoredValues wrote at version(sample).
void ExpectStoredRows(MessageStore* store, uint64_t n, const std::function<uint64_t(uint64_t)>& version,
                      const std::string& what) {
  std::vector<uint64_t> samples;
  for (uint64_t s = 0; s < n; ++s) samples.push_back(s);
  std::vector<std::vector<float>> out(n, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(n);
  ASSERT_TRUE(store->GetBatch(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
  for (uint64_t s = 0; s < n; ++s) {
    ASSERT_TRUE(reads[s].status.ok()) << what << " sample " << s << ": " << reads[s].status;
    EXPECT_TRUE(SameBits(out[s], StoredValues(kLink, s, version(s)))) << what << " sample " << s;
  }
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

TEST(RocksDbMessageStoreTest, ReadsFromMemoryFindMemtableRowsAndNeverDoIo) {
  ScratchDir dir;
  std::vector<uint64_t> samples = {0, 7, 19, 25};  // 25 was never written
  std::vector<std::vector<float>> out(samples.size(), std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(samples.size());
  {
    auto store = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
    ASSERT_TRUE(store.ok()) << store.status();
    PutRows(store->get(), 20, 3);
    // Just written: in the memtable, read as GetBatch reads them.
    ASSERT_TRUE((*store)->GetBatchFromMemory(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(reads[i].status.ok()) << reads[i].status;
      EXPECT_TRUE(SameBits(out[i], StoredValues(kLink, samples[i], 3)));
      EXPECT_NE(reads[i].payload_checksum, 0u);
    }
    EXPECT_TRUE(absl::IsNotFound(reads[3].status)) << reads[3].status;
    ASSERT_TRUE((*store)->Close().ok());  // flushed to SST and blob files
  }
  auto store = RocksDbMessageStore::Open(SmallOptions(dir.Sub("db")));
  ASSERT_TRUE(store.ok()) << store.status();
  // On disk now: not in memory, and nothing was read to find out.
  ASSERT_TRUE((*store)->GetBatchFromMemory(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(absl::IsUnavailable(reads[i].status)) << "sample " << samples[i] << ": " << reads[i].status;
  }
  EXPECT_EQ((*store)->GetStats().rows_found, 0u);
  ExpectStoredRows(store->get(), 20, [](uint64_t) { return 3; }, "after reopen");
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

// Bytes of the files in `dir` named *`extension` (".blob": blob files;
// ".trash": obsolete files waiting for paced deletion, which RocksDB renames
// NAME.trash first).
uint64_t FileBytes(const std::string& dir, const std::string& extension) {
  uint64_t total = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == extension) total += entry.file_size();
  }
  return total;
}

uint64_t BlobFileBytes(const std::string& dir) { return FileBytes(dir, ".blob"); }

// Blob GC is off by default (Options::blob_garbage_collection): blob files
// whose rows were all overwritten must still be deleted once compaction has
// dropped the old references, so an epoch-style workload (every row rewritten
// each epoch) keeps its disk use near the live bytes.
TEST(RocksDbMessageStoreTest, OverwrittenBlobFilesAreDeletedWithoutBlobGc) {
  ScratchDir dir;
  RocksDbMessageStore::Options o = SmallOptions(dir.Sub("db"));
  ASSERT_FALSE(o.blob_garbage_collection);
  constexpr uint64_t kRows = 256, kEpochs = 5;
  const uint64_t live = kRows * kLink.payload_bytes();
  {
    auto store = RocksDbMessageStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status();
    for (uint64_t epoch = 1; epoch <= kEpochs; ++epoch) {
      for (uint64_t begin = 0; begin < kRows; begin += 16) {
        std::vector<uint64_t> samples;
        std::vector<std::vector<float>> rows;
        for (uint64_t s = begin; s < begin + 16; ++s) {
          samples.push_back(s);
          rows.push_back(RowValues(kLink, s, epoch));
        }
        ASSERT_TRUE((*store)->PutBatch(kLink, samples, ConstSpans(rows)).ok());
      }
    }
    ASSERT_TRUE((*store)->Compact().ok());
    ASSERT_TRUE((*store)->Close().ok());
  }
  // Reopening deletes files the last version no longer references.
  auto store = RocksDbMessageStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  // 5 versions were written; without deletion the blob files would hold ~5x.
  EXPECT_LE(BlobFileBytes(dir.Sub("db")), 2 * live + live / 2);
  EXPECT_GE(BlobFileBytes(dir.Sub("db")), live);
  std::vector<uint64_t> samples;
  for (uint64_t s = 0; s < kRows; ++s) samples.push_back(s);
  std::vector<std::vector<float>> out(kRows, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(kRows);
  ASSERT_TRUE((*store)->GetBatch(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
  for (uint64_t s = 0; s < kRows; ++s) {
    ASSERT_TRUE(reads[s].status.ok()) << "sample " << s << ": " << reads[s].status;
    EXPECT_TRUE(SameBits(out[s], StoredValues(kLink, s, kEpochs))) << "sample " << s;
  }
}

uint64_t TrashBytes(const std::string& dir) { return FileBytes(dir, ".trash"); }

// Paced deletion of obsolete files (Options::delete_bytes_per_s, on by
// default): rows stay exact while RocksDB's background thread cuts obsolete
// blob files down a chunk at a time, and whatever it has not deleted when the
// store closes (NAME.trash) is deleted when the store is reopened: at once,
// inside Open, with pacing off.
TEST(RocksDbMessageStoreTest, PacedFileDeletionKeepsRowsExactAndTrashIsDeletedAtReopen) {
  ScratchDir dir;
  const std::string db = dir.Sub("db");
  RocksDbMessageStore::Options o = SmallOptions(db);
  ASSERT_GT(o.delete_bytes_per_s, 0u);
  o.delete_bytes_per_s = 1 << 20;  // slow: most obsolete files are still trash at Close
  o.delete_chunk_bytes = 64 << 10;
  constexpr uint64_t kRows = 256, kEpochs = 5;
  const uint64_t live = kRows * kLink.payload_bytes();
  {
    auto store = RocksDbMessageStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status();
    for (uint64_t epoch = 1; epoch <= kEpochs; ++epoch) {
      PutRows(store->get(), kRows, epoch);
      ExpectStoredRows(store->get(), kRows, [&](uint64_t) { return epoch; }, "paced");
    }
    ASSERT_TRUE((*store)->Compact().ok());
    ExpectStoredRows(store->get(), kRows, [](uint64_t) { return kEpochs; }, "compacted");
    ASSERT_TRUE((*store)->Close().ok());
  }
  // A file the deletion thread had not reached yet, whatever the timing.
  const std::string trash = (std::filesystem::path(db) / "000999.blob.trash").string();
  std::ofstream(trash) << std::string(256 << 10, 'x');
  o.delete_bytes_per_s = 0;
  auto store = RocksDbMessageStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_FALSE(std::filesystem::exists(trash));
  EXPECT_EQ(TrashBytes(db), 0u);
  // 5 versions were written; without deletion the blob files would hold ~5x.
  EXPECT_LE(BlobFileBytes(db), 2 * live + live / 2);
  ExpectStoredRows(store->get(), kRows, [](uint64_t) { return kEpochs; }, "reopened");
}

// With blob GC on (the option), rows stay exact through the relocation.
TEST(RocksDbMessageStoreTest, BlobGcOptionKeepsRowsExact) {
  ScratchDir dir;
  RocksDbMessageStore::Options o = SmallOptions(dir.Sub("db"));
  o.blob_garbage_collection = true;
  o.verify_rocksdb_checksums = true;
  auto store = RocksDbMessageStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (uint64_t version = 1; version <= 3; ++version) PutRows(store->get(), 200, version);
  PutRows(store->get(), 100, 4);  // half the rows stay at version 3
  ASSERT_TRUE((*store)->Compact().ok());
  ExpectStoredRows(store->get(), 200, [](uint64_t s) { return s < 100 ? 4 : 3; }, "");
}

// Direct I/O on or off for reads and writes, one or three flush threads:
// the same exact rows after overwrites, flushes and a reopen.
TEST(RocksDbMessageStoreTest, IoModesFlushThreadsAndMemtablesKeepRowsExact) {
  for (const bool direct : {false, true}) {
    for (const int flush_threads : {1, 3}) {
      for (const bool hash_memtable : {false, true}) {
        ScratchDir dir;
        RocksDbMessageStore::Options o = SmallOptions(dir.Sub("db"));
        o.direct_io_reads = direct;
        o.direct_io_writes = direct;
        o.flush_threads = flush_threads;
        o.hash_memtable = hash_memtable;
        const std::string what =
            absl::StrCat("direct ", direct, " flush_threads ", flush_threads, " hash_memtable ", hash_memtable);
        {
          auto store = RocksDbMessageStore::Open(o);
          ASSERT_TRUE(store.ok()) << store.status();
          for (uint64_t version = 1; version <= 3; ++version) PutRows(store->get(), 200, version);
          // Read back from the memtables before any flush, too.
          ExpectStoredRows(store->get(), 200, [](uint64_t) { return 3; }, what + " (open)");
          ASSERT_TRUE((*store)->Close().ok());
        }
        // The memtable kind is not persisted: reopen with the other one.
        o.hash_memtable = !hash_memtable;
        auto store = RocksDbMessageStore::Open(o);
        ASSERT_TRUE(store.ok()) << store.status();
        ExpectStoredRows(store->get(), 200, [](uint64_t) { return 3; }, what + " (reopened)");
      }
    }
  }
}

// AQ-SGD rewrites every row once per epoch. In place, a memtable holding a
// link's rows keeps one version of each; without, every put adds a row.
TEST(RocksDbMessageStoreTest, InPlaceUpdatesKeepOneVersionPerRowInTheMemtable) {
  constexpr uint64_t kRows = 200, kVersions = 10;
  const uint64_t version_bytes = kRows * kLink.num_values() * sizeof(float);
  for (const bool hash_memtable : {false, true}) {
    for (const bool inplace : {false, true}) {
      ScratchDir dir;
      RocksDbMessageStore::Options o = SmallOptions(dir.Sub("db"));
      o.write_buffer_bytes = 64 << 20;  // every version fits: no flush
      o.hash_memtable = hash_memtable;
      o.inplace_updates = inplace;
      const std::string what = absl::StrCat("hash_memtable ", hash_memtable, " inplace ", inplace);
      auto store = RocksDbMessageStore::Open(o);
      ASSERT_TRUE(store.ok()) << store.status();
      for (uint64_t version = 1; version <= kVersions; ++version) {
        PutRows(store->get(), kRows, version);
        ExpectStoredRows(store->get(), kRows, [&](uint64_t) { return version; }, what);
      }
      const uint64_t memtable = (*store)->MemtableBytes();
      if (inplace) {
        EXPECT_LT(memtable, 3 * version_bytes) << what;
      } else {
        EXPECT_GT(memtable, (kVersions - 2) * version_bytes) << what;
      }
      ASSERT_TRUE((*store)->Close().ok());
      // What was updated in place is what a reopened store reads.
      auto reopened = RocksDbMessageStore::Open(o);
      ASSERT_TRUE(reopened.ok()) << reopened.status();
      ExpectStoredRows(reopened->get(), kRows, [](uint64_t) { return kVersions; }, what + " (reopened)");
    }
  }
}

TEST(RocksDbMessageStoreTest, RejectsBadTuningOptions) {
  ScratchDir dir;
  for (int bad = 0; bad < 8; ++bad) {
    RocksDbMessageStore::Options o = SmallOptions(dir.Sub("db"));
    if (bad == 7) o.max_trash_ratio = std::nan("");
    if (bad == 6) o.max_trash_ratio = -1;
    if (bad == 5) o.delete_bytes_per_s = uint64_t{1} << 63;
    if (bad == 4) o.hash_memtable_buckets = 0;
    if (bad == 0) o.flush_threads = 0;
    if (bad == 1) o.background_jobs = 0;
    if (bad == 2) o.max_write_buffers = 1;
    if (bad == 3) o.slowdown_write_bytes_per_s = 0;
    auto store = RocksDbMessageStore::Open(o);
    EXPECT_TRUE(absl::IsInvalidArgument(store.status())) << bad << ": " << store.status();
  }
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

// A full disk is a typed status: RocksDB's NoSpace becomes a DiskFullError,
// which survives propagation and which no other ResourceExhausted status is
// taken for, whatever its message says.
TEST(StoreStatusTest, AFullDiskIsTypedAndOtherResourceExhaustedStatusesAreNot) {
  const absl::Status full = internal::FromRocksDb(rocksdb::Status::NoSpace("write"), "put");
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_TRUE(IsDiskFull(full)) << full;
  const absl::Status copied = full;
  EXPECT_TRUE(IsDiskFull(copied));
  EXPECT_FALSE(IsDiskFull(absl::ResourceExhaustedError("disk full: no space")));
  EXPECT_FALSE(IsDiskFull(internal::FromRocksDb(rocksdb::Status::IOError("read"), "get")));
  EXPECT_FALSE(IsDiskFull(absl::OkStatus()));
}

}  // namespace
}  // namespace aqswarm::storage
