#include "storage/rocksdb_message_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <climits>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rocksdb/db.h"
#include "rocksdb/iterator.h"
#include "rocksdb/memtablerep.h"
#include "rocksdb/options.h"
#include "rocksdb/slice_transform.h"
#include "rocksdb/sst_file_manager.h"
#include "rocksdb/write_batch.h"
#include "storage/rocksdb_util.h"
#include "storage/row_codec.h"

namespace aqswarm::storage {
namespace {

rocksdb::Slice ToSlice(std::string_view s) { return rocksdb::Slice(s.data(), s.size()); }

absl::Status FsyncPath(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, " for fsync failed"));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("fsync ", path, " failed"));
  return absl::OkStatus();
}

// Whether files in `dir` can be opened with O_DIRECT (not on every
// filesystem, e.g. older tmpfs). Creates `dir` if needed; false on any error
// (opening the DB then reports it with its own message).
bool SupportsDirectIo(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return false;
  const std::string probe = (std::filesystem::path(dir) / "AQSWARM_DIRECT_IO_PROBE").string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
  if (fd < 0) {
    ::unlink(probe.c_str());
    return false;
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return true;
}

}  // namespace

RocksDbMessageStore::RocksDbMessageStore(const Options& options)
    : RowStoreBase(options.capacity_bytes), options_(options) {}

RocksDbMessageStore::~RocksDbMessageStore() { (void)Close(); }

absl::StatusOr<std::unique_ptr<RocksDbMessageStore>> RocksDbMessageStore::Open(
    const Options& options) {
  if (options.path.empty()) return absl::InvalidArgumentError("message store: empty path");
  if (options.max_write_buffers < 2 || options.background_jobs < 1 || options.flush_threads < 1 ||
      options.slowdown_write_bytes_per_s == 0 ||
      options.write_buffer_bytes == 0 || options.blob_file_bytes == 0 ||
      options.delete_bytes_per_s > static_cast<uint64_t>(INT64_MAX) ||
      !(options.max_trash_ratio >= 0) ||
      (options.hash_memtable && options.hash_memtable_buckets == 0)) {
    return absl::InvalidArgumentError("message store: bad RocksDB tuning options");
  }
  std::unique_ptr<RocksDbMessageStore> store(new RocksDbMessageStore(options));
  if (absl::Status s = store->Init(); !s.ok()) return s;
  return store;
}

