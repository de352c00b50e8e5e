#include "compression/token_reference.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"

namespace aqswarm::compression {

TokenReference::TokenReference(int64_t vocab, int64_t rows, int64_t cols)
    : vocab_(vocab),
      rows_(rows),
      cols_(cols),
      table_(static_cast<size_t>(vocab * cols), 0.0f),
      count_(static_cast<size_t>(vocab), 0) {}

absl::Status TokenReference::Gather(absl::Span<const int32_t> tokens, absl::Span<float> out) const {
  if (static_cast<int64_t>(tokens.size()) != rows_ || static_cast<int64_t>(out.size()) != rows_ * cols_) {
    return absl::InvalidArgumentError(absl::StrCat("token reference: ", tokens.size(), " tokens and ", out.size(),
                                                   " values for rows of ", rows_, " x ", cols_));
  }
  for (int64_t t = 0; t < rows_; ++t) {
    const int32_t tok = tokens[t];
    if (tok < 0 || tok >= vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("token reference: token ", tok, " outside [0, ", vocab_, ")"));
    }
    std::copy_n(table_.data() + static_cast<size_t>(tok) * cols_, cols_, out.data() + t * cols_);
  }
  return absl::OkStatus();
}

absl::Status TokenReference::Record(uint32_t micro_batch, uint32_t position, absl::Span<const int32_t> tokens,
                                    absl::Span<const float> m) {
  if (static_cast<int64_t>(tokens.size()) != rows_ || static_cast<int64_t>(m.size()) != rows_ * cols_) {
    return absl::InvalidArgumentError("token reference: record of the wrong size");
  }
  for (int32_t tok : tokens) {
    if (tok < 0 || tok >= vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("token reference: token ", tok, " outside [0, ", vocab_, ")"));
    }
  }
  Pending& r = records_[{micro_batch, position}];
  r.tokens.assign(tokens.begin(), tokens.end());
  r.m.assign(m.begin(), m.end());
  return absl::OkStatus();
}

void TokenReference::Commit() {
  for (const auto& [place, r] : records_) {
    for (int64_t t = 0; t < rows_; ++t) {
      const size_t tok = static_cast<size_t>(r.tokens[t]);
      const uint32_t c = count_[tok];
      const float w = 1.0f / static_cast<float>(std::min(c + 1, kWindow));
      float* row = table_.data() + tok * cols_;
      const float* m = r.m.data() + t * cols_;
      for (int64_t j = 0; j < cols_; ++j) row[j] += (m[j] - row[j]) * w;
      count_[tok] = std::min(c + 1, kWindow);
    }
  }
  records_.clear();
}

void TokenReference::Reset() {
  std::fill(table_.begin(), table_.end(), 0.0f);
  std::fill(count_.begin(), count_.end(), 0u);
}

uint64_t TokenReference::Checksum(absl::Span<const float> r) { return Checksum64(r.data(), r.size() * sizeof(float)); }

}  // namespace aqswarm::compression
