// Shared by crash_test.cc and crash_writer_main.cc: what the writer writes.
#ifndef AQSWARM_STORAGE_CRASH_TEST_SPEC_H_
#define AQSWARM_STORAGE_CRASH_TEST_SPEC_H_

#include <string>

#include "storage/message_store.h"
#include "storage/rocksdb_message_store.h"

namespace aqswarm::storage {

inline constexpr int kCrashTestBatch = 8;
inline constexpr uint64_t kCrashTestSamples = 512;

inline LinkSpec CrashTestLink() {
  return LinkSpec{{0, 0}, /*generation=*/1, /*rows=*/16, /*cols=*/256, RowPrecision::kFloat16};
}

inline RocksDbMessageStore::Options CrashTestStoreOptions(const std::string& dir) {
  RocksDbMessageStore::Options o;
  o.path = dir;
  o.write_buffer_bytes = 1 << 20;  // frequent flushes: the kill lands mid-flush too
  o.min_blob_bytes = 1024;
  o.blob_file_bytes = 4 << 20;
  o.capacity_bytes = 400 * (17 + 40 + 16 * 256 * 2);  // and evictions
  return o;
}

}  // namespace aqswarm::storage

#endif  // AQSWARM_STORAGE_CRASH_TEST_SPEC_H_
