// `aqswarm bench store`: the per-sample message store under the AQ-SGD access
// pattern (epoch-permutation order, get + put per sample, micro-batches),
// RocksDB vs in-memory vs a plain sequential file baseline, in the same run.
//
// Per shape (fp16 rows):
//   populate   write every sample once (epoch 0), then reopen the store and
//              drop our files from the page cache (posix_fadvise DONTNEED), so
//              later epochs read from disk, not RAM.
//   direct     one epoch of GetBatch + PutBatch per micro-batch on the store,
//              synchronously: the I/O time per micro-batch.
//   prefetch   the same through the Prefetcher, no compute: throughput.
//   hidden_io  through the Prefetcher with a simulated compute time per
//              micro-batch (sleep: the GPU works, the CPU is free) equal to
//              1x and 2x the direct I/O time, for kHiddenEpochs epochs back to
//              back, as a trainer runs them: each epoch's permutation is
//              appended (Prefetcher::AppendOrder) when the previous epoch
//              starts, so the loaders run on across the epoch boundary (the
//              first epoch still starts cold, with an empty window, and the
//              run ends with the final flush). stall_fraction = time blocked
//              in TakeBatch/PutBatch and the final flush / total time of all
//              epochs; stall_by_epoch splits it (the final flush counted in
//              the last epoch; the first epoch's value is the old
//              single-epoch measurement, which started cold every epoch).
//              The I/O time is the honest one: the `direct` epoch's wall time
//              per micro-batch on the same backend, same shape, same run (a
//              single thread doing get + put synchronously, with RocksDB's own
//              background threads running beside it as they would anyway).
//              Compute is a sleep, not a busy-spin: on a GPU stage the kernels
//              run on the device and the host thread mostly waits, so the
//              loader/writer/RocksDB threads get the CPU cores. On this
//              project's 2-core machines a spinning consumer would take one of
//              the two cores the direct run's I/O was measured with, so a spin
//              at "1x" would measure CPU starvation, not I/O hiding. The
//              consumer touches one value per row (row[0] += 1), i.e. it
//              does not pull the rows into its cache the way a real update of
//              every value would; the store's per-put finiteness check then
//              reads rows cold (a slight pessimism for the prefetcher).
// file_seq: read a micro-batch of raw row bytes sequentially from one file,
// write it sequentially to another (no codec, no checksum): the disk's pace.
//
// mb_per_s counts payload bytes moved (get + put); p99_get_us is per
// micro-batch GetBatch call (p99_put_us, max_*_us likewise). Prefetcher runs
// also report its counters: misses (rows read synchronously), waits (for an
// in-flight load), deferred / loaded_from_queue (next-epoch occurrences held
// back until their previous put, then rounded from the queued put),
// encoded_ahead (queued batches encoded by the encode thread), get wait
// and put back-pressure seconds. Each epoch uses a fresh permutation.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/file_util.h"
#include "common/random.h"
#include "common/row_format.h"
#include "storage/memory_message_store.h"
#include "storage/prefetcher.h"
#include "storage/rocksdb_message_store.h"

namespace aqswarm::bench {
namespace {

using Clock = std::chrono::steady_clock;
using storage::LinkSpec;
using storage::MessageStore;
using storage::RowRead;

// Shapes without an explicit ":SAMPLES" get at most this many row bytes per
// workload, so the default run takes minutes, not hours (1024x1600 fp16 is
// 3.3 MB a row; 10,000 of them are 33 GB per pass).
constexpr uint64_t kDefaultMaxBytesPerShape = 2ull << 30;

// Epochs per hidden-I/O run.
constexpr int kHiddenEpochs = 3;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Shape {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t samples = 0;
  int64_t requested = 0;  // before the byte cap
};

absl::StatusOr<std::vector<Shape>> ParseShapes(const std::string& spec, int64_t samples) {
  std::vector<Shape> out;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::vector<std::string> count = absl::StrSplit(part, ':');
    Shape s;
    if (!ParseRowShape(count[0], &s.rows, &s.cols) || count.size() > 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad shape '", std::string(part), "' (want ROWSxCOLS[:SAMPLES])"));
    }
    const uint64_t row_bytes = EncodedRowBytes(RowPrecision::kFloat16, s.rows, s.cols);
    if (count.size() == 2) {
      if (!absl::SimpleAtoi(count[1], &s.samples) || s.samples <= 0) {
        return absl::InvalidArgumentError(absl::StrCat("bad sample count in '", std::string(part), "'"));
      }
      s.requested = s.samples;
    } else {
      s.requested = samples;
      s.samples = std::min<int64_t>(
          samples, std::max<int64_t>(1, kDefaultMaxBytesPerShape / row_bytes));
    }
    out.push_back(s);
  }
  if (out.empty()) return absl::InvalidArgumentError("no shapes");
  return out;
}

std::vector<uint64_t> Permutation(int64_t n, uint64_t seed) {
  std::vector<uint64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  Rng rng(seed);
  for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.Uniform(i + 1)]);
  return order;
}

