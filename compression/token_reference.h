// A shared per-token reference for AQ-SGD's first visits
// (compression.firstVisitReference, experimental; docs/design/ALGORITHMS.md
// §2.5). Both ends of a link keep the same table: one row of `cols` values per
// token id, the running mean of the stage boundary's activations at that
// token. A first visit (FULL row with a first-visit codec) sends
// F(a - R) where R[t] = table[token t], and both ends set
// m = Round_p(R + D(F(a - R))) (compression/aqsgd_codec.h).
//
// The table changes only at step boundaries and only from values both ends
// hold bit-identically: every sample whose row ended a step's micro-batch as
// FULL (sent or resent) is recorded with its final m, and Commit applies the
// records in (micro-batch, position) order:
//   for each token t of the record: c = count[tok] (saturating at kWindow),
//   w = 1.0f / (float)min(c + 1, kWindow), row[j] += (m[t, j] - row[j]) * w
// (float arithmetic in this order; the first kWindow visits of a token give
// its mean, later ones an exponential average). The table starts at zero and
// lives as long as the endpoint (a new link generation starts a new one). A
// FULL row carries Checksum(R); a receiver whose R differs (it restarted and
// lost its table) resets its table and asks for a resend, which travels
// without the reference; the sender resets its table when it resends a row
// that carried one. Both resets fall in the same step and keep the step's
// records, so from the next step on both ends hold the same table again.
//
// Example:
//   TokenReference ref(vocab, seq_len, d_model);
//   AQSWARM_RETURN_IF_ERROR(ref.Gather(tokens, absl::MakeSpan(r)));   // R for one sample
//   ... encode or decode the sample's row against r ...
//   ref.Record(micro_batch, position, tokens, m);   // its row ended FULL
//   ref.Commit();                                    // at the next step
#ifndef AQSWARM_COMPRESSION_TOKEN_REFERENCE_H_
#define AQSWARM_COMPRESSION_TOKEN_REFERENCE_H_

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace aqswarm::compression {

class TokenReference {
 public:
  // Visits over which a token's row is a plain mean before it becomes an
  // exponential average with weight 1 / kWindow.
  static constexpr uint32_t kWindow = 16;

  // vocab token ids, rows tokens per sample, cols values per token.
  TokenReference(int64_t vocab, int64_t rows, int64_t cols);

  // R for one sample: out[t, :] = table[tokens[t], :]. InvalidArgument when
  // tokens.size() != rows, out.size() != rows * cols, or a token is outside
  // [0, vocab).
  absl::Status Gather(absl::Span<const int32_t> tokens, absl::Span<float> out) const;

  // Records a sample whose row ended FULL at (micro_batch, position) of the
  // current step, replacing an earlier record of the same place. Sizes as
  // Gather (tokens already checked by it).
  absl::Status Record(uint32_t micro_batch, uint32_t position, absl::Span<const int32_t> tokens,
                      absl::Span<const float> m);

  // Applies the step's records (see the banner) and clears them.
  void Commit();

  // Zeroes the table and the visit counts; the step's records stay.
  void Reset();

  // XXH3-64 of R's float32 bytes (what a FULL row carries).
  static uint64_t Checksum(absl::Span<const float> r);

  size_t pending() const { return records_.size(); }

 private:
  struct Pending {
    std::vector<int32_t> tokens;
    std::vector<float> m;
  };
  const int64_t vocab_, rows_, cols_;
  std::vector<float> table_;      // [vocab, cols]
  std::vector<uint32_t> count_;   // visits per token, saturating at kWindow
  std::map<std::pair<uint32_t, uint32_t>, Pending> records_;
};

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_TOKEN_REFERENCE_H_
