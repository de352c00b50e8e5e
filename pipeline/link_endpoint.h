// The two ends of one forward pipeline link (stage j -> j+1), without any
// transport: they turn a micro-batch of activations into an ActivationBatch
// message and back, running the AQ-SGD protocol (ALGORITHMS.md §2) against
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
// m(xi) lives in the store (both ends) and is read through a Prefetcher fed
// with the epoch's sample order, so the rows a micro-batch needs are usually
// already in memory. The sender treats a sample as "seen" iff its store holds
// a row for it under the link's generation; a receiver whose row differs (lost
// write, eviction, corruption) detects it by the checksum in every DELTA and
// asks for a FULL resend.
//
// Not thread-safe: one compute thread drives each endpoint.
#ifndef AQSWARM_PIPELINE_LINK_ENDPOINT_H_
#define AQSWARM_PIPELINE_LINK_ENDPOINT_H_

#include <cstdint>
#include <memory>
#include <vector>

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
};

// Builds endpoint options from a job: mode, fw bits, m precision, warm-up.
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
  // Flushes queued store writes and stops the prefetcher.
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
  LinkEndpointStats stats_;
  std::vector<float> decoded_;  // scratch: a DIRECT row as the receiver decodes it
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
  // a FULL resend (DELTA against a different m, or not yet received).
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
  LinkEndpointOptions options_;
  storage::MessageStore* store_;
  std::unique_ptr<storage::Prefetcher> prefetcher_;
  std::unique_ptr<compression::AqsgdLinkCodec> codec_;
  LinkEndpointStats stats_;
  // The micro-batch being received.
  bool active_ = false;
  uint64_t step_ = 0;
  uint32_t micro_batch_ = 0;
  std::vector<uint64_t> samples_;
  std::vector<std::vector<float>> m_;    // per-sample m rows (AQ-SGD) or decoded rows
  std::vector<storage::RowRead> reads_;
  std::vector<bool> done_;
  std::vector<bool> dirty_;              // m row changed: write it back
};

// Counters of a GradientCodec's Encode calls.
struct GradientCodecStats {
  uint64_t tensors = 0;
  uint64_t payload_bytes = 0;  // scales + payload
  uint64_t raw_bytes = 0;      // the same gradients as float32
  double error_sq = 0;         // sum of ||g - decode(encode(g))||^2
  double signal_sq = 0;        // sum of ||g||^2
};
// Gradients on the way back: directly quantized (fixed point, bw bits,
// per-channel over d_model), or raw float32 in fp32 mode. Stateless.
class GradientCodec {
 public:
  // Micro-batch gradients are quantized whatever their size (no raw
  // pass-through for small tensors).
  GradientCodec(v1::LinkCompression::Mode mode, int bw_bits, int64_t seq_len, int64_t d_model);
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