// Evicts a file's clean pages from the page cache.
void DropFromPageCache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void DropDirFromPageCache(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.is_regular_file()) DropFromPageCache(e.path().string());
  }
}

uint64_t DirBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.is_regular_file()) total += e.file_size();
  }
  return total;
}

struct Row {
  std::string backend;
  std::string mode;
  Shape shape;
  uint64_t row_bytes = 0;
  int64_t micro_batch = 0;
  int64_t prefetch_batches = 0;
  int epochs = 1;
  double seconds = 0;
  std::vector<double> get_us;
  std::vector<double> put_us;
  uint64_t found = 0;
  double compute_us = -1;
  double io_us_per_batch = -1;
  double stall_fraction = -1;
  // Parts of the blocked time (seconds): in gets, in puts, in the final flush.
  double blocked_get_s = 0, blocked_put_s = 0, blocked_flush_s = 0;
  std::vector<double> stall_by_epoch;
  bool prefetched = false;
  storage::PrefetcherStats prefetch_stats;
  uint64_t disk_bytes = 0;
  bool moves_reads = true;  // populate only writes

  double rows_per_s() const { return epochs * shape.samples / seconds; }
  double mb_per_s() const {
    return (moves_reads ? 2.0 : 1.0) * row_bytes * epochs * shape.samples / seconds / 1e6;
  }
};

void Print(const Row& r, bool json, std::ostream& out) {
  const std::string shape = absl::StrCat(r.shape.rows, "x", r.shape.cols);
  if (json) {
    std::ostringstream o;
    o << std::fixed << std::setprecision(1);
    o << "{\"bench\":\"store\",\"backend\":\"" << r.backend << "\",\"mode\":\"" << r.mode
      << "\",\"shape\":\"" << shape << "\",\"precision\":\"fp16\",\"samples\":" << r.shape.samples
      << ",\"samples_requested\":" << r.shape.requested << ",\"micro_batch\":" << r.micro_batch
      << ",\"prefetch_batches\":" << r.prefetch_batches << ",\"epochs\":" << r.epochs
      << ",\"row_bytes\":" << r.row_bytes
      << ",\"seconds\":" << std::setprecision(3) << r.seconds << std::setprecision(1)
      << ",\"rows_per_s\":" << r.rows_per_s() << ",\"mb_per_s\":" << r.mb_per_s()
      << ",\"p50_get_us\":" << Percentile(r.get_us, 0.5)
      << ",\"p99_get_us\":" << Percentile(r.get_us, 0.99);
    if (!r.put_us.empty()) {
      o << ",\"p99_put_us\":" << Percentile(r.put_us, 0.99)
        << ",\"max_put_us\":" << Percentile(r.put_us, 1.0)
        << ",\"max_get_us\":" << Percentile(r.get_us, 1.0);
    }
    o << ",\"found\":" << r.found;
    if (r.compute_us >= 0) o << ",\"compute_us\":" << r.compute_us;
    if (r.io_us_per_batch >= 0) o << ",\"io_us_per_batch\":" << r.io_us_per_batch;
    if (r.stall_fraction >= 0) {
      o << std::setprecision(4) << ",\"stall_fraction\":" << r.stall_fraction
        << ",\"stall_get_fraction\":" << r.blocked_get_s / r.seconds
        << ",\"stall_put_fraction\":" << r.blocked_put_s / r.seconds
        << ",\"stall_final_flush_fraction\":" << r.blocked_flush_s / r.seconds
        << ",\"stall_by_epoch\":[";
      for (size_t e = 0; e < r.stall_by_epoch.size(); ++e) {
        o << (e > 0 ? "," : "") << r.stall_by_epoch[e];
      }
      o << "]" << std::setprecision(1);
    }
    if (r.prefetched) {
      const storage::PrefetcherStats& p = r.prefetch_stats;
      o << ",\"prefetch_misses\":" << p.misses << ",\"prefetch_waits\":" << p.waits
        << ",\"prefetch_deferred\":" << p.deferred
        << ",\"prefetch_loaded_from_queue\":" << p.loaded_from_queue
        << ",\"prefetch_encoded_ahead\":" << p.batches_encoded_ahead << std::setprecision(4)
        << ",\"prefetch_get_wait_s\":" << p.get_stall_nanos * 1e-9
        << ",\"prefetch_put_backpressure_s\":" << p.put_stall_nanos * 1e-9 << std::setprecision(1);
    }
    if (r.disk_bytes > 0) o << ",\"disk_bytes\":" << r.disk_bytes;
    o << ",\"page_cache\":\"dropped before each epoch\"}";
    out << o.str() << "\n";
    return;
  }
  out << std::left << std::setw(10) << shape << std::right << std::setw(7) << r.shape.samples
      << "  " << std::left << std::setw(9) << r.backend << std::setw(10) << r.mode << std::right
      << std::fixed << std::setprecision(0) << std::setw(10) << r.rows_per_s() << std::setw(9)
      << r.mb_per_s() << std::setw(11) << Percentile(r.get_us, 0.5) << std::setw(11)
      << Percentile(r.get_us, 0.99);
  if (r.compute_us >= 0) {
    out << std::setw(11) << r.compute_us << std::setprecision(2) << std::setw(9)
        << 100.0 * r.stall_fraction << "%";
  }
  out << "\n";
}

