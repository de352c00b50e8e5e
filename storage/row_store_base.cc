#include "storage/row_store_base.h"

#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "storage/row_codec.h"

namespace aqswarm::storage {

absl::Status ValidateLinkSpec(const LinkSpec& link) {
  if (link.rows <= 0 || link.cols <= 0 || link.rows > UINT32_MAX || link.cols > UINT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad row shape ", link.rows, "x", link.cols));
  }
  if (!IsValidRowPrecision(static_cast<uint8_t>(link.precision))) {
    return absl::InvalidArgumentError("bad row precision");
  }
  return absl::OkStatus();
}

absl::Status ValidateGetArgs(const LinkSpec& link, absl::Span<const uint64_t> samples,
                             absl::Span<const absl::Span<float>> out, absl::Span<RowRead> reads) {
  if (absl::Status s = ValidateLinkSpec(link); !s.ok()) return s;
  if (out.size() != samples.size() || reads.size() != samples.size()) {
    return absl::InvalidArgumentError(absl::StrCat("GetBatch: ", samples.size(), " samples but ",
                                                   out.size(), " outputs and ", reads.size(),
                                                   " results"));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (static_cast<int64_t>(out[i].size()) != link.num_values()) {
      return absl::InvalidArgumentError(absl::StrCat("GetBatch: output ", i, " holds ",
                                                     out[i].size(), " floats, want ",
                                                     link.num_values()));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePutArgs(const LinkSpec& link, absl::Span<const uint64_t> samples,
                             absl::Span<const absl::Span<const float>> values) {
  if (absl::Status s = ValidateLinkSpec(link); !s.ok()) return s;
  if (values.size() != samples.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("PutBatch: ", samples.size(), " samples but ", values.size(), " rows"));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (static_cast<int64_t>(values[i].size()) != link.num_values()) {
      return absl::InvalidArgumentError(absl::StrCat("PutBatch: row ", i, " has ",
                                                     values[i].size(), " floats, want ",
                                                     link.num_values()));
    }
  }
  // Finiteness is checked once per put, fused with the encoding
  // (RowStoreBase::PutBatch -> EncodeRowValue), not here: a separate pass
  // would read every value of every row from memory once more.
  return absl::OkStatus();
}

namespace {

// MessageStore's default EncodePut: a copy of the arguments, written by
// PutBatch at commit.
class CopiedPut final : public MessageStore::EncodedPut {
 public:
  const MessageStore* owner = nullptr;
  LinkSpec link;
  std::vector<uint64_t> samples;
  std::vector<std::vector<float>> values;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MessageStore::EncodedPut>> MessageStore::EncodePut(
    const LinkSpec& link, absl::Span<const uint64_t> samples,
    absl::Span<const absl::Span<const float>> values) {
  if (absl::Status s = ValidatePutArgs(link, samples, values); !s.ok()) return s;
  auto put = std::make_unique<CopiedPut>();
  put->owner = this;
  put->link = link;
  put->samples.assign(samples.begin(), samples.end());
  for (absl::Span<const float> v : values) put->values.emplace_back(v.begin(), v.end());
  return put;
}

absl::Status MessageStore::GetBatchFromMemory(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                              absl::Span<const absl::Span<float>> out,
                                              absl::Span<RowRead> reads) {
  if (absl::Status s = ValidateGetArgs(link, samples, out, reads); !s.ok()) return s;
  for (RowRead& r : reads) r = {absl::UnavailableError("not in memory"), 0};
  return absl::OkStatus();
}

absl::Status MessageStore::CommitPut(std::unique_ptr<EncodedPut> put) {
  auto* copied = dynamic_cast<CopiedPut*>(put.get());
  if (copied == nullptr || copied->owner != this) {
    return absl::InvalidArgumentError("CommitPut: not a put encoded by this store");
  }
  std::vector<absl::Span<const float>> values(copied->values.begin(), copied->values.end());
  return PutBatch(copied->link, copied->samples, values);
}

namespace internal {
namespace {

uint64_t NanosSince(std::chrono::steady_clock::time_point t0) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - t0)
                                   .count());
}

std::string IndexKeyFor(std::string row_key) {
  row_key[0] = static_cast<char>(kIndexKind);
  return row_key;
}

// The writes of one stored row: the row and its index entry (same batch).
void AppendRowOps(std::string row_key, std::string row, uint64_t seq, uint64_t bytes,
                  std::vector<WriteOp>* ops) {
  std::string index_key = IndexKeyFor(row_key);
  std::string index_value = EncodeIndexValue(index_key, seq, bytes);
  ops->push_back({false, std::move(row_key), std::move(row)});
  ops->push_back({false, std::move(index_key), std::move(index_value)});
}

}  // namespace

absl::Status RowStoreBase::CheckOpen() const {
  if (closed_.load()) return absl::FailedPreconditionError("message store is closed");
  return absl::OkStatus();
}

absl::Status RowStoreBase::GetBatch(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                    absl::Span<const absl::Span<float>> out,
                                    absl::Span<RowRead> reads) {
  return Get(link, samples, out, reads, /*memory_only=*/false);
}

absl::Status RowStoreBase::GetBatchFromMemory(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                              absl::Span<const absl::Span<float>> out,
                                              absl::Span<RowRead> reads) {
  return Get(link, samples, out, reads, /*memory_only=*/true);
}

absl::Status RowStoreBase::Get(const LinkSpec& link, absl::Span<const uint64_t> samples,
                               absl::Span<const absl::Span<float>> out, absl::Span<RowRead> reads,
                               bool memory_only) {
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status s = CheckOpen(); !s.ok()) return s;
  if (absl::Status s = ValidateGetArgs(link, samples, out, reads); !s.ok()) return s;
  std::vector<std::string> keys;
  keys.reserve(samples.size());
  for (uint64_t sample : samples) keys.push_back(EncodeKey(kRowKind, link.link, sample));

  uint64_t found = 0, unseen = 0, stale = 0, corrupt = 0;
  ReadRaw(keys, memory_only, [&](size_t i, const absl::Status& status, std::string_view value) {
    RowRead& r = reads[i];
    r.payload_checksum = 0;
    if (absl::IsNotFound(status)) {
      r.status = absl::NotFoundError("unseen");
      ++unseen;
      return;
    }
    if (!status.ok()) {
      r.status = status;
      if (absl::IsDataLoss(status)) ++corrupt;
      return;
    }
    RowHeader header;
    std::string_view payload;
    r.status = VerifyRowValue(keys[i], value, &header, &payload);
    if (!r.status.ok()) {
      ++corrupt;
      return;
    }
    if (!RowMatches(header, link)) {
      r.status = absl::NotFoundError(
          absl::StrCat("unseen: stored row is generation ", header.generation, " ",
                       RowPrecisionName(header.precision), " ", header.rows, "x", header.cols,
                       ", link is generation ", link.generation));
      ++unseen;
      ++stale;
      return;
    }
    r.status = DecodeRow(link.precision, link.rows, link.cols, payload, out[i]);
    if (!r.status.ok()) {
      r.status = absl::DataLossError(r.status.message());
      ++corrupt;
      return;
    }
    r.payload_checksum = header.payload_checksum;
    ++found;
  });
  rows_found_ += found;
  rows_unseen_ += unseen;
  rows_stale_ += stale;
  rows_corrupt_ += corrupt;
  ++get_batches_;
  get_nanos_ += NanosSince(t0);
  return absl::OkStatus();
}

void RowStoreBase::EraseLocked(const std::string& row_key, std::vector<WriteOp>* ops) {
  auto it = index_.find(row_key);
  if (it != index_.end()) {
    live_bytes_ -= it->second.bytes;
    by_seq_.erase(it->second.seq);
    index_.erase(it);
  }
  ops->push_back({true, row_key, {}});
  ops->push_back({true, IndexKeyFor(row_key), {}});
}

// A batch encoded by RowStoreBase::EncodePut: row keys and full row values.
class RowStoreBase::RowPut final : public MessageStore::EncodedPut {
 public:
  explicit RowPut(RowStoreBase* owner) : owner_(owner) {}
  // Not committed: its value buffers go back to the spare pool.
  ~RowPut() override { owner_->ReturnSpareValues(&rows); }

  RowStoreBase* owner() const { return owner_; }

  std::vector<std::string> keys;
  std::vector<std::string> rows;
  uint64_t encode_nanos = 0;

 private:
  RowStoreBase* const owner_;
};

absl::StatusOr<std::unique_ptr<MessageStore::EncodedPut>> RowStoreBase::EncodePut(
    const LinkSpec& link, absl::Span<const uint64_t> samples,
    absl::Span<const absl::Span<const float>> values) {
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status s = CheckOpen(); !s.ok()) return s;
  if (absl::Status s = ValidatePutArgs(link, samples, values); !s.ok()) return s;
  // The expensive part of a put, outside mu_. Value buffers are recycled: a
  // fresh multi-MB string per row costs page faults and zero-filling on
  // every put.
  auto put = std::make_unique<RowPut>(this);
  put->keys.resize(samples.size());
  put->rows = TakeSpareValues(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    put->keys[i] = EncodeKey(kRowKind, link.link, samples[i]);
    if (absl::Status s = EncodeRowValue(put->keys[i], link, values[i], &put->rows[i]); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("PutBatch: row ", i, " (sample ", samples[i],
                                                     "): ", s.message()));
    }
  }
  put->encode_nanos = NanosSince(t0);
  return put;
}

