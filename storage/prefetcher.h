// Prefetcher: hides message-store I/O behind compute. The epoch's sample
// order is known in advance (docs/design/ARCHITECTURE.md "Data identity"), so loader
// threads keep the rows of the next K micro-batches in memory before the
// consumer asks for them, and a writer thread writes updates behind.
//
//   Prefetcher::Options o;
//   o.link = link;  o.micro_batch = 8;  o.prefetch_batches = 4;
//   AQSWARM_ASSIGN_OR_RETURN(auto prefetcher, Prefetcher::Create(store, o));
//   AQSWARM_RETURN_IF_ERROR(prefetcher->SetOrder(epoch_permutation));
//   for each micro-batch `samples` in that order:
//     prefetcher->GetBatch(samples, out, reads);   // memory, usually
//     ... compute, encode deltas ...
//     prefetcher->PutBatch(samples, new_m);        // returns after a copy
//   prefetcher->Close();                           // flushes, joins threads
//
// Across epochs: AppendOrder(next_permutation) while the current order is
// being consumed (a trainer knows the next epoch's permutation in advance)
// lets the loaders run on into the next epoch, so the window is already
// full when it starts; SetOrder instead drops the window (a cold start).
//
// Zero-copy loop (what the AQ-SGD link uses): TakeBatch moves the prefetched
// row buffers out, the caller updates m(xi) in place and hands the same
// buffers back with PutBatch(samples, std::move(rows)); buffers are recycled
// through a bounded pool, so a steady epoch allocates nothing.
//
// Contract:
//   - GetBatch/PutBatch have MessageStore's semantics; GetBatch may ask for
//     any samples. Samples of the prefetch window are served from memory
//     (hits); others are read from the store synchronously (misses).
//   - Read-your-writes: a GetBatch after a PutBatch of the same sample returns
//     the put's rounded values, whether the write is still queued, in flight,
//     or done, and even if the old row had already been prefetched.
//   - Memory is bounded: prefetched rows (decoded float32) by
//     max_prefetch_bytes; queued writes by max_write_behind_bytes, beyond which
//     PutBatch blocks (back-pressure) until the writer catches up.
//   - A failed write-behind is sticky: every later call returns that error
//     (the store no longer holds what the link believes; bump the generation).
//   - Across an AppendOrder boundary a sample may occur twice in the window
//     (late in one epoch, early in the next). Its later occurrence is loaded
//     only once the earlier one has been taken AND put again (the put is then
//     the value to read: it is rounded from the queued put, or read from the
//     store once written) -- never from the store before that put, which
//     would be the stale m(xi). Until then it is `deferred`; a sample taken
//     and never put again stays deferred and is read synchronously (a miss)
//     when asked for.
//   - PutBatch checks shapes on the caller's thread but NOT finiteness: that
//     would read every value of every row on the consumer's critical path
//     (for 3 MB rows, ~3% of the store's whole I/O time per micro-batch). The
//     store checks it once, fused with encoding, in the writer thread: a
//     batch with a NaN/inf is not written, and the prefetcher fails with that
//     sticky InvalidArgument (naming the sample) from the next call on;
//     Flush()/Close() return it. A get of such a queued row fails the same way.
//
// Small rows (Options::min_handoff_bytes, inline_write_bytes): a loader is
// woken only once it can claim half the window's worth and reads it in one
// store read; the writer only once that much is queued; and a small put with
// nothing queued is written by PutBatch itself (which then returns that
// write's error, sticky as a write-behind's), so 4 KB rows cost no wake-up
// per micro-batch.
//
// Write-behind: puts are written in PutBatch order, one queued batch per
// store write. The writer commits (MessageStore::CommitPut); encode threads
// encode the next queued batches meanwhile (MessageStore::EncodePut), so
// with large rows the conversion and checksums of batch n+1 overlap the
// store write of batch n.
//
// Thread-safety: thread-safe, but the read-your-writes guarantee is between a
// put and a get issued in that order; concurrent put/get of the same sample
// from different threads see either value. Owns its threads (loader_threads
// loaders, one writer, encode_threads encoders), joined by Close() / the
// destructor. Does not own the store, which must outlive it.
#ifndef AQSWARM_STORAGE_PREFETCHER_H_
#define AQSWARM_STORAGE_PREFETCHER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "storage/message_store.h"