void PrintHeader(std::ostream& out) {
  out << std::left << std::setw(10) << "shape" << std::right << std::setw(7) << "samples"
      << "  " << std::left << std::setw(9) << "backend" << std::setw(10) << "mode" << std::right
      << std::setw(10) << "rows/s" << std::setw(9) << "MB/s" << std::setw(11) << "p50get_us"
      << std::setw(11) << "p99get_us" << std::setw(11) << "compute_us" << std::setw(10)
      << "stall" << "\n";
}

// One store backend, reopenable (RocksDB: close + open + drop page cache).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual MessageStore* store() = 0;
  virtual absl::Status Reopen() = 0;
  virtual uint64_t disk_bytes() { return 0; }
};

class MemoryBackend : public Backend {
 public:
  absl::Status Init() {
    auto s = storage::MemoryMessageStore::Create({});
    if (!s.ok()) return s.status();
    store_ = std::move(s).value();
    return absl::OkStatus();
  }
  MessageStore* store() override { return store_.get(); }
  absl::Status Reopen() override { return absl::OkStatus(); }

 private:
  std::unique_ptr<storage::MemoryMessageStore> store_;
};

class RocksDbBackend : public Backend {
 public:
  explicit RocksDbBackend(std::string path) { options_.path = std::move(path); }
  absl::Status Init() {
    auto s = storage::RocksDbMessageStore::Open(options_);
    if (!s.ok()) return s.status();
    store_ = std::move(s).value();
    return absl::OkStatus();
  }
  MessageStore* store() override { return store_.get(); }
  absl::Status Reopen() override {
    if (absl::Status s = store_->Close(); !s.ok()) return s;
    store_.reset();
    DropDirFromPageCache(options_.path);
    return Init();
  }
  uint64_t disk_bytes() override { return DirBytes(options_.path); }

 private:
  storage::RocksDbMessageStore::Options options_;
  std::unique_ptr<storage::RocksDbMessageStore> store_;
};

struct EpochConfig {
  int64_t micro_batch = 8;
  int64_t prefetch_batches = 4;
  bool use_prefetcher = false;
  double compute_us = 0;  // simulated compute per micro-batch
};

