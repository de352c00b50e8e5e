// libFuzzer target: what a stage reads from its StageLink stream. Each record
// is a serialized v1::LinkFrame, handled as the receiving stage handles it:
//   activations  -> pipeline::ActivationReceiver::Apply (every row decoded
//                   against m(xi) in a MemoryMessageStore), Take when
//                   complete, ApplyEval for eval batches;
//   gradients    -> pipeline::GradientCodec::Decode, tied values decoded;
//   commit       -> tied values decoded;
//   hello        -> compared with the stage's expected hello as
//                   stage::CheckHello does (plan order, then equality of the
//                   serialized hellos; CheckHello itself is in
//                   stage/link_handshake.cc, in the torch-linked aqswarm_stage,
//                   and is not linked here).
// Input: [mode u8][m precision u8][fw bits u8][bw bits u8][seq_len u8]
//        [d_model u8][micro-batch u8][resident u8] then records
//        (u16 length + LinkFrame bytes). Seeds: fuzz/corpus/link_frame.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "compression/codec.h"
#include "fuzz/fuzz_input.h"
#include "pipeline/link_endpoint.h"
#include "proto/link.pb.h"
#include "storage/memory_message_store.h"
#include "fuzz/quiet_protobuf.h"

using namespace aqswarm;

namespace {

void DecodeTied(const v1::TiedGradient& tied) {
  if (!tied.has_values()) return;
  compression::WireLimits limits;
  limits.max_elements = 1 << 16;
  if (!compression::ValidateEncodedTensor(tied.values(), limits).ok()) return;
  std::vector<float> out(tied.values().num_elements());
  (void)compression::Decode(tied.values(), absl::MakeSpan(out), limits);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  const uint8_t mode_byte = in.U8() % 3;
  const auto mode = mode_byte == 0 ? v1::LinkCompression::aqsgd
                    : mode_byte == 1 ? v1::LinkCompression::directq
                                     : v1::LinkCompression::fp32;
  pipeline::LinkEndpointOptions o;
  o.link.precision = static_cast<RowPrecision>(in.U8() % 3);
  o.codec.mode = mode == v1::LinkCompression::aqsgd     ? compression::LinkMode::kAqsgd
                 : mode == v1::LinkCompression::directq ? compression::LinkMode::kDirectQ
                                                        : compression::LinkMode::kFp32;
  o.codec.stored = o.link.precision;
  o.codec.quantizer.bits = 1 + in.U8() % 8;
  o.codec.quantizer.min_compress_elements = 1;
  o.codec.warmup_epochs = 0;
  o.codec.limits.max_elements = 1 << 16;
  const int bw_bits = 1 + in.U8() % 8;
  o.link.rows = 1 + in.U8() % 8;
  o.link.cols = 1 + in.U8() % 32;
  o.micro_batch = 1 + in.U8() % 4;
  o.resident_bytes = (in.U8() & 1) ? (1u << 20) : 0;
  o.prefetch_batches = 2;

  auto store = storage::MemoryMessageStore::Create({});
  if (!store.ok()) return 0;
  const bool stateful = mode == v1::LinkCompression::aqsgd;
  auto receiver = pipeline::ActivationReceiver::Create(stateful ? store->get() : nullptr, o);
  if (!receiver.ok()) return 0;
  const int64_t mb = o.micro_batch, samples_total = 4 * mb;
  std::vector<uint64_t> order(samples_total);
  for (int64_t i = 0; i < samples_total; ++i) order[i] = i;
  if (!(*receiver)->StartEpoch(order).ok()) return 0;
  uint32_t micro_batch = 0;
  auto begin = [&]() {
    const uint64_t first = (micro_batch % 4) * mb;
    std::vector<uint64_t> samples(order.begin() + first, order.begin() + first + mb);
    return (*receiver)->Begin(/*step=*/0, micro_batch, samples);
  };
  if (!begin().ok()) return 0;
  v1::LinkCompression compression;
  compression.set_mode(mode);
  compression.set_bw_bits(bw_bits);
  const pipeline::GradientCodec grads(compression, o.link.rows, o.link.cols);
  v1::LinkHello want;
  want.set_job_name("fuzz");
  want.set_seq_len(o.link.rows);
  want.set_d_model(o.link.cols);
  want.set_plan(3);
  want.set_link_protocol(2);

  for (int frames = 0; !in.empty() && frames < 16; ++frames) {
    const std::string_view bytes = in.Record();
    v1::LinkFrame f;
    if (!f.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) continue;
    switch (f.body_case()) {
      case v1::LinkFrame::kActivations: {
        if (f.activations().eval()) {
          std::vector<float> acts;
          (void)(*receiver)->ApplyEval(f.activations(), mb, &acts);
          break;
        }
        std::vector<uint64_t> missing;
        if (!(*receiver)->Apply(f.activations(), &missing).ok() || !missing.empty()) break;
        std::vector<float> acts;
        if (!(*receiver)->Take(&acts).ok()) return 0;
        ++micro_batch;
        if (!begin().ok()) return 0;
        break;
      }
      case v1::LinkFrame::kGradients: {
        std::vector<float> out;
        (void)grads.Decode(f.gradients().grad(), mb, &out);
        DecodeTied(f.gradients().tied());
        break;
      }
      case v1::LinkFrame::kCommit:
        DecodeTied(f.commit().tied());
        break;
      case v1::LinkFrame::kHello: {
        const v1::LinkHello& got = f.hello();
        if (got.plan() == want.plan()) (void)(got.SerializeAsString() == want.SerializeAsString());
        (void)got.ShortDebugString();
        break;
      }
      default:
        break;
    }
  }
  (void)(*receiver)->Close();
  return 0;
}
