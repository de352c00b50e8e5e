// One pipeline stage of a decoder-only language model, whatever its family
// (INTERNAL to pipeline/: includes torch).
//
// A stage is a contiguous block range; stage 0 also owns the token embedding,
// the last stage the final norm, the LM head and the loss. Parameters carry
// their global Hugging Face names (GPT-2: "wte.weight", "h.3.attn.c_attn.weight")
// and are initialised from a generator seeded by (seed, name), so a model
// split into K stages starts bit-identical to the unsplit one.
//
// Tied embeddings across stages (model.tie_embeddings, K > 1): stage 0's
// embedding and the last stage's head are two copies of one matrix
// (tied_embedding()); the step protocol sums their gradients every step
// (stage/step_protocol.h), so both copies stay bit-identical.
//
// Compute precision (set_compute_dtype; job.precision): parameters stay
// float32 masters and forward() casts each weight at its use (a
// differentiable cast, so gradients land in float32 .grad); matmuls, attention
// and the MLP run in the compute dtype, while the residual stream, norm
// statistics and the attention softmax stay float32 (as Megatron's
// fp32_residual_connection), and forward() returns float32, so links and the
// optimizer never see another dtype. libtorch 1.13 has no float16 CPU kernels
// for matmul/softmax: on CPU, kHalf rounds every cast operand to float16 and
// computes in float32 (float16 values, float32 arithmetic).
//
// Recompute (model.recompute): each block runs without keeping its
// activations and is run again, with grad, in backward (RunBlock).
//
//   std::shared_ptr<StageModel> m = MakeStageModel(spec, StageRangeFor(spec, 0, 2), seed).value();
//   m->set_compute_dtype(torch::kBFloat16);   // optional
//   torch::Tensor h = m->forward(ids);        // [B,T] int64 -> [B,T,D] float32
#ifndef AQSWARM_PIPELINE_STAGE_MODEL_H_
#define AQSWARM_PIPELINE_STAGE_MODEL_H_

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

struct StageRange {
  int stage = 0;
  int num_stages = 1;
  int first_block = 0;  // inclusive
  int end_block = 0;    // exclusive
  bool has_embedding() const { return stage == 0; }
  bool has_head() const { return stage == num_stages - 1; }
};

// Even split of n_layer blocks over num_stages (earlier stages take the
// remainder: they also carry fewer non-block costs than the head stage).
StageRange StageRangeFor(const v1::ModelSpec& spec, int stage, int num_stages);

class StageModel : public torch::nn::Module {
 public:
  // Stage 0: int64 token ids [B,T]. Other stages: hidden [B,T,D].
  // Returns hidden [B,T,D], or logits [B,T,V] on the last stage.
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;

  // Parameters by global Hugging Face name, in a fixed order.
  const std::vector<std::pair<std::string, torch::Tensor>>& named_params() const { return named_; }
  const StageRange& range() const { return range_; }
  const v1::ModelSpec& spec() const { return spec_; }
  // With tie_embeddings across stages: this stage's copy of the tied matrix
  // (the embedding on stage 0, the head on the last stage); undefined
  // otherwise (also for a single stage, where one tensor is both).
  torch::Tensor tied_embedding() const;

  // kFloat32 (default), kBFloat16 or kHalf: the dtype forward() computes in.
  void set_compute_dtype(torch::Dtype dtype) { compute_dtype_ = dtype; }
  torch::Dtype compute_dtype() const { return compute_dtype_; }

 protected:
  StageModel(const v1::ModelSpec& spec, StageRange range, uint64_t seed) : spec_(spec), range_(range), seed_(seed) {}
  // Registers `init` as parameter `name` (its global name; dots become
  // underscores for torch's registry).
  torch::Tensor AddParam(const std::string& name, torch::Tensor init);
  // init ~ N(0, stddev^2) from a generator seeded by (seed, seed_name).
  torch::Tensor NormalParam(const std::string& name, std::vector<int64_t> shape, double stddev,
                            const std::string& seed_name = "");
  // `t` in the compute dtype (t itself for float32; differentiable). For
  // kHalf on CPU: rounded to float16, returned as float32 (see above).
  torch::Tensor ToCompute(const torch::Tensor& t) const;
  // block(x) for one block whose parameters are `params`. With
  // spec.recompute() and grad enabled, the block runs without grad and is
  // run again in backward (block must be deterministic and must use only x
  // and `params` as differentiable inputs; its parameters must outlive the
  // backward pass).
  torch::Tensor RunBlock(std::function<torch::Tensor(const torch::Tensor&)> block, const torch::Tensor& x,
                         const std::vector<torch::Tensor>& params) const;

  v1::ModelSpec spec_;
  StageRange range_;
  uint64_t seed_;
  std::vector<std::pair<std::string, torch::Tensor>> named_;
  torch::Tensor embedding_, head_;  // token embedding (stage 0), LM head (last stage)
  torch::Dtype compute_dtype_ = torch::kFloat32;
};

// Name of the last stage's head weight where it is not the embedding itself
// (GPT-2 and Llama alike: Hugging Face's "lm_head.weight").
inline const char* TiedEmbeddingName() { return "lm_head.weight"; }

// The stage of spec.family's model (pipeline/gpt.h, pipeline/llama.h).
absl::StatusOr<std::shared_ptr<StageModel>> MakeStageModel(const v1::ModelSpec& spec, StageRange range,
                                                           uint64_t seed);

// The compute dtype of job.precision: bf16 -> kBFloat16, fp16 -> kHalf,
// anything else (the validated default fp32) -> kFloat32.
torch::Dtype ComputeDtypeFor(v1::JobSpec::Precision::Value precision);

// Mean next-token cross-entropy of logits [B,T,V] against targets [B,T].
torch::Tensor NextTokenLoss(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_STAGE_MODEL_H_
