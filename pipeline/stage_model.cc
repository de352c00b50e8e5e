#include "pipeline/stage_model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "pipeline/gpt.h"
#include "pipeline/llama.h"

namespace aqswarm::pipeline {
namespace {

uint64_t NameSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name, mixed with the seed
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return Mix64(seed ^ h);
}

// The block function of one RecomputedBlock call, kept for its backward.
struct BlockHolder : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> block;
};

// y = block(x), keeping only x and the parameters: forward runs without grad
// (Function::apply disables it), backward runs the block again with grad and
// differentiates it w.r.t. x and the parameters (libtorch 1.13 has no C++
// checkpoint utility). Inputs: block (not a tensor), x, the parameters.
struct RecomputedBlock : torch::autograd::Function<RecomputedBlock> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               std::function<torch::Tensor(const torch::Tensor&)> block, const torch::Tensor& x,
                               torch::TensorList params) {
    auto holder = c10::make_intrusive<BlockHolder>();
    holder->block = block;
    ctx->saved_data["block"] = c10::IValue::make_capsule(std::move(holder));
    std::vector<torch::Tensor> saved{x};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    return block(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto holder = c10::static_intrusive_pointer_cast<BlockHolder>(ctx->saved_data["block"].toCapsule());
    torch::autograd::variable_list saved = ctx->get_saved_variables();
    torch::autograd::variable_list inputs;
    inputs.push_back(saved[0].detach().requires_grad_(true));
    for (size_t i = 1; i < saved.size(); ++i) inputs.push_back(saved[i]);
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = holder->block(inputs[0]);
    }
    torch::autograd::variable_list grads =
        torch::autograd::grad({y}, inputs, {grad_out[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                              /*allow_unused=*/true);
    grads.insert(grads.begin(), torch::Tensor());  // for `block`
    return grads;
  }
};

}  // namespace

StageRange StageRangeFor(const v1::ModelSpec& spec, int stage, int num_stages) {
  StageRange r;
  r.stage = stage;
  r.num_stages = num_stages;
  const int n = static_cast<int>(spec.n_layer());
  const int base = n / num_stages, extra = n % num_stages;
  r.first_block = stage * base + std::min(stage, extra);
  r.end_block = r.first_block + base + (stage < extra ? 1 : 0);
  return r;
}

torch::Tensor StageModel::AddParam(const std::string& name, torch::Tensor init) {
  std::string reg = name;
  for (char& c : reg) c = (c == '.') ? '_' : c;
  torch::Tensor p = register_parameter(reg, std::move(init));
  named_.emplace_back(name, p);
  return p;
}

torch::Tensor StageModel::NormalParam(const std::string& name, std::vector<int64_t> shape, double stddev,
                                      const std::string& seed_name) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(NameSeed(seed_, seed_name.empty() ? name : seed_name));
  torch::Tensor t = torch::empty(shape, torch::kFloat32);
  t.normal_(0.0, stddev, gen);
  return AddParam(name, std::move(t));
}

torch::Tensor StageModel::ToCompute(const torch::Tensor& t) const {
  if (compute_dtype_ == torch::kFloat32 || t.scalar_type() == compute_dtype_) return t;
  if (compute_dtype_ == torch::kHalf && t.device().is_cpu()) return t.to(torch::kHalf).to(t.scalar_type());
  return t.to(compute_dtype_);
}

torch::Tensor StageModel::RunBlock(std::function<torch::Tensor(const torch::Tensor&)> block, const torch::Tensor& x,
                                   const std::vector<torch::Tensor>& params) const {
  if (!spec_.recompute() || !torch::GradMode::is_enabled()) return block(x);
  return RecomputedBlock::apply(std::move(block), x, torch::TensorList(params));
}

torch::Tensor StageModel::tied_embedding() const {
  if (!spec_.tie_embeddings() || range_.num_stages < 2) return {};
  return range_.has_embedding() ? embedding_ : range_.has_head() ? head_ : torch::Tensor();
}

absl::StatusOr<std::shared_ptr<StageModel>> MakeStageModel(const v1::ModelSpec& spec, StageRange range,
                                                           uint64_t seed) {
  switch (spec.family()) {
    case v1::ModelSpec::Family::UNSPECIFIED:  // the default
    case v1::ModelSpec::Family::gpt2: return std::make_shared<GptStageImpl>(spec, range, seed);
    case v1::ModelSpec::Family::llama: return std::make_shared<LlamaStageImpl>(spec, range, seed);
    default:
      return absl::InvalidArgumentError(absl::StrCat("model.family ", spec.family(), ": expected gpt2 or llama"));
  }
}

torch::Dtype ComputeDtypeFor(v1::JobSpec::Precision::Value precision) {
  switch (precision) {
    case v1::JobSpec::Precision::bf16: return torch::kBFloat16;
    case v1::JobSpec::Precision::fp16: return torch::kHalf;
    default: return torch::kFloat32;
  }
}

torch::Tensor NextTokenLoss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32),
                                              targets.reshape({-1}));
}

}  // namespace aqswarm::pipeline
