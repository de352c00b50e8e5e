#include "pipeline/torch_info.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace aqswarm::pipeline {

std::string TorchInfo() {
  return absl::StrCat("torch ", TORCH_VERSION, ", ", at::get_num_threads(), " intra-op threads, CUDA ",
                      torch::cuda::is_available() ? "available" : "unavailable");
}

}  // namespace aqswarm::pipeline
