// RocksDbMessageStore: the on-SSD MessageStore backend (GPT-2-XL needs ~6.5 MB
// per sample per link: far beyond RAM). One RocksDB instance per directory;
// all links of a peer can share it (keys carry the link id).
//
// Tuning for large, incompressible, overwrite-once-per-epoch values:
//   - BlobDB (enable_blob_files): rows >= min_blob_bytes go to blob files, so
//     compaction moves 17-byte keys + blob references, not megabytes. Blob
//     garbage collection (relocating live rows out of old blob files) is OFF
//     by default: see Options::blob_garbage_collection for why that is safe
//     for space under this workload.
//   - No compression (SST or blob): fp16/int8 activations are near-random
//     bits; compression costs CPU and saves little (measure before enabling).
//   - MultiGet for batched reads. Every row read is verified by our own
//     checksums (header checksum over key + header, payload checksum over the
//     payload: every byte we use). RocksDB's read-side CRCs are off by default
//     (Options::verify_rocksdb_checksums): they would re-check bytes our
//     checksums already cover, on every read. RocksDB still writes its CRCs
//     (computed with the crc32 instruction, rocksdb_crc32c.h).
//
// WAL and sync (Options::use_wal, default false): rows are written with the
// WAL disabled, halving write bytes for multi-MB rows. A process crash can
// then lose the most recent puts (whatever was still in the memtable); the
// store reopens at an older, consistent point (each PutBatch is atomic, rows
// and their budget index entries together). That is safe for AQ-SGD because:
//   1. a lost row reads as unseen -> the next send is FULL;
//   2. a row rolled back to an older m(xi) is still a valid row, but the
//      other end of the link holds a different m(xi): every DELTA carries
//      checksum(m(xi)) (RowRead::payload_checksum), the receiver detects the
//      mismatch and asks for RESEND (FULL). No silent drift;
//   3. the store reports opened_after_unclean_shutdown in its stats (a
//      marker file written after a clean Close), so a link owner may also
//      simply bump the link generation after a crash.
// A corrupt row is never returned: RocksDB CRCs plus our checksums. Set
// use_wal = true when another user needs every acknowledged put to survive a
// process crash (not a power loss: WAL writes are not fsynced).
//
// Example:
//   RocksDbMessageStore::Options options;
//   options.path = "/var/lib/aqswarm/messages";
//   options.capacity_bytes = 200ull << 30;
//   AQSWARM_ASSIGN_OR_RETURN(auto store, RocksDbMessageStore::Open(options));
//
// Thread-safety: thread-safe (see message_store.h). One process per
// directory (RocksDB's LOCK file); a second Open fails with FailedPrecondition.
#ifndef AQSWARM_STORAGE_ROCKSDB_MESSAGE_STORE_H_
#define AQSWARM_STORAGE_ROCKSDB_MESSAGE_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "storage/row_store_base.h"

namespace rocksdb {
class DB;
class WriteBatch;
}

