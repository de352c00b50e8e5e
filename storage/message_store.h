// MessageStore: the per-sample previous message m(xi) of every AQ-SGD link,
// kept on both ends of the link (docs/design/ALGORITHMS.md §2,
// docs/design/ARCHITECTURE.md "Data identity"). Batched get/put of rows keyed
// by (link id, sample id).
//
// Backends: RocksDbMessageStore (on SSD; rocksdb_message_store.h) and
// MemoryMessageStore (memory_message_store.h). One conformance suite
// (message_store_conformance_test.cc) runs against both.
//
// Keys and generations:
//   key   = (LinkId{pipeline, boundary}, sample id), big-endian, so one link's
//           rows are contiguous and DropLink is one DeleteRange.
//   The link *generation* is NOT part of the key: it is stored in each row's
//   header, and every get/put names the caller's current generation. A row
//   written under another generation reads as unseen (NotFound), so bumping
//   the generation makes every sample unseen at once, and the next put of a
//   sample overwrites the stale row in place (no unbounded growth). Call
//   DropLink() when a generation starts to reclaim the space eagerly.
//
// Row = header (format version, precision, shape, generation, checksum of the
// payload, checksum of key+header) + payload encoded with common/row_format.h.
// PutBatch stores Encode(values); GetBatch returns Decode(stored bytes), i.e.
// exactly the rounded value both ends of the link add the next delta to.
//
// Per-key outcome of a get (RowRead::status):
//   OK        found: `out` holds the stored (rounded) values.
//   NotFound  unseen: never written, evicted by the capacity budget, dropped,
//             or written under another generation / precision / shape.
//   DataLoss  corrupt or truncated row (checksum verified on every read).
//             Counted in stats; `out` holds garbage; callers treat it as unseen.
//   other     an I/O error of the backend.
// Callers use IsUnseen(status) for "send FULL next time". GetBatchFromMemory
// adds Unavailable: the row is not in memory (read it with GetBatch).
//
// Capacity budget (Options::capacity_bytes of each backend): the store tracks
// the logical bytes of live rows (key + header + payload). A put that would
// exceed the budget first evicts rows oldest-written first (FIFO by write
// order) until the new row fits; a row larger than the whole budget is not
// stored (and any older version of it is deleted). Evicted rows are deleted
// and counted; they simply read as unseen. With no budget (0) nothing is
// evicted, and an overwrite that keeps a row's size keeps its place in the
// write order too (its index entry is not rewritten: half the writes of a
// steady epoch), so a store reopened later WITH a budget evicts such rows by
// their first write.
//
// Example:
//   AQSWARM_ASSIGN_OR_RETURN(auto store, RocksDbMessageStore::Open(options));
//   LinkSpec link{{/*pipeline=*/0, /*boundary=*/1}, /*generation=*/3, 128, 768,
//                 RowPrecision::kFloat16};
//   std::vector<RowRead> reads(samples.size());
//   AQSWARM_RETURN_IF_ERROR(store->GetBatch(link, samples, out_spans, absl::MakeSpan(reads)));
//   ...
//   AQSWARM_RETURN_IF_ERROR(store->PutBatch(link, samples, new_values));
//
// Thread-safety: every method of every backend is thread-safe. Concurrent puts
// of the same key are applied in some order; a get concurrent with a put of
// the same key sees either the old or the new row, never a mix.
#ifndef AQSWARM_STORAGE_MESSAGE_STORE_H_
#define AQSWARM_STORAGE_MESSAGE_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/row_format.h"

namespace aqswarm::storage {

// One forward edge (pipeline p, stage boundary j -> j+1).
struct LinkId {
  uint32_t pipeline = 0;
  uint32_t boundary = 0;
  friend bool operator==(const LinkId& a, const LinkId& b) {
    return a.pipeline == b.pipeline && a.boundary == b.boundary;
  }
};

// Everything a get/put needs to know about the rows of one link.
struct LinkSpec {
  LinkId link;
  // Current link generation; rows written under another one read as unseen.
  uint64_t generation = 0;
  // Row shape [rows, cols] (seq_len x d_model); every row of a link has it.
  int64_t rows = 0;
  int64_t cols = 0;
  // Stored precision of m(xi). Default: fp16.
  RowPrecision precision = RowPrecision::kFloat16;

