// AQ-SGD link codec for ONE sample row (papers/aq-sgd Alg. 1-2;
// docs/design/ALGORITHMS.md §2). Both ends of a pipeline link keep m(xi) per sample; this
// class encodes/decodes one row against caller-owned m buffers (the
// per-sample store lives in storage/).
//
// Sender, activation a (row [rows, cols]) with stored precision p:
//   FULL  if the sample is unseen on this link generation, epoch <
//         warmup_epochs, or the receiver asked for a resend:
//           tensor = a as raw f16 (p = fp16) or raw f32 (fp32, int8), i.e.
//           lossless w.r.t. what is stored;  m = Round_p(a)
//         or, with a `first_visit` codec (tiled first visits):
//           tensor = F(a);  m = Round_p(D(tensor)), what the receiver gets
//         or, with a first-visit reference R (RowContext::reference; not
//         on a resend): tensor = F(a - R), reference_checksum = XXH3(R),
//           m = Round_p(R + D(tensor))
//   DELTA otherwise:  c = Q(a - m);  base_checksum = RowChecksum(m);
//           m = Round_p(m + D(c))
// Receiver:
//   FULL:  m = Round_p(decoded a); with reference_checksum: the caller's R
//          must have that checksum (else kResendNeeded, m untouched), and
//          m = Round_p(R + decoded)
//   DELTA: RowChecksum(m) != base_checksum -> kResendNeeded, m untouched;
//          else m = Round_p(m + D(c))
// RowChecksum(m) is XXH3-64 of m's stored encoding (common/row_format.h
// EncodeRow at precision p): the payload checksum a message store keeps with
// the row and hands back with every read (storage::RowRead), so a caller
// that read m from its store passes that value in and neither end hashes m.
// Round_p is RoundRowInPlace (common/row_format.h) and D is Decode
// (bit-exact), so both ends hold bit-identical m after every message; the
// receiver's stage input is m itself.
// Baselines through the same entry points: kDirectQ sends Q(a) and kFp32
// sends raw a (kind DIRECT, no state); the receiver writes the decoded row
// into the same buffer.
//
// Example:
//   AqsgdLinkOptions o;  o.stored = RowPrecision::kFloat16;
//   AQSWARM_ASSIGN_OR_RETURN(auto codec, AqsgdLinkCodec::Create(o));
//   // sender
//   v1::AqsgdRow msg;
//   AQSWARM_RETURN_IF_ERROR(codec->EncodeRow({.seen = true, .epoch = 3}, a, rows, cols,
//                                            m_send, /*rng_key=*/step, &msg));
//   // receiver
//   AQSWARM_ASSIGN_OR_RETURN(ReceiveResult r, codec->DecodeRow(msg, rows, cols, m_recv));
//   if (r == ReceiveResult::kResendNeeded) { /* ask the sender for FULL */ }
//
// Not thread-safe (scratch buffers); use one instance per link direction/thread.
#ifndef AQSWARM_COMPRESSION_AQSGD_CODEC_H_
#define AQSWARM_COMPRESSION_AQSGD_CODEC_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/row_format.h"
#include "compression/codec.h"
#include "proto/tensor.pb.h"

namespace aqswarm::compression {

enum class LinkMode {
  kAqsgd,    // FULL / DELTA against m(xi)
  kDirectQ,  // Q(a) with the same quantizer, no state
  kFp32,     // raw float32, no state
};

struct AqsgdLinkOptions {
  // Default: AQ-SGD.
  LinkMode mode = LinkMode::kAqsgd;
  // Q for DELTA (and directq). Default: fixed point, 4 bits, nearest.
  CodecOptions quantizer;
  // Stored precision of m(xi) on both ends. Default: fp16.
  RowPrecision stored = RowPrecision::kFloat16;
  // Epochs sent FULL before deltas start. Default: 1 here (the reference); a
  // job's compression.warmup_epochs (pipeline/link_endpoint.cc) is 0 unless set,
  // so a job's links send deltas from the second time they see a sample.
  int64_t warmup_epochs = 1;
  // Limits applied to incoming tensors.
  WireLimits limits;
  // How FULL rows are encoded when set (e.g. the tiled codec); unset: raw at
  // the stored precision.
  std::optional<CodecOptions> first_visit;
};

struct RowContext {
  bool seen = false;        // sample already sent on this link generation
  int64_t epoch = 0;        // current epoch (0-based)
  bool force_full = false;  // the receiver asked for a RESEND
  uint64_t sample_id = 0;   // copied into the message
  // RowChecksum(m) if the caller knows it (the store's
  // RowRead::payload_checksum of the row m was read from); else computed.
  std::optional<uint64_t> m_checksum;
  // The sample's first-visit reference R ([rows, cols]; empty: none). Used
  // by a FULL row with a first-visit codec, unless force_full.
  absl::Span<const float> reference;
};

enum class ReceiveResult {
  kApplied,       // m (or the output row) now holds the row
  kResendNeeded,  // DELTA against a different m: ask the sender for FULL
};

class AqsgdLinkCodec {
 public:
  static absl::StatusOr<std::unique_ptr<AqsgdLinkCodec>> Create(const AqsgdLinkOptions& options);

  // Encodes `a` ([rows, cols]) and updates the sender's m (size rows*cols;
  // unused for the stateless modes). On error m is unchanged.
  absl::Status EncodeRow(const RowContext& ctx, absl::Span<const float> a, int64_t rows,
                         int64_t cols, absl::Span<float> m, uint32_t rng_key, v1::AqsgdRow* out);

  // Applies `msg` to the receiver's m (or writes the decoded row for
  // stateless modes). Errors (malformed message, wrong precision or size)
  // leave m unchanged; so does kResendNeeded. A row whose values, or whose
  // new m (FULL rounded to the stored precision, m + DELTA), would hold a
  // NaN or an infinity is refused with a non-finite error (codec.h
  // IsNonFiniteError) and m stays as it was.
  // `m_checksum`: RowChecksum(m) if the caller knows it (see RowContext).
  // `reference`: the sample's first-visit reference R, for a FULL row that
  // carries reference_checksum (empty: the caller keeps none, and such a row
  // asks for a resend).
  absl::StatusOr<ReceiveResult> DecodeRow(const v1::AqsgdRow& msg, int64_t rows, int64_t cols,
                                          absl::Span<float> m,
                                          std::optional<uint64_t> m_checksum = std::nullopt,
                                          absl::Span<const float> reference = {});

  // XXH3-64 of m's encoding at `stored` precision (what DELTA messages carry;
  // equal to a message store's payload checksum of the row).
  static uint64_t RowChecksum(RowPrecision stored, int64_t rows, int64_t cols,
                              absl::Span<const float> m);
  // The same, encoding into `*scratch` (kept between calls: no allocation).
  static uint64_t RowChecksum(RowPrecision stored, int64_t rows, int64_t cols,
                              absl::Span<const float> m, std::string* scratch);

  const AqsgdLinkOptions& options() const { return options_; }

 private:
  explicit AqsgdLinkCodec(const AqsgdLinkOptions& options) : options_(options) {}
  absl::Status CheckSize(absl::Span<const float> m, int64_t rows, int64_t cols) const;

  // `known` if set, else RowChecksum(options_.stored, rows, cols, m).
  uint64_t Checksum(int64_t rows, int64_t cols, absl::Span<const float> m,
                    std::optional<uint64_t> known) const;

  const AqsgdLinkOptions options_;
  std::vector<float> scratch_;
  std::vector<float> next_m_;  // DecodeRow: the new m, checked before it replaces m
};

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_AQSGD_CODEC_H_
