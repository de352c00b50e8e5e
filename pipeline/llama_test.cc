#include "pipeline/llama.h"

#include <cmath>
#include <map>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "pipeline/worker_pipeline_test_util.h"
#include "pipeline/gpt.h"
#include "pipeline/job_spec.h"
#include "pipeline/safetensors.h"
#include "pipeline/stage_worker.h"

namespace aqswarm::pipeline {
namespace {

// Written by scripts/gen_llama_reference.py (plain torch, float64).
const std::string kReferenceDir = AQSWARM_LLAMA_REFERENCE_DIR;

std::unique_ptr<SafetensorsFile> OpenReference(const std::string& file) {
  auto f = SafetensorsFile::Open(kReferenceDir + "/" + file);
  EXPECT_TRUE(f.ok()) << f.status() << " (regenerate with scripts/gen_llama_reference.py)";
  return f.ok() ? std::move(f).value() : nullptr;
}

torch::Tensor ToTensor(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsFile::Entry* e = f.Find(name);
  if (e == nullptr) {
    ADD_FAILURE() << "reference has no " << name;
    return {};
  }
  std::vector<float> v = f.ToFloat32(*e);
  return torch::from_blob(v.data(), e->shape, torch::kFloat32).clone();
}

// The reference model's spec, from the weights file's metadata.
v1::ModelSpec ReferenceSpec(const SafetensorsFile& w, bool tie) {
  auto num = [&](const char* key) { return std::stod(w.metadata().at(key)); };
  v1::ModelSpec s;
  s.set_family(v1::ModelSpec::Family::llama);
  s.set_vocab_size(num("vocab_size"));
  s.set_seq_len(num("seq_len"));
  s.set_d_model(num("d_model"));
  s.set_n_layer(num("n_layer"));
  s.set_n_head(num("n_head"));
  s.set_n_kv_head(num("n_kv_head"));
  s.set_d_ff(num("d_ff"));
  s.set_rope_theta(num("rope_theta"));
  s.set_norm_eps(num("norm_eps"));
  s.set_tie_embeddings(tie);
  return s;
}

// Copies every parameter of `stage` from `w` by its Hugging Face name.
void LoadByName(StageModel& stage, const SafetensorsFile& w) {
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : stage.named_params()) {
    torch::Tensor t = ToTensor(w, name);
    ASSERT_TRUE(t.defined()) << name;
    ASSERT_EQ(t.sizes(), p.sizes()) << name;
    p.copy_(t);
  }
}

double MaxDiff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

TEST(LlamaReferenceTest, LogitsMatchAnIndependentImplementation) {
  auto w = OpenReference("weights.safetensors"), ex = OpenReference("expected.safetensors");
  ASSERT_TRUE(w && ex);
  const v1::ModelSpec spec = ReferenceSpec(*w, /*tie=*/false);
  LlamaStage m(spec, StageRangeFor(spec, 0, 1), /*seed=*/1);
  LoadByName(*m, *w);
  EXPECT_EQ(m->named_params().size(), w->entries().size());  // every name used, no extra ones
  torch::Tensor ids = ToTensor(*ex, "input_ids").to(torch::kLong);
  torch::Tensor expected = ToTensor(*ex, "logits");
  torch::Tensor logits = m->forward(ids);
  ASSERT_EQ(logits.sizes(), expected.sizes());
  EXPECT_LE(MaxDiff(logits, expected), 1e-5 * expected.abs().max().item<double>());
  EXPECT_GT(expected.abs().max().item<double>(), 1.0);  // not a trivially small output
}

TEST(LlamaReferenceTest, TwoStagesMatchTheReferenceHiddenAndLogits) {
  auto w = OpenReference("weights.safetensors"), ex = OpenReference("expected.safetensors");
  ASSERT_TRUE(w && ex);
  const v1::ModelSpec spec = ReferenceSpec(*w, /*tie=*/false);
  LlamaStage s0(spec, StageRangeFor(spec, 0, 2), 1), s1(spec, StageRangeFor(spec, 1, 2), 1);
  LoadByName(*s0, *w);
  LoadByName(*s1, *w);
  torch::Tensor ids = ToTensor(*ex, "input_ids").to(torch::kLong);
  torch::Tensor hidden = ToTensor(*ex, "hidden_0"), logits = ToTensor(*ex, "logits");
  EXPECT_LE(MaxDiff(s0->forward(ids), hidden), 1e-5 * hidden.abs().max().item<double>());
  EXPECT_LE(MaxDiff(s1->forward(hidden), logits), 1e-5 * logits.abs().max().item<double>());
}

TEST(LlamaReferenceTest, TiedOnOneStageTheHeadIsTheEmbedding) {
  auto w = OpenReference("weights.safetensors"), ex = OpenReference("expected.safetensors");
  ASSERT_TRUE(w && ex);
  const v1::ModelSpec spec = ReferenceSpec(*w, /*tie=*/true);
  LlamaStage m(spec, StageRangeFor(spec, 0, 1), 1);
  for (auto& [name, p] : m->named_params()) EXPECT_NE(name, "lm_head.weight");
  EXPECT_FALSE(m->tied_embedding().defined());  // one tensor, nothing to exchange
  LoadByName(*m, *w);
  torch::Tensor expected = ToTensor(*ex, "logits_tied");
  torch::Tensor logits = m->forward(ToTensor(*ex, "input_ids").to(torch::kLong));
  EXPECT_LE(MaxDiff(logits, expected), 1e-5 * expected.abs().max().item<double>());
}

v1::ModelSpec SmallSpec(bool tie) {
  v1::ModelSpec s;
  s.set_family(v1::ModelSpec::Family::llama);
  s.set_vocab_size(97);
  s.set_seq_len(16);
  s.set_d_model(32);
  s.set_n_layer(4);
  s.set_n_head(4);
  s.set_n_kv_head(2);
  s.set_d_ff(40);
  s.set_tie_embeddings(tie);
  return s;
}

struct RunResult {
  double loss;
  std::map<std::string, torch::Tensor> grads;
};

// Forward + backward through K stages as a pipeline runs them: each stage
// sees a detached input that requires grad and receives its output's
// gradient from the next stage; tied copies get the sum of both gradients.
RunResult RunPipeline(const v1::ModelSpec& spec, int k, const torch::Tensor& ids, const torch::Tensor& targets,
                      torch::Dtype dtype = torch::kFloat32) {
  std::vector<std::shared_ptr<StageModel>> stages;
  for (int s = 0; s < k; ++s) {
    stages.push_back(MakeStageModel(spec, StageRangeFor(spec, s, k), /*seed=*/42).value());
    stages.back()->set_compute_dtype(dtype);
  }
  std::vector<torch::Tensor> inputs, outputs;
  torch::Tensor x = ids;
  for (int s = 0; s < k; ++s) {
    torch::Tensor in = (s == 0) ? x : x.detach().requires_grad_(true);
    inputs.push_back(in);
    x = stages[s]->forward(in);
    EXPECT_EQ(x.scalar_type(), torch::kFloat32);
    outputs.push_back(x);
  }
  torch::Tensor loss = NextTokenLoss(x, targets);
  loss.backward();
  for (int s = k - 2; s >= 0; --s) outputs[s].backward(inputs[s + 1].grad());
  RunResult r{loss.item<double>(), {}};
  for (auto& st : stages) {
    for (auto& [name, p] : st->named_params()) r.grads[name] = p.grad().clone();
  }
  if (spec.tie_embeddings() && k > 1) {
    const std::string embed = spec.family() == v1::ModelSpec::Family::llama ? "model.embed_tokens.weight" : "wte.weight";
    r.grads[embed] += r.grads[TiedEmbeddingName()];
    r.grads.erase(TiedEmbeddingName());
  }
  return r;
}

void ExpectSameGradients(const RunResult& got, const RunResult& ref, double tol, const std::string& what) {
  EXPECT_NEAR(got.loss, ref.loss, tol) << what;
  ASSERT_EQ(got.grads.size(), ref.grads.size()) << what;
  for (auto& [name, g] : ref.grads) {
    ASSERT_TRUE(got.grads.count(name)) << what << " " << name;
    EXPECT_LE(MaxDiff(got.grads.at(name), g), tol) << what << " " << name;
  }
}

class LlamaSplitTest : public ::testing::TestWithParam<bool> {};

TEST_P(LlamaSplitTest, KStagesEqualTheUnsplitModelInLossAndEveryGradient) {
  torch::manual_seed(0);
  const v1::ModelSpec spec = SmallSpec(GetParam());
  torch::Tensor ids = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
  torch::Tensor targets = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
  RunResult ref = RunPipeline(spec, 1, ids, targets);
  EXPECT_NEAR(ref.loss, std::log(97.0), 0.3);  // fresh model: near-uniform predictions
  for (int k : {2, 3, 4}) ExpectSameGradients(RunPipeline(spec, k, ids, targets), ref, 1e-5, "k=" + std::to_string(k));
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, LlamaSplitTest, ::testing::Bool());

TEST(LlamaStageTest, ParameterNamesShapesAndCount) {
  for (bool tie : {true, false}) {
    const v1::ModelSpec spec = SmallSpec(tie);
    LlamaStage whole(spec, StageRangeFor(spec, 0, 1), 1);
    std::map<std::string, std::vector<int64_t>> shapes;
    int64_t n = 0;
    for (auto& [name, p] : whole->named_params()) {
      shapes[name] = p.sizes().vec();
      n += p.numel();
    }
    EXPECT_EQ(n, TotalParameterCount(spec)) << tie;
    EXPECT_EQ(shapes.size(), 4u * 9 + 2 + (tie ? 0 : 1));
    using V = std::vector<int64_t>;
    EXPECT_EQ(shapes["model.embed_tokens.weight"], V({97, 32}));
    EXPECT_EQ(shapes["model.layers.3.input_layernorm.weight"], V({32}));
    EXPECT_EQ(shapes["model.layers.3.self_attn.q_proj.weight"], V({32, 32}));
    EXPECT_EQ(shapes["model.layers.3.self_attn.k_proj.weight"], V({16, 32}));
    EXPECT_EQ(shapes["model.layers.3.self_attn.v_proj.weight"], V({16, 32}));
    EXPECT_EQ(shapes["model.layers.3.self_attn.o_proj.weight"], V({32, 32}));
    EXPECT_EQ(shapes["model.layers.3.post_attention_layernorm.weight"], V({32}));
    EXPECT_EQ(shapes["model.layers.3.mlp.gate_proj.weight"], V({40, 32}));
    EXPECT_EQ(shapes["model.layers.3.mlp.up_proj.weight"], V({40, 32}));
    EXPECT_EQ(shapes["model.layers.3.mlp.down_proj.weight"], V({32, 40}));
    EXPECT_EQ(shapes["model.norm.weight"], V({32}));
    EXPECT_EQ(shapes.count("lm_head.weight"), tie ? 0u : 1u);
  }
}

TEST(LlamaStageTest, DefaultFeedForwardWidthIsLlamas) {
  v1::ModelSpec spec = SmallSpec(true);
  spec.set_d_ff(0);
  spec.set_d_model(4096);
  EXPECT_EQ(FeedForwardDim(spec), 11008);  // Llama-7B
  spec.set_d_model(32);
  EXPECT_EQ(FeedForwardDim(spec), 256);
  spec.set_d_ff(40);
  EXPECT_EQ(FeedForwardDim(spec), 40);
}

TEST(LlamaStageTest, MakeStageModelDispatchesOnFamily) {
  const v1::ModelSpec spec = SmallSpec(false);
  auto m = MakeStageModel(spec, StageRangeFor(spec, 0, 1), 1);
  ASSERT_TRUE(m.ok());
  EXPECT_NE(dynamic_cast<LlamaStageImpl*>(m->get()), nullptr);
  v1::ModelSpec other = spec;
  other.set_family(static_cast<v1::ModelSpec::Family::Value>(9));  // no family of this build
  EXPECT_FALSE(MakeStageModel(other, StageRangeFor(other, 0, 1), 1).ok());
}

TEST(LlamaStageTest, TiedAcrossStagesTheHeadStartsAsACopyOfTheEmbedding) {
  const v1::ModelSpec spec = SmallSpec(true);
  LlamaStage first(spec, StageRangeFor(spec, 0, 2), 7), last(spec, StageRangeFor(spec, 1, 2), 7);
  ASSERT_TRUE(first->tied_embedding().defined() && last->tied_embedding().defined());
  EXPECT_TRUE(torch::equal(first->tied_embedding(), last->tied_embedding()));
  EXPECT_EQ(last->named_params().back().first, "lm_head.weight");
}

// GQA == multi-head attention whose key/value heads are the GQA heads repeated.
TEST(LlamaStageTest, GroupedQueryAttentionEqualsRepeatedKeyValueHeads) {
  v1::ModelSpec gqa = SmallSpec(false), mha = gqa;
  gqa.set_n_kv_head(2);
  mha.set_n_kv_head(4);
  LlamaStage a(gqa, StageRangeFor(gqa, 0, 1), 3), b(mha, StageRangeFor(mha, 0, 1), 3);
  {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> src(a->named_params().begin(), a->named_params().end());
    for (auto& [name, p] : b->named_params()) {
      torch::Tensor s = src.at(name);
      if (s.sizes() != p.sizes()) s = s.view({2, 8, 32}).repeat_interleave(2, 0).reshape({32, 32});  // [KV,hd,d]
      p.copy_(s);
    }
  }
  torch::Tensor ids = torch::randint(0, 97, {2, 16}, torch::kLong);
  EXPECT_LE(MaxDiff(a->forward(ids), b->forward(ids)), 1e-5);
}

// Compute precision and recompute, for both families.
class StageModelFamilyTest : public ::testing::TestWithParam<v1::ModelSpec::Family::Value> {
 protected:
  v1::ModelSpec Spec(bool tie = false) const {
    v1::ModelSpec s = SmallSpec(tie);
    s.set_family(GetParam());
    return s;
  }
};

bool AllFinite(const torch::Tensor& t) { return torch::isfinite(t).all().item<bool>(); }

// Trains `m` on a repeating 5-token sequence for `steps` AdamW steps; returns
// the first and the last loss.
std::pair<double, double> TrainOnARepeatingSequence(StageModel& m, int steps) {
  torch::optim::AdamW opt(m.parameters(), torch::optim::AdamWOptions(3e-3));
  torch::Tensor seq = torch::arange(0, 17, torch::kLong).remainder(5).unsqueeze(0);
  torch::Tensor ids = seq.slice(1, 0, 16), targets = seq.slice(1, 1, 17);
  double first = 0, last = 0;
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    torch::Tensor loss = NextTokenLoss(m.forward(ids), targets);
    loss.backward();
    opt.step();
    if (i == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  return {first, last};
}

TEST_P(StageModelFamilyTest, CausalNoFutureLeak) {
  const v1::ModelSpec spec = Spec(true);
  std::shared_ptr<StageModel> m = MakeStageModel(spec, StageRangeFor(spec, 0, 1), 3).value();
  torch::NoGradGuard no_grad;
  torch::Tensor a = torch::randint(0, 97, {1, 16}, torch::kLong);
  torch::Tensor b = a.clone();
  b.index_put_({0, 15}, (a.index({0, 15}).item<int64_t>() + 1) % 97);
  torch::Tensor la = m->forward(a), lb = m->forward(b);
  EXPECT_TRUE(torch::equal(la.slice(1, 0, 15), lb.slice(1, 0, 15)));
  EXPECT_FALSE(torch::equal(la.slice(1, 15, 16), lb.slice(1, 15, 16)));
}

TEST_P(StageModelFamilyTest, TrainsOnARepeatingSequence) {
  const v1::ModelSpec spec = Spec(true);
  std::shared_ptr<StageModel> m = MakeStageModel(spec, StageRangeFor(spec, 0, 1), 5).value();
  auto [first, last] = TrainOnARepeatingSequence(*m, 60);
  EXPECT_LT(last, first * 0.2);
}

// Relative difference of the concatenated gradients.
double GradRelDiff(const RunResult& a, const RunResult& b) {
  double num = 0, den = 0;
  for (auto& [name, g] : b.grads) {
    num += (a.grads.at(name) - g).pow(2).sum().item<double>();
    den += g.pow(2).sum().item<double>();
  }
  return std::sqrt(num / den);
}

TEST_P(StageModelFamilyTest, Bf16AndFp16LossesAreCloseToFp32AndGradientsStayFp32) {
  torch::manual_seed(1);
  const v1::ModelSpec spec = Spec();
  torch::Tensor ids = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
  torch::Tensor targets = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
  for (int k : {1, 2}) {
    RunResult ref = RunPipeline(spec, k, ids, targets);
    for (torch::Dtype dtype : {torch::kBFloat16, torch::kHalf}) {
      const std::string what = std::string(c10::toString(dtype)) + " k=" + std::to_string(k);
      RunResult got = RunPipeline(spec, k, ids, targets, dtype);
      EXPECT_NE(got.loss, ref.loss) << what;  // the dtype is really used
      EXPECT_NEAR(got.loss, ref.loss, 0.02 * ref.loss) << what;
      for (auto& [name, g] : got.grads) {
        EXPECT_EQ(g.scalar_type(), torch::kFloat32) << what << " " << name;
        EXPECT_TRUE(AllFinite(g)) << what << " " << name;
      }
      EXPECT_LT(GradRelDiff(got, ref), dtype == torch::kBFloat16 ? 0.05 : 0.01) << what;
    }
  }
}

TEST(StageModelTest, ComputeDtypeComesFromJobPrecision) {
  EXPECT_EQ(ComputeDtypeFor(v1::JobSpec::Precision::fp32), torch::kFloat32);
  EXPECT_EQ(ComputeDtypeFor(v1::JobSpec::Precision::UNSPECIFIED), torch::kFloat32);
  EXPECT_EQ(ComputeDtypeFor(v1::JobSpec::Precision::bf16), torch::kBFloat16);
  EXPECT_EQ(ComputeDtypeFor(v1::JobSpec::Precision::fp16), torch::kHalf);
}

TEST_P(StageModelFamilyTest, TrainsInBf16WithFp32Masters) {
  const v1::ModelSpec spec = Spec(true);
  std::shared_ptr<StageModel> m = MakeStageModel(spec, StageRangeFor(spec, 0, 1), 5).value();
  m->set_compute_dtype(torch::kBFloat16);
  auto [first, last] = TrainOnARepeatingSequence(*m, 30);
  EXPECT_LT(last, first * 0.5);
  for (auto& [name, p] : m->named_params()) EXPECT_EQ(p.scalar_type(), torch::kFloat32) << name;
}

TEST_P(StageModelFamilyTest, RecomputeGivesTheSameLossAndGradients) {
  torch::manual_seed(2);
  v1::ModelSpec spec = Spec(true);
  torch::Tensor ids = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
  torch::Tensor targets = torch::randint(0, spec.vocab_size(), {3, spec.seq_len()}, torch::kLong);
  for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (int k : {1, 2, 4}) {
      spec.set_recompute(false);
      RunResult ref = RunPipeline(spec, k, ids, targets, dtype);
      spec.set_recompute(true);
      RunResult got = RunPipeline(spec, k, ids, targets, dtype);
      ExpectSameGradients(got, ref, 1e-6, std::string(c10::toString(dtype)) + " k=" + std::to_string(k));
    }
  }
}

// Autograd nodes reachable from t, and how many of them are recomputed blocks.
std::pair<int, int> CountNodes(const torch::Tensor& t) {
  int nodes = 0, recomputed = 0;
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    ++nodes;
    if (n->name().find("RecomputedBlock") != std::string::npos) ++recomputed;
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return {nodes, recomputed};
}

// Recompute keeps one autograd node per block instead of the block's graph.
TEST_P(StageModelFamilyTest, RecomputeKeepsOnlyTheBlockBoundaries) {
  v1::ModelSpec spec = Spec(false);
  torch::Tensor h = torch::randn({2, spec.seq_len(), spec.d_model()}).requires_grad_(true);
  auto plain = CountNodes(MakeStageModel(spec, StageRangeFor(spec, 1, 2), 5).value()->forward(h));
  spec.set_recompute(true);
  std::shared_ptr<StageModel> m = MakeStageModel(spec, StageRangeFor(spec, 1, 2), 5).value();
  auto recomputed = CountNodes(m->forward(h));
  EXPECT_EQ(plain.second, 0);
  EXPECT_EQ(recomputed.second, 2);  // blocks 2 and 3
  EXPECT_LT(recomputed.first * 3, plain.first) << recomputed.first << " vs " << plain.first;
  torch::NoGradGuard no_grad;  // inference: a plain forward, no graph
  EXPECT_EQ(m->forward(h).grad_fn(), nullptr);
}

// Step losses of K stage workers (one process) on `job_json`, on the same
// learnable micro-batches every step.
std::vector<double> TrainWorkers(const std::string& job_json, int k, int steps) {
  auto job = ParseJobSpec(job_json);
  EXPECT_TRUE(job.ok()) << job.status();
  if (!job.ok()) return {};
  job->set_stages(k);
  testing::WorkerPipeline p(*job);
  return p.Train(steps, [](int mb, int, int n) {
    auto tokens = [&](int shift) {
      std::vector<int32_t> v(n);
      for (int i = 0; i < n; ++i) v[i] = (i * 7 + mb * 3 + shift) % 5;  // learnable
      return v;
    };
    return testing::Batch{tokens(0), tokens(1)};
  });
}

// The job fields reach the model through StageWorker: family, precision, recompute.
TEST(LlamaStageWorkerTest, TrainsInBf16WithRecomputeAcrossTwoStages) {
  const std::string base = R"({"seed":3,"model":{"family":"llama","vocabSize":61,"seqLen":8,"dModel":16,
      "nLayer":2,"nHead":4,"nKvHead":2,"dFf":24,"tieEmbeddings":false)";
  const std::string opt = R"(},"optimizer":{"lr":0.01,"warmupSteps":2,"totalSteps":20,"gradClip":1.0},
      "microBatchSize":2,"microBatchesPerStep":2)";
  std::vector<double> fp32 = TrainWorkers(base + opt + "}", 2, 8);
  std::vector<double> recompute = TrainWorkers(base + R"(,"recompute":true)" + opt + "}", 2, 8);
  std::vector<double> bf16 = TrainWorkers(base + R"(,"recompute":true)" + opt + R"(,"precision":"bf16"})", 2, 8);
  std::vector<double> bf16_one = TrainWorkers(base + opt + R"(,"precision":"bf16"})", 1, 8);
  ASSERT_EQ(fp32.size(), 8u);
  ASSERT_EQ(recompute.size(), 8u);
  ASSERT_EQ(bf16.size(), 8u);
  ASSERT_EQ(bf16_one.size(), 8u);
  for (size_t i = 0; i < fp32.size(); ++i) {
    EXPECT_NEAR(recompute[i], fp32[i], 1e-5) << i;
    EXPECT_NEAR(bf16[i], fp32[i], 0.03 * fp32[i]) << i;
    EXPECT_NEAR(bf16_one[i], bf16[i], 1e-3 * bf16[i]) << i;
  }
  EXPECT_NE(bf16[0], fp32[0]);
  EXPECT_LT(bf16.back(), 0.8 * bf16.front());
}

INSTANTIATE_TEST_SUITE_P(Families, StageModelFamilyTest,
                         ::testing::Values(v1::ModelSpec::Family::gpt2, v1::ModelSpec::Family::llama),
                         [](const ::testing::TestParamInfo<v1::ModelSpec::Family::Value>& i) {
                           return v1::ModelSpec::Family::Value_Name(i.param);
                         });

}  // namespace
}  // namespace aqswarm::pipeline
