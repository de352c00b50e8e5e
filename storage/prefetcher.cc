#include "storage/prefetcher.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "storage/row_codec.h"

namespace aqswarm::storage {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t NanosSince(Clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

// out <- Decode(Encode(in)), the value the store will hold; *checksum <- the
// checksum of the encoded payload (RowRead::payload_checksum).
// InvalidArgument if `in` is not finite (the queued put will fail too).
absl::Status RoundAndChecksum(const LinkSpec& link, absl::Span<const float> in,
                              absl::Span<float> out, std::string* scratch, uint64_t* checksum) {
  scratch->resize(link.payload_bytes());
  if (absl::Status s = internal::EncodePayloadChecked(link, in, scratch->data()); !s.ok()) {
    return s;
  }
  (void)DecodeRow(link.precision, link.rows, link.cols, *scratch, out);
  *checksum = Checksum64(scratch->data(), scratch->size());
  return absl::OkStatus();
}

uint64_t BatchBytes(const Prefetcher::Options& o) {
  return static_cast<uint64_t>(o.micro_batch) * o.link.num_values() * sizeof(float);
}

// Options::min_handoff_bytes in whole micro-batches: >= 1, <= half the window.
int64_t HandoffBatches(const Prefetcher::Options& o) {
  const uint64_t batch = BatchBytes(o);
  const int64_t n = batch > 0 ? static_cast<int64_t>(o.min_handoff_bytes / batch) : 1;
  return std::max<int64_t>(1, std::min(n, o.prefetch_batches / 2));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Prefetcher>> Prefetcher::Create(MessageStore* store,
                                                              const Options& options) {
  if (store == nullptr) return absl::InvalidArgumentError("Prefetcher: null store");
  if (absl::Status s = ValidateLinkSpec(options.link); !s.ok()) return s;
  if (options.micro_batch <= 0 || options.prefetch_batches <= 0 || options.loader_threads <= 0) {
    return absl::InvalidArgumentError(
        "Prefetcher: micro_batch, prefetch_batches and loader_threads must be > 0");
  }
  if (options.encode_threads < 0) {
    return absl::InvalidArgumentError("Prefetcher: encode_threads must be >= 0");
  }
  const uint64_t batch_bytes = BatchBytes(options);
  if (options.max_prefetch_bytes < batch_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("Prefetcher: max_prefetch_bytes ",
                                                   options.max_prefetch_bytes,
                                                   " cannot hold one micro-batch (", batch_bytes,
                                                   " bytes)"));
  }
  std::unique_ptr<Prefetcher> p(new Prefetcher(store, options));
  for (int i = 0; i < options.loader_threads; ++i) {
    p->loaders_.emplace_back([raw = p.get()] { raw->LoaderLoop(); });
  }
  p->writer_ = std::thread([raw = p.get()] { raw->WriterLoop(); });
  for (int i = 0; i < options.encode_threads; ++i) {
    p->encoders_.emplace_back([raw = p.get()] { raw->EncoderLoop(); });
  }
  return p;
}

Prefetcher::Prefetcher(MessageStore* store, const Options& options)
    : store_(store),
      options_(options),
      row_bytes_(static_cast<uint64_t>(options.link.num_values()) * sizeof(float)),
      handoff_batches_(HandoffBatches(options)),
      handoff_bytes_(static_cast<uint64_t>(handoff_batches_) * BatchBytes(options)) {
  // Every buffer that can be in use at once: the prefetch window, the write
  // queue (which always accepts one batch) and two batches held by the
  // consumer. Idle buffers are kept only while pool + prefetched + queued rows
  // stay within that, so the pool never raises the memory bound; a steady
  // epoch then allocates (and page-faults, and zero-fills) nothing.
  const uint64_t bound_bytes = options.max_prefetch_bytes + options.max_write_behind_bytes;
  max_pool_rows_ = static_cast<size_t>(bound_bytes / row_bytes_ + 3 * options.micro_batch);
  inline_reads_ = BatchBytes(options) <= options.inline_read_bytes;
}

std::vector<float> Prefetcher::NewBufferLocked() {
  if (pool_.empty()) {
    // Allocated by SizeBuffer() outside the lock: zero-filling and faulting
    // in a multi-MB row under mu_ would hold up every other thread.
    ++stats_.buffers_allocated;
    return {};
  }
  std::vector<float> b = std::move(pool_.back());
  pool_.pop_back();
  return b;
}

void Prefetcher::SizeBuffer(std::vector<float>& buffer) const {
  buffer.resize(static_cast<size_t>(options_.link.num_values()));
}

void Prefetcher::RecycleLocked(std::vector<float> buffer) {
  const size_t in_use = static_cast<size_t>((cache_bytes_ + write_bytes_) / row_bytes_);
  if (pool_.size() + in_use < max_pool_rows_ &&
      buffer.size() == static_cast<size_t>(options_.link.num_values())) {
    pool_.push_back(std::move(buffer));
  }
}

Prefetcher::~Prefetcher() { (void)Close(); }

int64_t Prefetcher::num_batches() const {
  return batch_base_ + static_cast<int64_t>(batch_begin_.size());
}

int64_t Prefetcher::order_end() const {
  return order_base_ + static_cast<int64_t>(order_.size());
}

int64_t Prefetcher::batch_begin(int64_t batch) const { return batch_begin_[batch - batch_base_]; }

// Orders are contiguous, so a batch ends where the next one begins (the last
// batch of an order at the next order's first position).
int64_t Prefetcher::batch_end(int64_t batch) const {
  return batch + 1 < num_batches() ? batch_begin(batch + 1) : order_end();
}

uint64_t Prefetcher::sample_at(int64_t position) const { return order_[position - order_base_]; }

int64_t Prefetcher::untaken_begin() const {
  const int64_t b = std::max(consumer_batch_ + 1, first_batch());
  return b < num_batches() ? batch_begin(b) : order_end();
}

int64_t Prefetcher::BatchOfLocked(uint64_t sample, int64_t from) const {
  auto it = position_.find(sample);
  if (it == position_.end()) return -1;
  auto p = std::lower_bound(it->second.begin(), it->second.end(), from);
  if (p == it->second.end()) return -1;
  auto b = std::upper_bound(batch_begin_.begin(), batch_begin_.end(), *p);
  return batch_base_ + static_cast<int64_t>(b - batch_begin_.begin()) - 1;
}

bool Prefetcher::MustDeferLocked(uint64_t sample, int64_t position) const {
  if (held_.contains(sample)) return true;  // taken, its put is still to come
  auto it = position_.find(sample);
  if (it == position_.end()) return false;
  // An earlier occurrence the consumer has not taken yet.
  auto p = std::lower_bound(it->second.begin(), it->second.end(), untaken_begin());
  return p != it->second.end() && *p < position;
}

void Prefetcher::AppendOrderLocked(std::vector<uint64_t> order) {
  const int64_t begin = order_end();
  const int64_t n = static_cast<int64_t>(order.size());
  for (int64_t i = 0; i < n; i += options_.micro_batch) batch_begin_.push_back(begin + i);
  for (int64_t i = 0; i < n; ++i) {
    position_[order[i]].push_back(begin + i);
    order_.push_back(order[i]);
  }
  segment_end_.push_back(begin + n);
  WakeLoadersLocked();
}

void Prefetcher::TrimConsumedOrdersLocked() {
  while (!segment_end_.empty() && consumer_batch_ >= first_batch() &&
         consumer_batch_ < num_batches() && batch_begin(consumer_batch_) >= segment_end_.front()) {
    const int64_t end = segment_end_.front();
    segment_end_.pop_front();
    for (; order_base_ < end; ++order_base_) {
      auto it = position_.find(order_.front());
      order_.pop_front();
      if (it == position_.end()) continue;
      std::vector<int64_t>& positions = it->second;
      positions.erase(positions.begin(),
                      std::upper_bound(positions.begin(), positions.end(), order_base_));
      if (positions.empty()) position_.erase(it);
    }
    while (!batch_begin_.empty() && batch_begin_.front() < end) {
      batch_begin_.pop_front();
      ++batch_base_;
    }
  }
}

absl::Status Prefetcher::SetOrder(std::vector<uint64_t> order) {
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::FailedPreconditionError("Prefetcher is closed");
  if (!write_error_.ok()) return write_error_;
  // In-flight loads find their ticket gone and discard themselves.
  cache_.clear();
  cache_bytes_ = 0;
  order_.clear();
  order_base_ = 0;
  batch_begin_.clear();
  batch_base_ = 0;
  segment_end_.clear();
  position_.clear();
  held_.clear();
  deferred_.clear();
  late_.clear();
  consumer_batch_ = -1;
  next_load_batch_ = 0;
  released_batch_ = 0;
  inline_reads_ = BatchBytes(options_) <= options_.inline_read_bytes;
  AppendOrderLocked(std::move(order));
  return absl::OkStatus();
}

absl::Status Prefetcher::AppendOrder(std::vector<uint64_t> order) {
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::FailedPreconditionError("Prefetcher is closed");
  if (!write_error_.ok()) return write_error_;
  AppendOrderLocked(std::move(order));
  return absl::OkStatus();
}

int64_t Prefetcher::LoadableBatchesLocked() const {
  if (inline_reads_) return 0;  // TakeBatch reads the rows itself
  const int64_t window_end = std::min(num_batches(), consumer_batch_ + options_.prefetch_batches + 1);
  const uint64_t batch_bytes = static_cast<uint64_t>(options_.micro_batch) * row_bytes_;
  const uint64_t room = cache_bytes_ < options_.max_prefetch_bytes
                            ? (options_.max_prefetch_bytes - cache_bytes_) / batch_bytes
                            : 0;
  return std::max<int64_t>(0, std::min(window_end - next_load_batch_, static_cast<int64_t>(room)));
}

bool Prefetcher::LoaderHasWork() const {
  if (!late_.empty() && cache_bytes_ + row_bytes_ <= options_.max_prefetch_bytes) return true;
  const int64_t n = LoadableBatchesLocked();
  if (n <= 0) return false;
  // A full hand-off, or all there is: the rest of the order, or all the
  // memory bound allows.
  return n >= handoff_batches_ || next_load_batch_ + n >= num_batches() ||
         cache_bytes_ + static_cast<uint64_t>(n + 1) * options_.micro_batch * row_bytes_ >
             options_.max_prefetch_bytes;
}

void Prefetcher::WakeLoadersLocked() {
  if (!LoaderHasWork()) return;
  // One hand-off's worth: one loader claims it all (waking the others would
  // be wake-ups that find nothing).
  if (late_.empty() && LoadableBatchesLocked() < 2 * handoff_batches_) {
    loader_cv_.Signal();
  } else {
    loader_cv_.SignalAll();
  }
}

void Prefetcher::EraseSlotLocked(uint64_t sample) {
  auto it = cache_.find(sample);
  if (it == cache_.end()) return;
  cache_bytes_ -= row_bytes_;
  cache_.erase(it);
}

void Prefetcher::AdvanceConsumerLocked(int64_t batch) {
  if (batch <= consumer_batch_) return;
  consumer_batch_ = batch;
  // Release rows of batches the consumer has moved past without asking (only
  // slots loaded for those occurrences: a sample's slot may already be for
  // its next occurrence).
  for (released_batch_ = std::max(released_batch_, first_batch());
       released_batch_ < consumer_batch_; ++released_batch_) {
    const int64_t end = batch_end(released_batch_);
    for (int64_t i = batch_begin(released_batch_); i < end; ++i) {
      auto it = cache_.find(sample_at(i));
      if (it != cache_.end() && it->second.position == i) {
        EraseSlotLocked(it->first);  // an in-flight load then discards itself
      }
    }
  }
  // The loader may have caught up with the skipped batches.
  next_load_batch_ = std::max(next_load_batch_, consumer_batch_ + 1);
  TrimConsumedOrdersLocked();
  // Wake the loaders only for work (each wake of an idle loader is a context
  // switch; with 4 KB rows these were a visible share of a stage's CPU).
  WakeLoadersLocked();
}

void Prefetcher::LoaderLoop() {
  pthread_setname_np(pthread_self(), "aqs-prefetch");  // for perf and /proc
  const LinkSpec& link = options_.link;
  // Reused across batches: the loader allocates nothing per batch.
  std::vector<uint64_t> samples, tickets;
  std::vector<std::vector<float>> rows;
  std::vector<absl::Span<float>> spans;
  std::vector<RowRead> reads;
  // Rows whose latest put is still queued: rounded from that put (index into
  // samples/rows, the put).
  std::vector<std::pair<size_t, Pending>> queued;
  std::vector<size_t> from_store;
  std::string scratch;
  while (true) {
    samples.clear();
    tickets.clear();
    rows.clear();
    queued.clear();
    from_store.clear();
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && !LoaderHasWork()) loader_cv_.Wait(&mu_);
      if (stop_) return;
      auto claim = [&](uint64_t s, int64_t position) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        Slot& slot = cache_[s];
        slot.ticket = next_ticket_++;
        slot.position = position;
        cache_bytes_ += row_bytes_;
        if (auto p = pending_.find(s); p != pending_.end()) {
          queued.emplace_back(samples.size(), p->second);
        } else {
          from_store.push_back(samples.size());
        }
        samples.push_back(s);
        tickets.push_back(slot.ticket);
        rows.push_back(NewBufferLocked());
      };
      const int64_t untaken = untaken_begin();
      if (!late_.empty()) {
        // Deferred rows whose earlier occurrence has been put since.
        while (!late_.empty() && samples.size() < static_cast<size_t>(options_.micro_batch) &&
               cache_bytes_ + row_bytes_ <= options_.max_prefetch_bytes) {
          const auto [s, position] = late_.front();
          late_.pop_front();
          if (position < untaken) continue;  // consumed meanwhile
          auto c = cache_.find(s);
          if (c != cache_.end() && c->second.position == position) continue;  // loaded
          if (c != cache_.end() || MustDeferLocked(s, position)) {
            deferred_.try_emplace(s, position);  // blocked again: wait for the next put
            continue;
          }
          claim(s, position);
        }
      } else {
        // A whole hand-off (or what there is) for one store read.
        for (int64_t k = 0; k < handoff_batches_ && LoadableBatchesLocked() > 0; ++k) {
          const int64_t b = next_load_batch_++;
          const int64_t end = batch_end(b);
          for (int64_t i = batch_begin(b); i < end; ++i) {
            const uint64_t s = sample_at(i);
            auto c = cache_.find(s);
            // Loaded for this occurrence: a late load got here first.
            if (c != cache_.end() && c->second.position == i) continue;
            // Loaded for an earlier occurrence (a duplicate, or the same
            // sample late in the previous epoch): this one is deferred too.
            if (c != cache_.end() || MustDeferLocked(s, i)) {
              // Keep the earliest occurrence still ahead.
              auto [d, inserted] = deferred_.try_emplace(s, i);
              if (!inserted && d->second < untaken) d->second = i;
              ++stats_.deferred;
              continue;
            }
            claim(s, i);
          }
        }
      }
      if (!samples.empty()) ++stats_.loader_rounds;
    }
    if (samples.empty()) continue;
    for (auto& r : rows) SizeBuffer(r);
    reads.assign(samples.size(), RowRead());
    absl::Status status;
    if (!from_store.empty()) {
      std::vector<uint64_t> store_samples;
      spans.clear();
      for (size_t i : from_store) {
        store_samples.push_back(samples[i]);
        spans.emplace_back(absl::MakeSpan(rows[i]));
      }
      std::vector<RowRead> store_reads(from_store.size());
      status = store_->GetBatch(link, store_samples, spans, absl::MakeSpan(store_reads));
      for (size_t k = 0; k < from_store.size(); ++k) reads[from_store[k]] = std::move(store_reads[k]);
    }
    // 0: read from the store; 1: rounded from a queued put; 2: that put is
    // not finite (left to TakeBatch, which reports the error).
    std::vector<char> kind(samples.size(), 0);
    for (auto& [i, pending] : queued) {
      kind[i] = RoundAndChecksum(link, pending.item->rows[pending.index], absl::MakeSpan(rows[i]),
                                 &scratch, &reads[i].payload_checksum)
                        .ok()
                    ? 1
                    : 2;
      reads[i].status = absl::OkStatus();
    }
    absl::MutexLock lock(&mu_);
    stats_.loaded_from_queue += queued.size();
    for (size_t i = 0; i < samples.size(); ++i) {
      auto it = cache_.find(samples[i]);
      if (it == cache_.end() || it->second.ticket != tickets[i]) {
        ++stats_.prefetch_discarded;  // overtaken by a put or a new order
        RecycleLocked(std::move(rows[i]));
        continue;
      }
      if (kind[i] == 2) {
        EraseSlotLocked(samples[i]);
        RecycleLocked(std::move(rows[i]));
        continue;
      }
      Slot& slot = it->second;
      slot.ready = true;
      if (kind[i] == 1 || status.ok()) {
        slot.values = std::move(rows[i]);
        slot.read = std::move(reads[i]);
      } else {
        slot.read.status = status;
        RecycleLocked(std::move(rows[i]));
      }
      ++stats_.rows_prefetched;
    }
    consumer_cv_.SignalAll();
  }
}

