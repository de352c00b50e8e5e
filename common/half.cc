#include "common/half.h"

namespace aqswarm {

void FloatToHalf(absl::Span<const float> in, uint16_t* out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = FloatToHalf(in[i]);
}

void HalfToFloat(absl::Span<const uint16_t> in, float* out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = HalfToFloat(in[i]);
}

}  // namespace aqswarm
