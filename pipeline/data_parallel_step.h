// A stage's data-parallel step (StageWorker::StepDataParallel): the flat
// copy of the stage's parameters and gradients, its optimizers
// (pipeline/dp_optimizer.h: one for the stage, one for a tied-embedding
// copy), the delayed update's thread (dp.delayedUpdate) and the optimizer
// state in checkpoints. Included by stage_worker.cc only (it names torch
// through stage_io.h).
//
// The flat vector: a tied-embedding copy first (its own optimizer), then the
// big tensors (the compressed part), then the small ones. It is laid out at
// the first Step or Load.
//
// Not thread-safe (the delayed update's thread is its own).
#ifndef AQSWARM_PIPELINE_DATA_PARALLEL_STEP_H_
#define AQSWARM_PIPELINE_DATA_PARALLEL_STEP_H_

#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checksum.h"
#include "pipeline/dp_optimizer.h"
#include "pipeline/stage_io.h"

namespace aqswarm::pipeline {

// The data-parallel part of a checkpoint's metadata, typed. On disk (as
// older builds wrote it): "dp_step" (decimal), "dp_frozen" ("1"/"0",
// QuantizedAdam only) and "dp_optimizer" ("diloco"; absent for
// quantized_adam and adamw).
struct DpCheckpointMeta {
  bool diloco = false;
  DpStateMeta state;
  void WriteTo(std::map<std::string, std::string>& metadata) const;
  // DataLoss naming `path` on a bad dp_step.
  static absl::StatusOr<DpCheckpointMeta> ReadFrom(const std::map<std::string, std::string>& metadata,
                                                   const std::string& path);
};

class DataParallelStep {
 public:
  DataParallelStep(const v1::JobSpec& job, StageModel* model);
  ~DataParallelStep();

  // One step: flattens the parameters (unless a delayed update keeps its
  // own) and the gradients clipped by the pipeline's squared norm
  // `total_sq`, refuses a non-finite gradient before anything is sent,
  // steps the optimizers and copies the result into the model (dp.delayedUpdate:
  // starts the step in the background and applies the previous one,
  // extrapolated). May throw torch's exceptions (the caller guards).
  absl::Status Step(int64_t step, double total_sq, ReplicaExchange& ex);
  // The job's end: DiLoCo puts the model on the anchors, a delayed update
  // lands.
  absl::Status Finish();
  // Waits for the delayed update in flight, if any; a failed update fails
  // every later call.
  absl::Status Join();

  // The last update this thread saw finish: its kind and the optimizers'
  // counters after it (a delayed update's once it is joined).
  DpStepKind last_step_kind() const { return kind_; }
  const AllReduceStats& stats() const { return stats_; }
  // AdamW's float32 all-reduce of the whole stage at every step so far: the
  // baseline of the DP traffic.
  uint64_t raw_bytes() const { return raw_total_; }
  // Adds the parameters every replica shares to `c` when they are not the
  // live ones (DiLoCo's anchors); false (nothing added) otherwise.
  bool HashShared(Checksummer& c) const;

  // The optimizers' state (and a delayed update's parameters) into `extra`.
  absl::Status Save(ExtraCheckpointState& extra);
  // From a loaded checkpoint's `extra` (the stage's parameters are loaded
  // already); FailedPrecondition when it holds another optimizer's state.
  absl::Status Load(ExtraCheckpointState& extra, const std::string& path);
  // The model's parameters (the tied copy's already are, after Load) become
  // the shared ones where the optimizer keeps such (DiLoCo's anchor; its own
  // m, v restart), and the optimizers go on at `step` (SkipTo).
  absl::Status RestartFromShared(int64_t step);

 private:
  void Init();
  absl::Status StepOptimizers(ReplicaExchange& ex, double lr);
  AllReduceStats OptimizerStats() const;
  // Copies params_ into the model's parameters and zeroes their gradients.
  // predict (delayed updates, once an update has landed): params_ plus the
  // update that took prev_params_ to it, 2 params_ - prev_params_.
  void Apply(bool predict = false);

  const v1::JobSpec& job_;
  StageModel* const model_;
  DataParallelOptimizers opt_;  // empty until Init
  int64_t tied_n_ = 0;          // the tied copy's elements, at the front of params_
  std::vector<torch::Tensor> order_;
  std::vector<float> params_, grads_;
  AllReduceStats stats_;  // as of the last update this thread saw finish
  DpStepKind kind_ = DpStepKind::kNone;
  uint64_t raw_total_ = 0;
  // dp.delayed_update: params_ holds the optimizer's parameters (one update
  // ahead of the model's while update_ runs or until the next step applies it).
  bool master_ = false;
  std::vector<float> prev_params_;  // params_ before the update in flight (empty before the first)
  std::vector<float> predicted_;    // Apply's scratch for the prediction (kept between steps)
  std::thread update_;
  absl::Status update_status_;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_DATA_PARALLEL_STEP_H_