  int64_t num_values() const { return rows * cols; }
  // Bytes of the encoded payload (without header).
  size_t payload_bytes() const { return EncodedRowBytes(precision, rows, cols); }
};

// Result of reading one key.
struct RowRead {
  // OK / NotFound (unseen) / DataLoss (corrupt) / other (I/O); see above.
  absl::Status status;
  // When OK: XXH3-64 of the stored encoded payload, i.e. checksum(m(xi)) that
  // AQ-SGD puts in DELTA messages. Equal on both ends iff they hold the same m.
  uint64_t payload_checksum = 0;
};

// True for the outcomes a caller treats as "unseen": send FULL next.
inline bool IsUnseen(const absl::Status& s) {
  return absl::IsNotFound(s) || absl::IsDataLoss(s);
}

// Plain counters; a snapshot, cheap to take. Prometheus export comes later.
struct MessageStoreStats {
  uint64_t rows_found = 0;        // gets that returned data
  uint64_t rows_unseen = 0;       // gets that returned NotFound (incl. stale)
  uint64_t rows_stale = 0;        // ... of which: another generation or format
  uint64_t rows_corrupt = 0;      // gets that returned DataLoss
  uint64_t rows_written = 0;      // rows stored by puts
  uint64_t rows_evicted = 0;      // rows deleted (or not stored) by the budget
  uint64_t live_rows = 0;         // rows currently stored
  uint64_t live_bytes = 0;        // their logical bytes (key + header + payload)
  uint64_t capacity_bytes = 0;    // the budget; 0 = unlimited
  uint64_t get_batches = 0;
  uint64_t put_batches = 0;
  uint64_t get_nanos_total = 0;   // wall time spent in GetBatch
  uint64_t put_nanos_total = 0;   // wall time spent in PutBatch (EncodePut + CommitPut)
  // RocksDB backend: the store was not closed cleanly last time (process
  // killed). Recent puts may be lost (see README "WAL and sync").
  bool opened_after_unclean_shutdown = false;
};

class MessageStore {
 public:
  virtual ~MessageStore() = default;

  // Reads the rows of `samples` into `out` (one span of link.num_values()
  // floats per sample) and sets `reads[i]` per key (see the banner). The
  // returned status is non-OK only for bad arguments or a closed/failed store.
  virtual absl::Status GetBatch(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                absl::Span<const absl::Span<float>> out,
                                absl::Span<RowRead> reads) = 0;

  // GetBatch without I/O: keys whose row the backend holds in memory
  // (RocksDB: memtables and block cache; the memory backend: all) get
  // GetBatch's outcome; the others get Unavailable ("not in memory"), `out`
  // unspecified, for the caller to read with GetBatch. Lets a caller read
  // small memory-resident rows on its own thread and hand only real I/O to
  // loader threads (Prefetcher::Options::inline_read_bytes). Default: every
  // key Unavailable.
  virtual absl::Status GetBatchFromMemory(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                          absl::Span<const absl::Span<float>> out,
                                          absl::Span<RowRead> reads);

  // Stores Encode(values[i]) as the row of samples[i] under link.generation,
  // replacing any previous row. values[i] has link.num_values() floats, all
  // finite (else InvalidArgument and nothing is written). The batch is atomic:
  // after a crash either all of it or none of it is visible (budget evictions
  // included). A sample listed twice keeps its last values.
  virtual absl::Status PutBatch(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                absl::Span<const absl::Span<const float>> values) = 0;

  // PutBatch in two phases, for callers that pipeline puts (the prefetcher's
  // write-behind encodes the next batches while one is being written: with
  // multi-MB rows, encoding and the store's write each take about half of a
  // put). EncodePut does the CPU-heavy half -- argument and finiteness
  // checks, encoding, checksums -- and changes nothing in the store, so it
  // may run on any thread, concurrently with every other call. CommitPut
  // writes an encoded batch of THIS store; puts take effect in CommitPut
  // order. CommitPut(EncodePut(link, s, v)) is PutBatch(link, s, v): same
  // errors (InvalidArgument from either phase), atomicity and budget. An
  // encoded put that is never committed is simply dropped; none may outlive
  // the store that encoded it. The default implementations copy the values
  // and call PutBatch.
  class EncodedPut {
   public:
    virtual ~EncodedPut() = default;

   protected:
    EncodedPut() = default;
  };
  virtual absl::StatusOr<std::unique_ptr<EncodedPut>> EncodePut(
      const LinkSpec& link, absl::Span<const uint64_t> samples,
      absl::Span<const absl::Span<const float>> values);
  // InvalidArgument for a null put or one encoded by another store.
  virtual absl::Status CommitPut(std::unique_ptr<EncodedPut> put);

  // Deletes every row of `link` (all generations). Not counted as evictions.
  virtual absl::Status DropLink(const LinkId& link) = 0;

  virtual MessageStoreStats GetStats() const = 0;

  // Makes everything written so far durable (RocksDB: flushes memtables) and
  // releases resources; later calls fail with FailedPrecondition. Idempotent.
  virtual absl::Status Close() = 0;
};

// Argument checks shared by the backends (and the prefetcher): counts and
// shapes. ValidatePutArgs does not read the values; finiteness is checked
// once per put, fused with encoding, by the backends' PutBatch.
absl::Status ValidateLinkSpec(const LinkSpec& link);
absl::Status ValidateGetArgs(const LinkSpec& link, absl::Span<const uint64_t> samples,
                             absl::Span<const absl::Span<float>> out, absl::Span<RowRead> reads);
absl::Status ValidatePutArgs(const LinkSpec& link, absl::Span<const uint64_t> samples,
                             absl::Span<const absl::Span<const float>> values);

}  // namespace aqswarm::storage

#endif  // AQSWARM_STORAGE_MESSAGE_STORE_H_
