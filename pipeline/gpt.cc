#include "pipeline/gpt.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "pipeline/job_spec.h"

namespace aqswarm::pipeline {
GptStageImpl::GptStageImpl(const v1::ModelSpec& spec, StageRange range, uint64_t seed)
    : StageModel(spec, range, seed) {
  const int64_t d = spec.d_model(), v = spec.vocab_size(), t = spec.seq_len(), f = FeedForwardDim(spec);
  const double std_proj = 0.02 / std::sqrt(2.0 * spec.n_layer());
  auto normal = [&](const std::string& name, std::vector<int64_t> shape, double sd) {
    return NormalParam(name, std::move(shape), sd);
  };
  if (range.has_embedding()) {
    embedding_ = normal("wte.weight", {v, d}, 0.02);
    wpe_ = normal("wpe.weight", {t, d}, 0.01);
  }
  for (int i = range.first_block; i < range.end_block; ++i) {
    const std::string p = absl::StrCat("h.", i, ".");
    Block b;
    b.ln1_w = AddParam(p + "ln_1.weight", torch::ones({d}));
    b.ln1_b = AddParam(p + "ln_1.bias", torch::zeros({d}));
    b.attn_w = normal(p + "attn.c_attn.weight", {d, 3 * d}, 0.02);
    b.attn_b = AddParam(p + "attn.c_attn.bias", torch::zeros({3 * d}));
    b.attn_proj_w = normal(p + "attn.c_proj.weight", {d, d}, std_proj);
    b.attn_proj_b = AddParam(p + "attn.c_proj.bias", torch::zeros({d}));
    b.ln2_w = AddParam(p + "ln_2.weight", torch::ones({d}));
    b.ln2_b = AddParam(p + "ln_2.bias", torch::zeros({d}));
    b.fc_w = normal(p + "mlp.c_fc.weight", {d, f}, 0.02);
    b.fc_b = AddParam(p + "mlp.c_fc.bias", torch::zeros({f}));
    b.proj_w = normal(p + "mlp.c_proj.weight", {f, d}, std_proj);
    b.proj_b = AddParam(p + "mlp.c_proj.bias", torch::zeros({d}));
    blocks_.push_back(b);
  }
  if (range.has_head()) {
    ln_f_w_ = AddParam("ln_f.weight", torch::ones({d}));
    ln_f_b_ = AddParam("ln_f.bias", torch::zeros({d}));
    if (spec.tie_embeddings() && range.has_embedding()) {
      head_ = embedding_;
    } else {
      // Tied: a copy of wte initialised from wte's own seed. Untied: its own.
      head_ = NormalParam(TiedEmbeddingName(), {v, d}, 0.02, spec.tie_embeddings() ? "wte.weight" : "");
    }
  }
}

torch::Tensor GptStageImpl::BlockForward(const Block& b, const torch::Tensor& x) const {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const int64_t H = spec_.n_head(), hd = D / H;
  auto c = [this](const torch::Tensor& t) { return ToCompute(t); };
  torch::Tensor h = c(torch::layer_norm(x, {D}, b.ln1_w, b.ln1_b, 1e-5));
  torch::Tensor qkv = torch::addmm(c(b.attn_b), h.reshape({B * T, D}), c(b.attn_w))
                          .view({B, T, 3, H, hd})
                          .permute({2, 0, 3, 1, 4});  // [3,B,H,T,hd]
  torch::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)).to(torch::kFloat32) *
                      (1.0 / std::sqrt(static_cast<double>(hd)));
  torch::Tensor mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device()))
                           .triu(1);
  att = c(att.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1));
  torch::Tensor y = torch::matmul(att, v).transpose(1, 2).reshape({B * T, D});
  torch::Tensor out = x + torch::addmm(c(b.attn_proj_b), y, c(b.attn_proj_w)).view({B, T, D}).to(torch::kFloat32);
  h = c(torch::layer_norm(out, {D}, b.ln2_w, b.ln2_b, 1e-5).reshape({B * T, D}));
  torch::Tensor m = torch::gelu(torch::addmm(c(b.fc_b), h, c(b.fc_w)), "tanh");
  return out + torch::addmm(c(b.proj_b), m, c(b.proj_w)).view({B, T, D}).to(torch::kFloat32);
}

torch::Tensor GptStageImpl::forward(const torch::Tensor& input) {
  torch::Tensor x;
  if (range_.has_embedding()) {
    const int64_t T = input.size(1);
    x = torch::embedding(embedding_, input) + wpe_.slice(0, 0, T).unsqueeze(0);
  } else {
    x = input.to(torch::kFloat32);
  }
  for (const Block& b : blocks_) {
    x = RunBlock([this, b](const torch::Tensor& in) { return BlockForward(b, in); }, x, b.params());
  }
  if (range_.has_head()) {
    const int64_t D = x.size(2);
    x = ToCompute(torch::layer_norm(x, {D}, ln_f_w_, ln_f_b_, 1e-5));
    x = torch::matmul(x, ToCompute(head_).t()).to(torch::kFloat32);
  }
  return x;
}

}  // namespace aqswarm::pipeline
