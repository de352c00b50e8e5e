// The two ends of one forward pipeline link (stage j -> j+1), without any
// transport: they turn a micro-batch of activations into an ActivationBatch
// message and back, running the AQ-SGD protocol (docs/design/ALGORITHMS.md §2) against
// each end's message store, and quantize gradients for the way back.
//
// Sender (stage j):
//   ActivationSender s(store, options);   s.StartEpoch(order);
//   s.Encode(step, mb, epoch, samples, acts, &batch);     // FULL/DELTA/DIRECT rows
//   s.EncodeResend(step, mb, epoch, samples, acts, ids, &batch);  // FULL rows
// Receiver (stage j+1):
//   ActivationReceiver r(store, options); r.StartEpoch(order);
//   r.Begin(step, mb, samples);  r.Apply(batch, &missing);  // repeat with resends
//   r.Take(&acts)  once `missing` is empty.
//
// m(xi) lives in the store (both ends). When an epoch's rows fit in
// LinkEndpointOptions::resident_bytes they stay resident in the endpoint
// (ResidentRows below): read from the store once, then updated in place with
// their checksums, and written back to the store when the endpoint closes or
// an epoch no longer fits. Otherwise every micro-batch's rows are read through
// a Prefetcher fed with the epoch's sample order and written behind. The
// sender treats a sample as "seen" iff it holds a row for it under the link's
// generation; a receiver whose row differs (lost write, a crash since the last
// write-back, eviction, corruption) detects it by the checksum in every DELTA
// and asks for a FULL resend.
//
// Not thread-safe: one compute thread drives each endpoint.
#ifndef AQSWARM_PIPELINE_LINK_ENDPOINT_H_
#define AQSWARM_PIPELINE_LINK_ENDPOINT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compression/aqsgd_codec.h"
#include "proto/link.pb.h"
#include "proto/job.pb.h"
#include "storage/message_store.h"
#include "storage/prefetcher.h"

namespace aqswarm::pipeline {

struct LinkEndpointOptions {
  // Link identity and row shape (rows = seq_len, cols = d_model) and stored
  // precision of m.
  storage::LinkSpec link;
  // Mode, activation quantizer (fw bits), warm-up epochs.
  compression::AqsgdLinkOptions codec;
  // Samples per micro-batch.
  int64_t micro_batch = 1;
  // Micro-batches prefetched ahead. With small rows the prefetcher hands
  // half of them to a loader at once (Prefetcher::Options::min_handoff_bytes).
  // Default: 16.
  int64_t prefetch_batches = 16;
  // Micro-batches this small (float32 bytes) are read from the store's memory
  // on the endpoint's thread rather than prefetched while they are in memory
  // (Prefetcher::Options::inline_read_bytes). Default: 256 KiB.
  uint64_t inline_read_bytes = 256ull << 10;
  // An epoch whose m rows fit in this many bytes (float32: samples x rows x
  // cols x 4) keeps them resident (see the banner): no per-micro-batch store
  // reads, row encodings or writes, which take CPU from the model on a
  // CPU-bound stage (`aqswarm bench link` compares the two). 0: always stream
  // through the prefetcher. Default: 64 MiB (job: compression.resident_bytes).
  uint64_t resident_bytes = 64ull << 20;
  // compression.firstVisitReference (AQ-SGD with a first-visit codec): both
  // ends keep a compression::TokenReference over `vocab` token ids, and
  // `tokens` gives the token ids of samples (link.rows each, sample after
  // sample; the stage sets it from its corpus).
  bool first_visit_reference = false;
  int64_t vocab = 0;
  std::function<absl::Status(absl::Span<const uint64_t> samples, std::vector<int32_t>* tokens)> tokens;
};

class LinkReference;  // link_endpoint.cc: an endpoint's TokenReference and its samples' tokens

// The m rows an endpoint keeps in memory for a whole epoch (one per sample,
// float32 holding the stored-precision values, with RowChecksum of each).
// Rows are loaded from the store on first use; `dirty` ones are written back
// by WriteBack. Rows live in slabs of ~1 MiB (kSlabBytes), not one heap
// block each: an epoch's thousands of long-lived rows scattered over the heap
// would slow every later malloc of the stage's tensors (glibc's _int_malloc,
// unlink_chunk, malloc_consolidate; scripts/perf_link_modes.sh measures
// that share, docs/notebook/slownet.md has the runs). Used by one endpoint's
// thread.
class ResidentRows {
 public:
  struct Row {
    absl::Span<float> m;    // this row's values in a slab (fixed for the row's life)
    uint64_t checksum = 0;  // RowChecksum(m) when `present`
    bool present = false;   // holds m(xi) (else: unseen, send or expect FULL)
    bool dirty = false;     // changed since the store last had it (implies present)
  };
  // Slab size: rows per slab = max(1, kSlabBytes / row bytes).
  static constexpr uint64_t kSlabBytes = 1ull << 20;

  ResidentRows(storage::MessageStore* store, const storage::LinkSpec& link) : store_(store), link_(link) {}

