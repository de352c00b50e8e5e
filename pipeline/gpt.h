// GPT-2 as a StageModel (pipeline/stage_model.h; INTERNAL to pipeline/:
// includes torch).
//
// Architecture: token + position embeddings, pre-LN blocks with causal
// self-attention and a GELU(tanh) MLP, final LayerNorm, LM head. Linear
// weights use GPT-2's Conv1D layout [in, out] (y = x W + b), so Hugging Face
// safetensors load without transposes. The head is `wte` itself where one
// stage holds both (tie_embeddings), else a weight of its own,
// "lm_head.weight": with tie_embeddings the last stage's copy of `wte`
// (initialised from wte's seed), without it an independent matrix.
//
//   GptStage stage(spec, StageRangeFor(spec, /*stage=*/0, /*num_stages=*/2), seed);
//   torch::Tensor h = stage->forward(ids);        // [B,T] int64 -> [B,T,D]
#ifndef AQSWARM_PIPELINE_GPT_H_
#define AQSWARM_PIPELINE_GPT_H_

#include <torch/torch.h>

#include <string>
#include <vector>

#include "pipeline/stage_model.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

class GptStageImpl : public StageModel {
 public:
  GptStageImpl(const v1::ModelSpec& spec, StageRange range, uint64_t seed);

  torch::Tensor forward(const torch::Tensor& input) override;

  // Kept for callers that name the family: NextTokenLoss.
  static torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& targets) {
    return NextTokenLoss(logits, targets);
  }

 private:
  struct Block {
    torch::Tensor ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b;
    torch::Tensor ln2_w, ln2_b, fc_w, fc_b, proj_w, proj_b;
    std::vector<torch::Tensor> params() const {
      return {ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, proj_w, proj_b};
    }
  };
  // x: the float32 residual stream; LayerNorm and softmax in float32, the
  // rest in the compute dtype (stage_model.h).
  torch::Tensor BlockForward(const Block& b, const torch::Tensor& x) const;

  torch::Tensor wpe_, ln_f_w_, ln_f_b_;
  std::vector<Block> blocks_;
};
TORCH_MODULE(GptStage);


}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_GPT_H_
