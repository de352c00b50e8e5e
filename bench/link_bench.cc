// `aqswarm bench link`: the CPU cost of one pipeline link's two ends per
// sample, AQ-SGD against DirectQ, with nothing else running: no model, no
// transport. What AQ-SGD adds over DirectQ (same quantizer, same bits, same
// bytes) is its per-sample state: at both ends, read m(xi) through the
// prefetcher, add the decoded delta, write m(xi) back behind. On a GPU stage
// that work runs on otherwise idle CPU cores; on a CPU-only machine it
// competes with the model, so its CPU per sample is what a CPU-bound cell of
// `bench slownet` loses (docs/METHODOLOGY.md, link endpoints; the comparison
// with the pipeline's cost: docs/notebook/slownet.md, AQ-SGD's extra CPU).
//
// One cell = a sender and a receiver (each with its own store, as the two
// processes of a link have) running `epochs` epochs of `samples` samples in
// micro-batches, a fresh permutation per epoch, as StageRunner drives them
// (StartEpoch at every epoch, Encode -> Begin/Apply/Take per micro-batch).
// Activations drift a little from epoch to epoch (a(xi) = base(xi) + 0.1
// noise(epoch, xi)), so AQ-SGD's deltas are realistic. Epoch 0 (FULL rows for
// AQ-SGD) is not timed. cpu_us_per_sample = process CPU time (every thread:
// prefetcher loaders and writer, RocksDB's background threads) / samples over
// the timed epochs; wall_us_per_sample likewise for wall time. Each cell runs
// `repeats` times and keeps its lowest CPU time (load only adds). Stores:
// resident (RocksDbMessageStore's defaults and the endpoints': an epoch this
// small keeps its rows resident in the endpoint, LinkEndpointOptions::
// resident_bytes, so the store is read once and written at Close; the rest
// stream every micro-batch through the prefetcher, resident_bytes = 0:)
// rocksdb (rows this small read on the endpoint's thread from the memtable,
// written behind), rocksdb_prefetch
// (the same with every row prefetched by the loader threads: the baseline of
// LinkEndpointOptions::inline_read_bytes), rocksdb_skiplist (RocksDB's
// default skip-list memtable: the baseline of the hash memtable choice),
// memory (MemoryMessageStore: what the prefetcher and the delta coding cost
// without any store). Row counts are the receiver's, over all
// epochs (epoch 0 included).
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/file_util.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "pipeline/link_endpoint.h"
#include "storage/memory_message_store.h"
#include "storage/rocksdb_message_store.h"

