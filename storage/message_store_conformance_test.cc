// One conformance suite for every MessageStore backend (in-memory, RocksDB):
// round trips at every precision, unseen/stale/corrupt outcomes, budget and
// eviction order, DropLink, argument checks, concurrency.
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rocksdb/db.h"
#include "storage/memory_message_store.h"
#include "storage/rocksdb_message_store.h"
#include "storage/row_codec.h"
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

using Mutation = std::function<void(std::string*)>;

// Opens, reopens and corrupts one backend.
class Harness {
 public:
  virtual ~Harness() = default;
  virtual absl::StatusOr<std::unique_ptr<MessageStore>> Open(uint64_t capacity_bytes) = 0;
  // Closes `store` (if persistent), applies `mutate` to the raw stored bytes
  // of the row underneath the store, and returns the store to use next.
  virtual absl::StatusOr<std::unique_ptr<MessageStore>> CorruptRow(
      std::unique_ptr<MessageStore> store, const LinkId& link, uint64_t sample,
      const Mutation& mutate) = 0;
  // Close + open again (in-memory: the same object).
  virtual absl::StatusOr<std::unique_ptr<MessageStore>> Reopen(
      std::unique_ptr<MessageStore> store) = 0;
  virtual bool persistent() const = 0;
};

class MemoryHarness : public Harness {
 public:
  absl::StatusOr<std::unique_ptr<MessageStore>> Open(uint64_t capacity_bytes) override {
    auto s = MemoryMessageStore::Create({capacity_bytes});
    if (!s.ok()) return s.status();
    return std::unique_ptr<MessageStore>(std::move(s).value());
  }
  absl::StatusOr<std::unique_ptr<MessageStore>> CorruptRow(std::unique_ptr<MessageStore> store,
                                                           const LinkId& link, uint64_t sample,
                                                           const Mutation& mutate) override {
    auto* mem = static_cast<MemoryMessageStore*>(store.get());
    absl::Status s = mem->MutateRowForTesting(link, sample, mutate);
    if (!s.ok()) return s;
    return store;
  }
  absl::StatusOr<std::unique_ptr<MessageStore>> Reopen(
      std::unique_ptr<MessageStore> store) override {
    return store;
  }
  bool persistent() const override { return false; }
};

class RocksDbHarness : public Harness {
 public:
  absl::StatusOr<std::unique_ptr<MessageStore>> Open(uint64_t capacity_bytes) override {
    capacity_ = capacity_bytes;
    RocksDbMessageStore::Options o;
    o.path = dir_.Sub("db");
    o.capacity_bytes = capacity_bytes;
    o.write_buffer_bytes = 1 << 20;  // small: exercise flushes and blob files
    o.min_blob_bytes = 1024;
    auto s = RocksDbMessageStore::Open(o);
    if (!s.ok()) return s.status();
    return std::unique_ptr<MessageStore>(std::move(s).value());
  }
  absl::StatusOr<std::unique_ptr<MessageStore>> CorruptRow(std::unique_ptr<MessageStore> store,
                                                           const LinkId& link, uint64_t sample,
                                                           const Mutation& mutate) override {
    if (absl::Status s = store->Close(); !s.ok()) return s;
    store.reset();
    {
      // Rewrite the raw value through a plain RocksDB handle: the store's own
      // checksums, not RocksDB's, must catch this.
      rocksdb::DB* raw = nullptr;
      rocksdb::Options o;
      o.enable_blob_files = true;
      o.min_blob_size = 1024;
      rocksdb::Status rs = rocksdb::DB::Open(o, dir_.Sub("db"), &raw);
      if (!rs.ok()) return absl::InternalError(rs.ToString());
      std::unique_ptr<rocksdb::DB> db(raw);
      const std::string key = internal::EncodeKey(internal::kRowKind, link, sample);
      std::string value;
      rs = db->Get(rocksdb::ReadOptions(), key, &value);
      if (!rs.ok()) return absl::InternalError(rs.ToString());
      mutate(&value);
      rs = db->Put(rocksdb::WriteOptions(), key, value);
      if (!rs.ok()) return absl::InternalError(rs.ToString());
      rs = db->Close();
      if (!rs.ok()) return absl::InternalError(rs.ToString());
    }
    return Open(capacity_);
  }
  absl::StatusOr<std::unique_ptr<MessageStore>> Reopen(
      std::unique_ptr<MessageStore> store) override {
    if (absl::Status s = store->Close(); !s.ok()) return s;
    store.reset();
    return Open(capacity_);
  }
  bool persistent() const override { return true; }

