// LoadHfCheckpoint (pipeline/hf_checkpoint.h): the half that touches torch.
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "pipeline/hf_checkpoint.h"
#include "pipeline/job_spec.h"
#include "pipeline/safetensors.h"
#include "pipeline/stage_model.h"

namespace aqswarm::pipeline {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

absl::StatusOr<std::string> ReadText(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(p.string(), " is missing"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool IsIgnoredBuffer(const std::string& name) {
  return absl::EndsWith(name, ".attn.bias") || absl::EndsWith(name, ".attn.masked_bias") ||
         absl::EndsWith(name, ".rotary_emb.inv_freq");
}

// Where a directory keeps its tensors: name -> file, from the index; or one
// file for all (empty map, single = true).
struct Layout {
  bool single = false;
  std::map<std::string, std::string> weight_map;
};

absl::StatusOr<Layout> ReadLayout(const fs::path& dir) {
  Layout l;
  if (fs::exists(dir / kHfIndexFile)) {
    AQSWARM_ASSIGN_OR_RETURN(std::string text, ReadText(dir / kHfIndexFile));
    json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat((dir / kHfIndexFile).string(), " has no weight_map object"));
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(kHfIndexFile, ": the file of ", it.key(), " is not a string"));
      }
      const std::string file = it.value().get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "..") {
        return absl::InvalidArgumentError(absl::StrCat(kHfIndexFile, ": ", it.key(), " names the file '", file,
                                                       "', not a file of the directory"));
      }
      l.weight_map[it.key()] = file;
    }
    return l;
  }
  if (fs::exists(dir / kHfWeightsFile)) {
    l.single = true;
    return l;
  }
  return absl::NotFoundError(absl::StrCat(dir.string(), " holds neither ", kHfWeightsFile, " nor ", kHfIndexFile));
}

}  // namespace

absl::Status LoadHfCheckpoint(const std::string& dir_path, StageModel& stage) {
  const fs::path dir(dir_path);
  const v1::ModelSpec& spec = stage.spec();
  const bool llama = spec.family() == v1::ModelSpec::Family::llama;
  AQSWARM_ASSIGN_OR_RETURN(std::string config, ReadText(dir / kHfConfigFile));
  {
    absl::Status s = CheckHfConfig(config, spec);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(dir_path, ": ", s.message()));
  }
  AQSWARM_ASSIGN_OR_RETURN(Layout layout, ReadLayout(dir));

  // The names a file may use for each of the whole model's parameters.
  std::map<std::string, std::string> canonical;  // file name -> our name
  for (const std::string& n : ModelParamNames(spec, /*num_stages=*/1)) {
    canonical[n] = n;
    canonical[HfFileName(spec, n)] = n;
  }
  canonical["lm_head.weight"] = "lm_head.weight";
  auto check_known = [&](const std::string& file_name, const std::string& where) -> absl::Status {
    if (canonical.count(file_name) || IsIgnoredBuffer(file_name)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("tensor ", file_name, " in ", where, " is not a parameter of a ",
                                                   ModelFamilyName(spec), " model with n_layer ", spec.n_layer()));
  };
  if (!layout.single) {
    for (const auto& [name, file] : layout.weight_map) AQSWARM_RETURN_IF_ERROR(check_known(name, kHfIndexFile));
  }

  // The file names to try for one of this stage's parameters, in order.
  const std::string embedding = llama ? "model.embed_tokens.weight" : "wte.weight";
  auto candidates = [&](const std::string& n) {
    std::vector<std::string> c = {n};
    if (!llama && n != "lm_head.weight") c.push_back("transformer." + n);
    if (n == "lm_head.weight" && spec.tie_embeddings()) {  // a tied head the file omits
      c.push_back(embedding);
      if (!llama) c.push_back("transformer." + embedding);
    }
    return c;
  };

  // Open only the files that hold this stage's tensors.
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open;
  auto open_file = [&](const std::string& file, const std::string& for_tensor) -> absl::StatusOr<SafetensorsFile*> {
    auto it = open.find(file);
    if (it != open.end()) return it->second.get();
    if (!fs::exists(dir / file)) {
      return absl::NotFoundError(absl::StrCat("shard ", file, " (holding ", for_tensor, ") is missing from ", dir_path));
    }
    AQSWARM_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open((dir / file).string()));
    if (layout.single) {
      for (const auto& e : f->entries()) AQSWARM_RETURN_IF_ERROR(check_known(e.name, file));
    }
    return open.emplace(file, std::move(f)).first->second.get();
  };

  struct Copy {
    torch::Tensor param;
    const SafetensorsFile* file;
    const SafetensorsFile::Entry* entry;
    int64_t rows;  // -1: the whole tensor; else its first `rows` rows
  };
  std::vector<Copy> plan;
  for (const auto& [name, p] : stage.named_params()) {
    std::string found_name, file;
    for (const std::string& c : candidates(name)) {
      if (layout.single) {
        AQSWARM_ASSIGN_OR_RETURN(SafetensorsFile * f, open_file(kHfWeightsFile, name));
        if (f->Find(c) != nullptr) {
          found_name = c;
          file = kHfWeightsFile;
          break;
        }
      } else if (auto it = layout.weight_map.find(c); it != layout.weight_map.end()) {
        found_name = c;
        file = it->second;
        break;
      }
    }
    if (found_name.empty()) {
      return absl::NotFoundError(absl::StrCat(dir_path, " lacks tensor ", HfFileName(spec, name),
                                              name == "lm_head.weight" && !spec.tie_embeddings()
                                                  ? " (the head is untied: tie_word_embeddings is false)"
                                                  : ""));
    }
    AQSWARM_ASSIGN_OR_RETURN(SafetensorsFile * f, open_file(file, found_name));
    const SafetensorsFile::Entry* e = f->Find(found_name);
    if (e == nullptr) {
      return absl::DataLossError(absl::StrCat(kHfIndexFile, " puts tensor ", found_name, " in ", file,
                                              ", which does not hold it"));
    }
    if (!e->is_float()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", found_name, " in ", file, " has dtype ",
                                                     e->dtype_name, "; expected F32, BF16 or F16"));
    }
    const std::vector<int64_t> want(p.sizes().begin(), p.sizes().end());
    int64_t rows = -1;
    // GPT-2's position table may cover a longer context than the job's.
    const bool longer_positions = name == "wpe.weight" && e->shape.size() == 2 && want.size() == 2 &&
                                  e->shape[1] == want[1] && e->shape[0] > want[0];
    if (longer_positions) {
      rows = want[0];
    } else if (e->shape != want) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", found_name, " in ", file, " has shape [",
                                                     absl::StrJoin(e->shape, ","), "] but the model needs [",
                                                     absl::StrJoin(want, ","), "]"));
    }
    plan.push_back({p, f, e, rows});
  }
  // Everything checked: copy (converting to float32 masters).
  torch::NoGradGuard no_grad;
  for (const Copy& c : plan) {
    std::vector<float> v = c.file->ToFloat32(*c.entry);
    torch::Tensor t = torch::from_blob(v.data(), c.entry->shape, torch::kFloat32);
    if (c.rows >= 0) t = t.slice(0, 0, c.rows);
    c.param.copy_(t);
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
