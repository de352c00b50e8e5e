// RocksDbMessageStore: the on-SSD MessageStore backend (GPT-2-XL needs ~6.5 MB
// per sample per link: far beyond RAM). One RocksDB instance per directory;
// all links of a peer can share it (keys carry the link id).
//
// Tuning for large, incompressible, overwrite-once-per-epoch values:
//   - BlobDB (enable_blob_files): rows >= min_blob_bytes go to blob files, so
//     compaction moves 17-byte keys + blob references, not megabytes; blob
//     garbage collection reclaims overwritten rows during compaction.
//   - No compression (SST or blob): fp16/int8 activations are near-random
//     bits; compression costs CPU and saves little (measure before enabling).
//   - MultiGet for batched reads; checksums verified on every read
//     (RocksDB's block/blob CRCs, then our own row checksums).
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
    // Memtables (active + immutable) before writes stall. Default: 4.
    int max_write_buffers = 4;
    // Background flush + compaction threads. Default: 2.
    int background_jobs = 2;
    // Write blob and table files with O_DIRECT (flush and compaction) when
    // the directory's filesystem supports it (probed at open; silently
    // buffered otherwise). Each row is written once and read back at most
    // once per epoch, so the page cache buys nothing, while copying every
    // written byte into it was the largest CPU cost of the store (measured:
    // ~35% of the process's CPU in `bench store`). Reads stay buffered.
    // Default: true.
    bool direct_io_writes = true;
  };

  // Opens (creating if needed) the store at options.path. Fails with a
  // message naming the path when the directory cannot be created or written
  // (PermissionDenied / FailedPrecondition), is locked by another process or
  // store object (FailedPrecondition), or the disk is full (ResourceExhausted).
  static absl::StatusOr<std::unique_ptr<RocksDbMessageStore>> Open(const Options& options);

  ~RocksDbMessageStore() override;

  // Flushes memtables, closes the DB and writes the clean-shutdown marker.
  absl::Status Close() override;

  // Name of the marker file written by a clean Close().
  static constexpr char kCleanShutdownMarker[] = "AQSWARM_CLEAN_SHUTDOWN";

 private:
  explicit RocksDbMessageStore(const Options& options);

  absl::Status Init();
  void ReadRaw(absl::Span<const std::string> keys, RawVisitor visit) override;
  absl::Status WriteRaw(absl::Span<internal::WriteOp> ops) override;
  absl::Status DeleteRangesRaw(
      absl::Span<const std::pair<std::string, std::string>> ranges) override;

  const Options options_;
  std::unique_ptr<rocksdb::DB> db_;
};

}  // namespace aqswarm::storage

#endif  // AQSWARM_STORAGE_ROCKSDB_MESSAGE_STORE_H_