 private:
  ScratchDir dir_;
  uint64_t capacity_ = 0;
};

struct BackendParam {
  std::string name;
  std::function<std::unique_ptr<Harness>()> make;
};

class MessageStoreConformanceTest : public ::testing::TestWithParam<BackendParam> {
 protected:
  void SetUp() override {
    harness_ = GetParam().make();
    auto s = harness_->Open(0);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(s).value();
  }

  void OpenWithCapacity(uint64_t capacity) {
    ASSERT_TRUE(store_->Close().ok());
    store_.reset();
    auto s = harness_->Open(capacity);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(s).value();
  }

  void Put(const LinkSpec& link, const std::vector<uint64_t>& samples, uint64_t version) {
    std::vector<std::vector<float>> rows;
    for (uint64_t s : samples) rows.push_back(RowValues(link, s, version));
    const auto spans = ConstSpans(rows);
    ASSERT_TRUE(store_->PutBatch(link, samples, spans).ok());
  }

  // Gets one sample; returns its status and (when OK) values.
  RowRead Get(const LinkSpec& link, uint64_t sample, std::vector<float>* values = nullptr) {
    std::vector<std::vector<float>> out(1, std::vector<float>(link.num_values(), -1.0f));
    auto spans = Spans(out);
    std::vector<RowRead> reads(1);
    const std::vector<uint64_t> samples = {sample};
    absl::Status s = store_->GetBatch(link, samples, spans, absl::MakeSpan(reads));
    EXPECT_TRUE(s.ok()) << s;
    if (values != nullptr) *values = out[0];
    return reads[0];
  }

  void ExpectStored(const LinkSpec& link, uint64_t sample, uint64_t version) {
    std::vector<float> got;
    RowRead r = Get(link, sample, &got);
    ASSERT_TRUE(r.status.ok()) << "sample " << sample << ": " << r.status;
    EXPECT_TRUE(SameBits(got, StoredValues(link, sample, version))) << "sample " << sample;
  }

  void Corrupt(const LinkId& link, uint64_t sample, const Mutation& m) {
    auto s = harness_->CorruptRow(std::move(store_), link, sample, m);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(s).value();
  }

  std::unique_ptr<Harness> harness_;
  std::unique_ptr<MessageStore> store_;
};

LinkSpec SmallLink(RowPrecision p = RowPrecision::kFloat16, uint64_t generation = 1) {
  return LinkSpec{{/*pipeline=*/2, /*boundary=*/1}, generation, /*rows=*/6, /*cols=*/40, p};
}

TEST_P(MessageStoreConformanceTest, NeverWrittenReadsUnseen) {
  const LinkSpec link = SmallLink();
  RowRead r = Get(link, 7);
  EXPECT_TRUE(absl::IsNotFound(r.status)) << r.status;
  EXPECT_TRUE(IsUnseen(r.status));
  EXPECT_EQ(store_->GetStats().rows_unseen, 1u);
}

TEST_P(MessageStoreConformanceTest, GetReturnsExactlyTheRoundedStoredValue) {
  for (RowPrecision p : {RowPrecision::kFloat32, RowPrecision::kFloat16, RowPrecision::kInt8}) {
    SCOPED_TRACE(RowPrecisionName(p));
    LinkSpec link = SmallLink(p);
    link.link.boundary = static_cast<uint32_t>(p) + 10;
    Put(link, {1, 2, 3}, 5);
    uint64_t checksum = 0;
    for (uint64_t s : {1, 2, 3}) {
      ExpectStored(link, s, 5);
      RowRead r = Get(link, s);
      EXPECT_NE(r.payload_checksum, 0u);
      if (s == 1) checksum = r.payload_checksum;
    }
    // Same stored bytes -> same checksum(m) on a second read.
    EXPECT_EQ(Get(link, 1).payload_checksum, checksum);
    // The rounded value round-trips unchanged (both ends add deltas to it).
    std::vector<float> stored = StoredValues(link, 1, 5);
    std::vector<float> again = stored;
    RoundRowInPlace(p, link.rows, link.cols, absl::MakeSpan(again));
    if (p != RowPrecision::kInt8) EXPECT_TRUE(SameBits(stored, again));
  }
  EXPECT_EQ(store_->GetStats().rows_written, 9u);
}