namespace aqswarm::storage {

class RocksDbMessageStore final : public internal::RowStoreBase {
 public:
  struct Options {
    // Directory of the store; created (with parents) if missing. Required.
    std::string path;
    // Budget in bytes of live rows (key + 40-byte header + payload); a put
    // that would exceed it evicts oldest-written rows first. Logical bytes:
    // disk usage is higher by blob garbage not yet collected. 0 = unlimited.
    // Default: 0.
    uint64_t capacity_bytes = 0;
    // Write the RocksDB WAL (not fsynced). See the banner. Default: false.
    bool use_wal = false;
    // Values of at least this many bytes are stored in blob files.
    // Default: 4096.
    uint64_t min_blob_bytes = 4096;
    // Target size of one blob file in bytes. Default: 256 MiB.
    uint64_t blob_file_bytes = 256ull << 20;
    // Memtable size in bytes; rows sit here until flushed to blob files.
    // Default: 64 MiB.
    uint64_t write_buffer_bytes = 64ull << 20;
    // Memtable index: a hash table of keys (RocksDB's hash skip list, one
    // bucket per key) instead of one skip list over all keys. Puts and gets
    // only ever name whole keys, and a skip list's ordered insert, which
    // walks ~log2(entries) levels of nodes scattered among the row values (a
    // cache miss each), is most of a small row's write cost. Scans (the index
    // rebuild at open) ask for total order; flushes sort the memtable once.
    // `aqswarm bench link` compares the two (store `rocksdb_skiplist`).
    // Default: true.
    bool hash_memtable = true;
    // Overwrite a row in place when its previous version is still in the
    // active memtable (RocksDB inplace_update_support; rows of one link all
    // have the same size, so the new value always fits). AQ-SGD rewrites
    // every row once per epoch: when a link's rows fit in a memtable (small
    // rows, e.g. 4 KB), each put would otherwise add a version to the key's
    // list and grow the memtable by a whole row, which then gets flushed and
    // rewritten every few epochs; in place it stays at one version per key
    // and is never flushed for that (no flush work, and no version lists for
    // the write-behind thread to walk). Reads take the key's lock stripe, so
    // a get never sees half an update (and the row checksums would catch one).
    // Rows too big to be still in the active memtable are written as before.
    // Default: true.
    bool inplace_updates = true;
    // Hash buckets per memtable (8 bytes each). Default: 65536.
    size_t hash_memtable_buckets = 1 << 16;
    // Memtables (active + immutable) before writes stall. Default: 4.
    int max_write_buffers = 4;
    // Background compaction threads. Default: 2.
    int background_jobs = 2;
    // Memtables flushed at once. Each flush is serial (the CRC32C of every
    // blob record, then O_DIRECT writes, one after the other), so a flush
    // thread waits for the disk much of its time; with fewer threads the
    // flushes fall behind a steady consumer of multi-MB rows, RocksDB stops
    // writes with every memtable full and write-behind cannot run ahead.
    // Three keep up with the default 4 memtables (one active, three
    // flushing). Useful up to max_write_buffers - 1.
    // Default: 3.
    int flush_threads = 3;
    // RocksDB's write slowdown rate (delayed_write_rate), applied e.g. while
    // the last allowed memtable is being written with more than 3 allowed.
    // RocksDB's default, 16 MB/s, is far below what this store sustains: with
    // multi-MB rows it would fire every few seconds (a 26 MB micro-batch
    // takes 1.6 s at that rate) and block puts. The hard stop when every
    // memtable is full stays: writes then go at the flushes' pace.
    // Default: 1 GiB/s.
    uint64_t slowdown_write_bytes_per_s = 1ull << 30;
    // Write blob and table files with O_DIRECT (flush and compaction) when
    // the directory's filesystem supports it (probed at open; silently
    // buffered otherwise). Each row is written once and read back at most
    // once per epoch, so the page cache buys nothing, while copying every
    // written byte into it is one of the store's largest CPU costs.
    // Default: true.
    bool direct_io_writes = true;
    // Read rows with O_DIRECT too (when supported, as above): a row is read
    // once per epoch, long after it was written, so the page cache never
    // hits; buffered reads only added the kernel's copy into and out of it,
    // readahead beyond the row, and reclaiming those pages. Default: true.
    bool direct_io_reads = true;
    // RocksDB blob garbage collection: compactions relocate the still-live
    // rows of the oldest blob files so those files can be deleted. Off by
    // default because this workload does not need it and it costs CPU (every
    // row is rewritten once more):
    //   - without it, a blob file is deleted as soon as all its rows are
    //     garbage (overwritten, evicted, dropped) and compaction has seen
    //     that; the key space is tiny (17-byte keys), so compactions are
    //     cheap and frequent;
    //   - AQ-SGD overwrites every row of a link once per epoch, so a blob file
    //     written during epoch e is all garbage by the end of epoch e+1: disk
    //     use stays below ~2x the live bytes plus the memtables;
    //   - the capacity budget evicts oldest-written rows first, and rows sit
    //     in blob files in write order, so eviction empties the oldest files
    //     whole instead of leaving live rows scattered in them.
    // Turn it on when rows can stay untouched for long while their neighbours
    // are rewritten (e.g. a training set that shrinks): one never-rewritten
    // row keeps its whole blob file (up to blob_file_bytes) on disk.
    // Default: false.
    bool blob_garbage_collection = false;
    // Rate at which RocksDB deletes obsolete blob and table files, in bytes
    // per second (RocksDB's SstFileManager: a background thread cuts a file
    // down by `delete_chunk_bytes` at a time, then waits). AQ-SGD overwrites
    // every row once per epoch, so the blob files written in one epoch
    // become garbage together (an epoch's rows at once), and deleting them at
    // once stalls the loaders' reads where the filesystem is mounted with
    // `discard`: the kernel TRIMs the whole freed range and reads queue
    // behind it (measured: docs/notebook/store.md). Paced deletion spreads
    // that over seconds. Should
    // exceed the store's sustained write rate: obsolete files wait as
    // NAME.trash until deleted, and beyond `max_trash_ratio` of the live
    // files' size they are deleted at once again. Trash left at Close is
    // deleted when the store is reopened. 0 = delete at once (RocksDB's
    // default). Default: 1 GiB/s.
    uint64_t delete_bytes_per_s = 1ull << 30;
    // Bytes cut from a file per step of paced deletion. Default: 8 MiB.
    uint64_t delete_chunk_bytes = 8ull << 20;
    // Obsolete files held for paced deletion, as a fraction of the size of the
    // live table and blob files, beyond which new obsolete files are deleted
    // at once. Default: 1.0.
    double max_trash_ratio = 1.0;
    // Also verify RocksDB's own block and blob CRCs on every read, on top of
    // the row checksums that are always verified (see the banner). Default:
    // false.
    bool verify_rocksdb_checksums = false;
  };

