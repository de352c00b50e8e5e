#include "pipeline/stage_io.h"

#include "pipeline/gpt.h"

#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace aqswarm::pipeline {
namespace {

const SafetensorsFile::Entry* FindHf(const SafetensorsFile& f, const std::string& name) {
  if (const auto* e = f.Find(name)) return e;
  return f.Find("transformer." + name);
}

torch::Tensor ToTensor(const SafetensorsFile& f, const SafetensorsFile::Entry& e) {
  std::vector<float> v = f.ToFloat32(e);
  return torch::from_blob(v.data(), e.shape, torch::kFloat32).clone();
}

absl::Status CheckShape(const std::string& name, const SafetensorsFile::Entry& e, const torch::Tensor& p) {
  if (std::vector<int64_t>(p.sizes().begin(), p.sizes().end()) != e.shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape [", absl::StrJoin(e.shape, ","),
                                                   "] but the stage needs [", absl::StrJoin(p.sizes(), ","), "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckFloat(const SafetensorsFile::Entry& e) {
  if (e.is_float()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("tensor ", e.name, " has dtype ", e.dtype_name, "; expected F32, BF16 or F16"));
}

std::vector<StTensor> Flatten(const std::vector<std::pair<std::string, torch::Tensor>>& named,
                              const std::string& prefix, std::vector<torch::Tensor>* keep) {
  std::vector<StTensor> out;
  for (const auto& [name, t] : named) {
    keep->push_back(t.detach().contiguous().to(torch::kCPU, torch::kFloat32));
    const torch::Tensor& c = keep->back();
    out.push_back({prefix + name, std::vector<int64_t>(c.sizes().begin(), c.sizes().end()),
                   absl::MakeConstSpan(c.data_ptr<float>(), c.numel())});
  }
  return out;
}

}  // namespace

absl::Status LoadGpt2Weights(const SafetensorsFile& file, StageModel& stage) {
  // Resolve and check everything first, then copy: all or nothing.
  std::vector<std::pair<torch::Tensor, const SafetensorsFile::Entry*>> plan;
  for (const auto& [name, p] : stage.named_params()) {
    const SafetensorsFile::Entry* e = FindHf(file, name);
    if (e == nullptr && name == TiedEmbeddingName()) e = FindHf(file, "wte.weight");
    if (e == nullptr) return absl::NotFoundError(absl::StrCat("weights file lacks ", name));
    AQSWARM_RETURN_IF_ERROR(CheckFloat(*e));
    AQSWARM_RETURN_IF_ERROR(CheckShape(name, *e, p));
    plan.emplace_back(p, e);
  }
  torch::NoGradGuard ng;
  for (auto& [p, e] : plan) p.copy_(ToTensor(file, *e));
  return absl::OkStatus();
}

absl::Status SaveStageCheckpoint(const std::string& path, const StageModel& stage, const AdamW& optimizer,
                                 const std::string& job_name, const ExtraCheckpointState* extra) {
  std::vector<torch::Tensor> keep;
  std::vector<StTensor> tensors = Flatten(stage.named_params(), "", &keep);
  std::vector<StTensor> state = Flatten(optimizer.NamedState(), "optim/", &keep);
  tensors.insert(tensors.end(), state.begin(), state.end());
  const StageRange& r = stage.range();
  std::map<std::string, std::string> metadata = {{"format", "aqswarm-stage-checkpoint-v1"},
                                                 {"stage", std::to_string(r.stage)},
                                                 {"num_stages", std::to_string(r.num_stages)},
                                                 {"step", std::to_string(optimizer.step())},
                                                 {"job", job_name}};
  if (extra != nullptr) {
    for (const auto& [name, values] : extra->tensors) {
      tensors.push_back({"extra/" + name, {static_cast<int64_t>(values.size())}, values});
    }
    for (const auto& [k, v] : extra->metadata) metadata.emplace(k, v);
  }
  return WriteSafetensors(path, tensors, metadata);
}

absl::Status LoadStageCheckpoint(const std::string& path, StageModel& stage, AdamW& optimizer,
                                 ExtraCheckpointState* extra) {
  AQSWARM_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  const auto& md = file->metadata();
  auto get = [&](const char* k) -> std::string {
    auto it = md.find(k);
    return it == md.end() ? "" : it->second;
  };
  if (get("format") != "aqswarm-stage-checkpoint-v1") {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not an aqswarm stage checkpoint"));
  }
  const StageRange& r = stage.range();
  if (get("stage") != std::to_string(r.stage) || get("num_stages") != std::to_string(r.num_stages)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " holds stage ", get("stage"), " of ", get("num_stages"),
                                                      ", not stage ", r.stage, " of ", r.num_stages));
  }
  int64_t step = 0;
  if (!absl::SimpleAtoi(get("step"), &step) || step < 0) {
    return absl::DataLossError(absl::StrCat(path, ": bad step '", get("step"), "'"));
  }
  for (const auto& e : file->entries()) AQSWARM_RETURN_IF_ERROR(CheckFloat(e));
  std::map<std::string, torch::Tensor> state;
  for (const auto& e : file->entries()) {
    if (e.name.rfind("optim/", 0) == 0) state[e.name.substr(6)] = ToTensor(*file, e);
  }
  // Parameters: exact names only (no HF prefix/tied fallbacks for checkpoints).
  std::vector<std::pair<torch::Tensor, const SafetensorsFile::Entry*>> plan;
  for (const auto& [name, p] : stage.named_params()) {
    const auto* e = file->Find(name);
    if (e == nullptr) return absl::NotFoundError(absl::StrCat(path, " lacks parameter ", name));
    AQSWARM_RETURN_IF_ERROR(CheckShape(name, *e, p));
    plan.emplace_back(p, e);
  }
  AQSWARM_RETURN_IF_ERROR(optimizer.LoadState(state, step));
  torch::NoGradGuard ng;
  for (auto& [p, e] : plan) p.copy_(ToTensor(*file, *e));
  if (extra != nullptr) {
    extra->tensors.clear();
    for (const auto& e : file->entries()) {
      if (e.name.rfind("extra/", 0) == 0) extra->tensors.emplace_back(e.name.substr(6), file->ToFloat32(e));
    }
    extra->metadata = md;
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