absl::Status RowStoreBase::PutBatch(const LinkSpec& link, absl::Span<const uint64_t> samples,
                                    absl::Span<const absl::Span<const float>> values) {
  auto put = EncodePut(link, samples, values);
  if (!put.ok()) return put.status();
  return CommitPut(std::move(put).value());
}

absl::Status RowStoreBase::CommitPut(std::unique_ptr<EncodedPut> encoded) {
  const auto t0 = std::chrono::steady_clock::now();
  auto* put = dynamic_cast<RowPut*>(encoded.get());
  if (put == nullptr || put->owner() != this) {
    return absl::InvalidArgumentError("CommitPut: not a put encoded by this store");
  }
  if (absl::Status s = CheckOpen(); !s.ok()) return s;
  std::vector<std::string>& keys = put->keys;
  std::vector<std::string>& rows = put->rows;
  const size_t n = keys.size();

  absl::MutexLock lock(&mu_);
  if (!write_failure_.ok()) return write_failure_;
  std::vector<WriteOp> ops;
  ops.reserve(n * 2);
  uint64_t evicted = 0, written = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t bytes = keys[i].size() + rows[i].size();
    auto it = index_.find(keys[i]);
    // Without a budget nothing is ever evicted: an overwrite of the same size
    // (every put of a steady epoch) changes nothing the index holds but the
    // write order, so it writes the row alone. A row keeps the place of its
    // first write (message_store.h, "Capacity budget").
    if (it != index_.end() && capacity_bytes_ == 0 && it->second.bytes == bytes) {
      ops.push_back({false, std::move(keys[i]), std::move(rows[i])});
      ++written;
      continue;
    }
    // Overwriting a row that needs no eviction: update its entries in place,
    // moving the key string between the eviction-order nodes, so the
    // bookkeeping allocates nothing.
    if (it != index_.end() &&
        (capacity_bytes_ == 0 || live_bytes_ - it->second.bytes + bytes <= capacity_bytes_)) {
      auto old = by_seq_.find(it->second.seq);
      std::string key = std::move(old->second);
      by_seq_.erase(old);
      const uint64_t seq = next_seq_++;
      live_bytes_ = live_bytes_ - it->second.bytes + bytes;
      it->second = {seq, bytes};
      by_seq_.emplace_hint(by_seq_.end(), seq, std::move(key));
      AppendRowOps(std::move(keys[i]), std::move(rows[i]), seq, bytes, &ops);
      ++written;
      continue;
    }
    // The old version (if any) is replaced: drop it from the accounting.
    if (it != index_.end()) {
      live_bytes_ -= it->second.bytes;
      by_seq_.erase(it->second.seq);
      index_.erase(it);
    }
    if (capacity_bytes_ > 0 && bytes > capacity_bytes_) {
      // Larger than the whole budget: not stored; an older version must not
      // survive either (the caller believes m(xi) is the new value).
      EraseLocked(keys[i], &ops);
      ++evicted;
      continue;
    }
    while (capacity_bytes_ > 0 && live_bytes_ + bytes > capacity_bytes_ && !by_seq_.empty()) {
      const std::string victim = by_seq_.begin()->second;
      EraseLocked(victim, &ops);
      ++evicted;
    }
    const uint64_t seq = next_seq_++;
    index_[keys[i]] = {seq, bytes};
    by_seq_[seq] = keys[i];
    live_bytes_ += bytes;
    AppendRowOps(std::move(keys[i]), std::move(rows[i]), seq, bytes, &ops);
    ++written;
  }
  absl::Status write_status = WriteRaw(absl::MakeSpan(ops));
  // Backends that copy values (RocksDB) leave them in `ops`: recycle them
  // (the put's destructor returns the rows that were not written).
  std::vector<std::string> used;
  used.reserve(n);
  for (WriteOp& op : ops) {
    if (!op.is_delete && op.key[0] == static_cast<char>(kRowKind)) used.push_back(std::move(op.value));
  }
  ReturnSpareValues(&used);
  if (!write_status.ok()) {
    write_failure_ = absl::Status(write_status.code(),
                                  absl::StrCat("message store write failed; reopen the store: ",
                                               write_status.message()));
    return write_failure_;
  }
  // A sample listed twice in one batch counts once per put; that is fine.
  rows_written_ += written;
  rows_evicted_ += evicted;
  ++put_batches_;
  put_nanos_ += put->encode_nanos + NanosSince(t0);
  return absl::OkStatus();
}

