// The configuration header of exchange_chunk_fuzz inputs, shared with the
// seed generator so that its seeds decode as the target reads them.
#ifndef AQSWARM_FUZZ_EXCHANGE_FUZZ_CONFIG_H_
#define AQSWARM_FUZZ_EXCHANGE_FUZZ_CONFIG_H_

#include <cstdint>

#include "fuzz/fuzz_input.h"
#include "pipeline/dp_allreduce.h"

namespace aqswarm::fuzz {

struct ExchangeFuzzConfig {
  bool global_qsgd = false;
  int size = 2, rank = 0;
  int64_t n = 1;
  uint8_t codec = 0, bits = 0, bucket = 0, levels = 0;
  bool error_feedback = false;

  static ExchangeFuzzConfig Read(FuzzInput& in) {
    ExchangeFuzzConfig c;
    c.global_qsgd = in.U8() & 1;
    c.size = 2 + in.U8() % 3;
    c.rank = in.U8() % c.size;
    c.n = 1 + in.U16() % 512;
    c.codec = in.U8();
    c.bits = in.U8();
    c.bucket = in.U8();
    c.error_feedback = in.U8() & 1;
    c.levels = in.U8();
    return c;
  }
  void Write(FuzzOutput& out) const {
    out.U8(global_qsgd).U8(size - 2).U8(rank).U16(static_cast<uint16_t>(n - 1)).U8(codec).U8(bits).U8(bucket);
    out.U8(error_feedback).U8(levels);
  }
  pipeline::AllReduceOptions Options() const {
    static constexpr v1::Codec kCodecs[] = {v1::CODEC_RAW_F32, v1::CODEC_RAW_F16, v1::CODEC_QSGD, v1::CODEC_MINMAX};
    pipeline::AllReduceOptions o;
    o.codec.codec = kCodecs[codec % 4];
    o.codec.bits = 2 + bits % 7;
    o.codec.bucket_size = 1 + bucket;
    o.codec.min_compress_elements = 1;
    o.bucket_elements = 1 + bucket * 2;
    return o;
  }
  pipeline::GlobalQsgdAllReduceOptions GlobalOptions() const {
    pipeline::GlobalQsgdAllReduceOptions o;
    o.bits = 2 + bits % 7;
    o.levels = (levels & 1) ? v1::LEVELS_EXPONENTIAL : v1::LEVELS_UNIFORM;
    o.bucket_size = 1 + bucket;
    return o;
  }
};

}  // namespace aqswarm::fuzz

#endif  // AQSWARM_FUZZ_EXCHANGE_FUZZ_CONFIG_H_