TEST_P(MessageStoreConformanceTest, PutOverwritesAndLastDuplicateWins) {
  const LinkSpec link = SmallLink();
  Put(link, {4}, 1);
  Put(link, {4}, 2);
  ExpectStored(link, 4, 2);
  std::vector<std::vector<float>> rows = {RowValues(link, 9, 1), RowValues(link, 9, 3)};
  const std::vector<uint64_t> samples = {9, 9};
  ASSERT_TRUE(store_->PutBatch(link, samples, ConstSpans(rows)).ok());
  ExpectStored(link, 9, 3);
  EXPECT_EQ(store_->GetStats().live_rows, 2u);
}

TEST_P(MessageStoreConformanceTest, OtherGenerationOrFormatReadsUnseen) {
  const LinkSpec gen1 = SmallLink(RowPrecision::kFloat16, 1);
  const LinkSpec gen2 = SmallLink(RowPrecision::kFloat16, 2);
  Put(gen1, {1, 2}, 1);
  RowRead r = Get(gen2, 1);
  EXPECT_TRUE(absl::IsNotFound(r.status)) << r.status;
  EXPECT_EQ(store_->GetStats().rows_stale, 1u);
  Put(gen2, {1}, 7);
  ExpectStored(gen2, 1, 7);
  EXPECT_TRUE(absl::IsNotFound(Get(gen1, 1).status));
  // Same generation, different precision or shape: also unseen, not garbage.
  LinkSpec fp32 = gen1;
  fp32.precision = RowPrecision::kFloat32;
  EXPECT_TRUE(absl::IsNotFound(Get(fp32, 2).status));
  LinkSpec wide = gen1;
  wide.cols = 80;
  wide.rows = 3;
  EXPECT_TRUE(absl::IsNotFound(Get(wide, 2).status));
  ExpectStored(gen1, 2, 1);
}

TEST_P(MessageStoreConformanceTest, LinksAreIndependentAndDropLinkRemovesOnlyOne) {
  LinkSpec a = SmallLink();
  a.link = {0, 0xffffffffu};  // adjacent to {1, 0} in key order
  LinkSpec b = SmallLink();
  b.link = {1, 0};
  LinkSpec c = SmallLink();
  c.link = {0, 0xfffffffeu};
  Put(a, {0, 1, ~0ull}, 1);
  Put(b, {0, 1}, 2);
  Put(c, {0}, 3);
  ExpectStored(a, ~0ull, 1);
  ExpectStored(b, 1, 2);
  ASSERT_TRUE(store_->DropLink(a.link).ok());
  EXPECT_TRUE(absl::IsNotFound(Get(a, 0).status));
  EXPECT_TRUE(absl::IsNotFound(Get(a, ~0ull).status));
  ExpectStored(b, 0, 2);
  ExpectStored(b, 1, 2);
  ExpectStored(c, 0, 3);
  const MessageStoreStats stats = store_->GetStats();
  EXPECT_EQ(stats.live_rows, 3u);
  EXPECT_EQ(stats.rows_evicted, 0u);
}

TEST_P(MessageStoreConformanceTest, BadArgumentsAreRejectedAndNothingIsWritten) {
  const LinkSpec link = SmallLink();
  std::vector<std::vector<float>> rows = {RowValues(link, 1, 1), RowValues(link, 2, 1)};
  rows[1][17] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<uint64_t> samples = {1, 2};
  EXPECT_TRUE(absl::IsInvalidArgument(store_->PutBatch(link, samples, ConstSpans(rows))));
  EXPECT_TRUE(absl::IsNotFound(Get(link, 1).status));
  rows[1].pop_back();
  rows[1][17] = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(store_->PutBatch(link, samples, ConstSpans(rows))));
  const std::vector<uint64_t> one = {1};
  EXPECT_TRUE(absl::IsInvalidArgument(store_->PutBatch(link, one, ConstSpans(rows))));
  LinkSpec bad = link;
  bad.rows = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(store_->PutBatch(bad, {}, {})));
  std::vector<std::vector<float>> out(1, std::vector<float>(3));
  std::vector<RowRead> reads(1);
  EXPECT_TRUE(
      absl::IsInvalidArgument(store_->GetBatch(link, one, Spans(out), absl::MakeSpan(reads))));
  EXPECT_EQ(store_->GetStats().rows_written, 0u);
}