absl::Status Prefetcher::GetBatch(absl::Span<const uint64_t> samples,
                                  absl::Span<const absl::Span<float>> out,
                                  absl::Span<RowRead> reads) {
  if (absl::Status s = ValidateGetArgs(options_.link, samples, out, reads); !s.ok()) return s;
  std::vector<std::vector<float>> rows;
  if (absl::Status s = TakeBatch(samples, &rows, reads); !s.ok()) return s;
  for (size_t i = 0; i < samples.size(); ++i) {
    if (reads[i].status.ok()) std::memcpy(out[i].data(), rows[i].data(), row_bytes_);
  }
  absl::MutexLock lock(&mu_);
  for (auto& r : rows) RecycleLocked(std::move(r));
  return absl::OkStatus();
}

absl::Status Prefetcher::TakeBatch(absl::Span<const uint64_t> samples,
                                   std::vector<std::vector<float>>* rows,
                                   absl::Span<RowRead> reads) {
  const LinkSpec& link = options_.link;
  if (reads.size() != samples.size()) {
    return absl::InvalidArgumentError("TakeBatch: reads.size() != samples.size()");
  }
  rows->resize(samples.size());
  uint64_t blocked_nanos = 0;
  bool inline_reads = false;
  std::vector<size_t> misses;
  std::vector<std::pair<size_t, Pending>> from_queue;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::FailedPreconditionError("Prefetcher is closed");
    if (!write_error_.ok()) return write_error_;
    const int64_t from = (consumer_batch_ >= first_batch() && consumer_batch_ < num_batches())
                             ? batch_begin(consumer_batch_)
                             : order_base_;
    int64_t last_batch = -1;
    for (size_t i = 0; i < samples.size(); ++i) {
      last_batch = std::max(last_batch, BatchOfLocked(samples[i], from));
    }
    AdvanceConsumerLocked(last_batch);
    for (size_t i = 0; i < samples.size(); ++i) {
      const uint64_t s = samples[i];
      held_.insert(s);
      while (true) {
        // A slot always holds the value of the latest put (a put erases the
        // sample's slot; a slot created after the put rounds it or reads it).
        auto c = cache_.find(s);
        if (c != cache_.end() && c->second.ready) {
          Slot& slot = c->second;
          reads[i] = std::move(slot.read);
          (*rows)[i] = reads[i].status.ok() ? std::move(slot.values) : NewBufferLocked();
          EraseSlotLocked(s);
          ++stats_.hits;
          break;
        }
        const bool in_flight = c != cache_.end();
        if (!in_flight) {
          if (auto p = pending_.find(s); p != pending_.end()) {
            from_queue.emplace_back(i, p->second);
            (*rows)[i] = NewBufferLocked();
            ++stats_.hits;
            break;
          }
          misses.push_back(i);
          (*rows)[i] = NewBufferLocked();
          break;
        }
        // In flight: wait for the loader, then look again (a put may have
        // replaced it meanwhile).
        if (stop_) return absl::FailedPreconditionError("Prefetcher is closed");
        ++stats_.waits;
        const auto w0 = Clock::now();
        consumer_cv_.Wait(&mu_);
        blocked_nanos += NanosSince(w0);
      }
    }
    WakeLoadersLocked();  // slots were freed
    inline_reads = inline_reads_;
  }
  for (auto& r : *rows) SizeBuffer(r);
  std::string scratch;
  for (auto& [i, pending] : from_queue) {
    reads[i].status = absl::OkStatus();
    if (absl::Status s = RoundAndChecksum(link, pending.item->rows[pending.index],
                                          absl::MakeSpan((*rows)[i]), &scratch,
                                          &reads[i].payload_checksum);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TakeBatch: sample ", samples[i], " was put with a non-finite value (", s.message(),
          "); its write-behind fails too"));
    }
  }
  // Reads the rows of `misses` and leaves in it those still to read: none
  // after GetBatch; after GetBatchFromMemory, the rows not in memory.
  auto read = [&](bool memory_only) -> absl::Status {
    std::vector<uint64_t> miss_samples;
    std::vector<absl::Span<float>> miss_out;
    std::vector<RowRead> miss_reads(misses.size());
    for (size_t i : misses) {
      miss_samples.push_back(samples[i]);
      miss_out.push_back(absl::MakeSpan((*rows)[i]));
    }
    absl::Status s = memory_only
                         ? store_->GetBatchFromMemory(link, miss_samples, miss_out, absl::MakeSpan(miss_reads))
                         : store_->GetBatch(link, miss_samples, miss_out, absl::MakeSpan(miss_reads));
    if (!s.ok()) return s;
    size_t left = 0;
    for (size_t k = 0; k < misses.size(); ++k) {
      if (memory_only && absl::IsUnavailable(miss_reads[k].status)) {
        misses[left++] = misses[k];
      } else {
        reads[misses[k]] = std::move(miss_reads[k]);
      }
    }
    misses.resize(left);
    return absl::OkStatus();
  };
  const size_t missed = misses.size();
  // First from the store's memory on this thread (Options::inline_read_bytes).
  if (inline_reads && !misses.empty()) {
    if (absl::Status s = read(/*memory_only=*/true); !s.ok()) return s;
  }
  const size_t read_inline = missed - misses.size();
  const size_t not_in_memory = inline_reads ? misses.size() : 0;
  if (!misses.empty()) {
    const auto m0 = Clock::now();
    if (absl::Status s = read(/*memory_only=*/false); !s.ok()) return s;
    blocked_nanos += NanosSince(m0);
  }
  absl::MutexLock lock(&mu_);
  stats_.get_stall_nanos += blocked_nanos;
  stats_.hits += read_inline;
  stats_.misses += missed - read_inline;
  stats_.rows_read_inline += read_inline;
  if (not_in_memory > 0 && inline_reads_) {
    // Rows on disk: prefetch them from here on (until the next SetOrder).
    stats_.inline_read_fallbacks += not_in_memory;
    inline_reads_ = false;
    WakeLoadersLocked();
  }
  return absl::OkStatus();
}

