// The torch-free half of pipeline/hf_checkpoint.h: names, config.json, export.
#include "pipeline/hf_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "pipeline/job_spec.h"
#include "nlohmann/json.hpp"
#include "pipeline/safetensors.h"
#include "pipeline/tokenizer.h"

namespace aqswarm::pipeline {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool IsLlama(const v1::ModelSpec& spec) { return spec.family() == v1::ModelSpec::Family::llama; }

// The family defaults a 0 in the spec stands for (proto/job.proto).
double NormEps(const v1::ModelSpec& spec) { return spec.norm_eps() > 0 ? spec.norm_eps() : 1e-5; }
double RopeTheta(const v1::ModelSpec& spec) { return spec.rope_theta() > 0 ? spec.rope_theta() : 10000.0; }

absl::Status Mismatch(const std::string& field, const std::string& have, const std::string& job_field,
                      const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: ", field, " is ", have, " but the job's ", job_field,
                                                 " is ", want));
}

std::string Num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

// Reads an integer field (or `def` when absent/null); an error names it.
absl::StatusOr<int64_t> IntField(const json& c, const std::string& key, int64_t def, bool required) {
  if (!c.contains(key) || c[key].is_null()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat("config.json lacks ", key));
    return def;
  }
  if (!c[key].is_number_integer()) return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " is not an integer"));
  return c[key].get<int64_t>();
}

absl::StatusOr<double> NumField(const json& c, const std::string& key, double def) {
  if (!c.contains(key) || c[key].is_null()) return def;
  if (!c[key].is_number()) return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " is not a number"));
  return c[key].get<double>();
}

absl::StatusOr<bool> BoolField(const json& c, const std::string& key, bool def) {
  if (!c.contains(key) || c[key].is_null()) return def;
  if (!c[key].is_boolean()) return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " is not a boolean"));
  return c[key].get<bool>();
}

absl::Status ExpectInt(const json& c, const std::string& key, int64_t want, const std::string& job_field) {
  AQSWARM_ASSIGN_OR_RETURN(int64_t have, IntField(c, key, 0, /*required=*/true));
  if (have != want) return Mismatch(key, std::to_string(have), job_field, std::to_string(want));
  return absl::OkStatus();
}

absl::Status ExpectNum(const json& c, const std::string& key, double def, double want, const std::string& job_field) {
  AQSWARM_ASSIGN_OR_RETURN(double have, NumField(c, key, def));
  if (std::abs(have - want) > 1e-6 * std::max(std::abs(want), 1e-30)) {
    return Mismatch(key, Num(have), job_field, Num(want));
  }
  return absl::OkStatus();
}

absl::StatusOr<json> ParseConfig(const std::string& text) {
  json c = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (c.is_discarded() || !c.is_object()) return absl::InvalidArgumentError("config.json is not a JSON object");
  return c;
}

absl::StatusOr<std::string> ReadText(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status CopyFile(const fs::path& from, const fs::path& to) {
  AQSWARM_ASSIGN_OR_RETURN(std::string bytes, ReadText(from));
  return WriteFileAtomically(to.string(), bytes, 0644);
}

}  // namespace

std::vector<std::string> ModelParamNames(const v1::ModelSpec& spec, int num_stages) {
  std::vector<std::string> names;
  const bool separate_head = !spec.tie_embeddings() || num_stages > 1;
  if (IsLlama(spec)) {
    names.push_back("model.embed_tokens.weight");
    for (uint32_t i = 0; i < spec.n_layer(); ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      for (const char* s : {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}) {
        names.push_back(p + s);
      }
    }
    names.push_back("model.norm.weight");
  } else {
    names.push_back("wte.weight");
    names.push_back("wpe.weight");
    for (uint32_t i = 0; i < spec.n_layer(); ++i) {
      const std::string p = absl::StrCat("h.", i, ".");
      for (const char* s : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                            "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
                            "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"}) {
        names.push_back(p + s);
      }
    }
    names.push_back("ln_f.weight");
    names.push_back("ln_f.bias");
  }
  if (separate_head) names.push_back("lm_head.weight");
  return names;
}

std::string HfFileName(const v1::ModelSpec& spec, const std::string& name) {
  if (IsLlama(spec) || name == "lm_head.weight") return name;
  return "transformer." + name;
}