std::vector<std::string> RowStoreBase::TakeSpareValues(size_t n) {
  std::vector<std::string> out(n);
  absl::MutexLock lock(&spare_mu_);
  for (size_t i = 0; i < n && !spare_values_.empty(); ++i) {
    out[i] = std::move(spare_values_.back());
    spare_values_.pop_back();
    spare_bytes_ -= out[i].capacity();
  }
  return out;
}

void RowStoreBase::ReturnSpareValues(std::vector<std::string>* values) {
  absl::MutexLock lock(&spare_mu_);
  for (std::string& v : *values) {
    // Moved-from strings (the memory backend keeps its values) hold nothing.
    if (v.capacity() < 4096 || spare_bytes_ + v.capacity() > kMaxSpareValueBytes) continue;
    spare_bytes_ += v.capacity();
    spare_values_.push_back(std::move(v));
  }
  values->clear();
}

absl::Status RowStoreBase::DropLink(const LinkId& link) {
  if (absl::Status s = CheckOpen(); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (!write_failure_.ok()) return write_failure_;
  const std::vector<std::pair<std::string, std::string>> ranges = {
      {LinkBeginKey(kRowKind, link), LinkEndKey(kRowKind, link)},
      {LinkBeginKey(kIndexKind, link), LinkEndKey(kIndexKind, link)}};
  if (absl::Status s = DeleteRangesRaw(ranges); !s.ok()) return s;
  const std::string& begin = ranges[0].first;
  for (auto it = index_.begin(); it != index_.end();) {
    if (it->first.compare(0, begin.size(), begin) == 0) {
      live_bytes_ -= it->second.bytes;
      by_seq_.erase(it->second.seq);
      index_.erase(it++);
    } else {
      ++it;
    }
  }
  return absl::OkStatus();
}

void RowStoreBase::RestoreIndexEntry(std::string row_key, uint64_t seq, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (auto it = index_.find(row_key); it != index_.end()) {
    live_bytes_ -= it->second.bytes;
    by_seq_.erase(it->second.seq);
  }
  index_[row_key] = {seq, bytes};
  by_seq_[seq] = row_key;
  live_bytes_ += bytes;
  next_seq_ = std::max(next_seq_, seq + 1);
}

MessageStoreStats RowStoreBase::GetStats() const {
  MessageStoreStats s;
  s.rows_found = rows_found_.load();
  s.rows_unseen = rows_unseen_.load();
  s.rows_stale = rows_stale_.load();
  s.rows_corrupt = rows_corrupt_.load();
  s.rows_written = rows_written_.load();
  s.rows_evicted = rows_evicted_.load();
  s.get_batches = get_batches_.load();
  s.put_batches = put_batches_.load();
  s.get_nanos_total = get_nanos_.load();
  s.put_nanos_total = put_nanos_.load();
  s.capacity_bytes = capacity_bytes_;
  s.opened_after_unclean_shutdown = unclean_;
  absl::MutexLock lock(&mu_);
  s.live_rows = index_.size();
  s.live_bytes = live_bytes_;
  return s;
}

}  // namespace internal
}  // namespace aqswarm::storage