absl::Status Prefetcher::PutBatch(absl::Span<const uint64_t> samples,
                                  absl::Span<const absl::Span<const float>> values) {
  if (absl::Status s = ValidatePutArgs(options_.link, samples, values); !s.ok()) return s;
  if (samples.empty()) return absl::OkStatus();
  auto item = std::make_shared<WriteItem>();
  item->samples.assign(samples.begin(), samples.end());
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < values.size(); ++i) item->rows.push_back(NewBufferLocked());
  }
  for (size_t i = 0; i < values.size(); ++i) {
    SizeBuffer(item->rows[i]);
    std::memcpy(item->rows[i].data(), values[i].data(), row_bytes_);
  }
  return Enqueue(std::move(item));
}

absl::Status Prefetcher::PutBatch(absl::Span<const uint64_t> samples,
                                  std::vector<std::vector<float>> rows) {
  std::vector<absl::Span<const float>> spans(rows.begin(), rows.end());
  if (absl::Status s = ValidatePutArgs(options_.link, samples, spans); !s.ok()) return s;
  if (samples.empty()) return absl::OkStatus();
  auto item = std::make_shared<WriteItem>();
  item->samples.assign(samples.begin(), samples.end());
  item->rows = std::move(rows);
  return Enqueue(std::move(item));
}