absl::Status CheckHfConfig(const std::string& config_json, const v1::ModelSpec& spec) {
  AQSWARM_ASSIGN_OR_RETURN(json c, ParseConfig(config_json));
  const std::string& family = ModelFamilyName(spec);
  if (!c.contains("model_type") || !c["model_type"].is_string()) {
    return absl::InvalidArgumentError("config.json lacks model_type");
  }
  const std::string type = c["model_type"].get<std::string>();
  if (type != family) return Mismatch("model_type", "'" + type + "'", "model.family", "'" + family + "'");
  AQSWARM_RETURN_IF_ERROR(ExpectInt(c, "vocab_size", spec.vocab_size(), "model.vocab_size"));
  const int64_t seq_len = spec.seq_len();
  if (family == "gpt2") {
    AQSWARM_RETURN_IF_ERROR(ExpectInt(c, "n_embd", spec.d_model(), "model.d_model"));
    AQSWARM_RETURN_IF_ERROR(ExpectInt(c, "n_layer", spec.n_layer(), "model.n_layer"));
    AQSWARM_RETURN_IF_ERROR(ExpectInt(c, "n_head", spec.n_head(), "model.n_head"));
    AQSWARM_ASSIGN_OR_RETURN(int64_t n_inner, IntField(c, "n_inner", 4 * int64_t{spec.d_model()}, false));
    const int64_t d_ff = spec.d_ff() > 0 ? spec.d_ff() : 4 * int64_t{spec.d_model()};
    if (n_inner != d_ff) return Mismatch("n_inner", std::to_string(n_inner), "model.d_ff", std::to_string(d_ff));
    AQSWARM_ASSIGN_OR_RETURN(int64_t n_pos, IntField(c, "n_positions", 1024, false));
    if (n_pos < seq_len) {
      return Mismatch("n_positions", std::to_string(n_pos), "model.seq_len", absl::StrCat(seq_len, " (larger)"));
    }
    AQSWARM_RETURN_IF_ERROR(ExpectNum(c, "layer_norm_epsilon", 1e-5, NormEps(spec), "model.norm_eps"));
    AQSWARM_ASSIGN_OR_RETURN(bool tied, BoolField(c, "tie_word_embeddings", true));
    if (tied != spec.tie_embeddings()) {
      return Mismatch("tie_word_embeddings", tied ? "true" : "false", "model.tie_embeddings",
                      spec.tie_embeddings() ? "true" : "false");
    }
    if (c.contains("activation_function") && c["activation_function"] != "gelu_new" &&
        c["activation_function"] != "gelu_pytorch_tanh") {
      return absl::InvalidArgumentError(absl::StrCat("config.json: activation_function ",
                                                     c["activation_function"].dump(),
                                                     " is not supported (the model uses gelu_new)"));
    }
    return absl::OkStatus();
  }
  AQSWARM_RETURN_IF_ERROR(ExpectInt(c, "hidden_size", spec.d_model(), "model.d_model"));
  AQSWARM_RETURN_IF_ERROR(ExpectInt(c, "num_hidden_layers", spec.n_layer(), "model.n_layer"));
  AQSWARM_RETURN_IF_ERROR(ExpectInt(c, "num_attention_heads", spec.n_head(), "model.n_head"));
  AQSWARM_ASSIGN_OR_RETURN(int64_t kv, IntField(c, "num_key_value_heads", spec.n_head(), false));
  if (kv != KeyValueHeads(spec)) return Mismatch("num_key_value_heads", std::to_string(kv), "model.n_kv_head",
                                           std::to_string(KeyValueHeads(spec)));
  // model.d_ff = 0 stands for the family's default width (pipeline/llama.h):
  // the tensors' shapes check it then.
  if (spec.d_ff() > 0) AQSWARM_RETURN_IF_ERROR(ExpectInt(c, "intermediate_size", spec.d_ff(), "model.d_ff"));
  AQSWARM_ASSIGN_OR_RETURN(int64_t head_dim, IntField(c, "head_dim", spec.d_model() / spec.n_head(), false));
  if (head_dim != spec.d_model() / spec.n_head()) {
    return Mismatch("head_dim", std::to_string(head_dim), "model.d_model / model.n_head",
                    std::to_string(spec.d_model() / spec.n_head()));
  }
  AQSWARM_RETURN_IF_ERROR(ExpectNum(c, "rope_theta", 10000.0, RopeTheta(spec), "model.rope_theta"));
  AQSWARM_RETURN_IF_ERROR(ExpectNum(c, "rms_norm_eps", 1e-6, NormEps(spec), "model.norm_eps"));
  AQSWARM_ASSIGN_OR_RETURN(int64_t n_pos, IntField(c, "max_position_embeddings", 2048, false));
  if (n_pos < seq_len) {
    return Mismatch("max_position_embeddings", std::to_string(n_pos), "model.seq_len", absl::StrCat(seq_len, " (larger)"));
  }
  AQSWARM_ASSIGN_OR_RETURN(bool tied, BoolField(c, "tie_word_embeddings", false));
  if (tied != spec.tie_embeddings()) {
    return Mismatch("tie_word_embeddings", tied ? "true" : "false", "model.tie_embeddings",
                    spec.tie_embeddings() ? "true" : "false");
  }
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null()) {
    return absl::InvalidArgumentError("config.json: rope_scaling is not supported (the model uses plain RoPE)");
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    AQSWARM_ASSIGN_OR_RETURN(bool bias, BoolField(c, key, false));
    if (bias) return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " is not supported"));
  }
  if (c.contains("hidden_act") && c["hidden_act"] != "silu") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: hidden_act ", c["hidden_act"].dump(), " is not supported (the model uses silu)"));
  }
  return absl::OkStatus();
}