namespace aqswarm::storage {

struct PrefetcherStats {
  uint64_t hits = 0;                // rows served from memory (prefetched, queued writes, inline reads)
  uint64_t misses = 0;              // rows read synchronously from the store
  uint64_t waits = 0;               // hits that waited for an in-flight load
  uint64_t rows_prefetched = 0;     // rows loaded by the loader threads
  uint64_t prefetch_discarded = 0;  // loads made useless by a put or a new order
  uint64_t rows_written = 0;        // rows written behind
  uint64_t get_stall_nanos = 0;     // GetBatch time blocked on loads or misses
  uint64_t put_stall_nanos = 0;     // PutBatch time blocked by back-pressure
  uint64_t prefetched_bytes = 0;    // now held (reserved) for prefetched rows
  uint64_t write_behind_bytes = 0;  // now queued for writing
  uint64_t buffers_allocated = 0;   // row buffers allocated (not recycled from the pool)
  uint64_t deferred = 0;            // loads held back until an earlier occurrence was put
  uint64_t loaded_from_queue = 0;   // rows the loaders rounded from a queued put
  uint64_t batches_encoded_ahead = 0;  // queued writes encoded by the encode threads
  uint64_t loader_rounds = 0;       // times a loader claimed rows (one store read each)
  uint64_t writer_rounds = 0;       // times the writer woke and wrote queued batches
  uint64_t rows_written_inline = 0; // rows written on PutBatch's thread (inline_write_bytes)
  uint64_t inline_write_nanos = 0;  // PutBatch time spent writing them
  uint64_t rows_read_inline = 0;    // hits read from the store's memory on the caller's thread
  uint64_t inline_read_fallbacks = 0;  // rows not in memory that turned prefetching on
};

class Prefetcher {
 public:
  struct Options {
    // The link whose rows are prefetched (generation, shape, precision).
    LinkSpec link;
    // Samples per micro-batch in the order given to SetOrder. Default: 8.
    int64_t micro_batch = 8;
    // Micro-batches kept loaded ahead of the consumer (K). Default: 4.
    int64_t prefetch_batches = 4;
    // Bound on bytes (float32) of prefetched rows held in memory; must fit one
    // micro-batch. Default: 256 MiB.
    uint64_t max_prefetch_bytes = 256ull << 20;
    // Bound on bytes (float32) of rows queued for writing; PutBatch blocks
    // beyond it (one batch is always accepted into an empty queue).
    // Default: 256 MiB.
    uint64_t max_write_behind_bytes = 256ull << 20;
    // Loader threads, each loading one micro-batch of the window at a time.
    // Two keep the disk busy while a finished batch is being verified and
    // decoded (one thread alternates: read, then CPU, then read). Default: 2.
    int loader_threads = 2;
    // Encode threads: they encode queued writes (MessageStore::EncodePut:
    // finiteness check, fp16/int8 conversion, checksums) ahead of the
    // writer, which then only commits them (and encodes whatever they have
    // not claimed). With multi-MB rows encoding and the store's write each
    // took about half of the single writer's time, and the writer was the
    // bottleneck of the prefetch path (measured: busy 97% of an epoch of
    // 3.3 MB rows while the loaders idled). At most encode_threads + 1
    // queued writes are encoded and not yet written. 0 = the writer
    // encodes everything. Default: 1.
    int encode_threads = 1;
    // Queued writes smaller than this (bytes of float32) are always encoded
    // by the writer: for small rows a hand-off between threads costs more
    // than the encoding. Default: 1 MiB.
    uint64_t min_encode_ahead_bytes = 1ull << 20;
    // Bytes (float32) one hand-off to a loader or to the writer carries at
    // least. A loader is woken once this much of the window is free, and
    // then claims all of it for one store read; the writer once this much
    // is queued, and then writes the whole queue. With small rows every
    // wake-up (a futex call, a context switch, cold caches) cost as much as
    // the row work it handed over: 4 KB rows, one micro-batch per hand-off,
    // were 2 wake-ups per 8 rows. Batches this large or larger are handed
    // off one at a time, at once (as with 0). Capped at half the window,
    // so the consumer still finds the other half loaded. Default: 512 KiB.
    uint64_t min_handoff_bytes = 512ull << 10;
    // A put of at most this many bytes (float32) is written on the caller's
    // thread when no write is queued (PutBatch returns once it is in the
    // store, with its error if any), instead of being handed to the writer:
    // the rows are still in the caller's cache, and there is no wake-up.
    // Larger puts, and puts behind queued ones, are written behind.
    // 0 = never. Default: 256 KiB.
    uint64_t inline_write_bytes = 256ull << 10;
    // Micro-batches of at most this many bytes (float32) are read on the
    // caller's thread (in TakeBatch/GetBatch) from the store's memory
    // (MessageStore::GetBatchFromMemory) instead of being prefetched: for
    // rows already in memory (RocksDB's memtable) the loaders' hand-off --
    // the wake-up, and the decoded rows crossing to the caller's core --
    // costs more CPU than the read (4 KB rows: ~6 of AQ-SGD's ~16 extra CPU
    // us per sample and link; `aqswarm bench link`). A row that is not in
    // memory is read with GetBatch (the caller waits for the I/O) and turns
    // prefetching on until the next SetOrder, so rows on disk still load
    // ahead. 0 = never (always prefetch). Default: 0.
    uint64_t inline_read_bytes = 0;
  };