absl::Status Prefetcher::Enqueue(std::shared_ptr<WriteItem> item) {
  item->bytes = item->samples.size() * row_bytes_;
  absl::MutexLock lock(&mu_);
  const auto t0 = Clock::now();
  bool blocked = false;
  while (!closed_ && write_error_.ok() && write_bytes_ > 0 &&
         write_bytes_ + item->bytes > options_.max_write_behind_bytes) {
    if (!blocked) ++drain_waiters_;  // the writer must not wait for a full hand-off
    blocked = true;
    writer_cv_.Signal();
    consumer_cv_.Wait(&mu_);
  }
  if (blocked) {
    --drain_waiters_;
    stats_.put_stall_nanos += NanosSince(t0);
  }
  if (closed_) return absl::FailedPreconditionError("Prefetcher is closed");
  if (!write_error_.ok()) return write_error_;
  if (item->bytes <= options_.inline_write_bytes && queue_.empty() && !inline_writing_) {
    return WriteInlineLocked(*item);
  }
  item->seq = next_write_seq_++;
  std::shared_ptr<const WriteItem> shared = std::move(item);
  const int64_t untaken = untaken_begin();
  for (size_t i = 0; i < shared->samples.size(); ++i) {
    pending_[shared->samples[i]] = Pending{shared, i};
    NotePutLocked(shared->samples[i], untaken);
  }
  write_bytes_ += shared->bytes;
  auto queued = std::make_unique<QueuedWrite>();
  queued->item = std::move(shared);
  queue_.push_back(std::move(queued));
  if (WriterHasWorkLocked()) writer_cv_.Signal();
  // Small writes never wake an encode thread (NextToEncodeLocked skips them).
  if (options_.encode_threads > 0 && NextToEncodeLocked() != nullptr) encoder_cv_.Signal();
  // Freed slots or released deferred rows may have given the loaders work.
  WakeLoadersLocked();
  return absl::OkStatus();
}

