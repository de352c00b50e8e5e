// Error feedback (EF) as a decorator around any Compressor
// (docs/design/ALGORITHMS.md §1.6; BytePS/DeepSpeed style):
//   g += e;   c = C(g);   e = g - D(c)
// The residual e is part of the optimizer state: it is exposed for
// checkpointing and restored when a replica joins (we do not reset it).
// Invariant: sum of decoded messages + current residual == sum of inputs
// (up to float rounding of the additions).
//
// Example:
//   AQSWARM_ASSIGN_OR_RETURN(auto inner, CreateCompressor(opts));
//   ErrorFeedback ef(std::move(inner));
//   v1::EncodedTensor msg;
//   AQSWARM_RETURN_IF_ERROR(ef.Compress(grad, shape, step, &msg));
//   checkpoint.residual = std::vector<float>(ef.residual().begin(), ef.residual().end());
//   ...
//   AQSWARM_RETURN_IF_ERROR(ef.RestoreResidual(checkpoint.residual));
//
// Not thread-safe: one instance per tensor (or bucket) stream.
#ifndef AQSWARM_COMPRESSION_ERROR_FEEDBACK_H_
#define AQSWARM_COMPRESSION_ERROR_FEEDBACK_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compression/codec.h"

namespace aqswarm::compression {

class ErrorFeedback {
 public:
  explicit ErrorFeedback(std::unique_ptr<Compressor> inner) : inner_(std::move(inner)) {}

  // Compresses values + residual and updates the residual. The residual's
  // size is fixed by the first call (or RestoreResidual); a later call with
  // a different size is InvalidArgument. On error the residual is unchanged.
  absl::Status Compress(absl::Span<const float> values, absl::Span<const int64_t> shape,
                        uint32_t rng_key, v1::EncodedTensor* out);
  // Plain decode (the receiver keeps no EF state).
  absl::Status Decompress(const v1::EncodedTensor& msg, absl::Span<float> out) const {
    return inner_->Decompress(msg, out);
  }

  absl::Span<const float> residual() const { return residual_; }
  // Replaces the residual (checkpoint restore); InvalidArgument on NaN/Inf.
  absl::Status RestoreResidual(absl::Span<const float> residual);
  void ResetResidual() { residual_.clear(); }
  const Compressor& inner() const { return *inner_; }

 private:
  std::unique_ptr<Compressor> inner_;
  std::vector<float> residual_;
  std::vector<float> scratch_;
};

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_ERROR_FEEDBACK_H_