  // `store` must outlive the prefetcher. Starts the threads.
  static absl::StatusOr<std::unique_ptr<Prefetcher>> Create(MessageStore* store,
                                                            const Options& options);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Starts a new epoch: the consumer will get `order` micro_batch samples at
  // a time. Drops rows prefetched for the previous order; queued writes stay.
  absl::Status SetOrder(std::vector<uint64_t> order);
  // The consumer will get `order` (micro_batch samples at a time, its first
  // batch starting at order[0]) after everything set or appended so far:
  // the loaders prefetch across the boundary. Orders fully consumed are
  // forgotten, so appending one epoch ahead keeps memory flat. Without a
  // previous SetOrder it is SetOrder.
  absl::Status AppendOrder(std::vector<uint64_t> order);

  absl::Status GetBatch(absl::Span<const uint64_t> samples, absl::Span<const absl::Span<float>> out,
                        absl::Span<RowRead> reads);
  absl::Status PutBatch(absl::Span<const uint64_t> samples,
                        absl::Span<const absl::Span<const float>> values);

  // Zero-copy forms. TakeBatch is GetBatch into buffers it owns and moves to
  // the caller (`rows` is resized to samples.size(), each row to
  // link.num_values(); contents unspecified unless reads[i] is OK).
  absl::Status TakeBatch(absl::Span<const uint64_t> samples, std::vector<std::vector<float>>* rows,
                         absl::Span<RowRead> reads);
  // Queues `rows` (moved, not copied) for writing behind.
  absl::Status PutBatch(absl::Span<const uint64_t> samples, std::vector<std::vector<float>> rows);

  // Blocks until every queued write is in the store.
  absl::Status Flush();
  // Flush, then stop and join the threads. Idempotent.
  absl::Status Close();

  PrefetcherStats GetStats() const;

 private:
  struct Slot {
    uint64_t ticket = 0;
    int64_t position = 0;  // the occurrence (absolute order position) it was loaded for
    bool ready = false;
    std::vector<float> values;
    RowRead read;
  };
  struct WriteItem {
    uint64_t seq = 0;
    std::vector<uint64_t> samples;
    std::vector<std::vector<float>> rows;  // as given (unrounded)
    uint64_t bytes = 0;
  };
  struct Pending {
    std::shared_ptr<const WriteItem> item;
    size_t index = 0;
  };
  // A write in the queue and its encoding. `put` is set, then `encoded`
  // under mu_, by the one thread that claimed it (writer or encode thread).
  struct QueuedWrite {
    std::shared_ptr<const WriteItem> item;
    bool encoded = false;
    absl::StatusOr<std::unique_ptr<MessageStore::EncodedPut>> put;
  };