void Prefetcher::NotePutLocked(uint64_t sample, int64_t untaken) {
  EraseSlotLocked(sample);  // a prefetched (or in-flight) old row is now stale
  held_.erase(sample);
  // A later occurrence the loaders skipped for this put can load now.
  if (auto d = deferred_.find(sample); d != deferred_.end()) {
    if (d->second < untaken) {
      deferred_.erase(d);
    } else if (!MustDeferLocked(sample, d->second)) {
      late_.emplace_back(sample, d->second);
      deferred_.erase(d);
    }
  }
}

absl::Status Prefetcher::WriteInlineLocked(WriteItem& item) {
  // While the store is written without mu_, the samples stay held (their
  // later occurrences are not loaded) and a load of them claimed before is
  // discarded by NotePutLocked below, so no slot can hold the old row.
  inline_writing_ = true;
  const auto t0 = Clock::now();
  mu_.Unlock();
  absl::Status status = [&] {
    auto put = Encode(item);
    return put.ok() ? store_->CommitPut(std::move(put).value()) : put.status();
  }();
  mu_.Lock();
  inline_writing_ = false;
  stats_.inline_write_nanos += NanosSince(t0);
  const int64_t untaken = untaken_begin();
  for (uint64_t s : item.samples) NotePutLocked(s, untaken);
  for (auto& row : item.rows) RecycleLocked(std::move(row));
  if (status.ok()) {
    stats_.rows_written += item.samples.size();
    stats_.rows_written_inline += item.samples.size();
  } else if (write_error_.ok()) {
    write_error_ = absl::Status(status.code(), absl::StrCat("prefetcher write failed: ", status.message()));
  }
  if (WriterHasWorkLocked()) writer_cv_.Signal();  // puts queued meanwhile
  consumer_cv_.SignalAll();                        // a Flush may be waiting
  WakeLoadersLocked();
  return write_error_;
}

