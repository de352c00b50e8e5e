// Stored precision of a per-sample message row m(xi): fp32, fp16 or 8-bit with
// one float32 scale per channel. Shared by storage/ (rows on disk) and
// compression/ (the AQ-SGD codec rounds m(xi) through the same precision), so
// that both ends of a link add the next delta to exactly the stored value.
//
// A row is [rows, cols] row-major; "channel" = column.
// Encodings (little-endian):
//   kFloat32: rows*cols float32
//   kFloat16: rows*cols IEEE binary16 (round to nearest even)
//   kInt8:    cols float32 scales, then rows*cols int8 codes
//             scale_c = max_r |x[r,c]| / 127;  q = clamp(nearbyint(x / scale_c), -127, 127)
//             decode: (float)q * scale_c   (one IEEE multiply: bit-identical everywhere)
//             a zero column has scale 0 and decodes to 0.
// Non-finite inputs are rejected by EncodeRow's callers (ValidateFinite).
//
// Example:
//   std::string buf(EncodedRowBytes(p, r, c), '\0');
//   EncodeRow(p, r, c, values, buf.data());
//   AQSWARM_RETURN_IF_ERROR(DecodeRow(p, r, c, buf, out));
#ifndef AQSWARM_COMMON_ROW_FORMAT_H_
#define AQSWARM_COMMON_ROW_FORMAT_H_

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace aqswarm {

enum class RowPrecision : uint8_t { kFloat32 = 0, kFloat16 = 1, kInt8 = 2 };

const char* RowPrecisionName(RowPrecision p);
bool IsValidRowPrecision(uint8_t p);

// Encoded size in bytes; 0 for an empty row.
size_t EncodedRowBytes(RowPrecision p, int64_t rows, int64_t cols);

// `values.size()` must equal rows*cols; `out` holds EncodedRowBytes bytes.
void EncodeRow(RowPrecision p, int64_t rows, int64_t cols, absl::Span<const float> values, char* out);

// Checks the byte length before reading; `out.size()` must equal rows*cols.
absl::Status DecodeRow(RowPrecision p, int64_t rows, int64_t cols, std::string_view bytes,
                       absl::Span<float> out);

// values <- Decode(Encode(values)) in place, without allocating for fp32/fp16.
void RoundRowInPlace(RowPrecision p, int64_t rows, int64_t cols, absl::Span<float> values);

// values <- Round_p(values + delta): the same bits as adding, then
// RoundRowInPlace, in one pass for fp32/fp16. Sizes must match.
void AddRowInPlace(RowPrecision p, int64_t rows, int64_t cols, absl::Span<float> values,
                   absl::Span<const float> delta);

// InvalidArgument naming the first non-finite index, if any.
absl::Status ValidateFinite(absl::Span<const float> values);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_ROW_FORMAT_H_