  bool active() const { return active_; }
  // Resident for `order` if its distinct samples fit in `budget` bytes; rows
  // of other samples stay while all fit, else they are written back and
  // dropped. Returns whether it is resident now (if not, every row has been
  // written back and dropped).
  absl::StatusOr<bool> StartEpoch(const std::vector<uint64_t>& order, uint64_t budget);
  // The rows of `samples` (created, read from the store when it holds them).
  // The pointers stay valid until the row is dropped.
  absl::Status Rows(absl::Span<const uint64_t> samples, std::vector<Row*>* rows);
  // Writes the dirty rows of every sample not in `keep` (null: all) to the
  // store and drops those rows; with `keep` null, no longer resident (and
  // the slabs are freed).
  absl::Status WriteBack(const absl::flat_hash_set<uint64_t>* keep);
  // Marks `row` changed (it now holds m): present, dirty, checksum updated.
  void Updated(Row* row);

  // Rows held and slabs allocated (tests).
  size_t size() const { return rows_.size(); }
  size_t slabs() const { return slabs_.size(); }

 private:
  struct Slab {
    std::unique_ptr<float[]> values;
    std::unique_ptr<Row[]> rows;
  };
  // A zeroed row (not present, not dirty) from the free list, adding a slab
  // when it is empty.
  Row* Allocate();
  void Drop(uint64_t sample);

  storage::MessageStore* store_;
  storage::LinkSpec link_;
  bool active_ = false;
  absl::flat_hash_map<uint64_t, Row*> rows_;
  std::vector<Slab> slabs_;
  std::vector<Row*> free_;
  std::string scratch_;  // RowChecksum's encoding
};

// Tiles of the tiled codec when the job leaves compression.tile_size unset.
inline constexpr uint32_t kDefaultTileSize = 64;

// How the job's links store m(xi) (compression.m_precision); an unset or
// unknown value is an error naming the field.
absl::StatusOr<RowPrecision> StoredRowPrecision(const v1::LinkCompression& c);

// The tiled codec of a job's links at `bits` (tile size, rotation, entropy
// coding from `c`): the `tiled` mode's messages and AQ-SGD's tiled first visits.
compression::CodecOptions TiledCodecOptions(const v1::LinkCompression& c, int bits);

// Builds endpoint options from a job: mode, fw bits, m precision, warm-up,
// first visits.
absl::StatusOr<LinkEndpointOptions> LinkOptionsFromJob(const v1::JobSpec& job, uint32_t pipeline,
                                                       uint32_t boundary, uint64_t generation);

// Counters of one endpoint (sender or receiver).
struct LinkEndpointStats {
  uint64_t full_rows = 0;
  uint64_t delta_rows = 0;
  uint64_t direct_rows = 0;
  uint64_t resend_rows = 0;     // sender: FULL rows sent for resends; receiver: rows asked again
  uint64_t payload_bytes = 0;   // encoded scales+payload of rows (sender: sent, receiver: received)
  uint64_t raw_bytes = 0;       // what the same rows cost as float32
  // Sender: over every row encoded, sum of ||a - a_hat||^2 (a_hat = what the
  // receiver reconstructs: m after the update, or the decoded DIRECT row) and
  // of ||a||^2; relative quantization error = sqrt(error_sq / signal_sq).
  double error_sq = 0;
  double signal_sq = 0;
};

class ActivationSender {
 public:
  // `store` may be null for the stateless modes (fp32, directq); it must
  // outlive the sender otherwise.
  static absl::StatusOr<std::unique_ptr<ActivationSender>> Create(storage::MessageStore* store,
                                                                  const LinkEndpointOptions& options);
  ~ActivationSender();

  // The epoch's sample order, in micro-batch order (for prefetching).
  absl::Status StartEpoch(std::vector<uint64_t> order);
  // Encodes one micro-batch: acts is [samples.size(), rows, cols].
  absl::Status Encode(uint64_t step, uint32_t micro_batch, uint32_t epoch, absl::Span<const uint64_t> samples,
                      absl::Span<const float> acts, v1::ActivationBatch* out);
  // FULL rows for `resend_ids` (a subset of `samples`) of a micro-batch
  // already encoded; updates m to Round_p(a).
  absl::Status EncodeResend(uint64_t step, uint32_t micro_batch, uint32_t epoch,
                            absl::Span<const uint64_t> samples, absl::Span<const float> acts,
                            absl::Span<const uint64_t> resend_ids, v1::ActivationBatch* out);
  // Raw rows for evaluation: no state touched.
  absl::Status EncodeEval(uint64_t step, uint32_t micro_batch, absl::Span<const float> acts, int64_t batch,
                          v1::ActivationBatch* out);
  // Writes resident rows back, flushes queued store writes and stops the
  // prefetcher.
  absl::Status Close();
  const LinkEndpointStats& stats() const { return stats_; }
  // The m(xi) prefetcher's counters (zeros for stateless modes and after Close).
  storage::PrefetcherStats prefetcher_stats() const;