absl::StatusOr<std::unique_ptr<MessageStore::EncodedPut>> Prefetcher::Encode(
    const WriteItem& item) const {
  std::vector<absl::Span<const float>> rows(item.rows.begin(), item.rows.end());
  return store_->EncodePut(options_.link, item.samples, rows);
}

Prefetcher::QueuedWrite* Prefetcher::NextToEncodeLocked() const {
  // Encoded-but-unwritten batches hold their encoded rows: keep at most one
  // per encoding thread (and the writer's) ahead of the store.
  if (claimed_ >= queue_.size() || claimed_ > static_cast<size_t>(options_.encode_threads)) {
    return nullptr;
  }
  QueuedWrite* w = queue_[claimed_].get();
  return w->item->bytes >= options_.min_encode_ahead_bytes ? w : nullptr;
}

void Prefetcher::EncoderLoop() {
  pthread_setname_np(pthread_self(), "aqs-encode");
  while (true) {
    QueuedWrite* w = nullptr;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && (w = NextToEncodeLocked()) == nullptr) encoder_cv_.Wait(&mu_);
      if (stop_) return;
      ++claimed_;  // `w` stays in the queue until encoded (the writer waits for it)
    }
    auto put = Encode(*w->item);
    absl::MutexLock lock(&mu_);
    w->put = std::move(put);
    w->encoded = true;
    ++stats_.batches_encoded_ahead;
    writer_cv_.Signal();
  }
}