std::string HfConfigJson(const v1::ModelSpec& spec, int64_t max_positions, int64_t d_ff, int64_t eos_id) {
  json c;
  c["vocab_size"] = spec.vocab_size();
  c["tie_word_embeddings"] = spec.tie_embeddings();
  c["torch_dtype"] = "float32";
  if (eos_id >= 0) {  // documents are joined with it, so it both ends and starts one
    c["bos_token_id"] = eos_id;
    c["eos_token_id"] = eos_id;
  }
  if (IsLlama(spec)) {
    c["architectures"] = {"LlamaForCausalLM"};
    c["model_type"] = "llama";
    c["hidden_size"] = spec.d_model();
    c["num_hidden_layers"] = spec.n_layer();
    c["num_attention_heads"] = spec.n_head();
    c["num_key_value_heads"] = KeyValueHeads(spec);
    c["head_dim"] = spec.d_model() / spec.n_head();
    c["intermediate_size"] = d_ff;
    c["max_position_embeddings"] = max_positions;
    c["rope_theta"] = RopeTheta(spec);
    c["rope_scaling"] = nullptr;
    c["rms_norm_eps"] = NormEps(spec);
    c["hidden_act"] = "silu";
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
    c["attention_dropout"] = 0.0;
  } else {
    c["architectures"] = {"GPT2LMHeadModel"};
    c["model_type"] = "gpt2";
    c["n_embd"] = spec.d_model();
    c["n_layer"] = spec.n_layer();
    c["n_head"] = spec.n_head();
    c["n_inner"] = d_ff;
    c["n_positions"] = max_positions;
    c["n_ctx"] = max_positions;
    c["layer_norm_epsilon"] = NormEps(spec);
    c["activation_function"] = "gelu_new";
    c["resid_pdrop"] = 0.0;  // the model trains without dropout
    c["embd_pdrop"] = 0.0;
    c["attn_pdrop"] = 0.0;
  }
  return c.dump(2) + "\n";
}