  Prefetcher(MessageStore* store, const Options& options);
  void LoaderLoop();
  void WriterLoop();
  void EncoderLoop();
  absl::StatusOr<std::unique_ptr<MessageStore::EncodedPut>> Encode(const WriteItem& item) const;
  // The next queued write an encode thread (or the writer, waiting on an
  // encode thread) may claim; nullptr if none.
  QueuedWrite* NextToEncodeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool LoaderHasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Batches of the order a loader may claim now (window and memory bound).
  int64_t LoadableBatchesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wakes as many loaders as there is work for (none if LoaderHasWork() is false).
  void WakeLoadersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool WriterHasWorkLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks until the write queue is empty (waking the writer whatever it holds).
  void DrainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseSlotLocked(uint64_t sample) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdvanceConsumerLocked(int64_t batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AppendOrderLocked(std::vector<uint64_t> order) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets orders the consumer has moved past.
  void TrimConsumedOrdersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Absolute batch indices [first_batch(), num_batches()) and positions
  // [order_base_, order_end()) are the ones still known.
  int64_t first_batch() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return batch_base_; }
  int64_t num_batches() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t order_end() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t batch_begin(int64_t batch) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t batch_end(int64_t batch) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // First position the consumer has not taken yet.
  int64_t untaken_begin() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t sample_at(int64_t position) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The batch holding the first occurrence of `sample` at or after `from`
  // (absolute position); -1 if none.
  int64_t BatchOfLocked(uint64_t sample, int64_t from) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the row of `sample` for its occurrence at `position` must not be
  // loaded yet: an earlier occurrence is not yet taken, or taken and not yet
  // put again.
  bool MustDeferLocked(uint64_t sample, int64_t position) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Row buffers: recycled to avoid page-faulting fresh memory for every row.
  // A pooled buffer, or an empty one to be sized with SizeBuffer() after
  // mu_ is released.
  std::vector<float> NewBufferLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SizeBuffer(std::vector<float>& buffer) const;
  void RecycleLocked(std::vector<float> buffer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Enqueue(std::shared_ptr<WriteItem> item);
  // Writes `item` on this thread (Options::inline_write_bytes); called with
  // mu_ held, nothing queued and no other inline write, returns with it held.
  absl::Status WriteInlineLocked(WriteItem& item) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Bookkeeping of a put of `sample` (its slot is stale, its deferred next
  // occurrence may load), whether queued or written inline.
  void NotePutLocked(uint64_t sample, int64_t untaken) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  MessageStore* const store_;
  const Options options_;
  const uint64_t row_bytes_;  // float32 bytes of one row
  // Hand-off size (Options::min_handoff_bytes) in micro-batches (>= 1) and
  // in bytes (that many full micro-batches).
  const int64_t handoff_batches_;
  const uint64_t handoff_bytes_;

  mutable absl::Mutex mu_;
  absl::CondVar loader_cv_;    // loader work may exist
  absl::CondVar writer_cv_;    // write queue non-empty / a write was encoded
  absl::CondVar encoder_cv_;   // a write to encode ahead may exist
  absl::CondVar consumer_cv_;  // a slot became ready / writes drained
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Options::inline_read_bytes applies and no row was missing from the
  // store's memory since the last SetOrder: the loaders do not prefetch.
  bool inline_reads_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status write_error_ ABSL_GUARDED_BY(mu_);

  // Order: the epochs set or appended and not yet consumed, concatenated.
  // Positions and batch indices are absolute (they keep counting across
  // AppendOrder); order_[0] is position order_base_, batch_begin_[0] is the
  // first position of batch batch_base_.
  std::deque<uint64_t> order_ ABSL_GUARDED_BY(mu_);
  int64_t order_base_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<int64_t> batch_begin_ ABSL_GUARDED_BY(mu_);
  int64_t batch_base_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<int64_t> segment_end_ ABSL_GUARDED_BY(mu_);  // end position of each appended order
  // sample -> its positions, ascending.
  absl::flat_hash_map<uint64_t, std::vector<int64_t>> position_ ABSL_GUARDED_BY(mu_);
  int64_t consumer_batch_ ABSL_GUARDED_BY(mu_) = -1;   // last batch the consumer asked for
  int64_t next_load_batch_ ABSL_GUARDED_BY(mu_) = 0;   // next batch the loader loads
  int64_t released_batch_ ABSL_GUARDED_BY(mu_) = 0;    // batches below are released
  // Samples taken (TakeBatch/GetBatch) and not yet put again.
  absl::flat_hash_set<uint64_t> held_ ABSL_GUARDED_BY(mu_);
  // Samples the loaders skipped (MustDeferLocked) -> the position skipped;
  // a put of the sample moves it to late_ if that position is still ahead.
  absl::flat_hash_map<uint64_t, int64_t> deferred_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<uint64_t, int64_t>> late_ ABSL_GUARDED_BY(mu_);  // (sample, position)

  // Prefetched rows.
  absl::flat_hash_map<uint64_t, Slot> cache_ ABSL_GUARDED_BY(mu_);
  uint64_t cache_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;

  // Write-behind.
  // Items leave the queue only once written, so empty == all durable in the store.
  std::deque<std::unique_ptr<QueuedWrite>> queue_ ABSL_GUARDED_BY(mu_);
  // queue_[0, claimed_) are encoded or being encoded: the writer claims the
  // front, encode threads the first unclaimed item, so claims are a prefix.
  size_t claimed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t write_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_write_seq_ ABSL_GUARDED_BY(mu_) = 1;
  // The writer writes until the queue is empty once woken.
  bool writer_draining_ ABSL_GUARDED_BY(mu_) = false;
  // Threads waiting for the queue to drain (Flush, Close, back-pressure):
  // the writer then writes whatever is queued.
  int drain_waiters_ ABSL_GUARDED_BY(mu_) = 0;
  // A PutBatch is writing inline: the writer and other puts wait (order).
  bool inline_writing_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);  // latest put per sample

  std::vector<std::vector<float>> pool_ ABSL_GUARDED_BY(mu_);
  size_t max_pool_rows_ = 0;

  PrefetcherStats stats_ ABSL_GUARDED_BY(mu_);

  std::vector<std::thread> loaders_;
  std::thread writer_;
  std::vector<std::thread> encoders_;
};

}  // namespace aqswarm::storage

#endif  // AQSWARM_STORAGE_PREFETCHER_H_