void Prefetcher::WriterLoop() {
  pthread_setname_np(pthread_self(), "aqs-writeback");
  while (true) {
    QueuedWrite* front = nullptr;
    QueuedWrite* todo = nullptr;  // claimed here: encode it, then look again
    {
      absl::MutexLock lock(&mu_);
      while (true) {
        while (!stop_ && !WriterHasWorkLocked()) writer_cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stop_ and drained
        if (!writer_draining_) ++stats_.writer_rounds;
        writer_draining_ = true;  // until the queue is empty
        front = queue_.front().get();
        if (front->encoded) break;
        // Nobody encodes the front: do it here. Else an encode thread has
        // it: encode the next one meanwhile, if the lookahead allows.
        todo = claimed_ == 0 ? front : NextToEncodeLocked();
        if (todo != nullptr) {
          ++claimed_;
          break;
        }
        writer_cv_.Wait(&mu_);
      }
    }
    if (todo != nullptr) {
      auto put = Encode(*todo->item);
      absl::MutexLock lock(&mu_);
      todo->put = std::move(put);
      todo->encoded = true;
      continue;
    }
    // One batch per store write: its bytes are released (and a consumer
    // blocked on back-pressure resumes) as soon as it is in the store,
    // instead of in bursts after a large coalesced write.
    absl::Status status =
        front->put.ok() ? store_->CommitPut(std::move(front->put).value()) : front->put.status();
    absl::MutexLock lock(&mu_);
    std::unique_ptr<QueuedWrite> done = std::move(queue_.front());
    queue_.pop_front();
    --claimed_;
    if (queue_.empty()) writer_draining_ = false;
    const std::shared_ptr<const WriteItem>& it = done->item;
    write_bytes_ -= it->bytes;
    for (size_t i = 0; i < it->samples.size(); ++i) {
      auto p = pending_.find(it->samples[i]);
      // A later put of the same sample stays pending.
      if (p != pending_.end() && p->second.item.get() == it.get()) pending_.erase(p);
    }
    // Nobody else can reach the item now (readers copy Pending under mu_):
    // if we hold the last reference, recycle its buffers.
    if (it.use_count() == 1) {
      for (auto& row : std::const_pointer_cast<WriteItem>(it)->rows) RecycleLocked(std::move(row));
    }
    if (status.ok()) {
      stats_.rows_written += it->samples.size();
    } else if (write_error_.ok()) {
      write_error_ = absl::Status(status.code(),
                                  absl::StrCat("prefetcher write-behind failed: ", status.message()));
    }
    // The lookahead moved. (Small writes wake no encode thread.)
    if (options_.encode_threads > 0 && NextToEncodeLocked() != nullptr) encoder_cv_.Signal();
    consumer_cv_.SignalAll();
  }
}

