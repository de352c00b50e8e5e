// libFuzzer target: one AQ-SGD link row on the receiver
// (compression::AqsgdLinkCodec::DecodeRow), the decode every activation row
// from the previous stage goes through, with a first-visit reference equal
// to m. A malformed row must be an error that leaves m(xi) unchanged, never a
// crash.
// Input: [mode u8][stored precision u8][fw bits u8][rows u8][cols u8]
//        [m fill u8] then a serialized v1::AqsgdRow. Seeds: fuzz/corpus/aqsgd_row.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "compression/aqsgd_codec.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/quiet_protobuf.h"

using namespace aqswarm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  compression::AqsgdLinkOptions o;
  o.mode = static_cast<compression::LinkMode>(in.U8() % 3);
  o.stored = static_cast<RowPrecision>(in.U8() % 3);
  o.quantizer.bits = 1 + in.U8() % 8;
  o.limits.max_elements = 1 << 16;
  const int64_t rows = 1 + in.U8() % 16, cols = 1 + in.U8() % 64;
  const float fill = static_cast<float>(static_cast<int8_t>(in.U8())) / 16.0f;
  v1::AqsgdRow msg;
  const std::string_view bytes = in.Rest();
  if (!msg.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return 0;
  auto codec = compression::AqsgdLinkCodec::Create(o);
  if (!codec.ok()) return 0;
  std::vector<float> m(rows * cols, fill);
  RoundRowInPlace(o.stored, rows, cols, absl::MakeSpan(m));
  const std::vector<float> before = m;
  // A FULL row may name a first-visit reference: the target's is m's fill.
  absl::StatusOr<compression::ReceiveResult> r =
      (*codec)->DecodeRow(msg, rows, cols, absl::MakeSpan(m), std::nullopt, before);
  // The codec's contract: an error or a resend request leaves m untouched.
  if ((!r.ok() || *r == compression::ReceiveResult::kResendNeeded) &&
      std::memcmp(m.data(), before.data(), m.size() * sizeof(float)) != 0) {
    std::abort();
  }
  return 0;
}
