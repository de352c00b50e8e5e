// Hugging Face directories in (init_from) and out (export), and generation
// from an exported directory.
#include "pipeline/hf_checkpoint.h"

#include <limits>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "pipeline/generate.h"
#include "pipeline/job_spec.h"
#include "pipeline/optimizer.h"
#include "pipeline/safetensors.h"
#include "pipeline/stage_io.h"
#include "pipeline/stage_model.h"
#include "pipeline/stage_worker.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::pipeline {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

v1::ModelSpec Gpt2Spec(int seq_len = 8) {
  v1::ModelSpec s;
  s.set_family(v1::ModelSpec::Family::gpt2);
  s.set_vocab_size(50);
  s.set_seq_len(seq_len);
  s.set_d_model(16);
  s.set_n_layer(3);
  s.set_n_head(2);
  s.set_tie_embeddings(true);
  return s;
}

std::shared_ptr<StageModel> Make(const v1::ModelSpec& spec, int stage, int stages, uint64_t seed) {
  auto m = MakeStageModel(spec, StageRangeFor(spec, stage, stages), seed);
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Writes `model`'s parameters as a Hugging Face directory: GPT-2 names with
// the "transformer." prefix, no lm_head.weight (tied), tensors split over
// shards by `shard_of` (1-based; one shard = model.safetensors), config.json
// for `spec` with n_positions = the model's seq_len.
void WriteHfDir(const StageModel& model, const fs::path& dir, int num_shards,
                const std::function<int(const std::string&)>& shard_of) {
  const v1::ModelSpec& spec = model.spec();
  fs::create_directories(dir);
  std::vector<std::vector<StTensor>> shards(num_shards);
  std::vector<torch::Tensor> keep;
  nlohmann::json index;
  for (const auto& [name, p] : model.named_params()) {
    if (name == "lm_head.weight" && spec.tie_embeddings()) continue;
    keep.push_back(p.detach().contiguous());
    const std::string hf = HfFileName(spec, name);
    const int s = num_shards == 1 ? 1 : shard_of(name);
    shards[s - 1].push_back({hf, std::vector<int64_t>(p.sizes().begin(), p.sizes().end()),
                             absl::MakeConstSpan(keep.back().data_ptr<float>(), keep.back().numel())});
    index["weight_map"][hf] = absl::StrCat("model-0000", s, "-of-0000", num_shards, ".safetensors");
  }
  if (num_shards == 1) {
    ASSERT_TRUE(WriteSafetensors((dir / kHfWeightsFile).string(), shards[0], {{"format", "pt"}}).ok());
  } else {
    for (int s = 1; s <= num_shards; ++s) {
      ASSERT_TRUE(WriteSafetensors((dir / absl::StrCat("model-0000", s, "-of-0000", num_shards, ".safetensors")).string(),
                                   shards[s - 1], {{"format", "pt"}})
                      .ok());
    }
    std::ofstream(dir / kHfIndexFile) << index.dump(2);
  }
  const int64_t d_ff = 4 * int64_t{spec.d_model()};
  std::ofstream(dir / kHfConfigFile) << HfConfigJson(spec, spec.seq_len(), d_ff);
}

// Shard 1: embeddings and blocks 0-1; shard 2: block 2 and the final norm.
int TwoShards(const std::string& name) {
  return (name.rfind("h.2.", 0) == 0 || name.rfind("ln_f.", 0) == 0) ? 2 : 1;
}

torch::Tensor Ids(int64_t b, int64_t t, int64_t vocab) {
  torch::manual_seed(3);
  return torch::randint(0, vocab, {b, t}, torch::kLong);
}

class HfCheckpointTest : public ::testing::Test {
 protected:
  aqswarm::testing::ScratchDir scratch_;
  fs::path Dir(const std::string& name) const { return fs::path(scratch_.path()) / name; }
};

TEST_F(HfCheckpointTest, ShardedCheckpointLoadsIntoTwoStagesWithIdenticalLogits) {
  // The file's model has a longer context (16) than the job's (8): GPT-2's
  // position table is cut to the job's seq_len.
  const v1::ModelSpec file_spec = Gpt2Spec(16), job_spec = Gpt2Spec(8);
  auto src = Make(file_spec, 0, 1, 11);
  WriteHfDir(*src, Dir("hf"), 2, TwoShards);
  auto s0 = Make(job_spec, 0, 2, 99), s1 = Make(job_spec, 1, 2, 99);
  ASSERT_TRUE(LoadHfCheckpoint(Dir("hf").string(), *s0).ok());
  ASSERT_TRUE(LoadHfCheckpoint(Dir("hf").string(), *s1).ok());
  torch::NoGradGuard ng;
  const torch::Tensor ids = Ids(2, 8, 50);
  EXPECT_TRUE(torch::equal(s1->forward(s0->forward(ids)), src->forward(ids)));
}

TEST_F(HfCheckpointTest, ASingleFileAndAFullContextLoadToo) {
  const v1::ModelSpec spec = Gpt2Spec(8);
  auto src = Make(spec, 0, 1, 11);
  WriteHfDir(*src, Dir("hf"), 1, nullptr);
  auto dst = Make(spec, 0, 1, 5);
  absl::Status s = LoadHfCheckpoint(Dir("hf").string(), *dst);
  ASSERT_TRUE(s.ok()) << s;
  torch::NoGradGuard ng;
  const torch::Tensor ids = Ids(1, 8, 50);
  EXPECT_TRUE(torch::equal(dst->forward(ids), src->forward(ids)));
}

TEST_F(HfCheckpointTest, AMissingShardIsNamedAndOnlyTheStagesThatNeedItFail) {
  const v1::ModelSpec spec = Gpt2Spec(8);
  auto src = Make(spec, 0, 1, 11);
  WriteHfDir(*src, Dir("hf"), 2, TwoShards);
  fs::remove(Dir("hf") / "model-00002-of-00002.safetensors");
  auto s0 = Make(spec, 0, 2, 99), s1 = Make(spec, 1, 2, 99);
  const torch::Tensor before = s1->named_params()[0].second.clone();
  EXPECT_TRUE(LoadHfCheckpoint(Dir("hf").string(), *s0).ok());  // shard 1 holds all of stage 0
  absl::Status s = LoadHfCheckpoint(Dir("hf").string(), *s1);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_TRUE(torch::equal(before, s1->named_params()[0].second));  // nothing copied
}

TEST_F(HfCheckpointTest, AWrongShapeNameOrDtypeIsNamed) {
  const v1::ModelSpec spec = Gpt2Spec(8);
  auto src = Make(spec, 0, 1, 11);
  WriteHfDir(*src, Dir("hf"), 1, nullptr);
  const std::string weights = (Dir("hf") / kHfWeightsFile).string();
  auto rewrite = [&](const std::function<void(std::vector<StTensor>&, std::deque<std::vector<float>>&)>& edit) {
    WriteHfDir(*src, Dir("hf"), 1, nullptr);
    auto f = SafetensorsFile::Open(weights);
    ASSERT_TRUE(f.ok());
    std::deque<std::vector<float>> data;
    std::vector<StTensor> t;
    for (const auto& e : (*f)->entries()) {
      data.push_back((*f)->ToFloat32(e));
      t.push_back({e.name, e.shape, data.back()});
    }
    edit(t, data);
    ASSERT_TRUE(WriteSafetensors(weights, t, {}).ok());
  };
  auto dst = Make(spec, 0, 1, 5);
  rewrite([](std::vector<StTensor>& t, std::deque<std::vector<float>>&) {
    for (auto& x : t) {
      if (x.name == "transformer.h.1.ln_1.weight") x.shape = {4, 4};
    }
  });
  absl::Status s = LoadHfCheckpoint(Dir("hf").string(), *dst);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor transformer.h.1.ln_1.weight"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("shape [4,4]"));

  rewrite([](std::vector<StTensor>& t, std::deque<std::vector<float>>&) {
    for (auto& x : t) {
      if (x.name == "transformer.h.0.attn.c_attn.weight") x.name = "transformer.h.0.attn.c_atn.weight";
    }
  });
  s = LoadHfCheckpoint(Dir("hf").string(), *dst);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("transformer.h.0.attn.c_atn.weight"));

  rewrite([](std::vector<StTensor>& t, std::deque<std::vector<float>>&) {
    t.erase(std::remove_if(t.begin(), t.end(), [](const StTensor& x) { return x.name == "transformer.ln_f.bias"; }),
            t.end());
  });
  s = LoadHfCheckpoint(Dir("hf").string(), *dst);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("transformer.ln_f.bias"));

  // An integer tensor where a parameter belongs (the header says I32, same byte size).
  {
    WriteHfDir(*src, Dir("hf"), 1, nullptr);
    std::string bytes = ReadAll(weights);
    const size_t at = bytes.find(R"("F32")", bytes.find(R"("transformer.ln_f.bias":{)"));
    ASSERT_NE(at, std::string::npos);
    bytes.replace(at + 1, 3, "I32");
    std::ofstream(weights, std::ios::binary | std::ios::trunc) << bytes;
    s = LoadHfCheckpoint(Dir("hf").string(), *dst);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("transformer.ln_f.bias"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("I32"));
  }
}

