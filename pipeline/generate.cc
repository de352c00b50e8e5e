#include "pipeline/generate.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "pipeline/hf_checkpoint.h"
#include "pipeline/stage_model.h"
#include "pipeline/tokenizer.h"

namespace aqswarm::pipeline {
namespace {

namespace fs = std::filesystem;

// A uniform double in [0, 1) from 53 bits: the same on every standard library.
double Uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// The next token from one row of logits (see generate.h for the rule).
int32_t Pick(const std::vector<float>& logits, double temperature, int top_k, std::mt19937_64& rng) {
  const int n = static_cast<int>(logits.size());
  if (temperature <= 0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  const int k = top_k > 0 ? std::min(top_k, n) : n;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  order.resize(k);
  const double top = logits[order[0]];
  std::vector<double> p(k);
  double sum = 0;
  for (int i = 0; i < k; ++i) sum += p[i] = std::exp((logits[order[i]] - top) / temperature);
  double u = Uniform(rng) * sum;
  for (int i = 0; i < k; ++i) {
    if ((u -= p[i]) < 0) return order[i];
  }
  return order[k - 1];
}

absl::StatusOr<std::shared_ptr<StageModel>> LoadModel(const GenerateOptions& o, torch::Device* device) {
  AQSWARM_ASSIGN_OR_RETURN(v1::ModelSpec spec, ModelSpecFromHfDir(o.model_dir, std::max(2, o.max_seq_len)));
  AQSWARM_ASSIGN_OR_RETURN(std::shared_ptr<StageModel> model, MakeStageModel(spec, StageRangeFor(spec, 0, 1), 0));
  AQSWARM_RETURN_IF_ERROR(LoadHfCheckpoint(o.model_dir, *model));
  try {
    *device = torch::Device(o.device);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad device '", o.device, "': ", e.what()));
  }
  if (device->is_cuda() && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(absl::StrCat("device ", o.device, " requested but CUDA is not available"));
  }
  model->to(*device);
  model->eval();
  return model;
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> GenerateIds(const GenerateOptions& o, const std::vector<int32_t>& prompt,
                                                 int32_t stop_id) {
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  if (o.max_tokens < 0) return absl::InvalidArgumentError("max_tokens must be >= 0");
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) {
    return absl::InvalidArgumentError("temperature must be a finite number >= 0");
  }
  if (o.top_k < 0) return absl::InvalidArgumentError("top_k must be >= 0");
  torch::Device device(torch::kCPU);
  AQSWARM_ASSIGN_OR_RETURN(std::shared_ptr<StageModel> model, LoadModel(o, &device));
  const int64_t vocab = model->spec().vocab_size(), window = model->spec().seq_len();
  for (int32_t id : prompt) {
    if (id < 0 || id >= vocab) return absl::InvalidArgumentError(absl::StrCat("prompt token ", id, " outside the vocabulary"));
  }
  std::vector<int32_t> ids = prompt, out;
  std::mt19937_64 rng(o.seed);
  torch::NoGradGuard no_grad;
  for (int t = 0; t < o.max_tokens; ++t) {
    const int64_t n = std::min<int64_t>(window, static_cast<int64_t>(ids.size()));
    std::vector<int64_t> ctx(ids.end() - n, ids.end());
    torch::Tensor in = torch::tensor(ctx, torch::kLong).view({1, n}).to(device);
    torch::Tensor logits = model->forward(in).select(1, n - 1).reshape({-1}).to(torch::kCPU, torch::kFloat32).contiguous();
    std::vector<float> row(logits.data_ptr<float>(), logits.data_ptr<float>() + logits.numel());
    const int32_t next = Pick(row, o.temperature, o.top_k, rng);
    if (next == stop_id) break;
    ids.push_back(next);
    out.push_back(next);
  }
  return out;
}

absl::StatusOr<GenerateResult> Generate(const GenerateOptions& o) {
  const fs::path dir(o.model_dir);
  // The model directory's tokenizer: tokenizer.json or GPT-2's files under
  // our names (Tokenizer::Open), or under Hugging Face's GPT2Tokenizer names.
  std::unique_ptr<Tokenizer> tok;
  if (fs::exists(dir / "tokenizer.json") || fs::exists(dir / "encoder.json")) {
    AQSWARM_ASSIGN_OR_RETURN(tok, Tokenizer::Open(dir.string()));
  } else if (fs::exists(dir / "vocab.json")) {
    AQSWARM_ASSIGN_OR_RETURN(tok, Tokenizer::Load((dir / "vocab.json").string(), (dir / "merges.txt").string()));
  } else {
    return absl::NotFoundError(absl::StrCat(o.model_dir, " has no tokenizer (tokenizer.json, encoder.json + "
                                            "vocab.bpe, or vocab.json + merges.txt)"));
  }
  GenerateResult r;
  r.prompt_ids = tok->Encode(o.prompt);
  if (r.prompt_ids.empty() && tok->eot_id() >= 0) r.prompt_ids.push_back(tok->eot_id());  // starts a document
  AQSWARM_ASSIGN_OR_RETURN(r.generated_ids, GenerateIds(o, r.prompt_ids, tok->eot_id()));
  r.text = o.prompt + tok->Decode(r.generated_ids);
  return r;
}

}  // namespace aqswarm::pipeline
