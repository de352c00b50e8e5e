// Prefetcher: hits for the prefetch window, read-your-writes across every
// stage of a write-behind, bounded memory, skipped batches, shutdown.
// Synchronisation only through mutexes/conditions on a wrapper store: no sleeps.
#include "storage/prefetcher.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/random.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/memory_message_store.h"
#include "storage/rocksdb_message_store.h"
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

// Forwards to a real store; counts batches and can hold writes at a gate.
class ObservedStore : public MessageStore {
 public:
  explicit ObservedStore(MessageStore* inner) : inner_(inner) {}

  absl::Status GetBatch(const LinkSpec& link, absl::Span<const uint64_t> samples,
                        absl::Span<const absl::Span<float>> out,
                        absl::Span<RowRead> reads) override {
    absl::Status s = inner_->GetBatch(link, samples, out, reads);
    absl::MutexLock lock(&mu_);
    ++get_batches_;
    get_rows_ += static_cast<int>(samples.size());
    return s;
  }
  // The inner store's, or (SetInMemory(false)) every row "not in memory".
  absl::Status GetBatchFromMemory(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                  absl::Span<const absl::Span<float>> out, absl::Span<RowRead> reads) override {
    bool in_memory;
    {
      absl::MutexLock lock(&mu_);
      in_memory = in_memory_;
    }
    return in_memory ? inner_->GetBatchFromMemory(link, samples, out, reads)
                     : MessageStore::GetBatchFromMemory(link, samples, out, reads);
  }
  absl::Status PutBatch(const LinkSpec& link, absl::Span<const uint64_t> samples,
                        absl::Span<const absl::Span<const float>> values) override {
    {
      absl::MutexLock lock(&mu_);
      ++puts_entered_;
      mu_.Await(absl::Condition(
          +[](ObservedStore* self) { return self->gate_open_; }, this));
    }
    return inner_->PutBatch(link, samples, values);
  }
  // Encoding: MessageStore's default (a copy; PutBatch at commit), counted.
  absl::StatusOr<std::unique_ptr<EncodedPut>> EncodePut(
      const LinkSpec& link, absl::Span<const uint64_t> samples,
      absl::Span<const absl::Span<const float>> values) override {
    {
      absl::MutexLock lock(&mu_);
      ++encodes_;
    }
    return MessageStore::EncodePut(link, samples, values);
  }
  absl::Status DropLink(const LinkId& link) override { return inner_->DropLink(link); }
  MessageStoreStats GetStats() const override { return inner_->GetStats(); }
  absl::Status Close() override { return absl::OkStatus(); }

  void WaitForGetBatches(int n) {
    absl::MutexLock lock(&mu_);
    auto arg = std::make_pair(this, n);
    mu_.Await(absl::Condition(
        +[](std::pair<ObservedStore*, int>* a) { return a->first->get_batches_ >= a->second; },
        &arg));
  }
  void WaitForPutEntered(int n) {
    absl::MutexLock lock(&mu_);
    auto arg = std::make_pair(this, n);
    mu_.Await(absl::Condition(
        +[](std::pair<ObservedStore*, int>* a) { return a->first->puts_entered_ >= a->second; },
        &arg));
  }
  // False if fewer than `n` batches were encoded within a minute (a bound
  // for a failing test, not a synchronisation).
  bool WaitForEncodes(int n) {
    absl::MutexLock lock(&mu_);
    auto arg = std::make_pair(this, n);
    return mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<ObservedStore*, int>* a) { return a->first->encodes_ >= a->second; },
            &arg),
        absl::Minutes(1));
  }
  void SetGate(bool open) {
    absl::MutexLock lock(&mu_);
    gate_open_ = open;
  }
  void SetInMemory(bool in_memory) {
    absl::MutexLock lock(&mu_);
    in_memory_ = in_memory;
  }
  int get_batches() {
    absl::MutexLock lock(&mu_);
    return get_batches_;
  }
  int get_rows() {
    absl::MutexLock lock(&mu_);
    return get_rows_;
  }

 private:
  MessageStore* inner_;
  absl::Mutex mu_;
  int get_batches_ ABSL_GUARDED_BY(mu_) = 0;
  int get_rows_ ABSL_GUARDED_BY(mu_) = 0;
  int puts_entered_ ABSL_GUARDED_BY(mu_) = 0;
  int encodes_ ABSL_GUARDED_BY(mu_) = 0;
  bool gate_open_ ABSL_GUARDED_BY(mu_) = true;
  bool in_memory_ ABSL_GUARDED_BY(mu_) = true;
};

const LinkSpec kLink{{1, 2}, /*generation=*/1, /*rows=*/4, /*cols=*/32, RowPrecision::kFloat16};
constexpr int64_t kMicroBatch = 4;

class PrefetcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto mem = MemoryMessageStore::Create({});
    ASSERT_TRUE(mem.ok());
    memory_ = std::move(mem).value();
    observed_ = std::make_unique<ObservedStore>(memory_.get());
  }

  // Writes version `version` of samples [0, n) directly to the store.
  void Populate(uint64_t n, uint64_t version) {
    std::vector<uint64_t> samples;
    std::vector<std::vector<float>> rows;
    for (uint64_t s = 0; s < n; ++s) {
      samples.push_back(s);
      rows.push_back(RowValues(kLink, s, version));
    }
    ASSERT_TRUE(memory_->PutBatch(kLink, samples, ConstSpans(rows)).ok());
  }

  // A prefetcher over observed_ (or `store`) with a window of `k` batches,
  // 1 MiB memory bounds and the options' defaults otherwise, then `tweak`.
  // Hand-offs of one micro-batch (min_handoff_bytes 0) and every write
  // behind (inline_write_bytes 0) unless a tweak asks: the tests below pin
  // down which loads and writes happen when, batch by batch.
  std::unique_ptr<Prefetcher> MakePrefetcher(int64_t k,
                                             const std::function<void(Prefetcher::Options&)>& tweak = nullptr,
                                             MessageStore* store = nullptr) {
    Prefetcher::Options o;
    o.link = kLink;
    o.micro_batch = kMicroBatch;
    o.prefetch_batches = k;
    o.max_prefetch_bytes = 1 << 20;
    o.max_write_behind_bytes = 1 << 20;
    o.min_handoff_bytes = 0;
    o.inline_write_bytes = 0;
    if (tweak) tweak(o);
    auto p = Prefetcher::Create(store != nullptr ? store : observed_.get(), o);
    EXPECT_TRUE(p.ok()) << p.status();
    return std::move(p).value();
  }

  // Gets `samples` through `p` and checks they hold `version`.
  void ExpectVersion(Prefetcher* p, const std::vector<uint64_t>& samples, uint64_t version,
                     std::vector<uint64_t>* checksums = nullptr) {
    ExpectRowsHold([&](auto out, auto reads) { return p->GetBatch(samples, out, reads); }, samples, version,
                   checksums);
  }

  // The rows of `samples` in the backing store (under the prefetcher) hold `version`.
  void ExpectStoredVersion(const std::vector<uint64_t>& samples, uint64_t version) {
    ExpectRowsHold([&](auto out, auto reads) { return memory_->GetBatch(kLink, samples, out, reads); }, samples,
                   version);
  }

  // Reads `samples` with get(out spans, reads) and checks they hold `version`.
  template <typename Get>
  void ExpectRowsHold(Get get, const std::vector<uint64_t>& samples, uint64_t version,
                      std::vector<uint64_t>* checksums = nullptr) {
    std::vector<std::vector<float>> out(samples.size(), std::vector<float>(kLink.num_values()));
    std::vector<RowRead> reads(samples.size());
    ASSERT_TRUE(get(Spans(out), absl::MakeSpan(reads)).ok());
    for (size_t i = 0; i < samples.size(); ++i) {
      ASSERT_TRUE(reads[i].status.ok()) << "sample " << samples[i] << ": " << reads[i].status;
      EXPECT_TRUE(SameBits(out[i], StoredValues(kLink, samples[i], version)))
          << "sample " << samples[i];
      if (checksums != nullptr) checksums->push_back(reads[i].payload_checksum);
    }
  }

  void Put(Prefetcher* p, const std::vector<uint64_t>& samples, uint64_t version) {
    std::vector<std::vector<float>> rows;
    for (uint64_t s : samples) rows.push_back(RowValues(kLink, s, version));
    ASSERT_TRUE(p->PutBatch(samples, ConstSpans(rows)).ok());
  }

  std::unique_ptr<MemoryMessageStore> memory_;
  std::unique_ptr<ObservedStore> observed_;
};

std::vector<uint64_t> Permutation(uint64_t n, uint64_t seed) {
  std::vector<uint64_t> order(n);
  for (uint64_t i = 0; i < n; ++i) order[i] = i;
  aqswarm::Rng rng(seed);
  for (uint64_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.Uniform(i + 1)]);
  return order;
}

std::vector<uint64_t> Batch(const std::vector<uint64_t>& order, int64_t b) {
  return {order.begin() + b * kMicroBatch, order.begin() + (b + 1) * kMicroBatch};
}

TEST_F(PrefetcherTest, PrefetchedWindowIsServedFromMemory) {
  Populate(32, 1);
  auto p = MakePrefetcher(/*k=*/3);
  const std::vector<uint64_t> order = Permutation(32, 5);
  ASSERT_TRUE(p->SetOrder(order).ok());
  observed_->WaitForGetBatches(3);  // batches 0..2 loaded before any get
  for (int64_t b = 0; b < 3; ++b) ExpectVersion(p.get(), Batch(order, b), 1);
  PrefetcherStats stats = p->GetStats();
  EXPECT_EQ(stats.hits, 12u);
  EXPECT_EQ(stats.misses, 0u);
  // The rest of the epoch, with write-behind, is correct whatever the timing.
  for (int64_t b = 0; b < 8; ++b) {
    if (b >= 3) ExpectVersion(p.get(), Batch(order, b), 1);
    Put(p.get(), Batch(order, b), 2);
  }
  ASSERT_TRUE(p->Close().ok());
  stats = p->GetStats();
  EXPECT_EQ(stats.hits + stats.misses, 32u);
  EXPECT_EQ(stats.rows_written, 32u);
  EXPECT_EQ(stats.prefetched_bytes, 0u);
  // Second epoch straight from the store.
  auto q = MakePrefetcher(2);
  ASSERT_TRUE(q->SetOrder(Permutation(32, 6)).ok());
  for (int64_t b = 0; b < 8; ++b) ExpectVersion(q.get(), Batch(Permutation(32, 6), b), 2);
}

