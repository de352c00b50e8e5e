// libFuzzer target: job specs, as the coordinator, the peers and the CLI read
// them. Input starting with 0x01: the rest is a binary v1::JobSpec (the form
// the coordinator persists and sends in assignments), put through
// UpgradeStoredJob (as a state dir's job is read) + ApplyJobDefaults +
// ValidateJobSpec; anything else: JSON text through
// ParseJobSpec (protobuf's JSON parser, defaults, validation). A spec that
// validates is then used as the code that trusts a validated spec uses it:
// per-stage parameter counts and memory estimates, link options,
// learning-rate schedule. Nothing may crash or overflow (UBSan) on a spec
// that passed validation. Seeds: fuzz/corpus/jobspec (examples/*.json).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/fuzz_input.h"
#include "pipeline/job_spec.h"
#include "pipeline/link_endpoint.h"
#include "proto/job_format.h"
#include "fuzz/quiet_protobuf.h"

using namespace aqswarm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  v1::JobSpec job;
  if (size > 0 && data[0] == 0x01) {
    if (!job.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
    if (!job_format::UpgradeStoredJob(&job).ok()) return 0;
    pipeline::ApplyJobDefaults(&job);
    if (!pipeline::ValidateJobSpec(job).ok()) return 0;
  } else {
    absl::StatusOr<v1::JobSpec> parsed = pipeline::ParseJobSpec(text);
    if (!parsed.ok()) return 0;
    job = *std::move(parsed);
  }
  (void)pipeline::TotalParameterCount(job.model());
  (void)pipeline::DynamicLossScaling(job);
  (void)pipeline::DataSourceFor(job.data());
  for (int64_t step : {int64_t{0}, int64_t{1}, int64_t{job.optimizer().warmup_steps()},
                       int64_t{job.optimizer().total_steps()}, int64_t{1} << 40}) {
    (void)pipeline::LearningRateAt(job.optimizer(), step);
  }
  const int stages = static_cast<int>(std::min<uint32_t>(job.stages(), 64));
  for (int s = 0; s < stages; ++s) {
    (void)pipeline::StageParameterCount(job.model(), s, stages);
    (void)pipeline::EstimateStageBytes(job, s);
    (void)pipeline::CheckStageMemory(job, s, int64_t{1} << 40);
    if (s + 1 < stages) (void)pipeline::LinkOptionsFromJob(job, 0, s, 1);
  }
  return 0;
}
