// Loading and validating a training job (`aqswarm.v1.JobSpec`, proto/job.proto).
//
//   AQSWARM_ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobSpec("job.json"));
//
// Parsing checks the field names against the messages (unknown fields are
// errors, renamed ones read with a warning), then uses protobuf's JSON parser; defaults are
// filled in for zero/empty fields, then every field is checked once. Errors
// name the offending field and value.
#ifndef AQSWARM_PIPELINE_JOB_SPEC_H_
#define AQSWARM_PIPELINE_JOB_SPEC_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/dataset.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

// Parses JSON text, applies defaults, validates. An unknown field is an
// error naming its message and the closest valid name; a renamed field
// (kRenamedFields, job_spec.cc) is read under its old name with a warning,
// into `warnings` when given, else logged.
absl::StatusOr<v1::JobSpec> ParseJobSpec(std::string_view json, std::vector<std::string>* warnings = nullptr);
// ParseJobSpec's reading alone: field names checked, renamed fields moved,
// choices read by their JSON names ("" = unset, "1f1b"); no defaults, no
// validation: the job as it was written (a peer's saved copy).
absl::StatusOr<v1::JobSpec> ReadJobSpecJson(std::string_view json, std::vector<std::string>* warnings = nullptr);
// Reads a JSON file, then ParseJobSpec.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);

// dp.warmup_steps of a quantized_adam job that leaves it unset: 0/1 Adam's
// 16 full-precision steps, but no more than a sixteenth of the job's steps
// (max_steps, else optimizer.total_steps) and no fewer than
// kMinQuantizedAdamWarmup (2).
uint32_t DefaultQuantizedAdamWarmup(const v1::JobSpec& job);

// The job as JSON with every field printed, defaults included (after
// ParseJobSpec: the effective job): what `aqswarm job show` prints and what
// every `aqswarm pipeline` run writes to <out_dir>/job.json beside its events.
std::string JobSpecJson(const v1::JobSpec& job);

// Fills zero/empty fields with documented defaults (see proto/job.proto).
void ApplyJobDefaults(v1::JobSpec* job);
absl::Status ValidateJobSpec(const v1::JobSpec& job);

// The data a job names (data.corpus, tokenizer, textField, cacheDir), for
// pipeline/dataset.h's OpenData and IdentifyData.
DataSource DataSourceFor(const v1::DataSpec& data);

// Whether the job scales its loss dynamically: optimizer.loss_scale
// "dynamic", or unset with precision fp16.
bool DynamicLossScaling(const v1::JobSpec& job);

// Learning rate at `step` (0-based): linear warm-up, then linear decay to min_lr.
double LearningRateAt(const v1::OptimizerSpec& opt, int64_t step);

// ---- Sizes, without torch -------------------------------------------------
//
//   int64_t n = TotalParameterCount(job.model());          // GPT-2 small: 124,439,808
//   int64_t s = StageParameterCount(job.model(), 0, 4);    // what stage 0 of 4 holds
//   AQSWARM_RETURN_IF_ERROR(CheckStageMemory(job, stage)); // before building a stage
//
// Counts follow the models' parameter lists exactly (pipeline/gpt.h,
// pipeline/llama.h; tests compare them with the built models). The memory
// estimate is rough, see EstimateStageBytes.

// The name of the model's family ("gpt2" when unset, its default).
const std::string& ModelFamilyName(const v1::ModelSpec& spec);

// d_ff of a model: the spec's, or the family default when 0 (gpt2: 4 d;
// llama: 256 * ceil(floor(8 d / 3) / 256), pipeline/llama.h).
int64_t FeedForwardDim(const v1::ModelSpec& spec);

// Key/value heads of a model: n_kv_head, or n_head when 0 (gpt2 always has
// n_head).
int64_t KeyValueHeads(const v1::ModelSpec& spec);

// Parameters of the whole model (a tied head counted once). Applies no
// defaults: pass a spec after ApplyJobDefaults (or with every size set).
// The same number as stage_model.h's ModelParameterCount, which builds
// nothing either but lives in the torch library (that one is to call this).
int64_t TotalParameterCount(const v1::ModelSpec& spec);

// Parameters that stage `stage` of `num_stages` holds (blocks split as
// StageRangeFor: earlier stages take the remainder). With tie_embeddings
// across stages the last stage holds its own copy of the embedding, so the
// stages together hold V * d more than TotalParameterCount.
int64_t StageParameterCount(const v1::ModelSpec& spec, int stage, int num_stages);

// Rough estimate of one stage process's peak memory in bytes, on the
// device that computes (host RAM for "cpu"):
//   16 B per parameter: float32 weights, gradients, AdamW's m and v;
//   + 12 B per parameter while a state (checkpoint) is written: weights and
//     m, v serialized into one buffer;
//   + 2 B per parameter for the bf16/fp16 compute copies of the weights;
//   + 8 B per parameter for quantized_adam's error-feedback buffers (16 B
//     for diloco's anchor, outer momentum and error buffers), and
//     8 more for dp.delayed_update's copies of the parameters;
//   + activations kept for backward for the micro-batches in flight at the
//     stage (InFlightAt of the job's schedule; M for gpipe): per token and
//     layer about 17 d + n_head T values for gpt2 and
//     7 d + 3 kv + 4 d_ff + n_head T for llama (kv = n_kv_head * head_dim;
//     the n_head T are the softmaxed attention scores), at 4 B (fp32) or 2 B
//     (bf16, fp16); with model.recompute only each block's input (d per token
//     and layer) plus one block's full set for one micro-batch;
//   + on the last stage, one micro-batch's float32 logits (B T V 4 B) six
//     times (logits, log-softmax, their gradients, allocator slack: 5 to 7
//     copies measured);
//   + with tie_embeddings across stages, on every stage three copies of the
//     tied gradient ([V, d] float32) in flight (sent, relayed, received);
//   + each AQ-SGD link endpoint's resident m(xi) budget
//     (compression.resident_bytes, 64 MiB unset);
//   + 512 MiB for the process itself (libtorch, gRPC, the store, the corpus).
// Transient buffers of a single op (attention scores before the softmax,
// matmul workspaces) are not counted. Measured peaks are in docs/MODELS.md.
int64_t EstimateStageBytes(const v1::JobSpec& job, int stage);

// MemAvailable of /proc/meminfo, in bytes.
absl::StatusOr<int64_t> AvailableMemoryBytes();

// ResourceExhausted when EstimateStageBytes(job, stage) exceeds
// `available_bytes`, naming the stage, the estimate and what is available
// (so a stage that cannot fit fails with a message, not an OOM kill). The
// one-argument form reads AvailableMemoryBytes() and checks only stages on
// "cpu" (GPU memory is not checked here); it passes when /proc/meminfo
// cannot be read.
absl::Status CheckStageMemory(const v1::JobSpec& job, int stage, int64_t available_bytes);
absl::Status CheckStageMemory(const v1::JobSpec& job, int stage);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_JOB_SPEC_H_