// A Hugging Face checkpoint stored in half precision: BF16 and F16 tensors
// load as their float32 values.
TEST_F(HfCheckpointTest, Bf16AndF16TensorsLoadAsFloat32) {
  const v1::ModelSpec spec = Gpt2Spec(8);
  auto src = Make(spec, 0, 1, 11);
  WriteHfDir(*src, Dir("hf"), 1, nullptr);
  // Rewrite model.safetensors: even tensors BF16 (truncated), odd ones F16.
  nlohmann::json header = nlohmann::json::object();
  std::string payload;
  std::map<std::string, torch::Tensor> want;
  int i = 0;
  for (const auto& [name, p] : src->named_params()) {
    if (name == "lm_head.weight") continue;
    const torch::Tensor c = p.detach().contiguous();
    const bool bf16 = (i++ % 2) == 0;
    const torch::Tensor half = c.to(bf16 ? torch::kBFloat16 : torch::kFloat16).contiguous();
    want[name] = half.to(torch::kFloat32);
    const size_t bytes = half.numel() * 2;
    header[HfFileName(spec, name)] = {{"dtype", bf16 ? "BF16" : "F16"},
                                      {"shape", std::vector<int64_t>(c.sizes().begin(), c.sizes().end())},
                                      {"data_offsets", {payload.size(), payload.size() + bytes}}};
    payload.append(static_cast<const char*>(half.data_ptr()), bytes);
  }
  std::string h = header.dump();
  std::string file(8, '\0');
  for (int b = 0; b < 8; ++b) file[b] = static_cast<char>((h.size() >> (8 * b)) & 0xff);
  file += h + payload;
  std::ofstream(Dir("hf") / kHfWeightsFile, std::ios::binary | std::ios::trunc) << file;
  auto dst = Make(spec, 0, 1, 5);
  absl::Status s = LoadHfCheckpoint(Dir("hf").string(), *dst);
  ASSERT_TRUE(s.ok()) << s;
  for (const auto& [name, p] : dst->named_params()) {
    EXPECT_TRUE(torch::equal(p, want.at(name))) << name;
  }
}

