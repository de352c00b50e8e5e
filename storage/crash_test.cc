// SIGKILL in the middle of heavy writing: the store must reopen, and every row
// must read as either absent or a whole, verified version that was written —
// never corrupt data. The kill point is chosen by the child's reported
// progress (lines on a pipe), never by time.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "storage/crash_test_spec.h"
#include "storage/rocksdb_message_store.h"
#include "storage/test_util.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::storage {
namespace {

using ::aqswarm::storage::testing::SameBits;
using ::aqswarm::testing::ScratchDir;
using ::aqswarm::storage::testing::Spans;
using ::aqswarm::storage::testing::StoredValues;

// Runs the writer until it reports batch `kill_after`, then SIGKILLs it.
// Returns the last batch index it reported (so batches <= it were acknowledged
// and batch last + 1 may or may not have been applied).
int64_t RunWriterAndKill(const std::string& dir, bool use_wal, int64_t kill_after) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    ::execl(AQSWARM_CRASH_WRITER_PATH, AQSWARM_CRASH_WRITER_PATH, dir.c_str(),
            use_wal ? "1" : "0", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  FILE* in = ::fdopen(fds[0], "r");
  int64_t last = -1;
  char line[64];
  while (last < kill_after && std::fgets(line, sizeof(line), in) != nullptr) {
    last = std::strtoll(line, nullptr, 10);
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  // The child may have got further than we had read: drain the pipe.
  while (std::fgets(line, sizeof(line), in) != nullptr) last = std::strtoll(line, nullptr, 10);
  std::fclose(in);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "writer exited early with status " << status;
  return last;
}

class CrashTest : public ::testing::TestWithParam<bool> {};

TEST_P(CrashTest, SigkillDuringHeavyWritesNeverYieldsCorruptRows) {
  const bool use_wal = GetParam();
  ScratchDir dir;
  const std::string path = dir.Sub("db");
  const LinkSpec link = CrashTestLink();
  // Several kills in a row: later rounds also crash a store that was itself
  // recovered from a crash. Each round restarts at batch 0, so a row may also
  // hold a version written in an earlier round.
  std::vector<std::vector<uint64_t>> all_versions(kCrashTestSamples);
  for (int64_t kill_after : {150, 420, 260}) {
    SCOPED_TRACE(::testing::Message() << "kill after batch " << kill_after);
    const int64_t last = RunWriterAndKill(path, use_wal, kill_after);
    ASSERT_GE(last, kill_after);

    auto opened = RocksDbMessageStore::Open(CrashTestStoreOptions(path));
    ASSERT_TRUE(opened.ok()) << opened.status();
    auto& store = *opened;
    EXPECT_TRUE(store->GetStats().opened_after_unclean_shutdown);

    // Versions each sample received: batch b writes version b + 1; the
    // batch after `last` may or may not have landed.
    std::vector<uint64_t> acked(kCrashTestSamples, 0), in_flight(kCrashTestSamples, 0);
    for (int64_t b = 0; b <= last + 1; ++b) {
      for (int i = 0; i < kCrashTestBatch; ++i) {
        const uint64_t s = (b * kCrashTestBatch + i * 7) % kCrashTestSamples;
        all_versions[s].push_back(b + 1);
        (b <= last ? acked : in_flight)[s] = b + 1;
      }
    }
    std::vector<uint64_t> samples(kCrashTestSamples);
    for (uint64_t s = 0; s < kCrashTestSamples; ++s) samples[s] = s;
    std::vector<std::vector<float>> out(kCrashTestSamples,
                                        std::vector<float>(link.num_values()));
    std::vector<RowRead> reads(kCrashTestSamples);
    ASSERT_TRUE(store->GetBatch(link, samples, Spans(out), absl::MakeSpan(reads)).ok());
    int found = 0;
    for (uint64_t s = 0; s < kCrashTestSamples; ++s) {
      const absl::Status& st = reads[s].status;
      ASSERT_TRUE(st.ok() || absl::IsNotFound(st)) << "sample " << s << ": " << st;
      if (!st.ok()) continue;  // lost or evicted: reads as unseen, which is safe
      ++found;
      const uint64_t v = static_cast<uint64_t>(out[s][0]);
      bool written = false;
      for (uint64_t w : all_versions[s]) written |= (w == v);
      ASSERT_TRUE(written) << "sample " << s << " holds version " << v << " never written";
      ASSERT_TRUE(SameBits(out[s], StoredValues(link, s, v))) << "sample " << s;
      if (use_wal) {
        // With the WAL, a put that returned survives a process crash: the
        // row is the last acknowledged version or the in-flight one.
        ASSERT_TRUE(v == acked[s] || (in_flight[s] != 0 && v == in_flight[s]))
            << "sample " << s << " holds " << v << ", last acknowledged " << acked[s];
      }
    }
    EXPECT_GT(found, 0);
    EXPECT_EQ(store->GetStats().rows_corrupt, 0u);
    EXPECT_LE(store->GetStats().live_bytes, CrashTestStoreOptions(path).capacity_bytes);
    ASSERT_TRUE(store->Close().ok());
  }
  // A clean close is recognised as such.
  auto reopened = RocksDbMessageStore::Open(CrashTestStoreOptions(path));
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_FALSE((*reopened)->GetStats().opened_after_unclean_shutdown);
}

INSTANTIATE_TEST_SUITE_P(Wal, CrashTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("WalOn") : std::string("WalOff");
                         });

}  // namespace
}  // namespace aqswarm::storage