TEST_F(PrefetcherTest, ReadYourWritesWhileQueuedInFlightAndDone) {
  Populate(16, 1);
  auto p = MakePrefetcher(/*k=*/4);
  const std::vector<uint64_t> order = Permutation(16, 9);
  ASSERT_TRUE(p->SetOrder(order).ok());
  observed_->WaitForGetBatches(4);  // everything prefetched: old values in memory
  const std::vector<uint64_t> target = Batch(order, 2);

  observed_->SetGate(false);  // the writer will block inside the store
  Put(p.get(), target, 2);
  std::vector<uint64_t> while_queued, after_write;
  ExpectVersion(p.get(), target, 2, &while_queued);  // not the prefetched version 1
  observed_->WaitForPutEntered(1);
  ExpectVersion(p.get(), target, 2);  // write in flight
  observed_->SetGate(true);
  ASSERT_TRUE(p->Flush().ok());
  ExpectVersion(p.get(), target, 2, &after_write);  // from the store now
  EXPECT_EQ(while_queued, after_write);  // checksum(m) identical either way
  // Put twice, the later one wins.
  Put(p.get(), {target[0]}, 3);
  Put(p.get(), {target[0]}, 4);
  ExpectVersion(p.get(), {target[0]}, 4);
  ASSERT_TRUE(p->Close().ok());
  std::vector<std::vector<float>> out(1, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(1);
  const std::vector<uint64_t> one = {target[0]};
  ASSERT_TRUE(memory_->GetBatch(kLink, one, Spans(out), absl::MakeSpan(reads)).ok());
  EXPECT_TRUE(SameBits(out[0], StoredValues(kLink, target[0], 4)));
}

TEST_F(PrefetcherTest, MemoryIsBoundedAndWritesApplyBackPressure) {
  Populate(64, 1);
  const uint64_t batch_bytes = kMicroBatch * kLink.num_values() * sizeof(float);
  // K = 10 but memory for only 2 micro-batches; writes: 1 micro-batch.
  auto p = MakePrefetcher(/*k=*/10, [&](Prefetcher::Options& o) {
    o.max_prefetch_bytes = 2 * batch_bytes;
    o.max_write_behind_bytes = batch_bytes;
  });
  const std::vector<uint64_t> order = Permutation(64, 11);
  ASSERT_TRUE(p->SetOrder(order).ok());
  observed_->WaitForGetBatches(2);
  uint64_t max_prefetched = 0, max_queued = 0;
  for (int64_t b = 0; b < 16; ++b) {
    max_prefetched = std::max(max_prefetched, p->GetStats().prefetched_bytes);
    ExpectVersion(p.get(), Batch(order, b), 1);
    Put(p.get(), Batch(order, b), 2);
    max_queued = std::max(max_queued, p->GetStats().write_behind_bytes);
  }
  EXPECT_LE(max_prefetched, 2 * batch_bytes);
  EXPECT_LE(max_queued, batch_bytes);
  ASSERT_TRUE(p->Close().ok());
  EXPECT_EQ(memory_->GetStats().rows_written, 64u + 64u);
}

TEST_F(PrefetcherTest, SkippedBatchesAreReleasedAndUnknownSamplesMiss) {
  Populate(40, 1);
  auto p = MakePrefetcher(/*k=*/2);
  const std::vector<uint64_t> order = Permutation(32, 3);
  ASSERT_TRUE(p->SetOrder(order).ok());
  ExpectVersion(p.get(), Batch(order, 0), 1);
  ExpectVersion(p.get(), Batch(order, 5), 1);  // skip 1..4
  ExpectVersion(p.get(), {35, 36}, 1);          // not in the order: read through
  ExpectVersion(p.get(), Batch(order, 7), 1);
  PrefetcherStats stats = p->GetStats();
  EXPECT_GE(stats.misses, 2u);
  EXPECT_EQ(stats.prefetched_bytes, 0u);  // nothing left behind
  ASSERT_TRUE(p->Close().ok());
  std::vector<std::vector<float>> out(1, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(1);
  EXPECT_TRUE(absl::IsFailedPrecondition(
      p->GetBatch(std::vector<uint64_t>{1}, Spans(out), absl::MakeSpan(reads))));
}

TEST_F(PrefetcherTest, ZeroCopyTakeAndPutRoundTrip) {
  Populate(32, 1);
  auto p = MakePrefetcher(/*k=*/2);
  const std::vector<uint64_t> order = Permutation(32, 21);
  ASSERT_TRUE(p->SetOrder(order).ok());
  for (int64_t b = 0; b < 8; ++b) {
    const std::vector<uint64_t> samples = Batch(order, b);
    std::vector<std::vector<float>> rows;
    std::vector<RowRead> reads(samples.size());
    ASSERT_TRUE(p->TakeBatch(samples, &rows, absl::MakeSpan(reads)).ok());
    ASSERT_EQ(rows.size(), samples.size());
    for (size_t i = 0; i < samples.size(); ++i) {
      ASSERT_TRUE(reads[i].status.ok()) << reads[i].status;
      EXPECT_TRUE(SameBits(rows[i], StoredValues(kLink, samples[i], 1)));
      rows[i] = RowValues(kLink, samples[i], 2);  // the caller's update
    }
    ASSERT_TRUE(p->PutBatch(samples, std::move(rows)).ok());
    ExpectVersion(p.get(), samples, 2);  // read-your-writes on the owned path
  }
  ASSERT_TRUE(p->Close().ok());
  auto q = MakePrefetcher(2);
  ASSERT_TRUE(q->SetOrder(order).ok());
  for (int64_t b = 0; b < 8; ++b) ExpectVersion(q.get(), Batch(order, b), 2);
}

TEST_F(PrefetcherTest, SteadyZeroCopyEpochsRecycleBuffers) {
  Populate(256, 1);
  const uint64_t batch_bytes = kMicroBatch * kLink.num_values() * sizeof(float);
  // Window: 3 micro-batches, write-behind: 2 -> at most 5 batches queued or
  // prefetched, plus the consumer's; the pool may keep (5 + 3) batches.
  auto p = MakePrefetcher(/*k=*/2, [&](Prefetcher::Options& o) {
    o.max_prefetch_bytes = 3 * batch_bytes;
    o.max_write_behind_bytes = 2 * batch_bytes;
  });
  uint64_t rows_moved = 0;
  for (uint64_t epoch = 0; epoch < 3; ++epoch) {
    const std::vector<uint64_t> order = Permutation(256, 40 + epoch);
    ASSERT_TRUE(p->SetOrder(order).ok());
    for (int64_t b = 0; b < 64; ++b) {
      const std::vector<uint64_t> samples = Batch(order, b);
      std::vector<std::vector<float>> rows;
      std::vector<RowRead> reads(samples.size());
      ASSERT_TRUE(p->TakeBatch(samples, &rows, absl::MakeSpan(reads)).ok());
      for (size_t i = 0; i < samples.size(); ++i) {
        ASSERT_TRUE(reads[i].status.ok()) << reads[i].status;
        ASSERT_TRUE(SameBits(rows[i], StoredValues(kLink, samples[i], epoch + 1)));
        const std::vector<float> next = RowValues(kLink, samples[i], epoch + 2);
        std::copy(next.begin(), next.end(), rows[i].begin());  // update in place
      }
      ASSERT_TRUE(p->PutBatch(samples, std::move(rows)).ok());
      rows_moved += samples.size();
    }
    ASSERT_TRUE(p->Flush().ok());
  }
  const PrefetcherStats stats = p->GetStats();
  EXPECT_EQ(rows_moved, 768u);
  // Buffers come from the pool, not one allocation per row moved.
  EXPECT_LE(stats.buffers_allocated, static_cast<uint64_t>(8 * kMicroBatch));
  ASSERT_TRUE(p->Close().ok());
}

// Finiteness is not checked on the caller's thread: the write-behind rejects
// the batch (nothing of it is written) and the prefetcher fails from then on.
TEST_F(PrefetcherTest, NonFinitePutFailsTheWriteBehindStickilyAndWritesNothing) {
  Populate(16, 1);
  auto p = MakePrefetcher(/*k=*/2);
  const std::vector<uint64_t> order = Permutation(16, 5);
  ASSERT_TRUE(p->SetOrder(order).ok());
  const std::vector<uint64_t> samples = Batch(order, 0);
  std::vector<std::vector<float>> rows;
  std::vector<RowRead> reads(samples.size());
  ASSERT_TRUE(p->TakeBatch(samples, &rows, absl::MakeSpan(reads)).ok());
  for (size_t i = 0; i < samples.size(); ++i) rows[i] = RowValues(kLink, samples[i], 2);
  rows[2][5] = std::numeric_limits<float>::quiet_NaN();

  observed_->SetGate(false);  // hold the write: the bad row is still queued
  ASSERT_TRUE(p->PutBatch(samples, std::move(rows)).ok());
  // A get of the queued bad row fails rather than return NaNs as data.
  std::vector<std::vector<float>> out(1, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> one_read(1);
  const std::vector<uint64_t> bad = {samples[2]};
  EXPECT_TRUE(absl::IsInvalidArgument(p->GetBatch(bad, Spans(out), absl::MakeSpan(one_read))));
  observed_->SetGate(true);

  const absl::Status flushed = p->Flush();
  EXPECT_TRUE(absl::IsInvalidArgument(flushed)) << flushed;
  EXPECT_THAT(std::string(flushed.message()),
              ::testing::HasSubstr(absl::StrCat("sample ", samples[2])));
  // Sticky: every later call reports it.
  std::vector<std::vector<float>> more;
  std::vector<RowRead> more_reads(kMicroBatch);
  EXPECT_TRUE(absl::IsInvalidArgument(p->TakeBatch(Batch(order, 1), &more, absl::MakeSpan(more_reads))));
  Put(p.get(), {}, 3);  // (an empty put is a no-op even now)
  EXPECT_TRUE(absl::IsInvalidArgument(p->Close()));
  // The whole batch was refused: the store still holds version 1.
  std::vector<std::vector<float>> stored(samples.size(), std::vector<float>(kLink.num_values()));
  std::vector<RowRead> stored_reads(samples.size());
  ASSERT_TRUE(memory_->GetBatch(kLink, samples, Spans(stored), absl::MakeSpan(stored_reads)).ok());
  for (size_t i = 0; i < samples.size(); ++i) {
    ASSERT_TRUE(stored_reads[i].status.ok()) << stored_reads[i].status;
    EXPECT_TRUE(SameBits(stored[i], StoredValues(kLink, samples[i], 1))) << "sample " << samples[i];
  }
}

TEST_F(PrefetcherTest, RejectsBadOptions) {
  Prefetcher::Options o;
  o.link = kLink;
  o.loader_threads = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(Prefetcher::Create(observed_.get(), o).status()));
  o.loader_threads = 1;
  o.prefetch_batches = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(Prefetcher::Create(observed_.get(), o).status()));
  o.prefetch_batches = 1;
  o.encode_threads = -1;
  EXPECT_TRUE(absl::IsInvalidArgument(Prefetcher::Create(observed_.get(), o).status()));
}

// While the writer is held inside the store writing batch 1, the encode
// thread encodes batch 2 (and read-your-writes still holds for it).
TEST_F(PrefetcherTest, EncodeThreadEncodesTheNextWriteWhileOneIsWritten) {
  Populate(16, 1);
  auto p = MakePrefetcher(/*k=*/2, [](Prefetcher::Options& o) {
    o.encode_threads = 1;
    o.min_encode_ahead_bytes = 0;
  });
  const std::vector<uint64_t> order = Permutation(16, 13);
  ASSERT_TRUE(p->SetOrder(order).ok());
  observed_->SetGate(false);
  for (int64_t b = 0; b < 3; ++b) {
    ExpectVersion(p.get(), Batch(order, b), 1);
    Put(p.get(), Batch(order, b), 2);
  }
  observed_->WaitForPutEntered(1);  // the writer holds batch 0 in the store
  // The writer is blocked in the store, so the second encode is the encode
  // thread's. (Its counter is bumped after EncodePut returns: read it after
  // Close, not here, where it raced with the thread.)
  EXPECT_TRUE(observed_->WaitForEncodes(2));
  ExpectVersion(p.get(), Batch(order, 1), 2);  // encoded, not written: still the put
  observed_->SetGate(true);
  ASSERT_TRUE(p->Close().ok());
  EXPECT_GE(p->GetStats().batches_encoded_ahead, 1u);
  EXPECT_EQ(p->GetStats().rows_written, 3u * kMicroBatch);
  for (int64_t b = 0; b < 3; ++b) ExpectStoredVersion(Batch(order, b), 2);
}

// Writes below min_encode_ahead_bytes are all encoded by the writer: small
// rows cost no hand-off to an encode thread.
TEST_F(PrefetcherTest, SmallWritesAreNotHandedToTheEncodeThread) {
  Populate(32, 1);
  auto p = MakePrefetcher(/*k=*/2);  // default threshold: 1 MiB >> a batch here
  const std::vector<uint64_t> order = Permutation(32, 17);
  ASSERT_TRUE(p->SetOrder(order).ok());
  for (int64_t b = 0; b < 8; ++b) {
    ExpectVersion(p.get(), Batch(order, b), 1);
    Put(p.get(), Batch(order, b), 2);
  }
  ASSERT_TRUE(p->Close().ok());
  const PrefetcherStats stats = p->GetStats();
  EXPECT_EQ(stats.rows_written, 32u);
  EXPECT_EQ(stats.batches_encoded_ahead, 0u);
}

// A non-finite batch among others, encoded by whichever thread: it alone is
// not written, the batches before it are, and the prefetcher fails stickily
// naming the sample.
TEST_F(PrefetcherTest, NonFiniteWriteEncodedAheadFailsStickily) {
  Populate(64, 1);
  for (int encode_threads : {1, 2}) {
    SCOPED_TRACE(encode_threads);
    auto p = MakePrefetcher(
        /*k=*/2,
        [&](Prefetcher::Options& o) {
          o.encode_threads = encode_threads;
          o.min_encode_ahead_bytes = 0;
        },
        memory_.get());
    std::vector<uint64_t> order = Permutation(32, 19 + encode_threads);
    for (uint64_t& s : order) s += 32 * (encode_threads - 1);  // rows still at version 1
    ASSERT_TRUE(p->SetOrder(order).ok());
    constexpr int64_t kBad = 4;
    uint64_t bad_sample = 0;
    for (int64_t b = 0; b <= kBad; ++b) {  // the bad batch last: later calls would fail
      const std::vector<uint64_t> samples = Batch(order, b);
      std::vector<std::vector<float>> rows;
      std::vector<RowRead> reads(samples.size());
      ASSERT_TRUE(p->TakeBatch(samples, &rows, absl::MakeSpan(reads)).ok());
      for (size_t i = 0; i < samples.size(); ++i) {
        rows[i] = RowValues(kLink, samples[i], 10 + encode_threads);
      }
      if (b == kBad) {
        rows[1][3] = -std::numeric_limits<float>::infinity();
        bad_sample = samples[1];
      }
      ASSERT_TRUE(p->PutBatch(samples, std::move(rows)).ok());
    }
    const absl::Status flushed = p->Flush();
    EXPECT_TRUE(absl::IsInvalidArgument(flushed)) << flushed;
    EXPECT_THAT(std::string(flushed.message()),
                ::testing::HasSubstr(absl::StrCat("sample ", bad_sample)));
    EXPECT_TRUE(absl::IsInvalidArgument(p->Close()));
    // Batches before the bad one hold the put; the bad one the old rows.
    for (int64_t b = 0; b <= kBad; ++b) ExpectStoredVersion(Batch(order, b), b < kBad ? 10 + encode_threads : 1);
  }
}

// MessageStore's default two-phase put (a store that only has PutBatch):
// a copy of the arguments, written by PutBatch at commit, refused elsewhere.
TEST_F(PrefetcherTest, DefaultEncodedPutIsWrittenByPutBatchAtCommit) {
  std::vector<std::vector<float>> rows = {RowValues(kLink, 5, 3)};
  const std::vector<uint64_t> samples = {5};
  auto put = observed_->EncodePut(kLink, samples, ConstSpans(rows));
  ASSERT_TRUE(put.ok()) << put.status();
  rows[0].assign(rows[0].size(), 0.0f);  // the put holds its own copy
  std::vector<std::vector<float>> out(1, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(1);
  ASSERT_TRUE(memory_->GetBatch(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
  EXPECT_TRUE(absl::IsNotFound(reads[0].status));
  ASSERT_TRUE(observed_->CommitPut(std::move(put).value()).ok());
  ASSERT_TRUE(memory_->GetBatch(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
  ASSERT_TRUE(reads[0].status.ok()) << reads[0].status;
  EXPECT_TRUE(SameBits(out[0], StoredValues(kLink, 5, 3)));
  EXPECT_TRUE(absl::IsInvalidArgument(observed_->CommitPut(nullptr)));
  // Encoded by another store (the inner one): not this store's put.
  auto inner = memory_->EncodePut(kLink, samples, ConstSpans(rows));
  ASSERT_TRUE(inner.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(observed_->CommitPut(std::move(inner).value())));
  ObservedStore other(memory_.get());
  auto foreign = other.EncodePut(kLink, samples, ConstSpans(rows));
  ASSERT_TRUE(foreign.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(observed_->CommitPut(std::move(foreign).value())));
  rows[0].pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(observed_->EncodePut(kLink, samples, ConstSpans(rows)).status()));
}

// Several loader threads fill the window concurrently; every row still comes
// back exact, whichever thread loaded it, across epochs over a real RocksDB.
// The next epoch's order is appended while the current one runs: the loaders
// go on into it, but a sample whose earlier occurrence is not yet taken and
// put again must not be read from the store (that would be the stale m(xi)).
// Here every sample of epoch 2 is also in epoch 1 and the writes are held
// inside the store, so epoch 2 must come entirely from the queued puts.
TEST_F(PrefetcherTest, AppendedEpochNeverReadsARowBeforeItsPreviousPut) {
  Populate(8, 1);
  auto p = MakePrefetcher(/*k=*/8);  // the window spans both epochs
  const std::vector<uint64_t> epoch1 = Permutation(8, 1), epoch2 = Permutation(8, 2);
  ASSERT_TRUE(p->SetOrder(epoch1).ok());
  ASSERT_TRUE(p->AppendOrder(epoch2).ok());
  observed_->WaitForGetBatches(2);  // epoch 1 loaded
  observed_->SetGate(false);        // writes stay queued / in flight
  for (int64_t b = 0; b < 2; ++b) {
    ExpectVersion(p.get(), Batch(epoch1, b), 1);
    Put(p.get(), Batch(epoch1, b), 2);
  }
  std::vector<uint64_t> checksums;
  for (int64_t b = 0; b < 2; ++b) ExpectVersion(p.get(), Batch(epoch2, b), 2, &checksums);
  PrefetcherStats stats = p->GetStats();
  EXPECT_EQ(stats.hits, 16u);
  EXPECT_EQ(stats.misses, 0u);
  EXPECT_EQ(observed_->get_rows(), 8);  // epoch 1 only: nothing of epoch 2 from the store
  observed_->SetGate(true);
  ASSERT_TRUE(p->Close().ok());
  // The checksums served for epoch 2 are those of the rows now stored.
  std::vector<uint64_t> stored;
  for (int64_t b = 0; b < 2; ++b) {
    const std::vector<uint64_t> samples = Batch(epoch2, b);
    std::vector<std::vector<float>> out(samples.size(), std::vector<float>(kLink.num_values()));
    std::vector<RowRead> reads(samples.size());
    ASSERT_TRUE(memory_->GetBatch(kLink, samples, Spans(out), absl::MakeSpan(reads)).ok());
    for (const RowRead& r : reads) stored.push_back(r.payload_checksum);
  }
  EXPECT_EQ(checksums, stored);
}

// Small rows: a loader is handed half the window at once (one store read),
// the writer a queue of that many batches; with min_handoff_bytes 0, one
// batch each. Values stay exact either way.
TEST_F(PrefetcherTest, SmallRowsAreHandedOffHalfAWindowAtATime) {
  constexpr int64_t kBatches = 64, kWindow = 8;
  const uint64_t batch_bytes = kMicroBatch * kLink.num_values() * sizeof(float);
  for (const uint64_t handoff : {uint64_t{0}, 4 * batch_bytes, 100 * batch_bytes}) {
    SetUp();
    Populate(kBatches * kMicroBatch, 1);
    auto p = MakePrefetcher(kWindow, [&](Prefetcher::Options& o) { o.min_handoff_bytes = handoff; });
    const std::vector<uint64_t> order = Permutation(kBatches * kMicroBatch, 5);
    ASSERT_TRUE(p->SetOrder(order).ok());
    for (int64_t b = 0; b < kBatches; ++b) {
      ExpectVersion(p.get(), Batch(order, b), 1);
      Put(p.get(), Batch(order, b), 2);
    }
    ASSERT_TRUE(p->Flush().ok());  // wakes the writer for a queue under a hand-off
    ExpectStoredVersion(order, 2);
    const PrefetcherStats stats = p->GetStats();
    EXPECT_EQ(stats.rows_written, static_cast<uint64_t>(kBatches * kMicroBatch));
    EXPECT_EQ(stats.hits + stats.misses, static_cast<uint64_t>(kBatches * kMicroBatch));
    // Each row was loaded ahead, or read at once when the consumer got there
    // before a loader (then its whole batch is skipped by the loaders).
    EXPECT_EQ(stats.rows_prefetched + stats.misses, static_cast<uint64_t>(kBatches * kMicroBatch));
    const uint64_t loaded_batches = stats.rows_prefetched / kMicroBatch;
    // Hand-offs are capped at half the window (4 batches) whatever is asked;
    // every claim takes a whole one except at the order's end.
    const uint64_t per_handoff = handoff == 0 ? 1 : kWindow / 2;
    EXPECT_LE(stats.loader_rounds, (loaded_batches + per_handoff - 1) / per_handoff + 1) << handoff;
    if (handoff == 0) EXPECT_EQ(stats.loader_rounds, loaded_batches);
    // The writer wakes for a full hand-off (or the final Flush) and then
    // writes the whole queue.
    EXPECT_LE(stats.writer_rounds, kBatches / per_handoff + 1) << handoff;
    ASSERT_TRUE(p->Close().ok());
  }
}

// The writer waits for a full hand-off, but never past a Flush, a Close or a
// put blocked on the write-behind bound (here smaller than a hand-off).
TEST_F(PrefetcherTest, WritesUnderAHandOffAreWrittenOnFlushCloseAndBackPressure) {
  Populate(64, 1);
  const uint64_t batch_bytes = kMicroBatch * kLink.num_values() * sizeof(float);
  auto p = MakePrefetcher(/*k=*/16, [&](Prefetcher::Options& o) {
    o.max_write_behind_bytes = 2 * batch_bytes;
    o.min_handoff_bytes = 8 * batch_bytes;
  });
  const std::vector<uint64_t> order = Permutation(64, 6);
  ASSERT_TRUE(p->SetOrder(order).ok());
  Put(p.get(), Batch(order, 0), 2);
  ASSERT_TRUE(p->Flush().ok());
  ExpectStoredVersion(Batch(order, 0), 2);
  for (int64_t b = 1; b < 16; ++b) Put(p.get(), Batch(order, b), 2);  // back-pressure from the 3rd on
  EXPECT_LE(p->GetStats().write_behind_bytes, 2 * batch_bytes);
  ASSERT_TRUE(p->Close().ok());
  ExpectStoredVersion(order, 2);
}

// Small puts with nothing queued are in the store when PutBatch returns, and
// no writer is woken for them.
TEST_F(PrefetcherTest, SmallPutsAreWrittenOnTheCallersThread) {
  Populate(64, 1);
  const uint64_t batch_bytes = kMicroBatch * kLink.num_values() * sizeof(float);
  auto p = MakePrefetcher(/*k=*/4, [&](Prefetcher::Options& o) { o.inline_write_bytes = batch_bytes; });
  const std::vector<uint64_t> order = Permutation(64, 7);
  for (uint64_t epoch = 1; epoch <= 2; ++epoch) {
    ASSERT_TRUE(p->SetOrder(order).ok());
    for (int64_t b = 0; b < 16; ++b) {
      ExpectVersion(p.get(), Batch(order, b), epoch);
      Put(p.get(), Batch(order, b), epoch + 1);
      ExpectStoredVersion(Batch(order, b), epoch + 1);  // no Flush needed
    }
  }
  const PrefetcherStats stats = p->GetStats();
  EXPECT_EQ(stats.rows_written_inline, 128u);
  EXPECT_EQ(stats.rows_written, 128u);
  EXPECT_EQ(stats.writer_rounds, 0u);
  ASSERT_TRUE(p->Close().ok());
}

// An inline put returns its own error (and, as a write-behind would, fails
// every later call); nothing of the batch is written.
TEST_F(PrefetcherTest, NonFiniteInlinePutFailsAtOnceAndStickily) {
  Populate(16, 1);
  auto p = MakePrefetcher(/*k=*/2, [](Prefetcher::Options& o) { o.inline_write_bytes = 1 << 20; });
  const std::vector<uint64_t> order = Permutation(16, 8);
  ASSERT_TRUE(p->SetOrder(order).ok());
  const std::vector<uint64_t> samples = Batch(order, 0);
  std::vector<std::vector<float>> rows;
  for (uint64_t s : samples) rows.push_back(RowValues(kLink, s, 2));
  rows[1][3] = std::numeric_limits<float>::quiet_NaN();
  const absl::Status put = p->PutBatch(samples, ConstSpans(rows));
  EXPECT_TRUE(absl::IsInvalidArgument(put)) << put;
  EXPECT_THAT(std::string(put.message()), HasSubstr("prefetcher write failed"));
  ExpectStoredVersion(samples, 1);
  std::vector<std::vector<float>> out(kMicroBatch, std::vector<float>(kLink.num_values()));
  std::vector<RowRead> reads(kMicroBatch);
  EXPECT_TRUE(absl::IsInvalidArgument(p->GetBatch(Batch(order, 1), Spans(out), absl::MakeSpan(reads))));
  EXPECT_TRUE(absl::IsInvalidArgument(p->Close()));
}

// A small put behind a queued one is queued too: the store sees them in
// PutBatch order.
TEST_F(PrefetcherTest, SmallPutBehindAQueuedOneIsQueued) {
  Populate(16, 1);
  const uint64_t batch_bytes = kMicroBatch * kLink.num_values() * sizeof(float);
  auto p = MakePrefetcher(/*k=*/2, [&](Prefetcher::Options& o) { o.inline_write_bytes = batch_bytes; });
  const std::vector<uint64_t> order = Permutation(16, 9);
  ASSERT_TRUE(p->SetOrder(order).ok());
  std::vector<uint64_t> big = Batch(order, 0);
  const std::vector<uint64_t> next = Batch(order, 1);
  big.insert(big.end(), next.begin(), next.end());  // 2 batches: written behind
  observed_->SetGate(false);
  Put(p.get(), big, 2);
  observed_->WaitForPutEntered(1);     // the writer holds it in the store
  Put(p.get(), {big[0], big[5]}, 3);   // returns: queued, not written here
  ExpectVersion(p.get(), {big[0]}, 3);
  observed_->SetGate(true);
  ASSERT_TRUE(p->Flush().ok());
  ExpectStoredVersion({big[0], big[5]}, 3);
  ExpectStoredVersion({big[1], big[4]}, 2);
  EXPECT_EQ(p->GetStats().rows_written_inline, 0u);
  ASSERT_TRUE(p->Close().ok());
}

// A RocksDB store sized for tests: small memtable, rows of 512+ bytes in blob files.
absl::StatusOr<std::unique_ptr<RocksDbMessageStore>> OpenSmallRocksDb(const ScratchDir& dir) {
  RocksDbMessageStore::Options o;
  o.path = dir.Sub("db");
  o.write_buffer_bytes = 1 << 20;
  o.min_blob_bytes = 512;
  return RocksDbMessageStore::Open(o);
}

// A trainer's loop: each epoch's successor appended when it starts, window
// deeper than an epoch, writes completing at their own pace. Every row read
// is the previous epoch's put, exactly.
TEST_F(PrefetcherTest, SmallBatchesInMemoryAreReadOnTheCallersThread) {
  Populate(32, 1);
  auto p = MakePrefetcher(/*k=*/3, [](Prefetcher::Options& o) { o.inline_read_bytes = 1 << 20; });
  const std::vector<uint64_t> order = Permutation(32, 7);
  ASSERT_TRUE(p->SetOrder(order).ok());
  for (int64_t b = 0; b < 8; ++b) {
    ExpectVersion(p.get(), Batch(order, b), 1);
    Put(p.get(), Batch(order, b), 2);
  }
  PrefetcherStats stats = p->GetStats();
  EXPECT_EQ(stats.rows_read_inline, 32u);
  EXPECT_EQ(stats.hits, 32u);
  EXPECT_EQ(stats.misses, 0u);
  EXPECT_EQ(stats.inline_read_fallbacks, 0u);
  EXPECT_EQ(stats.loader_rounds, 0u);  // no loader ever woke
  EXPECT_EQ(stats.rows_prefetched, 0u);
  EXPECT_EQ(observed_->get_batches(), 0);  // and no read that could wait for I/O
  // Read-your-writes: the next epoch sees every put, queued or written.
  const std::vector<uint64_t> next = Permutation(32, 8);
  ASSERT_TRUE(p->SetOrder(next).ok());
  for (int64_t b = 0; b < 8; ++b) ExpectVersion(p.get(), Batch(next, b), 2);
  ASSERT_TRUE(p->Close().ok());
  ExpectStoredVersion(order, 2);
}

TEST_F(PrefetcherTest, RowsNotInMemoryTurnPrefetchingOnUntilTheNextOrder) {
  Populate(32, 1);
  observed_->SetInMemory(false);  // as if every row were on disk
  auto p = MakePrefetcher(/*k=*/3, [](Prefetcher::Options& o) { o.inline_read_bytes = 1 << 20; });
  const std::vector<uint64_t> order = Permutation(32, 9);
  ASSERT_TRUE(p->SetOrder(order).ok());
  ExpectVersion(p.get(), Batch(order, 0), 1);  // read with GetBatch after all
  PrefetcherStats stats = p->GetStats();
  EXPECT_EQ(stats.inline_read_fallbacks, 4u);
  EXPECT_EQ(stats.misses, 4u);
  EXPECT_EQ(stats.rows_read_inline, 0u);
  observed_->WaitForGetBatches(1 + 3);  // ... and the loaders now fill the window (batches 1-3)
  for (int64_t b = 1; b < 8; ++b) ExpectVersion(p.get(), Batch(order, b), 1);
  stats = p->GetStats();
  EXPECT_GE(stats.rows_prefetched, 12u);
  EXPECT_EQ(stats.hits + stats.misses, 32u);
  // A new order tries memory again.
  observed_->SetInMemory(true);
  const std::vector<uint64_t> next = Permutation(32, 10);
  ASSERT_TRUE(p->SetOrder(next).ok());
  for (int64_t b = 0; b < 8; ++b) ExpectVersion(p.get(), Batch(next, b), 1);
  const PrefetcherStats after = p->GetStats();
  EXPECT_EQ(after.rows_read_inline, 32u);
  EXPECT_EQ(after.inline_read_fallbacks, 4u);
}

TEST(PrefetcherRocksDbTest, AppendedEpochsOverRocksDbAreExact) {
  ScratchDir dir;
  auto store = OpenSmallRocksDb(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  constexpr uint64_t kSamples = 64;
  constexpr uint64_t kEpochs = 6;
  {
    std::vector<uint64_t> samples;
    std::vector<std::vector<float>> rows;
    for (uint64_t s = 0; s < kSamples; ++s) {
      samples.push_back(s);
      rows.push_back(RowValues(kLink, s, 1));
    }
    ASSERT_TRUE((*store)->PutBatch(kLink, samples, ConstSpans(rows)).ok());
  }
  Prefetcher::Options po;
  po.link = kLink;
  po.micro_batch = kMicroBatch;
  po.prefetch_batches = 20;  // > the 16 batches of an epoch
  po.min_encode_ahead_bytes = 0;
  auto p = Prefetcher::Create(store->get(), po);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE((*p)->SetOrder(Permutation(kSamples, 100)).ok());
  for (uint64_t epoch = 0; epoch < kEpochs; ++epoch) {
    const std::vector<uint64_t> order = Permutation(kSamples, 100 + epoch);
    if (epoch + 1 < kEpochs) {
      ASSERT_TRUE((*p)->AppendOrder(Permutation(kSamples, 101 + epoch)).ok());
    }
    for (int64_t b = 0; b < static_cast<int64_t>(kSamples) / kMicroBatch; ++b) {
      const std::vector<uint64_t> samples = Batch(order, b);
      std::vector<std::vector<float>> rows;
      std::vector<RowRead> reads(samples.size());
      ASSERT_TRUE((*p)->TakeBatch(samples, &rows, absl::MakeSpan(reads)).ok());
      for (size_t i = 0; i < samples.size(); ++i) {
        ASSERT_TRUE(reads[i].status.ok()) << reads[i].status;
        ASSERT_TRUE(SameBits(rows[i], StoredValues(kLink, samples[i], epoch + 1)))
            << "epoch " << epoch << " sample " << samples[i];
        const std::vector<float> next = RowValues(kLink, samples[i], epoch + 2);
        std::copy(next.begin(), next.end(), rows[i].begin());
      }
      ASSERT_TRUE((*p)->PutBatch(samples, std::move(rows)).ok());
    }
  }
  ASSERT_TRUE((*p)->Close().ok());
  const PrefetcherStats stats = (*p)->GetStats();
  EXPECT_EQ(stats.hits + stats.misses, kSamples * kEpochs);
  EXPECT_EQ(stats.rows_written, kSamples * kEpochs);
  EXPECT_EQ(stats.prefetched_bytes, 0u);
  for (uint64_t s = 0; s < kSamples; ++s) {
    std::vector<std::vector<float>> out(1, std::vector<float>(kLink.num_values()));
    std::vector<RowRead> reads(1);
    const std::vector<uint64_t> one = {s};
    ASSERT_TRUE((*store)->GetBatch(kLink, one, Spans(out), absl::MakeSpan(reads)).ok());
    ASSERT_TRUE(reads[0].status.ok());
    EXPECT_TRUE(SameBits(out[0], StoredValues(kLink, s, kEpochs + 1)));
  }
}

TEST(PrefetcherRocksDbTest, EpochOverRocksDbIsExact) {
  ScratchDir dir;
  auto store = OpenSmallRocksDb(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  Prefetcher::Options po;
  po.link = kLink;
  po.micro_batch = kMicroBatch;
  po.prefetch_batches = 6;        // the default hand-off: 3 micro-batches
  po.min_encode_ahead_bytes = 0;  // every write may be encoded ahead
  po.inline_write_bytes = 0;      // every write behind (AppendedEpochs... writes inline)
  for (uint64_t epoch = 0; epoch < 3; ++epoch) {
    po.loader_threads = static_cast<int>(epoch) + 1;  // 1, 2, 3
    po.encode_threads = static_cast<int>(epoch);      // 0, 1, 2
    auto p = Prefetcher::Create(store->get(), po);
    ASSERT_TRUE(p.ok()) << p.status();
    const std::vector<uint64_t> order = Permutation(64, epoch);
    ASSERT_TRUE((*p)->SetOrder(order).ok());
    for (int64_t b = 0; b < 16; ++b) {
      const std::vector<uint64_t> samples = Batch(order, b);
      std::vector<std::vector<float>> out(kMicroBatch, std::vector<float>(kLink.num_values()));
      std::vector<RowRead> reads(kMicroBatch);
      ASSERT_TRUE((*p)->GetBatch(samples, Spans(out), absl::MakeSpan(reads)).ok());
      std::vector<std::vector<float>> next;
      for (int64_t i = 0; i < kMicroBatch; ++i) {
        if (epoch == 0) {
          ASSERT_TRUE(absl::IsNotFound(reads[i].status)) << reads[i].status;
        } else {
          ASSERT_TRUE(reads[i].status.ok()) << reads[i].status;
          EXPECT_TRUE(SameBits(out[i], StoredValues(kLink, samples[i], epoch)));
        }
        next.push_back(RowValues(kLink, samples[i], epoch + 1));
      }
      ASSERT_TRUE((*p)->PutBatch(samples, ConstSpans(next)).ok());
    }
    ASSERT_TRUE((*p)->Close().ok());
  }
}

}  // namespace
}  // namespace aqswarm::storage
