// storage_crash_writer DIR USE_WAL(0|1): opens a RocksDbMessageStore at DIR and
// overwrites rows of a small key space forever, as fast as it can. After each
// PutBatch it prints "<batch index>\n" to stdout (flushed), so the crash test
// can SIGKILL it at a point chosen by progress, never by time. Rows hold
// testing::RowValues(link, sample, version) with version = batch index + 1.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "storage/crash_test_spec.h"
#include "storage/rocksdb_message_store.h"
#include "storage/test_util.h"

int main(int argc, char** argv) {
  using namespace aqswarm::storage;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DIR USE_WAL\n", argv[0]);
    return 2;
  }
  RocksDbMessageStore::Options o = CrashTestStoreOptions(argv[1]);
  o.use_wal = std::string(argv[2]) == "1";
  auto store = RocksDbMessageStore::Open(o);
  if (!store.ok()) {
    std::fprintf(stderr, "open: %s\n", std::string(store.status().message()).c_str());
    return 1;
  }
  const LinkSpec link = CrashTestLink();
  for (uint64_t batch = 0;; ++batch) {
    std::vector<uint64_t> samples;
    std::vector<std::vector<float>> rows;
    for (int i = 0; i < kCrashTestBatch; ++i) {
      const uint64_t sample = (batch * kCrashTestBatch + i * 7) % kCrashTestSamples;
      samples.push_back(sample);
      rows.push_back(testing::RowValues(link, sample, batch + 1));
    }
    absl::Status s = (*store)->PutBatch(link, samples, testing::ConstSpans(rows));
    if (!s.ok()) {
      std::fprintf(stderr, "put: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    std::printf("%llu\n", static_cast<unsigned long long>(batch));
    std::fflush(stdout);
  }
}