// Finiteness is checked once, fused with encoding, chunk by chunk (and with
// F16C 8 values at a time): a bad value at a chunk edge or in the scalar
// tail must be caught as surely as one in the middle, at every precision.
TEST_P(MessageStoreConformanceTest, NonFiniteValueAnywhereIsRejectedAtEveryPrecision) {
  const float kBad[] = {std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()};
  for (RowPrecision p : {RowPrecision::kFloat32, RowPrecision::kFloat16, RowPrecision::kInt8}) {
    // 3 x 1367 = 4101 values: one full 4096-value chunk, a 5-value tail that
    // is not a multiple of 8.
    const LinkSpec link{{/*pipeline=*/3, /*boundary=*/0}, /*generation=*/1, 3, 1367, p};
    const int64_t n = link.num_values();
    for (int64_t at : {int64_t{0}, int64_t{7}, int64_t{4095}, int64_t{4096}, n - 5, n - 1}) {
      for (float bad : kBad) {
        std::vector<std::vector<float>> rows = {RowValues(link, 1, 1), RowValues(link, 2, 1)};
        rows[1][at] = bad;
        const std::vector<uint64_t> samples = {1, 2};
        const absl::Status s = store_->PutBatch(link, samples, ConstSpans(rows));
        EXPECT_TRUE(absl::IsInvalidArgument(s))
            << RowPrecisionName(p) << " value " << bad << " at " << at << ": " << s;
        EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("sample 2"));
        EXPECT_TRUE(absl::IsNotFound(Get(link, 1).status));  // the batch is atomic
      }
    }
    // The largest finite values are fine (fp16 stores them as inf, as before).
    std::vector<std::vector<float>> rows = {RowValues(link, 1, 1)};
    rows[0][n - 1] = std::numeric_limits<float>::max();
    rows[0][0] = -std::numeric_limits<float>::max();
    const std::vector<uint64_t> one = {1};
    EXPECT_TRUE(store_->PutBatch(link, one, ConstSpans(rows)).ok()) << RowPrecisionName(p);
  }
  EXPECT_EQ(store_->GetStats().rows_written, 3u);
}

TEST_P(MessageStoreConformanceTest, CorruptRowIsDataLossCountedAndNeverData) {
  const LinkSpec link = SmallLink(RowPrecision::kFloat32);
  Put(link, {1, 2, 3, 4, 5}, 1);
  const size_t header = internal::kRowHeaderBytes;
  Corrupt(link.link, 1, [&](std::string* v) { (*v)[header + 13] ^= 0x01; });   // payload bit
  Corrupt(link.link, 2, [](std::string* v) { (*v)[16] ^= 0x40; });             // generation bit
  Corrupt(link.link, 3, [&](std::string* v) { v->resize(v->size() - 4); });    // truncated
  Corrupt(link.link, 4, [](std::string* v) { v->resize(10); });                // torn header
  for (uint64_t s : {1, 2, 3, 4}) {
    RowRead r = Get(link, s);
    EXPECT_TRUE(absl::IsDataLoss(r.status)) << "sample " << s << ": " << r.status;
    EXPECT_TRUE(IsUnseen(r.status));
    EXPECT_EQ(r.payload_checksum, 0u);
  }
  ExpectStored(link, 5, 1);
  EXPECT_EQ(store_->GetStats().rows_corrupt, 4u);
  // The caller's next FULL send heals the row.
  Put(link, {1}, 2);
  ExpectStored(link, 1, 2);
}

