// libFuzzer target: the gradient codec (compression/codec.h). Any byte string
// parsed as an EncodedTensor must validate to an error or decode to values,
// never crash, read out of bounds or allocate beyond WireLimits; a
// Global-QSGD message is also combined with itself (the owner's integer sum).
// Input: a serialized v1::EncodedTensor. Seeds: fuzz/corpus/codec_decode.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "compression/codec.h"
#include "compression/global_qsgd.h"
#include "fuzz/quiet_protobuf.h"

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
