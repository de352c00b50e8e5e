// Text generation from an exported Hugging Face directory (torch-free header;
// the model runs in generate.cc). `aqswarm generate` is a thin wrapper.
//
// The directory (what `aqswarm export` writes, or a Hugging Face GPT-2 /
// Llama directory with GPT-2's BPE files) is loaded into one single-stage
// model (pipeline/hf_checkpoint.h), the prompt tokenized with the tokenizer
// found there (tokenizer.json, else GPT-2's encoder.json + vocab.bpe, or
// vocab.json + merges.txt; pipeline/tokenizer.h), and tokens sampled one at a time from the last position's
// logits over a window of the newest seq_len tokens (no KV cache: each token
// costs a full forward of the window). temperature 0 is greedy (argmax,
// lowest id on ties); otherwise softmax(logits / temperature) over the top_k
// largest (all when 0), drawn with a generator seeded by `seed`, so a run is
// reproducible. Generation stops after max_tokens or at the tokenizer's
// eot_id() (<|endoftext|>; Llama-3: <|end_of_text|>).
//
//   GenerateOptions o{.model_dir = "out/model", .prompt = "The Union is", .max_tokens = 20};
//   AQSWARM_ASSIGN_OR_RETURN(GenerateResult r, Generate(o));
//   std::cout << r.text;  // the prompt and its continuation
#ifndef AQSWARM_PIPELINE_GENERATE_H_
#define AQSWARM_PIPELINE_GENERATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace aqswarm::pipeline {

struct GenerateOptions {
  std::string model_dir;
  std::string prompt;
  int max_tokens = 32;      // new tokens at most
  double temperature = 0;   // 0 = greedy
  int top_k = 0;            // sample among the k likeliest (0 = all)
  uint64_t seed = 0;        // the sampler's seed
  std::string device = "cpu";
  int max_seq_len = 1024;   // the context window is min(this, the model's)
};

struct GenerateResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> generated_ids;
  std::string text;  // prompt + decoded continuation
};

absl::StatusOr<GenerateResult> Generate(const GenerateOptions& options);

// The same on token ids, without a tokenizer: the ids that follow `prompt`
// (prompt.text is ignored); stops at `stop_id` (not included) when >= 0.
absl::StatusOr<std::vector<int32_t>> GenerateIds(const GenerateOptions& options, const std::vector<int32_t>& prompt,
                                                 int32_t stop_id = -1);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_GENERATE_H_
