// `aqswarm generate`: text from an exported model directory
// (pipeline/generate.h does the work).
#include <iostream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "cli/command.h"
#include "pipeline/generate.h"

ABSL_DECLARE_FLAG(uint64_t, seed);  // cli/bench_command.cc

ABSL_FLAG(std::string, model, "", "Model directory (what `aqswarm export` writes, or a Hugging Face GPT-2/Llama "
                                  "directory with GPT-2's BPE files).");
ABSL_FLAG(std::string, prompt, "", "Text to continue.");
ABSL_FLAG(int32_t, max_tokens, 32, "New tokens at most (stops early at <|endoftext|>).");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature; 0 = greedy (argmax).");
ABSL_FLAG(int32_t, top_k, 0, "Sample among the k likeliest tokens (0 = all).");
ABSL_FLAG(std::string, device, "cpu", "Torch device of the model: cpu, cuda, cuda:1, ...");

namespace aqswarm::cli {
namespace {

int RunGenerate(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::cerr << "aqswarm generate: unexpected argument " << args[0] << " (the prompt goes in --prompt)\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_model).empty()) {
    std::cerr << "aqswarm generate: --model is required\n";
    return 2;
  }
  pipeline::GenerateOptions o;
  o.model_dir = absl::GetFlag(FLAGS_model);
  o.prompt = absl::GetFlag(FLAGS_prompt);
  o.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  o.temperature = absl::GetFlag(FLAGS_temperature);
  o.top_k = absl::GetFlag(FLAGS_top_k);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.device = absl::GetFlag(FLAGS_device);
  absl::StatusOr<pipeline::GenerateResult> r = pipeline::Generate(o);
  if (!r.ok()) {
    std::cerr << "aqswarm generate: " << r.status().message() << "\n";
    return 1;
  }
  std::cout << r->text << "\n";
  return 0;
}

}  // namespace

std::vector<Command> GenerateCommands() {
  return {{"generate",
           "Continue a prompt with an exported model (greedy, or seeded temperature / top-k sampling).",
           "Prints the prompt and its continuation. --seed is the sampler's seed: the same flags give the same\n"
           "text. No KV cache: each new token runs the model over the newest context window.",
           {"model", "prompt", "max_tokens", "temperature", "top_k", "seed", "device"},
           RunGenerate}};
}

}  // namespace aqswarm::cli