// Epochs of get + put, one per order, through one prefetcher (if any: each
// order after the first is appended when the epoch before it starts). Puts
// m + 1 in the first element (a new version of the row), like an AQ-SGD
// update.
absl::StatusOr<Row> RunEpochs(MessageStore* store, const LinkSpec& link,
                              const std::vector<std::vector<uint64_t>>& orders,
                              const EpochConfig& config) {
  const int64_t mb = config.micro_batch;
  const uint64_t batch_bytes = mb * link.num_values() * sizeof(float);
  std::unique_ptr<storage::Prefetcher> prefetcher;
  if (config.use_prefetcher) {
    storage::Prefetcher::Options o;
    o.link = link;
    o.micro_batch = mb;
    o.prefetch_batches = config.prefetch_batches;
    o.max_prefetch_bytes = (config.prefetch_batches + 1) * batch_bytes;
    // Write-behind: the default bound (256 MiB), at least two micro-batches.
    o.max_write_behind_bytes = std::max<uint64_t>(o.max_write_behind_bytes, 2 * batch_bytes);
    auto p = storage::Prefetcher::Create(store, o);
    if (!p.ok()) return p.status();
    prefetcher = std::move(p).value();
    if (absl::Status s = prefetcher->SetOrder(orders[0]); !s.ok()) return s;
  }
  std::vector<std::vector<float>> rows(mb, std::vector<float>(link.num_values()));
  std::vector<absl::Span<float>> out;
  std::vector<absl::Span<const float>> in;
  for (auto& r : rows) {
    out.emplace_back(absl::MakeSpan(r));
    in.emplace_back(r);
  }
  std::vector<RowRead> reads(mb);
  std::vector<std::vector<float>> owned;  // prefetcher: zero-copy Take/Put
  Row result;
  result.found = 0;
  result.epochs = static_cast<int>(orders.size());
  double blocked = 0;
  const auto start = Clock::now();
  for (size_t e = 0; e < orders.size(); ++e) {
    const std::vector<uint64_t>& order = orders[e];
    const auto epoch_start = Clock::now();
    double epoch_blocked = 0;
    if (prefetcher && e + 1 < orders.size()) {
      if (absl::Status s = prefetcher->AppendOrder(orders[e + 1]); !s.ok()) return s;
    }
    for (size_t begin = 0; begin < order.size(); begin += mb) {
      const size_t n = std::min<size_t>(mb, order.size() - begin);
      absl::Span<const uint64_t> samples(order.data() + begin, n);
      const auto t0 = Clock::now();
      absl::Status s = prefetcher ? prefetcher->TakeBatch(samples, &owned,
                                                          absl::MakeSpan(reads.data(), n))
                                  : store->GetBatch(link, samples, absl::MakeSpan(out.data(), n),
                                                    absl::MakeSpan(reads.data(), n));
      const auto t1 = Clock::now();
      if (!s.ok()) return s;
      for (size_t i = 0; i < n; ++i) {
        std::vector<float>& row = prefetcher ? owned[i] : rows[i];
        if (reads[i].status.ok()) ++result.found;
        row[0] += 1.0f;  // the update m(xi) += D(c), in place
      }
      if (config.compute_us > 0) {
        std::this_thread::sleep_until(
            t1 + std::chrono::nanoseconds(static_cast<int64_t>(config.compute_us * 1e3)));
      }
      const auto t2 = Clock::now();
      s = prefetcher ? prefetcher->PutBatch(samples, std::move(owned))
                     : store->PutBatch(link, samples, absl::MakeSpan(in.data(), n));
      owned.clear();
      const auto t3 = Clock::now();
      if (!s.ok()) return s;
      result.get_us.push_back(Seconds(t1 - t0) * 1e6);
      result.put_us.push_back(Seconds(t3 - t2) * 1e6);
      result.blocked_get_s += Seconds(t1 - t0);
      result.blocked_put_s += Seconds(t3 - t2);
      epoch_blocked += Seconds(t1 - t0) + Seconds(t3 - t2);
    }
    if (prefetcher && e + 1 == orders.size()) {
      const auto f0 = Clock::now();
      if (absl::Status s = prefetcher->Close(); !s.ok()) return s;
      result.blocked_flush_s = Seconds(Clock::now() - f0);
      result.prefetched = true;
      result.prefetch_stats = prefetcher->GetStats();
      epoch_blocked += result.blocked_flush_s;
    }
    blocked += epoch_blocked;
    result.stall_by_epoch.push_back(epoch_blocked / Seconds(Clock::now() - epoch_start));
  }
  result.seconds = Seconds(Clock::now() - start);
  result.stall_fraction = blocked / result.seconds;
  return result;
}

absl::Status Populate(MessageStore* store, const LinkSpec& link, int64_t samples, int64_t mb,
                      Row* row) {
  // A few random rows, reused with a per-sample first element.
  std::vector<std::vector<float>> pool(mb, std::vector<float>(link.num_values()));
  Rng rng(42);
  for (auto& r : pool) {
    for (float& x : r) x = static_cast<float>(rng.UnitDouble() * 4.0 - 2.0);
  }
  std::vector<absl::Span<const float>> in;
  for (auto& r : pool) in.emplace_back(r);
  const auto start = Clock::now();
  std::vector<uint64_t> ids;
  for (int64_t begin = 0; begin < samples; begin += mb) {
    const int64_t n = std::min<int64_t>(mb, samples - begin);
    ids.clear();
    for (int64_t i = 0; i < n; ++i) {
      ids.push_back(begin + i);
      pool[i][0] = static_cast<float>(begin + i);
    }
    if (absl::Status s = store->PutBatch(link, ids, absl::MakeSpan(in.data(), n)); !s.ok()) {
      return s;
    }
  }
  row->seconds = Seconds(Clock::now() - start);
  row->moves_reads = false;
  return absl::OkStatus();
}

