#include "pipeline/stage_model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "pipeline/gpt.h"

namespace aqswarm::pipeline {
namespace {

uint64_t NameSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name, mixed with the seed
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return Mix64(seed ^ h);
}

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

torch::Tensor StageModel::tied_embedding() const {
  if (!spec_.tie_embeddings() || range_.num_stages < 2) return {};
  return range_.has_embedding() ? embedding_ : range_.has_head() ? head_ : torch::Tensor();
}

absl::StatusOr<std::shared_ptr<StageModel>> MakeStageModel(const v1::ModelSpec& spec, StageRange range,
                                                           uint64_t seed) {
  if (spec.family().empty() || spec.family() == "gpt2") return std::make_shared<GptStageImpl>(spec, range, seed);
  return absl::InvalidArgumentError(absl::StrCat("model.family '", spec.family(), "': expected gpt2 or llama"));
}

torch::Tensor NextTokenLoss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32),
                                              targets.reshape({-1}));
}

int64_t ModelParameterCount(const v1::ModelSpec& spec) { return GptParameterCount(spec); }

}  // namespace aqswarm::pipeline