bool Prefetcher::WriterHasWorkLocked() const {
  return !queue_.empty() && !inline_writing_ &&
         (writer_draining_ || write_bytes_ >= handoff_bytes_ || drain_waiters_ > 0 || stop_);
}

void Prefetcher::DrainLocked() {
  ++drain_waiters_;
  writer_cv_.Signal();
  while (!queue_.empty() || inline_writing_) consumer_cv_.Wait(&mu_);
  --drain_waiters_;
}

absl::Status Prefetcher::Flush() {
  absl::MutexLock lock(&mu_);
  DrainLocked();
  return write_error_;
}

absl::Status Prefetcher::Close() {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return write_error_;
    DrainLocked();
    status = write_error_;
    closed_ = true;
    stop_ = true;
    loader_cv_.SignalAll();
    writer_cv_.SignalAll();
    encoder_cv_.SignalAll();
    consumer_cv_.SignalAll();
  }
  for (std::thread& t : loaders_) t.join();
  writer_.join();
  for (std::thread& t : encoders_) t.join();
  absl::MutexLock lock(&mu_);
  cache_.clear();
  cache_bytes_ = 0;
  return status;
}

PrefetcherStats Prefetcher::GetStats() const {
  absl::MutexLock lock(&mu_);
  PrefetcherStats s = stats_;
  s.prefetched_bytes = cache_bytes_;
  s.write_behind_bytes = write_bytes_;
  return s;
}

}  // namespace aqswarm::storage