 private:
  ActivationSender(storage::MessageStore* store, const LinkEndpointOptions& options);
  LinkEndpointOptions options_;
  storage::MessageStore* store_;
  std::unique_ptr<storage::Prefetcher> prefetcher_;
  std::unique_ptr<compression::AqsgdLinkCodec> codec_;
  std::unique_ptr<ResidentRows> resident_;  // AQ-SGD
  std::unique_ptr<LinkReference> reference_;  // first_visit_reference
  LinkEndpointStats stats_;
  std::vector<float> decoded_;  // scratch: a DIRECT row as the receiver decodes it
  std::vector<ResidentRows::Row*> rows_;  // scratch
};

class ActivationReceiver {
 public:
  static absl::StatusOr<std::unique_ptr<ActivationReceiver>> Create(storage::MessageStore* store,
                                                                    const LinkEndpointOptions& options);
  ~ActivationReceiver();

  absl::Status StartEpoch(std::vector<uint64_t> order);
  // Starts receiving micro-batch (step, mb) whose samples are `samples`.
  absl::Status Begin(uint64_t step, uint32_t micro_batch, absl::Span<const uint64_t> samples);
  // Applies a batch (the first one, or a resend) for the current micro-batch.
  // Every row is validated (sample belongs to the micro-batch, kind allowed
  // for the mode, shape, checksum). `missing` gets the samples that still need
  // a FULL resend (DELTA against a different m, or not yet received). A row
  // with a NaN or infinity (in its values or in the m it would make) is
  // refused with compression::NonFiniteError naming its sample; its m row
  // stays as it was (the sender's differs from then on, so its next DELTA
  // asks for a FULL resend).
  absl::Status Apply(const v1::ActivationBatch& batch, std::vector<uint64_t>* missing);
  // Moves the assembled stage input [samples, rows, cols] out; requires that
  // no sample is missing. Stores the updated m rows.
  absl::Status Take(std::vector<float>* acts);
  // Decodes an eval batch (raw rows) into `acts`.
  absl::Status ApplyEval(const v1::ActivationBatch& batch, int64_t batch_size, std::vector<float>* acts);
  absl::Status Close();
  const LinkEndpointStats& stats() const { return stats_; }
  storage::PrefetcherStats prefetcher_stats() const;

 private:
  ActivationReceiver(storage::MessageStore* store, const LinkEndpointOptions& options);
  // Sample i's row of the current micro-batch (resident or in m_).
  absl::Span<float> Row(size_t i);
  LinkEndpointOptions options_;
  storage::MessageStore* store_;
  std::unique_ptr<storage::Prefetcher> prefetcher_;
  std::unique_ptr<compression::AqsgdLinkCodec> codec_;
  std::unique_ptr<ResidentRows> resident_;  // AQ-SGD
  std::unique_ptr<LinkReference> reference_;  // first_visit_reference
  LinkEndpointStats stats_;
  // The micro-batch being received.
  bool active_ = false;
  uint64_t step_ = 0;
  uint32_t micro_batch_ = 0;
  std::vector<uint64_t> samples_;
  std::vector<std::vector<float>> m_;    // per-sample m rows (AQ-SGD) or decoded rows
  std::vector<ResidentRows::Row*> rows_;  // instead of m_ while resident
  std::vector<storage::RowRead> reads_;
  std::vector<bool> done_;
  std::vector<bool> dirty_;              // m row changed: write it back
  std::vector<bool> full_;               // the row applied was FULL
};

// Counters of a GradientCodec's Encode calls.
struct GradientCodecStats {
  uint64_t tensors = 0;
  uint64_t payload_bytes = 0;  // scales + payload
  uint64_t raw_bytes = 0;      // the same gradients as float32
  double error_sq = 0;         // sum of ||g - decode(encode(g))||^2
  double signal_sq = 0;        // sum of ||g||^2
};
// Gradients on the way back: directly quantized at bw bits, per channel over
// the micro-batch (fixed point) or per tile of one token's channels (tiled:
// mode tiled, or compression.bw_codec "tiled"), or raw float32 in fp32 mode.
// Stateless.
class GradientCodec {
 public:
  // Micro-batch gradients are quantized whatever their size (no raw
  // pass-through for small tensors).
  // fp32 links (and an unset mode) send raw float32; tiled links the tiled codec at bw_bits;
  // the others fixed point at bw_bits; entropy_coding applies to both.
  GradientCodec(const v1::LinkCompression& compression, int64_t seq_len, int64_t d_model);
  absl::Status Encode(absl::Span<const float> grad, int64_t batch, uint32_t rng_key, v1::EncodedTensor* out) const;
  // Validates the shape [batch, seq_len, d_model] and decodes.
  absl::Status Decode(const v1::EncodedTensor& msg, int64_t batch, std::vector<float>* out) const;
  const GradientCodecStats& stats() const { return stats_; }

 private:
  compression::CodecOptions options_;
  int64_t seq_len_, d_model_;
  // Encode measures its own error (one extra decode per tensor).
  mutable GradientCodecStats stats_;
  mutable std::vector<float> decoded_;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_LINK_ENDPOINT_H_