TEST_F(HfCheckpointTest, AConfigMismatchNamesTheField) {
  const v1::ModelSpec spec = Gpt2Spec(8);
  auto src = Make(spec, 0, 1, 11);
  WriteHfDir(*src, Dir("hf"), 1, nullptr);
  auto dst = Make(spec, 0, 1, 5);
  const std::string good = ReadAll(Dir("hf") / kHfConfigFile);
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* want;
  };
  for (const Case& c : std::vector<Case>{{"n_head", 4, "n_head is 4 but the job's model.n_head is 2"},
                                         {"n_positions", 4, "n_positions is 4"},
                                         {"model_type", "llama", "model_type"},
                                         {"vocab_size", 51, "vocab_size"},
                                         {"n_embd", 32, "n_embd"},
                                         {"n_layer", 2, "n_layer"},
                                         {"layer_norm_epsilon", 1e-6, "layer_norm_epsilon"},
                                         {"tie_word_embeddings", false, "tie_word_embeddings"},
                                         {"n_inner", 17, "n_inner"}}) {
    nlohmann::json j = nlohmann::json::parse(good);
    j[c.key] = c.value;
    std::ofstream(Dir("hf") / kHfConfigFile, std::ios::trunc) << j.dump();
    absl::Status s = LoadHfCheckpoint(Dir("hf").string(), *dst);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.want)) << c.key;
  }
  fs::remove(Dir("hf") / kHfConfigFile);
  EXPECT_EQ(LoadHfCheckpoint(Dir("hf").string(), *dst).code(), absl::StatusCode::kNotFound);
}

