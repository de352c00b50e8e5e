// Llama as a StageModel (pipeline/stage_model.h; INTERNAL to pipeline/:
// includes torch).
//
// Architecture (Hugging Face LlamaForCausalLM): token embedding, pre-norm
// blocks of RMSNorm -> grouped-query causal self-attention with rotary
// position embeddings -> residual, RMSNorm -> SwiGLU MLP
// down(silu(gate(x)) * up(x)) -> residual; final RMSNorm; LM head. No biases.
//
//   RMSNorm(x) = w * x / sqrt(mean(x^2) + eps), eps = model.norm_eps (0: 1e-5);
//     statistics in float32 whatever the compute dtype.
//   Rotary: HF's rotate_half convention; head_dim = d_model / n_head, position
//     p, pair i < head_dim/2 rotates by p * theta^(-2i/head_dim) with
//     theta = model.rope_theta (0: 10000); applied to q and k of every head.
//   Grouped-query attention: n_kv_head (0: n_head) key/value heads; query
//     head j reads key/value head j / (n_head / n_kv_head) (HF's repeat_kv).
//   d_ff (0: the Llama default) = 256 * ceil(floor(8 * d_model / 3) / 256),
//     the rule of Meta's reference code with multiple_of = 256 (d_model 4096
//     -> 11008, as Llama-7B).
//
// Parameter names are exactly Hugging Face's, weights in nn.Linear layout
// [out, in] (y = x W^T), so HF checkpoints map by name:
//   model.embed_tokens.weight [V, d]                  (stage 0)
//   model.layers.{i}.input_layernorm.weight [d]
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  q [H*hd, d], k/v [KV*hd, d], o [d, H*hd]
//   model.layers.{i}.post_attention_layernorm.weight [d]
//   model.layers.{i}.mlp.{gate,up}_proj.weight [d_ff, d], down_proj [d, d_ff]
//   model.norm.weight [d], lm_head.weight [V, d]      (last stage)
// With tie_embeddings on one stage the head IS model.embed_tokens.weight (no
// lm_head.weight); across stages the last stage's lm_head.weight is a copy
// initialised from embed_tokens' seed (the step protocol keeps the two equal).
// Init: matrices N(0, 0.02^2) seeded by (seed, name), norms ones.
//
//   LlamaStage stage(spec, StageRangeFor(spec, /*stage=*/0, /*num_stages=*/2), seed);
//   torch::Tensor h = stage->forward(ids);        // [B,T] int64 -> [B,T,D]
#ifndef AQSWARM_PIPELINE_LLAMA_H_
#define AQSWARM_PIPELINE_LLAMA_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "pipeline/stage_model.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

class LlamaStageImpl : public StageModel {
 public:
  LlamaStageImpl(const v1::ModelSpec& spec, StageRange range, uint64_t seed);

  torch::Tensor forward(const torch::Tensor& input) override;

 private:
  struct Block {
    torch::Tensor attn_norm, q, k, v, o, mlp_norm, gate, up, down;
    std::vector<torch::Tensor> params() const { return {attn_norm, q, k, v, o, mlp_norm, gate, up, down}; }
  };
  torch::Tensor BlockForward(const Block& b, const torch::Tensor& x) const;
  // RMSNorm of x (float32) with weight w, in the compute dtype.
  torch::Tensor Norm(const torch::Tensor& x, const torch::Tensor& w) const;
  // Rotary embedding of x [B, heads, T, hd] with cos/sin [T, hd].
  static torch::Tensor Rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

  int64_t n_kv_head_, d_ff_;
  double rope_theta_, norm_eps_;
  torch::Tensor norm_;
  std::vector<Block> blocks_;
};
TORCH_MODULE(LlamaStage);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_LLAMA_H_
