// Hugging Face checkpoint directories in and out (torch-free header; the
// importer's body is in hf_import.cc, which includes torch).
//
// A directory holds config.json and either model.safetensors or shards
// model-0000x-of-0000y.safetensors with model.safetensors.index.json
// ({"weight_map": {tensor name: shard file}}).
//
// Names. Our parameters carry Hugging Face names already
// (pipeline/stage_model.h). GPT-2: files name them with or without the
// "transformer." prefix (GPT2LMHeadModel writes it; lm_head.weight never has
// it) and omit lm_head.weight when the head is tied to wte. Llama: the names
// of LlamaForCausalLM as they are; lm_head.weight is absent when
// tie_word_embeddings. A head that the file omits is copied from the token
// embedding (only when the config says tied). Tensors the model does not have
// are an error naming them, except the buffers older writers stored
// ("*.attn.bias", "*.attn.masked_bias", "*.rotary_emb.inv_freq").
//
// Import (LoadHfCheckpoint): config.json is checked against the job's
// ModelSpec field by field (family, sizes, heads, norm epsilon, rope theta,
// tie, context >= seq_len); then each stage opens only the shards that hold
// its own tensors, checks every tensor's name, shape and dtype (F32, BF16,
// F16: converted to float32 masters) and copies them in, all or nothing.
// GPT-2's position table may be longer than the job's seq_len: its first
// seq_len rows are used.
//
// Export (ExportHfModel): merges the stages' checkpoints of a finished run
// into one model.safetensors with the names GPT2LMHeadModel /
// LlamaForCausalLM load, writes config.json (torch_dtype float32) and copies
// the job's tokenizer files: a tokenizer.json (data.tokenizer names the file
// or a directory holding it) with the tokenizer_config.json and
// special_tokens_map.json beside it when present; GPT-2's encoder.json and
// vocab.bpe, also as HF's vocab.json and merges.txt, when the directory has
// them.
//
//   AQSWARM_RETURN_IF_ERROR(LoadHfCheckpoint("models/gpt2", *stage));
//   AQSWARM_RETURN_IF_ERROR(ExportHfModel({.job = job, .stage_checkpoints = paths, .out_dir = "out"}));
#ifndef AQSWARM_PIPELINE_HF_CHECKPOINT_H_
#define AQSWARM_PIPELINE_HF_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

class StageModel;  // pipeline/stage_model.h (torch)

inline constexpr char kHfConfigFile[] = "config.json";
inline constexpr char kHfWeightsFile[] = "model.safetensors";
inline constexpr char kHfIndexFile[] = "model.safetensors.index.json";

// Names of every parameter of the whole model `spec` describes, as our stages
// name them (GPT-2 without "transformer."; "lm_head.weight" included when the
// head is a tensor of its own: untied, or tied across several stages when
// `num_stages` > 1).
std::vector<std::string> ModelParamNames(const v1::ModelSpec& spec, int num_stages = 1);

// The name a Hugging Face file gives our parameter `name` (GPT-2: with the
// "transformer." prefix, except lm_head.weight; Llama: unchanged).
std::string HfFileName(const v1::ModelSpec& spec, const std::string& name);

// Checks config.json's text against `spec`; the error names the field, e.g.
// "config.json: n_head is 12 but the job's model.n_head is 4".
absl::Status CheckHfConfig(const std::string& config_json, const v1::ModelSpec& spec);

// config.json for `spec`: `max_positions` (GPT-2's n_positions, Llama's
// max_position_embeddings) and `d_ff` (the MLP width) as the weights have them;
// bos_token_id and eos_token_id are `eos_id` (the tokenizer's document
// separator, Tokenizer::eot_id(); omitted when < 0).
std::string HfConfigJson(const v1::ModelSpec& spec, int64_t max_positions, int64_t d_ff, int64_t eos_id = 50256);

// The ModelSpec a Hugging Face directory's config.json describes; seq_len is
// its context length, capped at `max_seq_len`.
absl::StatusOr<v1::ModelSpec> ModelSpecFromHfDir(const std::string& dir, int64_t max_seq_len = 2048);

// Fills `stage` from the Hugging Face directory `dir` (see the file comment).
absl::Status LoadHfCheckpoint(const std::string& dir, StageModel& stage);

struct HfExportOptions {
  // The run's job (model spec, data.tokenizer, name).
  v1::JobSpec job;
  // One stage checkpoint (pipeline/stage_io.h) per stage, in stage order.
  std::vector<std::string> stage_checkpoints;
  // Created if missing; files in it are replaced.
  std::string out_dir;
};

// Writes out_dir/{config.json, model.safetensors, tokenizer files}.
absl::Status ExportHfModel(const HfExportOptions& options);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_HF_CHECKPOINT_H_
