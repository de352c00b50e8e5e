// AdamW over a stage's named parameters (internal to pipeline/, includes torch).
//
// Written out rather than torch::optim::AdamW so that its state is addressable
// by parameter name (checkpoints, state transfer to a joining replica) and so
// QuantizedAdam can share it. Weight decay applies to matrices only (not to
// biases, LayerNorm gains or 1-D tensors), decoupled as in AdamW.
//
//   AdamW opt(stage->named_params(), job.optimizer());
//   loss.backward(); opt.Step(lr, opt.GradSquaredNorm());
#ifndef AQSWARM_PIPELINE_OPTIMIZER_H_
#define AQSWARM_PIPELINE_OPTIMIZER_H_

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

class AdamW {
 public:
  AdamW(std::vector<std::pair<std::string, torch::Tensor>> params, const v1::OptimizerSpec& spec);

  // Sum of squares of the gradients held by these parameters.
  double GradSquaredNorm() const;
  // Clips by the global L2 norm sqrt(total_grad_squared_norm) (when
  // spec.grad_clip > 0; pass GradSquaredNorm() when these parameters are the
  // whole model), applies one update with learning rate `lr`, and zeroes the
  // gradients.
  void Step(double lr, double total_grad_squared_norm);
  void ZeroGrad();
  int64_t step() const { return step_; }

  // State by name: "exp_avg/<param>", "exp_avg_sq/<param>"; the step count is
  // returned separately. Used by checkpoints and state transfer.
  std::vector<std::pair<std::string, torch::Tensor>> NamedState() const;
  // Restores state written by NamedState(); shapes must match.
  absl::Status LoadState(const std::map<std::string, torch::Tensor>& state, int64_t step);

 private:
  struct Slot {
    std::string name;
    torch::Tensor param, exp_avg, exp_avg_sq;
    bool decay;
  };
  std::vector<Slot> slots_;
  v1::OptimizerSpec spec_;
  int64_t step_ = 0;
};

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_OPTIMIZER_H_