TEST_F(HfCheckpointTest, TheLlamaConfigIsCheckedFieldByField) {
  v1::ModelSpec spec = Gpt2Spec(8);
  spec.set_family(v1::ModelSpec::Family::llama);
  spec.set_n_kv_head(1);
  spec.set_d_ff(40);
  spec.set_tie_embeddings(false);
  const std::string good = HfConfigJson(spec, 8, 40);
  EXPECT_TRUE(CheckHfConfig(good, spec).ok()) << CheckHfConfig(good, spec);
  for (const auto& [key, value, want] : std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"num_key_value_heads", 2, "num_key_value_heads is 2"},
           {"intermediate_size", 64, "intermediate_size"},
           {"rope_theta", 500000.0, "rope_theta"},
           {"rms_norm_eps", 1e-6, "rms_norm_eps"},
           {"hidden_size", 32, "hidden_size"},
           {"num_hidden_layers", 4, "num_hidden_layers"},
           {"max_position_embeddings", 4, "max_position_embeddings"},
           {"tie_word_embeddings", true, "tie_word_embeddings"}}) {
    nlohmann::json j = nlohmann::json::parse(good);
    j[key] = value;
    absl::Status s = CheckHfConfig(j.dump(), spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << key;
    EXPECT_THAT(std::string(s.message()), HasSubstr(want)) << key;
  }
}

TEST_F(HfCheckpointTest, StageWorkersStartFromInitFrom) {
  v1::ModelSpec spec = Gpt2Spec(8);
  spec.set_tie_embeddings(false);  // lm_head.weight in the file
  auto src = Make(spec, 0, 1, 11);
  WriteHfDir(*src, Dir("hf"), 2, TwoShards);
  v1::JobSpec job;
  ApplyJobDefaults(&job);
  *job.mutable_model() = spec;
  job.mutable_model()->set_init_from(Dir("hf").string());
  job.set_stages(2);
  auto w0 = StageWorker::Create(job, 0), w1 = StageWorker::Create(job, 1);
  ASSERT_TRUE(w0.ok()) << w0.status();
  ASSERT_TRUE(w1.ok()) << w1.status();
  const torch::Tensor ids = Ids(1, 8, 50);
  std::vector<int32_t> tokens(8), targets(8, 7);
  for (int i = 0; i < 8; ++i) tokens[i] = static_cast<int32_t>(ids[0][i].item<int64_t>());
  std::vector<float> hidden;
  double loss = 0;
  ASSERT_TRUE((*w0)->EvalHidden({}, tokens, 1, &hidden).ok());
  ASSERT_TRUE((*w1)->EvalLoss(hidden, tokens, targets, 1, &loss).ok());
  torch::NoGradGuard ng;
  const double want = NextTokenLoss(src->forward(ids), torch::full({1, 8}, 7, torch::kLong)).item<double>();
  EXPECT_NEAR(loss, want, 1e-6);
  // A directory that does not match the job fails the stage's creation.
  job.mutable_model()->set_n_head(4);
  auto bad = StageWorker::Create(job, 1);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("n_head"));
}

// A finished two-stage run's checkpoints (tied embeddings: the last stage
// holds a copy of wte as lm_head.weight).
std::vector<std::string> WriteRunCheckpoints(const v1::ModelSpec& spec, const fs::path& dir,
                                             std::vector<std::shared_ptr<StageModel>>* stages) {
  fs::create_directories(dir);
  std::vector<std::string> paths;
  for (int s = 0; s < 2; ++s) {
    stages->push_back(Make(spec, s, 2, 7));
    AdamW opt((*stages)[s]->named_params(), v1::OptimizerSpec());
    paths.push_back((dir / absl::StrCat("stage-", s, ".ckpt")).string());
    EXPECT_TRUE(SaveStageCheckpoint(paths.back(), *(*stages)[s], opt, "job").ok());
  }
  return paths;
}

