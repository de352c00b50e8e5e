#include "storage/test_util.h"

#include <cstring>

#include "common/random.h"

namespace aqswarm::storage::testing {

std::vector<float> RowValues(const LinkSpec& link, uint64_t sample, uint64_t version) {
  std::vector<float> v(link.num_values());
  Rng rng(Mix64(sample * 1000003 + version));
  for (size_t i = 0; i < v.size(); ++i) {
    const double u = rng.UnitDouble() * 2.0 - 1.0;
    v[i] = static_cast<float>(u * ((i % 7 == 0) ? 8.0 : 1.0));
  }
  if (!v.empty()) v[0] = static_cast<float>(version);
  return v;
}

std::vector<float> StoredValues(const LinkSpec& link, uint64_t sample, uint64_t version) {
  std::vector<float> v = RowValues(link, sample, version);
  RoundRowInPlace(link.precision, link.rows, link.cols, absl::MakeSpan(v));
  return v;
}

std::vector<absl::Span<const float>> ConstSpans(const std::vector<std::vector<float>>& rows) {
  std::vector<absl::Span<const float>> out;
  for (const auto& r : rows) out.emplace_back(r);
  return out;
}

std::vector<absl::Span<float>> Spans(std::vector<std::vector<float>>& rows) {
  std::vector<absl::Span<float>> out;
  for (auto& r : rows) out.emplace_back(absl::MakeSpan(r));
  return out;
}

bool SameBits(absl::Span<const float> a, absl::Span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace aqswarm::storage::testing
