// A GPT-2-style decoder split into pipeline stages (libtorch).
//
// INTERNAL to pipeline/: this header includes torch. Other modules use the
// torch-free facades in pipeline/ (e.g. stage_runner.h).
//
// Architecture (GPT-2): token + position embeddings, pre-LN blocks with causal
// self-attention and a GELU(tanh) MLP, final LayerNorm, LM head (with
// model.tie_embeddings, the token embedding itself where one stage holds both,
// as in a one-stage model; otherwise a weight of its own). Linear weights use
// GPT-2's Conv1D layout [in, out] (y = x W + b), so Hugging Face safetensors
// load without transposes.
//
// A stage is a contiguous block range; stage 0 also owns the embeddings, the
// last stage also the final LayerNorm, the head and the loss. Every parameter
// has its global Hugging Face name ("wte.weight", "h.3.attn.c_attn.weight") and
// is initialised from a generator seeded by (seed, name), so a model split
// into K stages starts bit-identical to the unsplit one.
//
// Head across stages: a last stage that does not own `wte` holds its own
// `lm_head.weight` (TiedEmbeddingName()), initialised equal to `wte.weight`
// with tie_embeddings and from its own seed without. Nothing adds the two
// copies' gradients, so tied copies would train apart: StageWorker::Create
// refuses model.tie_embeddings with more than one stage
// (pipeline/stage_worker.cc).
//
//   GptStage stage(spec, StageRangeFor(spec, /*stage=*/0, /*num_stages=*/2), seed);
//   torch::Tensor h = stage->forward(ids);        // [B,T] int64 -> [B,T,D]
#ifndef AQSWARM_PIPELINE_GPT_H_
#define AQSWARM_PIPELINE_GPT_H_

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

struct StageRange {
  int stage = 0;
  int num_stages = 1;
  int first_block = 0;  // inclusive
  int end_block = 0;    // exclusive
  bool has_embedding() const { return stage == 0; }
  bool has_head() const { return stage == num_stages - 1; }
};

// Even split of n_layer blocks over num_stages (earlier stages take the
// remainder: they also carry fewer non-block costs than the head stage).
StageRange StageRangeFor(const v1::ModelSpec& spec, int stage, int num_stages);

class GptStageImpl : public torch::nn::Module {
 public:
  GptStageImpl(const v1::ModelSpec& spec, StageRange range, uint64_t seed);

  // Stage 0: int64 token ids [B,T]. Other stages: float hidden [B,T,D].
  // Returns hidden [B,T,D], or logits [B,T,V] on the last stage.
  torch::Tensor forward(const torch::Tensor& input);

  // Mean next-token cross-entropy of logits [B,T,V] against targets [B,T].
  static torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& targets);

  // Parameters by global Hugging Face name, in a fixed order.
  const std::vector<std::pair<std::string, torch::Tensor>>& named_params() const { return named_; }
  const StageRange& range() const { return range_; }
  const v1::ModelSpec& spec() const { return spec_; }

 private:
  struct Block {
    torch::Tensor ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b;
    torch::Tensor ln2_w, ln2_b, fc_w, fc_b, proj_w, proj_b;
  };
  torch::Tensor AddParam(const std::string& name, torch::Tensor init);
  torch::Tensor BlockForward(const Block& b, const torch::Tensor& x);

  v1::ModelSpec spec_;
  StageRange range_;
  uint64_t seed_;
  std::vector<std::pair<std::string, torch::Tensor>> named_;
  torch::Tensor wte_, wpe_, ln_f_w_, ln_f_b_, lm_head_;
  std::vector<Block> blocks_;
};
TORCH_MODULE(GptStage);

// Name of the head weight that mirrors wte on a last stage without embeddings.
inline const char* TiedEmbeddingName() { return "lm_head.weight"; }

// Number of parameters of the whole model described by `spec`.
int64_t ModelParameterCount(const v1::ModelSpec& spec);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_GPT_H_