TEST_F(HfCheckpointTest, ExportThenImportGivesIdenticalLogits) {
  const v1::ModelSpec spec = Gpt2Spec(8);
  std::vector<std::shared_ptr<StageModel>> stages;
  HfExportOptions o;
  *o.job.mutable_model() = spec;
  o.stage_checkpoints = WriteRunCheckpoints(spec, Dir("run"), &stages);
  o.out_dir = Dir("export").string();
  absl::Status s = ExportHfModel(o);
  ASSERT_TRUE(s.ok()) << s;
  // GPT2LMHeadModel's names; the tied head is left to the loader.
  auto file = SafetensorsFile::Open((Dir("export") / kHfWeightsFile).string());
  ASSERT_TRUE(file.ok());
  EXPECT_NE((*file)->Find("transformer.wte.weight"), nullptr);
  EXPECT_NE((*file)->Find("transformer.h.2.mlp.c_proj.bias"), nullptr);
  EXPECT_EQ((*file)->Find("lm_head.weight"), nullptr);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  const auto config = nlohmann::json::parse(ReadAll(Dir("export") / kHfConfigFile));
  EXPECT_EQ(config["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(config["n_positions"], 8);
  EXPECT_EQ(config["torch_dtype"], "float32");

  auto whole = Make(spec, 0, 1, 1);
  s = LoadHfCheckpoint(o.out_dir, *whole);
  ASSERT_TRUE(s.ok()) << s;
  torch::NoGradGuard ng;
  const torch::Tensor ids = Ids(2, 8, 50);
  EXPECT_TRUE(torch::equal(whole->forward(ids), stages[1]->forward(stages[0]->forward(ids))));
  // ModelSpecFromHfDir reads the same model back.
  auto read = ModelSpecFromHfDir(o.out_dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->d_model(), 16u);
  EXPECT_EQ(read->seq_len(), 8u);
  EXPECT_TRUE(read->tie_embeddings());
}

TEST_F(HfCheckpointTest, LlamaExportThenImportGivesIdenticalLogits) {
  for (bool tied : {false, true}) {
    v1::ModelSpec spec = Gpt2Spec(8);
    spec.set_family(v1::ModelSpec::Family::llama);
    spec.set_n_kv_head(1);
    spec.set_d_ff(40);
    spec.set_rope_theta(500000);
    spec.set_tie_embeddings(tied);
    std::vector<std::shared_ptr<StageModel>> stages;
    HfExportOptions o;
    *o.job.mutable_model() = spec;
    const std::string tag = tied ? "tied" : "untied";
    o.stage_checkpoints = WriteRunCheckpoints(spec, Dir("run-" + tag), &stages);
    o.out_dir = Dir("export-" + tag).string();
    absl::Status s = ExportHfModel(o);
    ASSERT_TRUE(s.ok()) << s;
    auto file = SafetensorsFile::Open((Dir("export-" + tag) / kHfWeightsFile).string());
    ASSERT_TRUE(file.ok());
    EXPECT_NE((*file)->Find("model.embed_tokens.weight"), nullptr);
    EXPECT_NE((*file)->Find("model.layers.2.mlp.down_proj.weight"), nullptr);
    EXPECT_EQ((*file)->Find("lm_head.weight") != nullptr, !tied);  // LlamaForCausalLM ties it itself
    const auto config = nlohmann::json::parse(ReadAll(Dir("export-" + tag) / kHfConfigFile));
    EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
    EXPECT_EQ(config["intermediate_size"], 40);
    EXPECT_EQ(config["num_key_value_heads"], 1);

    auto whole = Make(spec, 0, 1, 1);
    s = LoadHfCheckpoint(o.out_dir, *whole);
    ASSERT_TRUE(s.ok()) << s;
    torch::NoGradGuard ng;
    const torch::Tensor ids = Ids(2, 8, 50);
    EXPECT_TRUE(torch::equal(whole->forward(ids), stages[1]->forward(stages[0]->forward(ids)))) << tag;
    // And back into two stages (the tied head copied from the embedding).
    auto s0 = Make(spec, 0, 2, 3), s1 = Make(spec, 1, 2, 3);
    ASSERT_TRUE(LoadHfCheckpoint(o.out_dir, *s0).ok());
    ASSERT_TRUE(LoadHfCheckpoint(o.out_dir, *s1).ok());
    EXPECT_TRUE(torch::equal(s1->forward(s0->forward(ids)), whole->forward(ids))) << tag;
  }
}

TEST_F(HfCheckpointTest, ExportRefusesCheckpointsOutOfOrder) {
  const v1::ModelSpec spec = Gpt2Spec(8);
  std::vector<std::shared_ptr<StageModel>> stages;
  HfExportOptions o;
  *o.job.mutable_model() = spec;
  o.stage_checkpoints = WriteRunCheckpoints(spec, Dir("run"), &stages);
  std::swap(o.stage_checkpoints[0], o.stage_checkpoints[1]);
  o.out_dir = Dir("export").string();
  EXPECT_EQ(ExportHfModel(o).code(), absl::StatusCode::kFailedPrecondition);
  o.stage_checkpoints.resize(1);
  EXPECT_FALSE(ExportHfModel(o).ok());
}

TEST_F(HfCheckpointTest, ExportRefusesAStageCheckpointWithAnIntegerTensor) {
  const v1::ModelSpec spec = Gpt2Spec(8);
  std::vector<std::shared_ptr<StageModel>> stages;
  HfExportOptions o;
  *o.job.mutable_model() = spec;
  o.stage_checkpoints = WriteRunCheckpoints(spec, Dir("run"), &stages);
  o.out_dir = Dir("export").string();
  // The last stage's ln_f.bias relabelled I32 (same byte size): a damaged file.
  std::string bytes = ReadAll(o.stage_checkpoints.back());
  const size_t at = bytes.find(R"("F32")", bytes.find(R"("ln_f.bias":{)"));
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at + 1, 3, "I32");
  std::ofstream(o.stage_checkpoints.back(), std::ios::binary | std::ios::trunc) << bytes;
  const absl::Status s = ExportHfModel(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("ln_f.bias"));
}

class GenerateTest : public HfCheckpointTest {
 protected:
  void SetUp() override {
    spec_ = Gpt2Spec(8);
    model_ = Make(spec_, 0, 1, 21);
    WriteHfDir(*model_, Dir("model"), 1, nullptr);
  }
  v1::ModelSpec spec_;
  std::shared_ptr<StageModel> model_;
};

TEST_F(GenerateTest, GreedyIsTheArgmaxContinuation) {
  GenerateOptions o{.model_dir = Dir("model").string(), .max_tokens = 10};  // past the window of 8
  const std::vector<int32_t> prompt = {3, 14, 15};
  auto got = GenerateIds(o, prompt);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 10u);
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  torch::NoGradGuard ng;
  for (int t = 0; t < 10; ++t) {
    const int64_t n = std::min<int64_t>(8, ids.size());
    std::vector<int64_t> ctx(ids.end() - n, ids.end());
    torch::Tensor logits = model_->forward(torch::tensor(ctx, torch::kLong).view({1, n}));
    ids.push_back(logits[0][n - 1].argmax().item<int64_t>());
    EXPECT_EQ((*got)[t], ids.back()) << "token " << t;
  }
  auto again = GenerateIds(o, prompt);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *got);
  // Stops before the first occurrence of the stop id.
  const int32_t stop = (*got)[got->size() - 1];
  const size_t first = std::find(got->begin(), got->end(), stop) - got->begin();
  auto stopped = GenerateIds(o, prompt, stop);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(*stopped, std::vector<int32_t>(got->begin(), got->begin() + first));
}

