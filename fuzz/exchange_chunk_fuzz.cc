// libFuzzer target: GradientExchange chunks as a replica consumes them. The
// data-parallel allreduce (pipeline::AllReduceMean, GlobalQsgdAllReduceMean)
// runs as rank `rank` of `size` against an exchange whose every Receive
// answers the next record, parsed as a v1::ExchangeChunk (the gRPC mailbox
// matches chunks by step/round/phase/bucket/chunk, so those are set to what
// was asked for; the tensor, from_rank and the rest are the sender's).
// Every decode, Global-QSGD combine and error-feedback update sees
// attacker bytes; the allreduce must end in a status, never a crash.
// Input: [algorithm u8][size u8][rank u8][n u16][codec u8][bits u8]
//        [bucket u8][error feedback u8][levels u8] then records
//        (u16 length + ExchangeChunk bytes). Seeds: fuzz/corpus/exchange_chunk
//        (fuzz/seed_gen.cc records what honest replicas send).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz/exchange_fuzz_config.h"
#include "fuzz/fuzz_input.h"
#include "pipeline/dp_allreduce.h"
#include "fuzz/quiet_protobuf.h"

using namespace aqswarm;

namespace {

class ReplayExchange final : public pipeline::ReplicaExchange {
 public:
  ReplayExchange(int rank, int size, fuzz::FuzzInput* in) : rank_(rank), size_(size), in_(in) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status Send(int to, const v1::ExchangeChunk& chunk) override {
    if (to == rank_ || to < 0 || to >= size_) return absl::InvalidArgumentError("bad destination");
    return absl::OkStatus();
  }
  absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                            uint32_t bucket, uint32_t chunk) override {
    if (in_->empty()) return absl::DeadlineExceededError("no more chunks");
    const std::string_view bytes = in_->Record();
    v1::ExchangeChunk c;
    if (!c.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
      return absl::InvalidArgumentError("unparsable chunk");
    }
    c.set_step(step);
    c.set_round(round);
    c.set_phase(phase);
    c.set_bucket(bucket);
    c.set_chunk(chunk);
    return c;
  }

 private:
  const int rank_, size_;
  fuzz::FuzzInput* in_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  const fuzz::ExchangeFuzzConfig cfg = fuzz::ExchangeFuzzConfig::Read(in);
  std::vector<float> values(cfg.n);
  for (int64_t i = 0; i < cfg.n; ++i) values[i] = static_cast<float>((i * 37 + cfg.rank * 11) % 101 - 50) / 25.0f;
  std::vector<float> out(cfg.n);
  ReplayExchange ex(cfg.rank, cfg.size, &in);
  if (cfg.global_qsgd) {
    (void)pipeline::GlobalQsgdAllReduceMean(ex, cfg.GlobalOptions(), /*step=*/7, /*round=*/0, values,
                                            absl::MakeSpan(out));
  } else {
    std::vector<float> worker_error, server_error;
    (void)pipeline::AllReduceMean(ex, cfg.Options(), /*step=*/7, /*round=*/0, values, absl::MakeSpan(out),
                                  cfg.error_feedback ? &worker_error : nullptr,
                                  cfg.error_feedback ? &server_error : nullptr);
  }
  return 0;
}