namespace aqswarm::bench {
namespace {

double ProcessCpuSeconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct Cell {
  std::string mode;   // directq | aqsgd
  std::string store;  // resident | rocksdb | rocksdb_prefetch | rocksdb_skiplist | memory ("-" for directq: no state)
};

struct Result {
  double cpu_us_per_sample = 0;
  double wall_us_per_sample = 0;
  uint64_t delta_rows = 0, full_rows = 0, direct_rows = 0, resend_rows = 0;
};

absl::StatusOr<std::unique_ptr<storage::MessageStore>> OpenStore(const std::string& kind,
                                                                const std::string& path) {
  if (kind == "memory") {
    AQSWARM_ASSIGN_OR_RETURN(auto s, storage::MemoryMessageStore::Create({}));
    return std::unique_ptr<storage::MessageStore>(std::move(s));
  }
  storage::RocksDbMessageStore::Options o;
  o.path = path;
  o.hash_memtable = kind != "rocksdb_skiplist";
  AQSWARM_ASSIGN_OR_RETURN(auto s, storage::RocksDbMessageStore::Open(o));
  return std::unique_ptr<storage::MessageStore>(std::move(s));
}

// The activations of every sample in one epoch: [samples, rows * cols].
void FillActs(const LinkBenchOptions& o, int64_t epoch, std::vector<float>* acts) {
  const int64_t n = o.rows * o.cols;
  acts->resize(o.samples * n);
  for (int64_t s = 0; s < o.samples; ++s) {
    const uint32_t base_key = StreamKey(o.seed, s);
    const uint32_t drift_key = StreamKey(o.seed + 1 + epoch, s);
    for (int64_t i = 0; i < n; ++i) {
      (*acts)[s * n + i] = 2 * DrawUnit(base_key, i) - 1 + 0.1f * (2 * DrawUnit(drift_key, i) - 1);
    }
  }
}

absl::StatusOr<Result> RunCell(const LinkBenchOptions& o, const Cell& cell, const std::string& dir) {
  pipeline::LinkEndpointOptions lo;
  lo.link.link = {0, 0};
  lo.link.generation = 1;
  lo.link.rows = o.rows;
  lo.link.cols = o.cols;
  lo.link.precision = RowPrecision::kFloat16;
  lo.codec.mode = cell.mode == "aqsgd" ? compression::LinkMode::kAqsgd : compression::LinkMode::kDirectQ;
  lo.codec.quantizer.codec = v1::CODEC_FIXED_POINT;
  lo.codec.quantizer.bits = o.fw_bits;
  lo.codec.quantizer.min_compress_elements = 1;
  lo.codec.stored = lo.link.precision;
  lo.micro_batch = o.micro_batch;
  if (cell.store == "rocksdb_prefetch") lo.inline_read_bytes = 0;
  if (cell.store != "resident") lo.resident_bytes = 0;

  std::unique_ptr<storage::MessageStore> send_store, recv_store;
  if (cell.mode == "aqsgd") {
    aqswarm::RemoveTree(dir).IgnoreError();
    AQSWARM_ASSIGN_OR_RETURN(send_store, OpenStore(cell.store, dir + "/sender"));
    AQSWARM_ASSIGN_OR_RETURN(recv_store, OpenStore(cell.store, dir + "/receiver"));
  }
  AQSWARM_ASSIGN_OR_RETURN(auto sender, pipeline::ActivationSender::Create(send_store.get(), lo));
  AQSWARM_ASSIGN_OR_RETURN(auto receiver, pipeline::ActivationReceiver::Create(recv_store.get(), lo));

  const int64_t n = o.rows * o.cols;
  std::vector<float> acts, mb_acts(o.micro_batch * n), taken;
  std::vector<uint64_t> order(o.samples), missing;
  std::iota(order.begin(), order.end(), 0);
  v1::ActivationBatch batch;
  std::vector<uint64_t> thrash(o.thrash_bytes / sizeof(uint64_t));
  double cpu = 0, wall = 0, thrash_cpu = 0, thrash_wall = 0;
  uint64_t step = 0;
  for (int64_t epoch = 0; epoch <= o.epochs; ++epoch) {
    FillActs(o, epoch, &acts);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(o.seed * 1000 + epoch));
    const double cpu0 = ProcessCpuSeconds();
    const auto wall0 = std::chrono::steady_clock::now();
    AQSWARM_RETURN_IF_ERROR(sender->StartEpoch(order));
    AQSWARM_RETURN_IF_ERROR(receiver->StartEpoch(order));
    for (int64_t first = 0; first + o.micro_batch <= o.samples; first += o.micro_batch, ++step) {
      absl::Span<const uint64_t> ids(order.data() + first, o.micro_batch);
      for (int64_t i = 0; i < o.micro_batch; ++i) {
        std::copy_n(acts.data() + ids[i] * n, n, mb_acts.data() + i * n);
      }
      AQSWARM_RETURN_IF_ERROR(sender->Encode(step, 0, epoch, ids, mb_acts, &batch));
      AQSWARM_RETURN_IF_ERROR(receiver->Begin(step, 0, ids));
      AQSWARM_RETURN_IF_ERROR(receiver->Apply(batch, &missing));
      if (!missing.empty()) {
        AQSWARM_RETURN_IF_ERROR(sender->EncodeResend(step, 0, epoch, ids, mb_acts, missing, &batch));
        AQSWARM_RETURN_IF_ERROR(receiver->Apply(batch, &missing));
        if (!missing.empty()) return absl::InternalError("link bench: rows still missing after a resend");
      }
      AQSWARM_RETURN_IF_ERROR(receiver->Take(&taken));
      if (!thrash.empty()) {  // the model's turn: other data through the caches
        const double t0 = ProcessCpuSeconds();
        const auto w0 = std::chrono::steady_clock::now();
        for (uint64_t& x : thrash) x = x * 6364136223846793005ull + step;
        if (epoch > 0) {
          thrash_cpu += ProcessCpuSeconds() - t0;
          thrash_wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
        }
      }
    }
    if (epoch == 0) continue;  // AQ-SGD's FULL epoch
    cpu += ProcessCpuSeconds() - cpu0;
    wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  }
  // Write-behind still queued at the end is part of the work.
  const double cpu0 = ProcessCpuSeconds();
  const auto wall0 = std::chrono::steady_clock::now();
  AQSWARM_RETURN_IF_ERROR(sender->Close());
  AQSWARM_RETURN_IF_ERROR(receiver->Close());
  cpu += ProcessCpuSeconds() - cpu0;
  wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  cpu -= thrash_cpu;
  wall -= thrash_wall;
  Result r;
  const double samples = static_cast<double>(o.epochs * (o.samples / o.micro_batch * o.micro_batch));
  r.cpu_us_per_sample = cpu * 1e6 / samples;
  r.wall_us_per_sample = wall * 1e6 / samples;
  r.full_rows = receiver->stats().full_rows;
  r.delta_rows = receiver->stats().delta_rows;
  r.direct_rows = receiver->stats().direct_rows;
  r.resend_rows = receiver->stats().resend_rows;
  if (send_store) AQSWARM_RETURN_IF_ERROR(send_store->Close());
  if (recv_store) AQSWARM_RETURN_IF_ERROR(recv_store->Close());
  aqswarm::RemoveTree(dir).IgnoreError();
  return r;
}

}  // namespace