TEST_F(GenerateTest, SeededSamplingIsReproducible) {
  GenerateOptions o{.model_dir = Dir("model").string(), .max_tokens = 12, .temperature = 1.5, .top_k = 20, .seed = 4};
  auto a = GenerateIds(o, {1, 2});
  auto b = GenerateIds(o, {1, 2});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  o.seed = 5;
  auto c = GenerateIds(o, {1, 2});
  ASSERT_TRUE(c.ok());
  EXPECT_NE(*a, *c);
  o.top_k = 1;  // top-1 sampling is greedy
  auto top1 = GenerateIds(o, {1, 2});
  o.temperature = 0;
  auto greedy = GenerateIds(o, {1, 2});
  ASSERT_TRUE(top1.ok() && greedy.ok());
  EXPECT_EQ(*top1, *greedy);
  o.temperature = -1;
  EXPECT_EQ(GenerateIds(o, {1, 2}).status().code(), absl::StatusCode::kInvalidArgument);
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    o.temperature = bad;
    EXPECT_EQ(GenerateIds(o, {1, 2}).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(GenerateTest, TextInTextOutWithTheExportedTokenizer) {
  const fs::path tok = fs::path(AQSWARM_DATA_DIR) / "gpt2";
  ASSERT_TRUE(fs::exists(tok / "encoder.json")) << "GPT-2 tokenizer files missing: run scripts/fetch_data.sh";
  v1::ModelSpec spec = Gpt2Spec(16);
  spec.set_vocab_size(50257);
  std::vector<std::shared_ptr<StageModel>> stages;
  HfExportOptions o;
  *o.job.mutable_model() = spec;
  o.job.mutable_data()->set_tokenizer(tok.string());
  o.stage_checkpoints = WriteRunCheckpoints(spec, Dir("run"), &stages);
  o.out_dir = Dir("export").string();
  ASSERT_TRUE(ExportHfModel(o).ok());
  for (const char* f : {"encoder.json", "vocab.bpe", "vocab.json", "merges.txt"}) {
    EXPECT_TRUE(fs::exists(Dir("export") / f)) << f;
  }
  auto r = Generate({.model_dir = o.out_dir, .prompt = "The state of the Union is", .max_tokens = 5});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt_ids.size(), 6u);
  EXPECT_LE(r->generated_ids.size(), 5u);
  EXPECT_EQ(r->text.rfind("The state of the Union is", 0), 0u);
}

// A Llama model trained with Llama-3's tokenizer.json exports that file and
// names its document separator (<|end_of_text|>, 128001) in config.json;
// generate reads text through it.
TEST_F(GenerateTest, ALlama3TokenizerIsExportedWithItsEndOfTextId) {
  const fs::path tok = fs::path(AQSWARM_DATA_DIR) / "llama3";
  ASSERT_TRUE(fs::exists(tok / "tokenizer.json")) << "Llama-3 tokenizer missing: run scripts/fetch_data.sh";
  v1::ModelSpec spec = Gpt2Spec(16);
  spec.set_family(v1::ModelSpec::Family::llama);
  spec.set_n_kv_head(1);
  spec.set_d_ff(40);
  spec.set_vocab_size(128256);
  spec.set_tie_embeddings(true);
  std::vector<std::shared_ptr<StageModel>> stages;
  HfExportOptions o;
  *o.job.mutable_model() = spec;
  o.job.mutable_data()->set_tokenizer(tok.string());
  o.stage_checkpoints = WriteRunCheckpoints(spec, Dir("run"), &stages);
  o.out_dir = Dir("export").string();
  absl::Status s = ExportHfModel(o);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(fs::exists(Dir("export") / "tokenizer.json"));
  EXPECT_FALSE(fs::exists(Dir("export") / "vocab.json"));
  const auto config = nlohmann::json::parse(ReadAll(Dir("export") / kHfConfigFile));
  EXPECT_EQ(config["eos_token_id"], 128001);
  EXPECT_EQ(config["bos_token_id"], 128001);
  auto r = Generate({.model_dir = o.out_dir, .prompt = "Hello, world!", .max_tokens = 3});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt_ids, (std::vector<int32_t>{9906, 11, 1917, 0}));

  // Without data (synthetic tokens) there is no tokenizer, and no special ids.
  o.job.mutable_data()->clear_tokenizer();
  o.out_dir = Dir("export-synthetic").string();
  ASSERT_TRUE(ExportHfModel(o).ok());
  EXPECT_FALSE(nlohmann::json::parse(ReadAll(Dir("export-synthetic") / kHfConfigFile)).contains("eos_token_id"));
}

}  // namespace
}  // namespace aqswarm::pipeline