absl::Status RocksDbMessageStore::Init() {
  const std::string& path = options_.path;
  // Clean-shutdown marker: present iff the last Close() completed. Remove it
  // before the first write so a crash from now on is detected next time.
  std::error_code ec;
  const std::filesystem::path marker = std::filesystem::path(path) / kCleanShutdownMarker;
  const bool existed = std::filesystem::exists(std::filesystem::path(path) / "CURRENT", ec);
  const bool clean = !existed || std::filesystem::exists(marker, ec);

  rocksdb::Options o;
  o.create_if_missing = true;
  o.paranoid_checks = true;
  o.compression = rocksdb::kNoCompression;
  o.bottommost_compression = rocksdb::kNoCompression;
  o.enable_blob_files = true;
  o.min_blob_size = options_.min_blob_bytes;
  o.blob_file_size = options_.blob_file_bytes;
  o.blob_compression_type = rocksdb::kNoCompression;
  o.enable_blob_garbage_collection = options_.blob_garbage_collection;
  o.blob_garbage_collection_age_cutoff = 0.5;
  if (options_.hash_memtable) {
    // Every key (row or index entry) is exactly kKeyBytes: a whole-key
    // "prefix" makes each hash bucket one key's versions.
    o.prefix_extractor.reset(rocksdb::NewFixedPrefixTransform(internal::kKeyBytes));
    o.memtable_factory.reset(rocksdb::NewHashSkipListRepFactory(options_.hash_memtable_buckets));
    o.allow_concurrent_memtable_write = false;  // only the skip list supports it
  }
  o.inplace_update_support = options_.inplace_updates;
  // Needed by both the hash memtable and in-place updates; there is one
  // writer anyway (WriteRaw runs under RowStoreBase's write lock).
  if (options_.inplace_updates) o.allow_concurrent_memtable_write = false;
  o.write_buffer_size = options_.write_buffer_bytes;
  o.max_write_buffer_number = options_.max_write_buffers;
  // Explicit limits (RocksDB otherwise gives flushes a quarter of the jobs).
  o.max_background_flushes = options_.flush_threads;
  o.max_background_compactions = options_.background_jobs;
  o.delayed_write_rate = options_.slowdown_write_bytes_per_s;
  o.target_file_size_base = 64ull << 20;
  o.max_bytes_for_level_base = 256ull << 20;
  o.avoid_flush_during_shutdown = false;  // flush memtables on close (WAL off)
  o.keep_log_file_num = 4;
  const bool direct_io = (options_.direct_io_writes || options_.direct_io_reads) && SupportsDirectIo(path);
  o.use_direct_io_for_flush_and_compaction = options_.direct_io_writes && direct_io;
  o.use_direct_reads = options_.direct_io_reads && direct_io;
  if (options_.delete_bytes_per_s > 0) {
    rocksdb::Status status;
    o.sst_file_manager.reset(rocksdb::NewSstFileManager(
        o.env, /*info_log=*/nullptr, /*trash_dir=*/"",
        static_cast<int64_t>(options_.delete_bytes_per_s), /*delete_existing_trash=*/true,
        &status, options_.max_trash_ratio, options_.delete_chunk_bytes));
    if (!status.ok()) {
      return internal::FromRocksDb(status, absl::StrCat("message store at '", path,
                                                        "': paced file deletion"));
    }
  }
  auto db = internal::OpenRocksDb(o, path, "message store");
  if (!db.ok()) return db.status();
  db_ = std::move(db).value();

  if (std::filesystem::exists(marker, ec)) {
    std::filesystem::remove(marker, ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrCat("message store at '", path,
                                                      "': cannot remove ", marker.string(), ": ",
                                                      ec.message()));
    }
    if (absl::Status s = FsyncPath(path); !s.ok()) return s;
  }
  set_opened_after_unclean_shutdown(!clean);

  // Rebuild the budget index from the small index entries.
  std::vector<internal::WriteOp> repairs;
  rocksdb::ReadOptions ro;
  ro.total_order_seek = true;  // a scan across keys, whatever the memtable
  const std::string begin(1, static_cast<char>(internal::kIndexKind));
  const std::string end(1, static_cast<char>(internal::kIndexKind + 1));
  rocksdb::Slice upper = ToSlice(end);
  ro.iterate_upper_bound = &upper;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
  for (it->Seek(ToSlice(begin)); it->Valid(); it->Next()) {
    const std::string_view key(it->key().data(), it->key().size());
    uint64_t seq = 0, bytes = 0;
    std::string row_key(key);
    row_key[0] = static_cast<char>(internal::kRowKind);
    if (key.size() != internal::kKeyBytes ||
        !internal::DecodeIndexValue(key, std::string_view(it->value().data(), it->value().size()),
                                    &seq, &bytes)
             .ok()) {
      // A damaged index entry: drop it and its row (the sample reads as unseen).
      repairs.push_back({true, std::string(key), {}});
      if (key.size() == internal::kKeyBytes) repairs.push_back({true, row_key, {}});
      continue;
    }
    RestoreIndexEntry(std::move(row_key), seq, bytes);
  }
  if (!it->status().ok()) {
    return internal::FromRocksDb(it->status(),
                                 absl::StrCat("message store at '", path, "': scan index"));
  }
  it.reset();
  if (!repairs.empty()) return WriteRaw(absl::MakeSpan(repairs));
  return absl::OkStatus();
}

