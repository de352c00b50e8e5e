#include "pipeline/dp_optimizer.h"

#include <algorithm>

#include "compression/codec.h"
#include "compression/global_qsgd.h"
#include "pipeline/diloco.h"
#include "pipeline/quantized_adam.h"

namespace aqswarm::pipeline {

std::string_view DpStepKindName(DpStepKind kind) {
  switch (kind) {
    case DpStepKind::kNone: return "";
    case DpStepKind::kAdamW: return "adamw";
    case DpStepKind::kWarmup: return "warmup";
    case DpStepKind::kCompressed: return "compressed";
    case DpStepKind::kRefresh: return "refresh";
    case DpStepKind::kLocal: return "local";
    case DpStepKind::kOuter: return "outer";
  }
  return "";
}

int TiedGlobalQsgdBits(const v1::JobSpec& job) {
  const int fits = compression::MinGlobalQsgdBits(v1::LEVELS_EXPONENTIAL,
                                                  static_cast<int>(std::max<uint32_t>(1, job.data_parallel())));
  return fits == 0 ? 0 : std::max(fits, static_cast<int>(job.dp().bits()));
}

DataParallelOptimizers MakeDataParallelOptimizers(const v1::JobSpec& job, const DpLayout& layout) {
  DataParallelOptimizers o;
  const int64_t n = static_cast<int64_t>(layout.decay.size()), tied_n = layout.tied_n;
  const int64_t tied_compressed = tied_n >= compression::kDefaultMinCompressElements ? tied_n : 0;
  if (job.dp().optimizer() == v1::DataParallelSpec::diloco) {
    const DiLoCoOptions options = DiLoCoOptionsFromJob(job);
    o.stage = std::make_unique<DiLoCo>(n, layout.num_compressed, layout.decay, options, layout.sizes);
    if (tied_n > 0) {
      // Its own rounds, one fragment; the anchor, the outer momentum and the
      // step are all the state that is not the pipeline's own.
      DiLoCoOptions to = options;
      to.first_round = 2;
      to.fragments = 1;
      to.compressed.codec.codec = v1::CODEC_GLOBAL_QSGD;
      to.compressed.codec.bits = TiedGlobalQsgdBits(job);
      if (to.compressed.robust != RobustAggregation::kOff) to.compressed.codec.codec = v1::CODEC_RAW_F32;
      o.tied = std::make_unique<DiLoCo>(tied_n, tied_compressed, std::vector<uint8_t>(tied_n, 1), to,
                                        std::vector<int64_t>{tied_n});
    }
    return o;
  }
  const QuantizedAdamOptions options = QuantizedAdamOptionsFromJob(job);
  o.stage = std::make_unique<QuantizedAdam>(n, layout.num_compressed, layout.decay, options, layout.sizes);
  if (tied_n > 0) {
    // m and v, the same on every replica, are all its state.
    QuantizedAdamOptions to = options;
    to.first_round = 2;
    to.compressed.codec.codec = v1::CODEC_GLOBAL_QSGD;
    to.compressed.codec.bits = TiedGlobalQsgdBits(job);
    // Under dp.robust: float32 means (AdamW, no error feedback either).
    if (to.compressed.robust != RobustAggregation::kOff) to.quantized = false;
    o.tied = std::make_unique<QuantizedAdam>(tied_n, tied_compressed, std::vector<uint8_t>(tied_n, 1), to,
                                             std::vector<int64_t>{tied_n});
  }
  return o;
}

}  // namespace aqswarm::pipeline
