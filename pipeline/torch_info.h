// Facts about the linked libtorch, for `aqswarm version` (no torch in here).
#ifndef AQSWARM_PIPELINE_TORCH_INFO_H_
#define AQSWARM_PIPELINE_TORCH_INFO_H_

#include <string>

namespace aqswarm::pipeline {

// e.g. "torch 1.13.1, 2 intra-op threads, CUDA unavailable".
std::string TorchInfo();

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_TORCH_INFO_H_