void RocksDbMessageStore::ReadRaw(absl::Span<const std::string> keys, bool memory_only,
                                  RawVisitor visit) {
  const size_t n = keys.size();
  std::vector<rocksdb::Slice> slices(n);
  for (size_t i = 0; i < n; ++i) slices[i] = ToSlice(keys[i]);
  // A value RocksDB cannot pin (a memtable row: in-place updates copy it out
  // under the key's lock) lands in a buffer of this thread that keeps its
  // capacity from call to call: a row-sized malloc and free per read is what
  // it would cost otherwise, in a heap the model's tensors keep fragmenting.
  thread_local std::vector<std::string> buffers;
  if (buffers.size() < n) buffers.resize(n);
  std::vector<rocksdb::PinnableSlice> values;
  values.reserve(n);
  for (size_t i = 0; i < n; ++i) values.emplace_back(&buffers[i]);
  std::vector<rocksdb::Status> statuses(n);
  rocksdb::ReadOptions ro;
  ro.verify_checksums = options_.verify_rocksdb_checksums;
  // Memtables and block cache only: a key needing I/O comes back Incomplete.
  if (memory_only) ro.read_tier = rocksdb::kBlockCacheTier;
  db_->MultiGet(ro, db_->DefaultColumnFamily(), n, slices.data(), values.data(), statuses.data());
  for (size_t i = 0; i < n; ++i) {
    if (statuses[i].IsNotFound()) {
      visit(i, absl::NotFoundError("unseen"), {});
    } else if (memory_only && statuses[i].IsIncomplete()) {
      visit(i, absl::UnavailableError("not in memory"), {});
    } else if (!statuses[i].ok()) {
      visit(i, internal::FromRocksDb(statuses[i], "message store read"), {});
    } else {
      visit(i, absl::OkStatus(), std::string_view(values[i].data(), values[i].size()));
    }
    values[i].Reset();  // release a pinned block before the next key's visit
    // Keep what a steady stream of small rows needs, not a one-off huge row.
    constexpr size_t kMaxKeptBytes = 1ull << 20;
    if (buffers[i].capacity() > kMaxKeptBytes) std::string().swap(buffers[i]);
  }
}

absl::Status RocksDbMessageStore::WriteRaw(absl::Span<internal::WriteOp> ops) {
  // Keep the batch buffer between puts unless one grew it past what a
  // steady stream of puts needs.
  constexpr size_t kMaxKeptBatchBytes = 64ull << 20;
  if (batch_ == nullptr || batch_->GetDataSize() > kMaxKeptBatchBytes) {
    batch_ = std::make_unique<rocksdb::WriteBatch>();
  }
  rocksdb::WriteBatch& batch = *batch_;
  batch.Clear();
  for (const internal::WriteOp& op : ops) {
    rocksdb::Status s = op.is_delete ? batch.Delete(ToSlice(op.key))
                                     : batch.Put(ToSlice(op.key), ToSlice(op.value));
    if (!s.ok()) return internal::FromRocksDb(s, "message store write batch");
  }
  rocksdb::WriteOptions wo;
  wo.disableWAL = !options_.use_wal;
  return internal::FromRocksDb(db_->Write(wo, &batch), "message store write");
}

absl::Status RocksDbMessageStore::Compact() {
  if (absl::Status s = CheckOpen(); !s.ok()) return s;
  const std::string context = absl::StrCat("compact message store at '", options_.path, "'");
  rocksdb::FlushOptions fo;
  fo.wait = true;
  if (absl::Status s = internal::FromRocksDb(db_->Flush(fo), context); !s.ok()) return s;
  rocksdb::CompactRangeOptions co;
  co.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  return internal::FromRocksDb(db_->CompactRange(co, nullptr, nullptr), context);
}

uint64_t RocksDbMessageStore::MemtableBytes() const {
  uint64_t bytes = 0;
  if (db_ == nullptr || !db_->GetIntProperty("rocksdb.cur-size-all-mem-tables", &bytes)) return 0;
  return bytes;
}

absl::Status RocksDbMessageStore::DeleteRangesRaw(
    absl::Span<const std::pair<std::string, std::string>> ranges) {
  rocksdb::WriteBatch batch;
  for (const auto& [begin, end] : ranges) {
    rocksdb::Status s =
        batch.DeleteRange(db_->DefaultColumnFamily(), ToSlice(begin), ToSlice(end));
    if (!s.ok()) return internal::FromRocksDb(s, "message store delete range");
  }
  rocksdb::WriteOptions wo;
  wo.disableWAL = !options_.use_wal;
  return internal::FromRocksDb(db_->Write(wo, &batch), "message store delete range");
}

absl::Status RocksDbMessageStore::Close() {
  if (db_ == nullptr) return absl::OkStatus();
  MarkClosed();
  const std::string context = absl::StrCat("close message store at '", options_.path, "'");
  rocksdb::FlushOptions fo;
  fo.wait = true;
  absl::Status status = internal::FromRocksDb(db_->Flush(fo), context);
  if (status.ok()) status = internal::FromRocksDb(db_->Close(), context);
  db_.reset();
  if (!status.ok()) return status;
  // Everything is in SST/blob files now: mark the shutdown clean.
  const std::string marker =
      (std::filesystem::path(options_.path) / kCleanShutdownMarker).string();
  int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat(context, ": cannot write ", marker));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat(context, ": fsync ", marker, " failed"));
  return FsyncPath(options_.path);
}

}  // namespace aqswarm::storage