absl::Status RunLinkBench(const LinkBenchOptions& options, std::ostream& out) {
  const LinkBenchOptions& o = options;
  if (o.rows <= 0 || o.cols <= 0 || o.micro_batch <= 0 || o.samples < o.micro_batch || o.epochs < 1 ||
      o.repeats < 1 || o.fw_bits < 2 || o.fw_bits > 8 || o.thrash_bytes < 0) {
    return absl::InvalidArgumentError(
        "link bench: rows, cols, micro_batch > 0; samples >= micro_batch; epochs, repeats >= 1; fw_bits in 2..8; "
        "thrash_bytes >= 0");
  }

  std::vector<Cell> cells;
  for (absl::string_view s : absl::StrSplit(o.stores, ',', absl::SkipEmpty())) {
    if (s != "resident" && s != "rocksdb" && s != "rocksdb_prefetch" && s != "rocksdb_skiplist" && s != "memory") {
      return absl::InvalidArgumentError(absl::StrCat(
          "link bench: unknown store '", s, "' (resident, rocksdb, rocksdb_prefetch, rocksdb_skiplist, memory)"));
    }
    cells.push_back({"aqsgd", std::string(s)});
  }
  cells.insert(cells.begin(), Cell{"directq", "-"});
  absl::StatusOr<std::string> made = MakeTempDir(o.dir, "aqswarm_link_bench_");
  if (!made.ok()) return made.status();
  const std::string tmpl = *made;
  if (!o.json) {
    out << absl::StrFormat("link bench: %dx%d fp16 rows, fw %d bits, %d samples x %d epochs, micro-batch %d%s\n",
                           o.rows, o.cols, o.fw_bits, o.samples, o.epochs, o.micro_batch,
                           o.thrash_bytes > 0 ? absl::StrCat(", ", o.thrash_bytes, " bytes rewritten between micro-batches")
                                              : "");
    out << absl::StrFormat("%-8s %-16s %12s %12s %10s\n", "mode", "store", "cpu us/smp", "wall us/smp", "vs dq");
  }
  double directq_cpu = 0;
  absl::Status status;
  for (const Cell& cell : cells) {
    Result best;
    for (int rep = 0; rep < o.repeats && status.ok(); ++rep) {
      absl::StatusOr<Result> r = RunCell(o, cell, tmpl + "/cell");
      if (!r.ok()) {
        status = r.status();
        break;
      }
      if (rep == 0 || r->cpu_us_per_sample < best.cpu_us_per_sample) best = *r;
    }
    if (!status.ok()) break;
    if (cell.mode == "directq") directq_cpu = best.cpu_us_per_sample;
    const double extra = best.cpu_us_per_sample - directq_cpu;
    if (o.json) {
      out << absl::StrFormat(
          "{\"bench\":\"link\",\"mode\":\"%s\",\"store\":\"%s\",\"rows\":%d,\"cols\":%d,\"fw_bits\":%d,"
          "\"samples\":%d,\"epochs\":%d,\"micro_batch\":%d,\"thrash_bytes\":%d,\"cpu_us_per_sample\":%.2f,"
          "\"wall_us_per_sample\":%.2f,\"extra_cpu_us_per_sample_vs_directq\":%.2f,\"delta_rows\":%d,"
          "\"full_rows\":%d,\"direct_rows\":%d,\"resend_rows\":%d}\n",
          cell.mode, cell.store, o.rows, o.cols, o.fw_bits, o.samples, o.epochs, o.micro_batch, o.thrash_bytes,
          best.cpu_us_per_sample, best.wall_us_per_sample, extra, best.delta_rows, best.full_rows,
          best.direct_rows, best.resend_rows);
    } else {
      out << absl::StrFormat("%-8s %-16s %12.2f %12.2f %+10.2f\n", cell.mode, cell.store, best.cpu_us_per_sample,
                             best.wall_us_per_sample, extra);
    }
  }
  aqswarm::RemoveTree(tmpl).IgnoreError();
  return status;
}

}  // namespace aqswarm::bench