  // Opens (creating if needed) the store at options.path. Fails with a
  // message naming the path when the directory cannot be created or written
  // (PermissionDenied / FailedPrecondition), is locked by another process or
  // store object (FailedPrecondition), or the disk is full (ResourceExhausted).
  static absl::StatusOr<std::unique_ptr<RocksDbMessageStore>> Open(const Options& options);

  ~RocksDbMessageStore() override;

  // Flushes memtables, closes the DB and writes the clean-shutdown marker.
  absl::Status Close() override;

  // Flushes the memtables and compacts the whole key range now: drops the
  // references to overwritten and deleted rows, so blob files holding only
  // such rows become deletable. Background compactions do this anyway; this
  // is for tests and for tools that want disk space back immediately.
  absl::Status Compact();

  // Bytes held by the memtables now (active and immutable; RocksDB's
  // "rocksdb.cur-size-all-mem-tables"). For tests and metrics.
  uint64_t MemtableBytes() const;

  // Name of the marker file written by a clean Close().
  static constexpr char kCleanShutdownMarker[] = "AQSWARM_CLEAN_SHUTDOWN";

 private:
  explicit RocksDbMessageStore(const Options& options);

  absl::Status Init();
  void ReadRaw(absl::Span<const std::string> keys, bool memory_only, RawVisitor visit) override;
  absl::Status WriteRaw(absl::Span<internal::WriteOp> ops) override;
  absl::Status DeleteRangesRaw(
      absl::Span<const std::pair<std::string, std::string>> ranges) override;

  const Options options_;
  std::unique_ptr<rocksdb::DB> db_;
  // Reused by WriteRaw (always called under RowStoreBase's write lock), so a
  // put does not grow a fresh multi-MB batch buffer from scratch each time.
  std::unique_ptr<rocksdb::WriteBatch> batch_;
};

}  // namespace aqswarm::storage

#endif  // AQSWARM_STORAGE_ROCKSDB_MESSAGE_STORE_H_
