// Helpers shared by the storage tests: deterministic row contents. (Scratch
// directories: aqswarm::testing::ScratchDir, tests/testing/scratch_dir.h.)
#ifndef AQSWARM_STORAGE_TEST_UTIL_H_
#define AQSWARM_STORAGE_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "storage/message_store.h"

namespace aqswarm::storage::testing {

// Deterministic activation-like values for (sample, version): finite, mixed
// signs and magnitudes. values[0] == version exactly (for small versions) so
// a reader can tell which write it sees.
std::vector<float> RowValues(const LinkSpec& link, uint64_t sample, uint64_t version);

// RowValues rounded through link.precision: what a get must return.
std::vector<float> StoredValues(const LinkSpec& link, uint64_t sample, uint64_t version);

// Spans over a vector of rows.
std::vector<absl::Span<const float>> ConstSpans(const std::vector<std::vector<float>>& rows);
std::vector<absl::Span<float>> Spans(std::vector<std::vector<float>>& rows);

// Bitwise equality (fp16/int8 rounding must be exact, not approximately so).
bool SameBits(absl::Span<const float> a, absl::Span<const float> b);

}  // namespace aqswarm::storage::testing

#endif  // AQSWARM_STORAGE_TEST_UTIL_H_