// Sequential raw-bytes baseline: read a micro-batch from file A, write it to
// file B, in file order.
absl::StatusOr<Row> RunFileBaseline(const std::string& dir, uint64_t row_bytes, int64_t samples,
                                    int64_t mb) {
  const std::string a = dir + "/baseline_a.bin", b = dir + "/baseline_b.bin";
  std::string buf(mb * row_bytes, '\0');
  Rng rng(7);
  for (size_t i = 0; i < buf.size(); i += 8) {
    const uint64_t v = rng.Next();
    std::memcpy(&buf[i], &v, std::min<size_t>(8, buf.size() - i));
  }
  {
    int fd = ::open(a.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", a));
    for (int64_t begin = 0; begin < samples; begin += mb) {
      const size_t n = std::min<int64_t>(mb, samples - begin) * row_bytes;
      if (::write(fd, buf.data(), n) != static_cast<ssize_t>(n)) {
        ::close(fd);
        return absl::InternalError(absl::StrCat("write ", a, " failed"));
      }
    }
    ::fsync(fd);
    ::close(fd);
    DropFromPageCache(a);
  }
  int in = ::open(a.c_str(), O_RDONLY);
  int out = ::open(b.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (in < 0 || out < 0) return absl::InternalError("cannot open baseline files");
  Row row;
  const auto start = Clock::now();
  for (int64_t begin = 0; begin < samples; begin += mb) {
    const size_t n = std::min<int64_t>(mb, samples - begin) * row_bytes;
    const auto t0 = Clock::now();
    if (::pread(in, buf.data(), n, begin * row_bytes) != static_cast<ssize_t>(n)) {
      return absl::InternalError("baseline read failed");
    }
    row.get_us.push_back(Seconds(Clock::now() - t0) * 1e6);
    if (::pwrite(out, buf.data(), n, begin * row_bytes) != static_cast<ssize_t>(n)) {
      return absl::InternalError("baseline write failed");
    }
    row.found += n / row_bytes;
  }
  row.seconds = Seconds(Clock::now() - start);
  ::close(in);
  ::close(out);
  std::filesystem::remove(a);
  std::filesystem::remove(b);
  return row;
}

absl::StatusOr<std::vector<std::string>> ParseBackends(const std::string& spec) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    if (part != "file_seq" && part != "rocksdb" && part != "memory") {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad store backend '", std::string(part), "' (want file_seq, rocksdb or memory)"));
    }
    out.emplace_back(part);
  }
  if (out.empty()) return absl::InvalidArgumentError("no store backends");
  return out;
}

