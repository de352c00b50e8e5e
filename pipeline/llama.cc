#include "pipeline/llama.h"

#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "pipeline/job_spec.h"

namespace aqswarm::pipeline {

LlamaStageImpl::LlamaStageImpl(const v1::ModelSpec& spec, StageRange range, uint64_t seed)
    : StageModel(spec, range, seed),
      n_kv_head_(KeyValueHeads(spec)),
      d_ff_(FeedForwardDim(spec)),
      rope_theta_(spec.rope_theta() == 0 ? 10000.0 : spec.rope_theta()),
      norm_eps_(spec.norm_eps() == 0 ? 1e-5 : spec.norm_eps()) {
  const int64_t d = spec.d_model(), v = spec.vocab_size();
  const int64_t hd = d / spec.n_head(), q_dim = spec.n_head() * hd, kv_dim = n_kv_head_ * hd;
  if (range.has_embedding()) embedding_ = NormalParam("model.embed_tokens.weight", {v, d}, 0.02);
  for (int i = range.first_block; i < range.end_block; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Block b;
    b.attn_norm = AddParam(p + "input_layernorm.weight", torch::ones({d}));
    b.q = NormalParam(p + "self_attn.q_proj.weight", {q_dim, d}, 0.02);
    b.k = NormalParam(p + "self_attn.k_proj.weight", {kv_dim, d}, 0.02);
    b.v = NormalParam(p + "self_attn.v_proj.weight", {kv_dim, d}, 0.02);
    b.o = NormalParam(p + "self_attn.o_proj.weight", {d, q_dim}, 0.02);
    b.mlp_norm = AddParam(p + "post_attention_layernorm.weight", torch::ones({d}));
    b.gate = NormalParam(p + "mlp.gate_proj.weight", {d_ff_, d}, 0.02);
    b.up = NormalParam(p + "mlp.up_proj.weight", {d_ff_, d}, 0.02);
    b.down = NormalParam(p + "mlp.down_proj.weight", {d, d_ff_}, 0.02);
    blocks_.push_back(b);
  }
  if (range.has_head()) {
    norm_ = AddParam("model.norm.weight", torch::ones({d}));
    if (spec.tie_embeddings() && range.has_embedding()) {
      head_ = embedding_;
    } else {
      // Tied across stages: a copy of the embedding from its own seed.
      head_ = NormalParam(TiedEmbeddingName(), {v, d}, 0.02,
                          spec.tie_embeddings() ? "model.embed_tokens.weight" : "");
    }
  }
}

torch::Tensor LlamaStageImpl::Norm(const torch::Tensor& x, const torch::Tensor& w) const {
  torch::Tensor xf = x.to(torch::kFloat32);
  return ToCompute(xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + norm_eps_) * w);
}

torch::Tensor LlamaStageImpl::Rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  torch::Tensor rotated = torch::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

torch::Tensor LlamaStageImpl::BlockForward(const Block& b, const torch::Tensor& x) const {
  // x: the float32 residual stream [B,T,D]; matmuls in the compute dtype.
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const int64_t H = spec_.n_head(), KV = n_kv_head_, hd = D / H;

  // Rotary tables [T, hd] (float32, then the compute dtype, as HF does).
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(x.device());
  torch::Tensor inv_freq =
      torch::pow(rope_theta_, torch::arange(0, hd, 2, f32.dtype(torch::kFloat64)) / static_cast<double>(hd))
          .reciprocal()
          .to(torch::kFloat32);
  torch::Tensor freqs = torch::outer(torch::arange(T, f32), inv_freq);
  torch::Tensor angles = torch::cat({freqs, freqs}, -1);
  torch::Tensor cos = ToCompute(angles.cos()), sin = ToCompute(angles.sin());

  torch::Tensor h = Norm(x, b.attn_norm);
  torch::Tensor q = torch::linear(h, ToCompute(b.q)).view({B, T, H, hd}).transpose(1, 2);
  torch::Tensor k = torch::linear(h, ToCompute(b.k)).view({B, T, KV, hd}).transpose(1, 2);
  torch::Tensor v = torch::linear(h, ToCompute(b.v)).view({B, T, KV, hd}).transpose(1, 2);
  q = Rope(q, cos, sin);
  k = Rope(k, cos, sin);
  if (KV != H) {  // query head j reads key/value head j / (H / KV)
    k = k.repeat_interleave(H / KV, /*dim=*/1);
    v = v.repeat_interleave(H / KV, /*dim=*/1);
  }
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)).to(torch::kFloat32) *
                         (1.0 / std::sqrt(static_cast<double>(hd)));
  torch::Tensor future = torch::ones({T, T}, f32.dtype(torch::kBool)).triu(1);
  torch::Tensor att = ToCompute(scores.masked_fill(future, -std::numeric_limits<float>::infinity()).softmax(-1));
  torch::Tensor y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, H * hd});
  torch::Tensor out = x + torch::linear(y, ToCompute(b.o)).to(torch::kFloat32);

  h = Norm(out, b.mlp_norm);
  torch::Tensor m = torch::silu(torch::linear(h, ToCompute(b.gate))) * torch::linear(h, ToCompute(b.up));
  return out + torch::linear(m, ToCompute(b.down)).to(torch::kFloat32);
}

torch::Tensor LlamaStageImpl::forward(const torch::Tensor& input) {
  torch::Tensor x = range_.has_embedding() ? torch::embedding(embedding_, input) : input.to(torch::kFloat32);
  for (const Block& b : blocks_) {
    x = RunBlock([this, b](const torch::Tensor& in) { return BlockForward(b, in); }, x, b.params());
  }
  if (range_.has_head()) x = torch::linear(Norm(x, norm_), ToCompute(head_)).to(torch::kFloat32);
  return x;
}

}  // namespace aqswarm::pipeline
