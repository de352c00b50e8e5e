// One interface for the data-parallel optimizers over a flat parameter
// vector (QuantizedAdam, which is also the AdamW baseline, and DiLoCo),
// torch-free, and the factory that builds a stage's pair of them from a job.
//
//   DataParallelOptimizers o = MakeDataParallelOptimizers(job, layout);
//   if (o.tied) AQSWARM_RETURN_IF_ERROR(o.tied->Step(ex, lr, tied_params, tied_grads));
//   AQSWARM_RETURN_IF_ERROR(o.stage->Step(ex, lr, params, grads));
//
// A third optimizer implements DataParallelOptimizer and gets a case in
// MakeDataParallelOptimizers; nothing else changes.
//
// Not thread-safe.
#ifndef AQSWARM_PIPELINE_DP_OPTIMIZER_H_
#define AQSWARM_PIPELINE_DP_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "pipeline/dp_allreduce.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

// What one data-parallel step did (events.proto StepDataParallel.kind holds
// its name).
enum class DpStepKind {
  kNone,        // no step yet
  kAdamW,       // AdamW on the float32 mean gradient (dp.optimizer adamw)
  kWarmup,      // QuantizedAdam's warm-up: AdamW on the mean gradient
  kCompressed,  // QuantizedAdam's compressed momentum exchange (also a local-step sync)
  kRefresh,     // QuantizedAdam's variance refresh
  kLocal,       // no traffic: QuantizedAdam's local step, DiLoCo's inner step
  kOuter,       // DiLoCo: some fragment's outer step
};
// "", "adamw", "warmup", "compressed", "refresh", "local", "outer".
std::string_view DpStepKindName(DpStepKind kind);

// Named flat buffers of an optimizer's state (checkpointed, handed to a
// joining replica), and what a checkpoint holds beside them.
using DpState = std::vector<std::pair<std::string, std::vector<float>>>;
struct DpStateMeta {
  int64_t step = 0;     // the optimizer's steps so far
  bool frozen = false;  // QuantizedAdam: the variance is frozen
};

class DataParallelOptimizer {
 public:
  virtual ~DataParallelOptimizer() = default;
  // One step with this replica's (already clipped) gradient.
  virtual absl::Status Step(ReplicaExchange& ex, double lr, absl::Span<float> params,
                            absl::Span<const float> grads) = 0;
  virtual DpStepKind last_step_kind() const = 0;
  virtual const AllReduceStats& stats() const = 0;
  virtual std::vector<std::pair<std::string, const std::vector<float>*>> NamedState() const = 0;
  virtual DpStateMeta meta() const = 0;
  // InvalidArgument naming the buffer on a state that does not fit; nothing
  // is changed then.
  virtual absl::Status LoadState(const DpState& state, const DpStateMeta& meta) = 0;
  // The parameters every replica holds the same where the live ones differ
  // between syncs (DiLoCo's anchor; empty before its first step); null when
  // the live parameters are the replicas' common ones.
  virtual const std::vector<float>* shared_params() const { return nullptr; }
  // Drops this replica's own progress since the last sync: params = the
  // shared ones (DiLoCo: RestartFromAnchor). A no-op where there is none.
  virtual absl::Status RestartFromShared(absl::Span<float> params) { return absl::OkStatus(); }
  // Training goes on at `step` (>= this optimizer's steps so far): the
  // steps between are skipped, so its schedule (DiLoCo's outer steps) meets
  // the replicas'. Only DiLoCo skips; the others accept their own step only.
  virtual absl::Status SkipTo(int64_t step) {
    if (step == meta().step) return absl::OkStatus();
    return absl::FailedPreconditionError("only diloco's inner steps can be skipped");
  }
};

// The code width of the tied-embedding copy's Global-QSGD exchange: dp.bits,
// widened to the narrowest width whose codes carry the sums of
// data_parallel replicas (3 bits for 2 to 4 replicas); 0 when none does.
int TiedGlobalQsgdBits(const v1::JobSpec& job);

// How a stage's flat vector is laid out: the tied-embedding copy first
// (tied_n values, 0 = none), then `sizes` (big tensors first: the first
// num_compressed values are compressed), with `decay` per element of the
// part after the tied copy.
struct DpLayout {
  int64_t tied_n = 0;
  int64_t num_compressed = 0;
  std::vector<int64_t> sizes;
  std::vector<uint8_t> decay;
};

struct DataParallelOptimizers {
  std::unique_ptr<DataParallelOptimizer> stage;  // the stage's parameters after the tied copy
  std::unique_ptr<DataParallelOptimizer> tied;   // the tied-embedding copy's, or null
};

// dp.optimizer adamw and quantized_adam: QuantizedAdam; diloco: DiLoCo. The
// tied copy's (first and last stage) runs with the same rounds, inputs and
// state at both ends, on Global-QSGD (no error feedback: its state must not
// depend on the replica, since a replica that replaces a lost one takes
// another's state and the other stage keeps its own) at
// TiedGlobalQsgdBits, in rounds 2 and 3; under dp.robust float32 instead
// (Global-QSGD sums codes without decoding them, so none can be clipped).
DataParallelOptimizers MakeDataParallelOptimizers(const v1::JobSpec& job, const DpLayout& layout);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_DP_OPTIMIZER_H_
