// Weights in and out of a stage (internal to pipeline/, includes torch).
//
// LoadGpt2Weights: fills a stage from a GPT-2-format safetensors file with
// Hugging Face names ("wte.weight", "h.0.attn.c_attn.weight", ...; an optional
// "transformer." prefix is accepted). Tensors the stage does not own are
// ignored; a tensor the stage needs but the file lacks, or one with another
// shape, is an error and nothing is modified. A last stage's "lm_head.weight"
// comes from the file's lm_head.weight, or from wte.weight when tied.
//
// Checkpoints are safetensors too: parameters under their names, optimizer
// state under "optim/<state name>", and metadata {format, stage, num_stages,
// step, job}. Written atomically.
#ifndef AQSWARM_PIPELINE_STAGE_IO_H_
#define AQSWARM_PIPELINE_STAGE_IO_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "pipeline/hf_checkpoint.h"  // LoadHfCheckpoint: model.init_from
#include "pipeline/stage_model.h"
#include "pipeline/optimizer.h"
#include "pipeline/safetensors.h"

namespace aqswarm::pipeline {

absl::Status LoadGpt2Weights(const SafetensorsFile& file, StageModel& stage);

// Extra flat float state stored beside the optimizer (e.g. the data-parallel
// optimizer's moments and error buffers), under "extra/<name>", plus metadata.
struct ExtraCheckpointState {
  std::vector<std::pair<std::string, std::vector<float>>> tensors;
  std::map<std::string, std::string> metadata;
};

absl::Status SaveStageCheckpoint(const std::string& path, const StageModel& stage, const AdamW& optimizer,
                                 const std::string& job_name, const ExtraCheckpointState* extra = nullptr);
// Restores parameters and optimizer state; checks that the checkpoint is for
// the same stage of the same split. `extra` (optional) receives the extra
// state and all metadata.
absl::Status LoadStageCheckpoint(const std::string& path, StageModel& stage, AdamW& optimizer,
                                 ExtraCheckpointState* extra = nullptr);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_STAGE_IO_H_