absl::StatusOr<v1::ModelSpec> ModelSpecFromHfDir(const std::string& dir, int64_t max_seq_len) {
  AQSWARM_ASSIGN_OR_RETURN(std::string text, ReadText(fs::path(dir) / kHfConfigFile));
  AQSWARM_ASSIGN_OR_RETURN(json c, ParseConfig(text));
  if (!c.contains("model_type") || !c["model_type"].is_string()) {
    return absl::InvalidArgumentError("config.json lacks model_type");
  }
  v1::ModelSpec s;
  const std::string type = c["model_type"].get<std::string>();
  v1::ModelSpec::Family::Value family;
  if (!v1::ModelSpec::Family::Value_Parse(type, &family) || family == v1::ModelSpec::Family::UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: model_type '", type, "' is not gpt2 or llama"));
  }
  s.set_family(family);
  AQSWARM_ASSIGN_OR_RETURN(int64_t vocab, IntField(c, "vocab_size", 0, true));
  s.set_vocab_size(vocab);
  const bool llama = type == "llama";
  AQSWARM_ASSIGN_OR_RETURN(int64_t d, IntField(c, llama ? "hidden_size" : "n_embd", 0, true));
  AQSWARM_ASSIGN_OR_RETURN(int64_t layers, IntField(c, llama ? "num_hidden_layers" : "n_layer", 0, true));
  AQSWARM_ASSIGN_OR_RETURN(int64_t heads, IntField(c, llama ? "num_attention_heads" : "n_head", 0, true));
  AQSWARM_ASSIGN_OR_RETURN(int64_t n_pos,
                           IntField(c, llama ? "max_position_embeddings" : "n_positions", llama ? 2048 : 1024, false));
  AQSWARM_ASSIGN_OR_RETURN(bool tied, BoolField(c, "tie_word_embeddings", !llama));
  s.set_d_model(d);
  s.set_n_layer(layers);
  s.set_n_head(heads);
  s.set_seq_len(std::min(n_pos, max_seq_len));
  s.set_tie_embeddings(tied);
  if (llama) {
    AQSWARM_ASSIGN_OR_RETURN(int64_t kv, IntField(c, "num_key_value_heads", heads, false));
    AQSWARM_ASSIGN_OR_RETURN(int64_t d_ff, IntField(c, "intermediate_size", 0, true));
    AQSWARM_ASSIGN_OR_RETURN(double theta, NumField(c, "rope_theta", 10000.0));
    AQSWARM_ASSIGN_OR_RETURN(double eps, NumField(c, "rms_norm_eps", 1e-6));
    s.set_n_kv_head(kv);
    s.set_d_ff(d_ff);
    s.set_rope_theta(theta);
    s.set_norm_eps(eps);
  } else {
    AQSWARM_ASSIGN_OR_RETURN(double eps, NumField(c, "layer_norm_epsilon", 1e-5));
    AQSWARM_ASSIGN_OR_RETURN(int64_t d_ff, IntField(c, "n_inner", 4 * d, false));
    s.set_norm_eps(eps);
    if (d_ff != 4 * d) s.set_d_ff(d_ff);
  }
  AQSWARM_RETURN_IF_ERROR(CheckHfConfig(text, s));
  return s;
}