TEST_P(MessageStoreConformanceTest, BudgetEvictsOldestWrittenFirst) {
  const LinkSpec link = SmallLink();
  const uint64_t row_bytes = internal::kKeyBytes + internal::kRowHeaderBytes + link.payload_bytes();
  OpenWithCapacity(3 * row_bytes + row_bytes / 2);
  Put(link, {10, 11, 12}, 1);
  Put(link, {10}, 2);  // overwrite: frees its own bytes first, evicts nothing
  EXPECT_EQ(store_->GetStats().rows_evicted, 0u);
  Put(link, {13, 14}, 1);  // evicts 11 then 12 (oldest written)
  MessageStoreStats stats = store_->GetStats();
  EXPECT_EQ(stats.rows_evicted, 2u);
  EXPECT_EQ(stats.live_rows, 3u);
  EXPECT_LE(stats.live_bytes, stats.capacity_bytes);
  EXPECT_TRUE(absl::IsNotFound(Get(link, 11).status));
  EXPECT_TRUE(absl::IsNotFound(Get(link, 12).status));
  ExpectStored(link, 10, 2);
  ExpectStored(link, 13, 1);
  ExpectStored(link, 14, 1);

  // A row larger than the whole budget is not stored, and its old version is
  // gone too (the caller must not read a stale m(xi)).
  LinkSpec big = link;
  big.rows = 40;
  Put(big, {10}, 3);
  EXPECT_TRUE(absl::IsNotFound(Get(link, 10).status));
  EXPECT_TRUE(absl::IsNotFound(Get(big, 10).status));
  EXPECT_EQ(store_->GetStats().rows_evicted, 3u);

  if (harness_->persistent()) {
    // The index survives a reopen: the next put still evicts the oldest.
    auto s = harness_->Reopen(std::move(store_));
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(s).value();
    stats = store_->GetStats();
    EXPECT_EQ(stats.live_rows, 2u);
    EXPECT_EQ(stats.live_bytes, 2 * row_bytes);
    Put(link, {15, 16}, 1);  // evicts 13
    EXPECT_TRUE(absl::IsNotFound(Get(link, 13).status));
    ExpectStored(link, 14, 1);
    ExpectStored(link, 16, 1);
  }
}

TEST_P(MessageStoreConformanceTest, OverwriteUnderASmallerBudgetEvictsDownToIt) {
  if (!harness_->persistent()) GTEST_SKIP() << "the memory backend keeps nothing across opens";
  const LinkSpec link = SmallLink();
  const uint64_t row_bytes = internal::kKeyBytes + internal::kRowHeaderBytes + link.payload_bytes();
  Put(link, {1, 2, 3}, 1);          // no budget
  OpenWithCapacity(2 * row_bytes);  // reopened over its new budget
  Put(link, {3}, 2);                // an overwrite, but the store must shrink to fit: evicts 1
  const MessageStoreStats stats = store_->GetStats();
  EXPECT_EQ(stats.rows_evicted, 1u);
  EXPECT_EQ(stats.live_bytes, 2 * row_bytes);
  EXPECT_TRUE(absl::IsNotFound(Get(link, 1).status));
  ExpectStored(link, 2, 1);
  ExpectStored(link, 3, 2);
}

// Without a budget a same-size overwrite writes the row alone (no index
// entry): the row is the new one, the accounting stays exact across a reopen,
// and the row keeps its first write's place in the eviction order, which a
// store reopened with a budget then follows. A size change still updates it.
TEST_P(MessageStoreConformanceTest, WithoutABudgetAnOverwriteKeepsItsFirstWritePlace) {
  const LinkSpec link = SmallLink();
  LinkSpec big = link;
  big.rows = 40;
  const uint64_t row_bytes = internal::kKeyBytes + internal::kRowHeaderBytes + link.payload_bytes();
  Put(link, {1, 2, 3}, 1);
  Put(big, {4}, 1);
  Put(link, {1}, 2);  // same size: row only
  Put(link, {4}, 2);  // smaller than before: index entry rewritten
  ExpectStored(link, 1, 2);
  ExpectStored(link, 4, 2);
  MessageStoreStats stats = store_->GetStats();
  EXPECT_EQ(stats.live_rows, 4u);
  EXPECT_EQ(stats.live_bytes, 4 * row_bytes);
  EXPECT_EQ(stats.rows_written, 6u);
  if (!harness_->persistent()) return;
  OpenWithCapacity(4 * row_bytes);
  stats = store_->GetStats();
  EXPECT_EQ(stats.live_rows, 4u);
  EXPECT_EQ(stats.live_bytes, 4 * row_bytes);
  ExpectStored(link, 1, 2);
  Put(link, {5}, 1);  // evicts 1: first written, though overwritten since
  EXPECT_TRUE(absl::IsNotFound(Get(link, 1).status));
  ExpectStored(link, 2, 1);
  ExpectStored(link, 4, 2);
  ExpectStored(link, 5, 1);
  // With a budget an overwrite moves the row to the back again.
  Put(link, {2}, 2);
  Put(link, {6}, 1);  // evicts 3, not 2
  EXPECT_TRUE(absl::IsNotFound(Get(link, 3).status));
  ExpectStored(link, 2, 2);
}

