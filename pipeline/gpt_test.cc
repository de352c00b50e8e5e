#include "pipeline/gpt.h"

#include <map>

#include "gtest/gtest.h"
#include "pipeline/job_spec.h"

namespace aqswarm::pipeline {
namespace {

v1::ModelSpec SmallSpec(bool tie) {
  v1::ModelSpec s;
  s.set_vocab_size(97);
  s.set_seq_len(16);
  s.set_d_model(32);
  s.set_n_layer(4);
  s.set_n_head(4);
  s.set_tie_embeddings(tie);
  return s;
}

struct RunResult {
  double loss;
  std::map<std::string, torch::Tensor> grads;
};

// Runs forward+backward through K stages the way a pipeline does: each stage
// sees a detached input that requires grad, and receives the gradient of its
// output from the next stage.
RunResult RunPipeline(const v1::ModelSpec& spec, int k, const torch::Tensor& ids,
                      const torch::Tensor& targets) {
  std::vector<GptStage> stages;
  for (int s = 0; s < k; ++s) stages.emplace_back(spec, StageRangeFor(spec, s, k), /*seed=*/42);
  std::vector<torch::Tensor> inputs, outputs;
  torch::Tensor x = ids;
  for (int s = 0; s < k; ++s) {
    torch::Tensor in = (s == 0) ? x : x.detach().requires_grad_(true);
    inputs.push_back(in);
    x = stages[s]->forward(in);
    outputs.push_back(x);
  }
  torch::Tensor loss = GptStageImpl::Loss(x, targets);
  loss.backward();
  for (int s = k - 2; s >= 0; --s) outputs[s].backward(inputs[s + 1].grad());
  RunResult r{loss.item<double>(), {}};
  for (auto& st : stages) {
    for (auto& [name, p] : st->named_params()) r.grads[name] = p.grad().clone();
  }
  if (spec.tie_embeddings() && k > 1) {
    // The engine's tied-gradient exchange: wte and its mirror get the sum.
    r.grads["wte.weight"] += r.grads[TiedEmbeddingName()];
    r.grads.erase(TiedEmbeddingName());
  }
  return r;
}

class SplitEqualsUnsplitTest : public ::testing::TestWithParam<bool> {};

TEST_P(SplitEqualsUnsplitTest, LossAndGradientsMatchForEveryStageCount) {
  torch::manual_seed(0);
  const v1::ModelSpec spec = SmallSpec(GetParam());
  torch::Tensor ids = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
  torch::Tensor targets = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
  RunResult ref = RunPipeline(spec, 1, ids, targets);
  EXPECT_NEAR(ref.loss, std::log(97.0), 0.3);  // fresh model: near-uniform predictions
  for (int k : {2, 3, 4}) {
    RunResult got = RunPipeline(spec, k, ids, targets);
    EXPECT_NEAR(got.loss, ref.loss, 1e-5) << "k=" << k;
    ASSERT_EQ(got.grads.size(), ref.grads.size()) << "k=" << k;
    for (auto& [name, g] : ref.grads) {
      ASSERT_TRUE(got.grads.count(name)) << name;
      const double diff = (got.grads[name] - g).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << "k=" << k << " " << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, SplitEqualsUnsplitTest, ::testing::Bool());

TEST(GptStageTest, StageRangesCoverAllBlocksOnce) {
  v1::ModelSpec spec = SmallSpec(true);
  spec.set_n_layer(7);
  for (int k = 1; k <= 7; ++k) {
    int next = 0;
    for (int s = 0; s < k; ++s) {
      StageRange r = StageRangeFor(spec, s, k);
      EXPECT_EQ(r.first_block, next);
      EXPECT_GT(r.end_block, r.first_block);
      next = r.end_block;
    }
    EXPECT_EQ(next, 7);
  }
}

TEST(GptStageTest, ParameterCountMatchesFormula) {
  for (bool tie : {true, false}) {
    v1::ModelSpec spec = SmallSpec(tie);
    GptStage whole(spec, StageRangeFor(spec, 0, 1), 1);
    int64_t n = 0;
    for (auto& [name, p] : whole->named_params()) n += p.numel();
    EXPECT_EQ(n, TotalParameterCount(spec)) << tie;
  }
}

// Causality and training on a repeating sequence: pipeline/llama_test.cc,
// StageModelFamilyTest (both families).

// Compute precision on a GPU, where float16 has real kernels (CPU tests:
// pipeline/llama_test.cc). Skipped without CUDA.
TEST(StageModelCudaTest, Bf16Fp16AndRecomputeOnCudaMatchFp32OnCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const auto family : {v1::ModelSpec::Family::gpt2, v1::ModelSpec::Family::llama}) {
    v1::ModelSpec spec = SmallSpec(false);
    spec.set_family(family);
    spec.set_n_kv_head(2);
    torch::manual_seed(4);
    torch::Tensor ids = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
    torch::Tensor targets = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
    auto run = [&](torch::Device device, torch::Dtype dtype, bool recompute) {
      v1::ModelSpec s = spec;
      s.set_recompute(recompute);
      std::shared_ptr<StageModel> m = MakeStageModel(s, StageRangeFor(s, 0, 1), 9).value();
      m->to(device);
      m->set_compute_dtype(dtype);
      torch::Tensor logits = m->forward(ids.to(device));
      EXPECT_EQ(logits.scalar_type(), torch::kFloat32);
      torch::Tensor loss = NextTokenLoss(logits, targets.to(device));
      loss.backward();
      std::vector<torch::Tensor> grads;
      for (auto& [name, p] : m->named_params()) {
        EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32) << name;
        grads.push_back(p.grad().flatten().to(torch::kCPU));
      }
      return std::make_pair(loss.item<double>(), torch::cat(grads));
    };
    auto ref = run(torch::kCPU, torch::kFloat32, false);
    const torch::Device cuda(torch::kCUDA, 0);
    for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16, torch::kHalf}) {
      const std::string what = v1::ModelSpec::Family::Value_Name(family) + " " + c10::toString(dtype);
      auto got = run(cuda, dtype, false), again = run(cuda, dtype, true);
      EXPECT_NEAR(got.first, ref.first, 0.02 * ref.first) << what;
      EXPECT_TRUE(torch::isfinite(got.second).all().item<bool>()) << what;
      const double rel = ((got.second - ref.second).norm() / ref.second.norm()).item<double>();
      EXPECT_LT(rel, dtype == torch::kFloat32 ? 1e-3 : dtype == torch::kHalf ? 0.01 : 0.05) << what;
      EXPECT_NEAR(again.first, got.first, 1e-6 * got.first) << what << " recompute";
      EXPECT_LE((again.second - got.second).abs().max().item<double>(), 1e-5) << what << " recompute";
    }
  }
}

}  // namespace
}  // namespace aqswarm::pipeline
