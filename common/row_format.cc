#include "common/row_format.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"

namespace aqswarm {
namespace {

void Int8Scales(int64_t rows, int64_t cols, absl::Span<const float> v, float* scales) {
  std::vector<float> maxabs(cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = v.data() + r * cols;
    for (int64_t c = 0; c < cols; ++c) maxabs[c] = std::max(maxabs[c], std::fabs(x[c]));
  }
  for (int64_t c = 0; c < cols; ++c) scales[c] = maxabs[c] / 127.0f;
}

inline int8_t Int8Code(float x, float scale) {
  if (scale == 0.0f) return 0;
  float q = std::nearbyint(x / scale);
  q = std::min(127.0f, std::max(-127.0f, q));
  return static_cast<int8_t>(q);
}

}  // namespace

const char* RowPrecisionName(RowPrecision p) {
  switch (p) {
    case RowPrecision::kFloat32: return "fp32";
    case RowPrecision::kFloat16: return "fp16";
    case RowPrecision::kInt8: return "int8";
  }
  return "unknown";
}

bool IsValidRowPrecision(uint8_t p) { return p <= static_cast<uint8_t>(RowPrecision::kInt8); }

size_t EncodedRowBytes(RowPrecision p, int64_t rows, int64_t cols) {
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  switch (p) {
    case RowPrecision::kFloat32: return n * 4;
    case RowPrecision::kFloat16: return n * 2;
    case RowPrecision::kInt8: return n == 0 ? 0 : static_cast<size_t>(cols) * 4 + n;
  }
  return 0;
}

void EncodeRow(RowPrecision p, int64_t rows, int64_t cols, absl::Span<const float> values, char* out) {
  const size_t n = values.size();
  switch (p) {
    case RowPrecision::kFloat32:
      std::memcpy(out, values.data(), n * 4);
      return;
    case RowPrecision::kFloat16: {
      if (reinterpret_cast<uintptr_t>(out) % alignof(uint16_t) == 0) {
        FloatToHalf(values, reinterpret_cast<uint16_t*>(out));
        return;
      }
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToHalf(values[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    }
    case RowPrecision::kInt8: {
      if (n == 0) return;
      std::vector<float> scales(cols);
      Int8Scales(rows, cols, values, scales.data());
      std::memcpy(out, scales.data(), cols * 4);
      int8_t* codes = reinterpret_cast<int8_t*>(out + cols * 4);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) codes[r * cols + c] = Int8Code(values[r * cols + c], scales[c]);
      }
      return;
    }
  }
}

absl::Status DecodeRow(RowPrecision p, int64_t rows, int64_t cols, std::string_view bytes,
                       absl::Span<float> out) {
  if (rows < 0 || cols < 0 || static_cast<size_t>(rows) * static_cast<size_t>(cols) != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat("row shape ", rows, "x", cols,
                                                   " does not match output of ", out.size()));
  }
  const size_t want = EncodedRowBytes(p, rows, cols);
  if (bytes.size() != want) {
    return absl::DataLossError(absl::StrCat(RowPrecisionName(p), " row ", rows, "x", cols, " needs ",
                                            want, " bytes, got ", bytes.size()));
  }
  const size_t n = out.size();
  if (n == 0) return absl::OkStatus();  // an empty row: no bytes (and null data() pointers) to copy
  switch (p) {
    case RowPrecision::kFloat32:
      std::memcpy(out.data(), bytes.data(), n * 4);
      break;
    case RowPrecision::kFloat16:
      if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(uint16_t) == 0) {
        HalfToFloat(absl::MakeConstSpan(reinterpret_cast<const uint16_t*>(bytes.data()), n), out.data());
        break;
      }
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
      break;
    case RowPrecision::kInt8: {
      if (n == 0) break;
      std::vector<float> scales(cols);
      std::memcpy(scales.data(), bytes.data(), cols * 4);
      const int8_t* codes = reinterpret_cast<const int8_t*>(bytes.data() + cols * 4);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          out[r * cols + c] = static_cast<float>(codes[r * cols + c]) * scales[c];
        }
      }
      break;
    }
  }
  return absl::OkStatus();
}

void RoundRowInPlace(RowPrecision p, int64_t rows, int64_t cols, absl::Span<float> values) {
  switch (p) {
    case RowPrecision::kFloat32:
      return;
    case RowPrecision::kFloat16: {
      // In chunks through the (fast) span conversions.
      uint16_t tmp[1024];
      for (size_t i = 0; i < values.size(); i += 1024) {
        const size_t len = std::min<size_t>(1024, values.size() - i);
        FloatToHalf(values.subspan(i, len), tmp);
        HalfToFloat(absl::MakeConstSpan(tmp, len), values.data() + i);
      }
      return;
    }
    case RowPrecision::kInt8: {
      if (values.empty()) return;
      std::vector<float> scales(cols);
      Int8Scales(rows, cols, values, scales.data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          float& v = values[r * cols + c];
          v = static_cast<float>(Int8Code(v, scales[c])) * scales[c];
        }
      }
      return;
    }
  }
}

void AddRowInPlace(RowPrecision p, int64_t rows, int64_t cols, absl::Span<float> values,
                   absl::Span<const float> delta) {
  if (p == RowPrecision::kFloat16) return AddRoundToHalf(values.data(), delta.data(), values.size());
  float* v = values.data();  // raw pointers: no per-element bounds checks
  const float* d = delta.data();
  for (size_t i = 0; i < values.size(); ++i) v[i] += d[i];
  RoundRowInPlace(p, rows, cols, values);
}

absl::Status ValidateFinite(absl::Span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("non-finite value ", values[i], " at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace aqswarm