TEST_P(MessageStoreConformanceTest, ConcurrentPutsAndGetsSeeWholeRows) {
  const LinkSpec link = SmallLink(RowPrecision::kFloat16);
  constexpr int kThreads = 4, kRounds = 40;
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 1; round <= kRounds; ++round) {
        const std::vector<uint64_t> samples = {static_cast<uint64_t>(round % 5),
                                               static_cast<uint64_t>(100 + t)};
        std::vector<std::vector<float>> rows = {RowValues(link, samples[0], round),
                                                RowValues(link, samples[1], round)};
        if (!store_->PutBatch(link, samples, ConstSpans(rows)).ok()) ++bad;
        std::vector<std::vector<float>> out(2, std::vector<float>(link.num_values()));
        std::vector<RowRead> reads(2);
        if (!store_->GetBatch(link, samples, Spans(out), absl::MakeSpan(reads)).ok()) ++bad;
        for (int i = 0; i < 2; ++i) {
          if (!reads[i].status.ok()) {
            ++bad;
            continue;
          }
          // Whichever writer won, the row is one whole version.
          const uint64_t version = static_cast<uint64_t>(out[i][0]);
          if (!SameBits(out[i], StoredValues(link, samples[i], version))) ++bad;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(store_->GetStats().live_rows, 5u + kThreads);
}

// EncodePut + CommitPut is PutBatch split in two: encoding changes nothing,
// commits take effect in commit order (not encode order), and the budget
// applies at commit.
TEST_P(MessageStoreConformanceTest, EncodedPutsTakeEffectOnlyWhenCommittedInCommitOrder) {
  const LinkSpec link = SmallLink();
  Put(link, {3}, 1);
  std::vector<std::vector<float>> v2 = {RowValues(link, 3, 2), RowValues(link, 4, 2)};
  std::vector<std::vector<float>> v3 = {RowValues(link, 3, 3)};
  const std::vector<uint64_t> both = {3, 4}, three = {3};
  auto first = store_->EncodePut(link, both, ConstSpans(v2));
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = store_->EncodePut(link, three, ConstSpans(v3));
  ASSERT_TRUE(second.ok()) << second.status();
  // Encoded, not committed: nothing visible, nothing counted.
  ExpectStored(link, 3, 1);
  EXPECT_TRUE(absl::IsNotFound(Get(link, 4).status));
  EXPECT_EQ(store_->GetStats().rows_written, 1u);
  // Committed out of encode order: the later commit wins.
  ASSERT_TRUE(store_->CommitPut(std::move(second).value()).ok());
  ExpectStored(link, 3, 3);
  ASSERT_TRUE(store_->CommitPut(std::move(first).value()).ok());
  ExpectStored(link, 3, 2);
  ExpectStored(link, 4, 2);
  const MessageStoreStats stats = store_->GetStats();
  EXPECT_EQ(stats.rows_written, 4u);
  EXPECT_EQ(stats.live_rows, 2u);
  EXPECT_EQ(stats.put_batches, 3u);
  // An encoded put that is dropped leaves the store as it was.
  std::vector<std::vector<float>> v9 = {RowValues(link, 4, 9)};
  const std::vector<uint64_t> four = {4};
  ASSERT_TRUE(store_->EncodePut(link, four, ConstSpans(v9)).ok());
  ExpectStored(link, 4, 2);
}

TEST_P(MessageStoreConformanceTest, EncodedPutAppliesTheBudgetAtCommit) {
  const LinkSpec link = SmallLink();
  const uint64_t row = internal::kKeyBytes + internal::kRowHeaderBytes + link.payload_bytes();
  OpenWithCapacity(2 * row);
  Put(link, {1}, 1);
  std::vector<std::vector<float>> rows = {RowValues(link, 2, 1), RowValues(link, 3, 1)};
  const std::vector<uint64_t> samples = {2, 3};
  auto put = store_->EncodePut(link, samples, ConstSpans(rows));
  ASSERT_TRUE(put.ok()) << put.status();
  Put(link, {4}, 1);  // written between encode and commit: older than 2 and 3
  ASSERT_TRUE(store_->CommitPut(std::move(put).value()).ok());
  EXPECT_TRUE(absl::IsNotFound(Get(link, 1).status));
  EXPECT_TRUE(absl::IsNotFound(Get(link, 4).status));
  ExpectStored(link, 2, 1);
  ExpectStored(link, 3, 1);
  EXPECT_EQ(store_->GetStats().rows_evicted, 2u);
}

TEST_P(MessageStoreConformanceTest, EncodePutRejectsBadArgumentsAndCommitPutForeignPuts) {
  const LinkSpec link = SmallLink();
  std::vector<std::vector<float>> rows = {RowValues(link, 1, 1), RowValues(link, 2, 1)};
  rows[1][5] = std::numeric_limits<float>::infinity();
  const std::vector<uint64_t> samples = {1, 2};
  auto nan = store_->EncodePut(link, samples, ConstSpans(rows));
  EXPECT_TRUE(absl::IsInvalidArgument(nan.status())) << nan.status();
  EXPECT_THAT(std::string(nan.status().message()), ::testing::HasSubstr("sample 2"));
  rows[1].pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(store_->EncodePut(link, samples, ConstSpans(rows)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(store_->CommitPut(nullptr)));
  // A put encoded by another store (of either backend) is refused.
  auto memory = MemoryMessageStore::Create({});
  ASSERT_TRUE(memory.ok());
  std::vector<std::vector<float>> good = {RowValues(link, 1, 1)};
  const std::vector<uint64_t> one = {1};
  auto foreign = (*memory)->EncodePut(link, one, ConstSpans(good));
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  EXPECT_TRUE(absl::IsInvalidArgument(store_->CommitPut(std::move(foreign).value())));
  EXPECT_TRUE(absl::IsNotFound(Get(link, 1).status));
  EXPECT_EQ(store_->GetStats().rows_written, 0u);
  // Closed: both phases fail; a put encoded before Close is not written.
  auto pending = store_->EncodePut(link, one, ConstSpans(good));
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_TRUE(store_->Close().ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->EncodePut(link, one, ConstSpans(good)).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->CommitPut(std::move(pending).value())));
}

TEST_P(MessageStoreConformanceTest, ClosedStoreFailsCleanly) {
  const LinkSpec link = SmallLink();
  Put(link, {1}, 1);
  ASSERT_TRUE(store_->Close().ok());
  ASSERT_TRUE(store_->Close().ok());  // idempotent
  std::vector<std::vector<float>> rows = {RowValues(link, 1, 1)};
  const std::vector<uint64_t> samples = {1};
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->PutBatch(link, samples, ConstSpans(rows))));
  std::vector<RowRead> reads(1);
  EXPECT_TRUE(absl::IsFailedPrecondition(
      store_->GetBatch(link, samples, Spans(rows), absl::MakeSpan(reads))));
}

INSTANTIATE_TEST_SUITE_P(
    Backends, MessageStoreConformanceTest,
    ::testing::Values(BackendParam{"Memory", [] { return std::make_unique<MemoryHarness>(); }},
                      BackendParam{"RocksDb", [] { return std::make_unique<RocksDbHarness>(); }}),
    [](const ::testing::TestParamInfo<BackendParam>& info) { return info.param.name; });

}  // namespace
}  // namespace aqswarm::storage