absl::Status RunShape(const Shape& shape, const std::vector<std::string>& backends,
                      const StoreBenchOptions& options, const std::string& dir, std::ostream& out) {
  LinkSpec link;
  link.link = {0, 0};
  link.generation = 1;
  link.rows = shape.rows;
  link.cols = shape.cols;
  link.precision = RowPrecision::kFloat16;
  const uint64_t row_bytes = link.payload_bytes();
  const int64_t mb = options.micro_batch;
  // The prefetch window: as given, or (0) as many micro-batches as
  // kAutoPrefetchBytes of fp32 rows hold, at least 4 (micro-batches of 8: 128x768 -> 85; 1024x1600 -> 5).
  const int64_t batch_floats = mb * static_cast<int64_t>(link.num_values());
  const int64_t window = options.prefetch_batches > 0
                             ? options.prefetch_batches
                             : std::max<int64_t>(4, kAutoPrefetchBytes / (batch_floats * int64_t{sizeof(float)}));
  auto fill = [&](Row& r, const char* backend, const char* mode) {
    r.backend = backend;
    r.mode = mode;
    r.shape = shape;
    r.row_bytes = row_bytes;
    r.micro_batch = mb;
    r.prefetch_batches = window;
  };

  for (const std::string& backend_name : backends) {
    const char* name = backend_name.c_str();
    if (backend_name == "file_seq") {
      auto base = RunFileBaseline(dir, row_bytes, shape.samples, mb);
      if (!base.ok()) return base.status();
      fill(*base, "file_seq", "direct");
      Print(*base, options.json, out);
      continue;
    }
    std::unique_ptr<Backend> backend;
    const std::string path = dir + "/rocksdb_" + std::to_string(shape.rows) + "x" +
                             std::to_string(shape.cols);
    if (std::string(name) == "rocksdb") {
      auto b = std::make_unique<RocksDbBackend>(path);
      if (absl::Status s = b->Init(); !s.ok()) return s;
      backend = std::move(b);
    } else {
      auto b = std::make_unique<MemoryBackend>();
      if (absl::Status s = b->Init(); !s.ok()) return s;
      backend = std::move(b);
    }
    Row pop;
    if (absl::Status s = Populate(backend->store(), link, shape.samples, mb, &pop); !s.ok()) {
      return s;
    }
    fill(pop, name, "populate");
    if (absl::Status s = backend->Reopen(); !s.ok()) return s;
    pop.disk_bytes = backend->disk_bytes();
    Print(pop, options.json, out);

    uint64_t seed = 1;
    EpochConfig config;
    config.micro_batch = mb;
    config.prefetch_batches = window;
    auto direct = RunEpochs(backend->store(), link, {Permutation(shape.samples, seed++)}, config);
    if (!direct.ok()) return direct.status();
    fill(*direct, name, "direct");
    direct->stall_fraction = -1;
    const double io_us =
        direct->seconds * 1e6 / ((shape.samples + mb - 1) / mb);  // per micro-batch
    if (absl::Status s = backend->Reopen(); !s.ok()) return s;
    direct->disk_bytes = backend->disk_bytes();  // after the epoch's overwrites
    Print(*direct, options.json, out);

    config.use_prefetcher = true;
    auto pre = RunEpochs(backend->store(), link, {Permutation(shape.samples, seed++)}, config);
    if (!pre.ok()) return pre.status();
    fill(*pre, name, "prefetch");
    pre->stall_fraction = -1;
    if (absl::Status s = backend->Reopen(); !s.ok()) return s;
    pre->disk_bytes = backend->disk_bytes();
    Print(*pre, options.json, out);

    for (double factor : {1.0, 2.0}) {
      config.compute_us = io_us * factor;
      std::vector<std::vector<uint64_t>> orders;
      for (int e = 0; e < kHiddenEpochs; ++e) orders.push_back(Permutation(shape.samples, seed++));
      auto hidden = RunEpochs(backend->store(), link, orders, config);
      if (!hidden.ok()) return hidden.status();
      fill(*hidden, name, factor == 1.0 ? "hidden_1x" : "hidden_2x");
      hidden->compute_us = config.compute_us;
      hidden->io_us_per_batch = io_us;
      if (absl::Status s = backend->Reopen(); !s.ok()) return s;
      hidden->disk_bytes = backend->disk_bytes();
      Print(*hidden, options.json, out);
    }
    const storage::MessageStoreStats stats = backend->store()->GetStats();
    if (stats.rows_corrupt != 0) {
      return absl::DataLossError(absl::StrCat(name, ": ", stats.rows_corrupt, " corrupt rows"));
    }
    if (absl::Status s = backend->store()->Close(); !s.ok()) return s;
    backend.reset();
    aqswarm::RemoveTree(path).IgnoreError();
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunStoreBench(const StoreBenchOptions& options, std::ostream& out) {
  if (options.samples <= 0 || options.micro_batch <= 0 || options.prefetch_batches < 0) {
    return absl::InvalidArgumentError("samples and micro_batch must be > 0, prefetch >= 0 (0 = auto)");
  }
  auto shapes = ParseShapes(options.shapes, options.samples);
  if (!shapes.ok()) return shapes.status();
  auto backends = ParseBackends(options.backends);
  if (!backends.ok()) return backends.status();
  absl::StatusOr<std::string> made = MakeTempDir(options.dir, "aqswarm_store_bench_");
  if (!made.ok()) return made.status();
  const std::string dir = *made;
  if (!options.json) {
    out << "store bench in " << dir << " (fp16 rows; page cache dropped before each epoch; "
        << "shapes without :SAMPLES capped at " << (kDefaultMaxBytesPerShape >> 20)
        << " MiB of rows)\n";
    PrintHeader(out);
  }
  absl::Status status;
  for (const Shape& shape : *shapes) {
    status = RunShape(shape, *backends, options, dir, out);
    if (!status.ok()) break;
  }
  aqswarm::RemoveTree(dir).IgnoreError();
  return status;
}

}  // namespace aqswarm::bench
