// RowStoreBase: the backend-independent half of every MessageStore (internal).
//
// It owns everything the conformance suite pins down — key/row encoding,
// checksum verification on every read, generation/format matching, the
// capacity budget with its eviction order, and the counters — and asks a
// backend for three raw operations on ordered byte keys: read a batch of keys,
// write a batch of puts/deletes atomically, delete the key ranges of a link.
// RocksDbMessageStore and MemoryMessageStore differ only in those.
//
// Budget bookkeeping: an in-memory index (row key -> write seq, bytes) plus a
// persisted index entry per row (kind 0x02, row_codec.h) written in the SAME
// atomic batch as the row, so a reopened store rebuilds the exact index by
// scanning small index entries instead of reading every row. Without a budget
// a same-size overwrite leaves both untouched (message_store.h).
//
// Thread-safety: thread-safe. Writes (PutBatch, DropLink) are serialised by
// `mu_`, which also guards the index; reads run concurrently with each other
// and with writes. Close() must not race with other calls.
#ifndef AQSWARM_STORAGE_ROW_STORE_BASE_H_
#define AQSWARM_STORAGE_ROW_STORE_BASE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "storage/message_store.h"

namespace aqswarm::storage::internal {

struct WriteOp {
  bool is_delete = false;
  std::string key;
  std::string value;
};

class RowStoreBase : public MessageStore {
 public:
  absl::Status GetBatch(const LinkSpec& link, absl::Span<const uint64_t> samples,
                        absl::Span<const absl::Span<float>> out,
                        absl::Span<RowRead> reads) override;
  absl::Status GetBatchFromMemory(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                  absl::Span<const absl::Span<float>> out,
                                  absl::Span<RowRead> reads) override;
  absl::Status PutBatch(const LinkSpec& link, absl::Span<const uint64_t> samples,
                        absl::Span<const absl::Span<const float>> values) override;
  absl::StatusOr<std::unique_ptr<EncodedPut>> EncodePut(
      const LinkSpec& link, absl::Span<const uint64_t> samples,
      absl::Span<const absl::Span<const float>> values) override;
  absl::Status CommitPut(std::unique_ptr<EncodedPut> put) override;
  absl::Status DropLink(const LinkId& link) override;
  MessageStoreStats GetStats() const override;

 protected:
  explicit RowStoreBase(uint64_t capacity_bytes) : capacity_bytes_(capacity_bytes) {}

  // Calls visit(i, status, value) once for each key, with `value` valid only
  // during the call. status: OK, NotFound, DataLoss (backend-detected
  // corruption) or another error; with `memory_only`, Unavailable for a key
  // whose value is not in memory (no I/O is done).
  using RawVisitor = absl::FunctionRef<void(size_t, const absl::Status&, std::string_view)>;
  virtual void ReadRaw(absl::Span<const std::string> keys, bool memory_only, RawVisitor visit) = 0;
  // Applies `ops` in order, atomically (may move values out of `ops`).
  virtual absl::Status WriteRaw(absl::Span<WriteOp> ops) = 0;
  // Deletes all keys in [begin, end) for each pair, atomically.
  virtual absl::Status DeleteRangesRaw(
      absl::Span<const std::pair<std::string, std::string>> ranges) = 0;

  // For Open(): feeds one persisted index entry back.
  void RestoreIndexEntry(std::string row_key, uint64_t seq, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  void set_opened_after_unclean_shutdown(bool v) { unclean_ = v; }
  // After Close(): every call fails with FailedPrecondition.
  void MarkClosed() { closed_.store(true); }
  absl::Status CheckOpen() const;

 private:
  class RowPut;
  absl::Status Get(const LinkSpec& link, absl::Span<const uint64_t> samples,
                   absl::Span<const absl::Span<float>> out, absl::Span<RowRead> reads, bool memory_only);
  struct IndexEntry {
    uint64_t seq = 0;
    uint64_t bytes = 0;
  };
  // Removes `row_key` from the index (if present) and appends the deletes of
  // its row and index entry to `ops`.
  void EraseLocked(const std::string& row_key, std::vector<WriteOp>* ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Encoded-row buffers kept between puts (at most kMaxSpareValueBytes of
  // capacity), so a steady stream of puts allocates no row-sized strings.
  static constexpr uint64_t kMaxSpareValueBytes = 64ull << 20;
  std::vector<std::string> TakeSpareValues(size_t n) ABSL_LOCKS_EXCLUDED(spare_mu_);
  void ReturnSpareValues(std::vector<std::string>* values) ABSL_LOCKS_EXCLUDED(spare_mu_);

  const uint64_t capacity_bytes_;
  std::atomic<bool> closed_{false};
  bool unclean_ = false;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, IndexEntry> index_ ABSL_GUARDED_BY(mu_);  // by row key
  absl::btree_map<uint64_t, std::string> by_seq_ ABSL_GUARDED_BY(mu_);       // eviction order
  uint64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  // Sticky: a failed atomic write leaves the index ahead of the data.
  absl::Status write_failure_ ABSL_GUARDED_BY(mu_);

  absl::Mutex spare_mu_;
  std::vector<std::string> spare_values_ ABSL_GUARDED_BY(spare_mu_);
  uint64_t spare_bytes_ ABSL_GUARDED_BY(spare_mu_) = 0;

  std::atomic<uint64_t> rows_found_{0}, rows_unseen_{0}, rows_stale_{0}, rows_corrupt_{0},
      rows_written_{0}, rows_evicted_{0}, get_batches_{0}, put_batches_{0}, get_nanos_{0},
      put_nanos_{0};
};

}  // namespace aqswarm::storage::internal

#endif  // AQSWARM_STORAGE_ROW_STORE_BASE_H_
