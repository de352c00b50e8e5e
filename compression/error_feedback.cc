#include "compression/error_feedback.h"

#include "absl/strings/str_cat.h"
#include "common/row_format.h"
#include "common/status_macros.h"

namespace aqswarm::compression {

absl::Status ErrorFeedback::Compress(absl::Span<const float> values, absl::Span<const int64_t> shape,
                                     uint32_t rng_key, v1::EncodedTensor* out) {
  if (residual_.empty() && !values.empty()) residual_.assign(values.size(), 0.0f);
  if (residual_.size() != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ErrorFeedback: ", values.size(),
                                                   " values but residual has ", residual_.size()));
  }
  const size_t n = values.size();
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) g[i] = values[i] + residual_[i];
  AQSWARM_RETURN_IF_ERROR(inner_->Compress(g, shape, rng_key, out));
  scratch_.resize(n);
  AQSWARM_RETURN_IF_ERROR(inner_->Decompress(*out, absl::MakeSpan(scratch_)));
  for (size_t i = 0; i < n; ++i) residual_[i] = g[i] - scratch_[i];
  return absl::OkStatus();
}

absl::Status ErrorFeedback::RestoreResidual(absl::Span<const float> residual) {
  AQSWARM_RETURN_IF_ERROR(ValidateFinite(residual));
  residual_.assign(residual.begin(), residual.end());
  return absl::OkStatus();
}

}  // namespace aqswarm::compression