absl::Status ExportHfModel(const HfExportOptions& o) {
  const v1::ModelSpec& spec = o.job.model();
  const int k = static_cast<int>(o.stage_checkpoints.size());
  if (k == 0) return absl::InvalidArgumentError("export: no stage checkpoints");
  // Read every stage's parameters (optimizer and extra state left out).
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<const SafetensorsFile*, const SafetensorsFile::Entry*>> params;
  for (int s = 0; s < k; ++s) {
    const std::string& path = o.stage_checkpoints[s];
    AQSWARM_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
    const auto& md = f->metadata();
    auto get = [&](const char* key) {
      auto it = md.find(key);
      return it == md.end() ? std::string() : it->second;
    };
    if (get("format") != "aqswarm-stage-checkpoint-v1") {
      return absl::InvalidArgumentError(absl::StrCat(path, " is not an aqswarm stage checkpoint"));
    }
    if (get("stage") != std::to_string(s) || get("num_stages") != std::to_string(k)) {
      return absl::FailedPreconditionError(absl::StrCat(path, " holds stage ", get("stage"), " of ",
                                                        get("num_stages"), ", expected stage ", s, " of ", k));
    }
    for (const auto& e : f->entries()) {
      if (absl::StartsWith(e.name, "optim/") || absl::StartsWith(e.name, "extra/")) continue;
      if (!e.is_float()) return absl::DataLossError(absl::StrCat(path, ": ", e.name, " has dtype ", e.dtype_name));
      if (!params.emplace(e.name, std::make_pair(f.get(), &e)).second) {
        return absl::DataLossError(absl::StrCat("parameter ", e.name, " is in two stages' checkpoints"));
      }
    }
    files.push_back(std::move(f));
  }
  const std::vector<std::string> names = ModelParamNames(spec, k);
  const std::set<std::string> expected(names.begin(), names.end());
  for (const auto& [name, unused] : params) {
    if (!expected.count(name)) {
      return absl::DataLossError(absl::StrCat("the checkpoints hold ", name, ", not a parameter of this ",
                                              ModelFamilyName(spec), " model"));
    }
  }
  std::deque<std::vector<float>> data;
  std::vector<StTensor> tensors;
  for (const std::string& name : names) {
    auto it = params.find(name);
    if (it == params.end()) return absl::NotFoundError(absl::StrCat("no stage checkpoint holds ", name));
    // The last stage's copy of a tied head: the file keeps the embedding only.
    if (name == "lm_head.weight" && spec.tie_embeddings()) continue;
    const auto& [file, entry] = it->second;
    if (!entry->is_float()) {
      return absl::DataLossError(absl::StrCat("stage checkpoint tensor ", name, " has dtype ", entry->dtype_name,
                                              "; expected F32, BF16 or F16"));
    }
    data.push_back(file->ToFloat32(*entry));
    tensors.push_back({HfFileName(spec, name), entry->shape, data.back()});
  }
  auto shape_of = [&](const std::string& name, size_t dim) -> int64_t {
    const auto& shape = params.at(name).second->shape;
    return dim < shape.size() ? shape[dim] : 0;
  };
  int64_t max_positions = 0, d_ff = 0;
  if (IsLlama(spec)) {
    max_positions = spec.seq_len();
    d_ff = shape_of("model.layers.0.mlp.gate_proj.weight", 0);
  } else {
    max_positions = shape_of("wpe.weight", 0);
    d_ff = shape_of("h.0.mlp.c_fc.weight", 1);
  }
  const fs::path out(o.out_dir);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create ", out.string(), ": ", ec.message()));
  AQSWARM_RETURN_IF_ERROR(WriteSafetensors((out / kHfWeightsFile).string(), tensors, {{"format", "pt"}}));
  const std::string tok_path = o.job.data().tokenizer();
  int64_t eos_id = -1;
  if (!tok_path.empty()) {
    AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Open(tok_path));
    eos_id = tokenizer->eot_id();
  }
  AQSWARM_RETURN_IF_ERROR(WriteFileAtomically((out / kHfConfigFile).string(),
                                              HfConfigJson(spec, max_positions, d_ff, eos_id), 0644));
  if (tok_path.empty()) return absl::OkStatus();  // synthetic data: no tokenizer
  const fs::path tok(tok_path);
  // A Hugging Face tokenizer.json (the file, or a directory holding it): it
  // and the configs beside it, which name the special tokens.
  if (fs::is_regular_file(tok) || fs::exists(tok / "tokenizer.json")) {
    const fs::path json_file = fs::is_regular_file(tok) ? tok : tok / "tokenizer.json";
    AQSWARM_RETURN_IF_ERROR(CopyFile(json_file, out / "tokenizer.json"));
    for (const char* optional : {"tokenizer_config.json", "special_tokens_map.json"}) {
      const fs::path from = json_file.parent_path() / optional;
      if (fs::exists(from)) AQSWARM_RETURN_IF_ERROR(CopyFile(from, out / optional));
    }
    // A directory that also has GPT-2's files exports them too (below).
    if (!fs::exists(tok / "encoder.json") || !fs::exists(tok / "vocab.bpe")) return absl::OkStatus();
  }
  // Ours (pipeline/tokenizer.h) and, under Hugging Face's names, GPT2Tokenizer's.
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"encoder.json", "encoder.json"}, {"vocab.bpe", "vocab.bpe"},
           {"encoder.json", "vocab.json"}, {"vocab.bpe", "merges.txt"}}) {
    if (!fs::exists(tok / from)) return absl::NotFoundError(absl::StrCat("tokenizer file ", (tok / from).string(), " is missing"));
    AQSWARM_RETURN_IF_ERROR(CopyFile(tok / from, out / to));
  }
  for (const char* optional : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    if (fs::exists(tok / optional)) AQSWARM_RETURN_IF_ERROR(CopyFile(tok / optional, out / optional));
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
