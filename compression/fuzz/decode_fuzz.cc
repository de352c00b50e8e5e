// libFuzzer target: any byte string parsed as an EncodedTensor must decode
// to an error status or to values, never crash or allocate beyond limits.
// Built only with -DAQSWARM_FUZZ=ON and clang.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "compression/codec.h"
#include "compression/global_qsgd.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  aqswarm::v1::EncodedTensor msg;
  if (!msg.ParseFromArray(data, static_cast<int>(size))) return 0;
  aqswarm::compression::WireLimits limits;
  limits.max_elements = 1 << 20;
  if (!aqswarm::compression::ValidateEncodedTensor(msg, limits).ok()) return 0;
  std::vector<float> out(msg.num_elements());
  (void)aqswarm::compression::Decode(msg, absl::MakeSpan(out), limits);
  if (msg.codec() == aqswarm::v1::CODEC_GLOBAL_QSGD) {
    aqswarm::v1::EncodedTensor sum;
    (void)aqswarm::compression::CombineGlobalQsgd(msg, msg, {}, &sum);
  }
  return 0;
}
