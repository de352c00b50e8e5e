// What the stage runner (stage/stage_runner.h) computes with: the job's
// corpus, the StageWorker behind the step protocol's StageCompute
// interface, and the process's resource counters per step.
#ifndef AQSWARM_STAGE_WORKER_COMPUTE_H_
#define AQSWARM_STAGE_WORKER_COMPUTE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/corpus.h"
#include "pipeline/stage_worker.h"
#include "proto/job.pb.h"
#include "stage/step_protocol.h"

namespace aqswarm::stage {

// Loads the job's corpus (pipeline/dataset.h), or synthetic tokens. A job
// that names its data's hashes must find them here; a tokenizer with more
// ids than the model's vocabulary is refused.
absl::StatusOr<std::unique_ptr<pipeline::TokenCorpus>> LoadCorpus(const v1::JobSpec& job);

// This process's resource use so far (all its threads: compute, link writers
// and readers, gRPC, the store's background work).
struct ProcessUsage {
  double cpu_seconds = 0;  // user + system
  double sys_seconds = 0;
  int64_t minor_faults = 0;
  int64_t ctx_switches = 0;        // voluntary: waits
  int64_t invol_ctx_switches = 0;  // preemptions
  int64_t peak_rss_bytes = 0;      // ru_maxrss (KiB on Linux) * 1024
};
ProcessUsage Usage();

// The stage's model and data as the step protocol sees them.
class WorkerCompute final : public StageCompute {
 public:
  WorkerCompute(pipeline::StageWorker* worker, const pipeline::TokenCorpus* corpus, const v1::JobSpec& job,
                int stage);

  absl::Status Forward(int mb, absl::Span<const int64_t> ids, absl::Span<const float> in, std::vector<float>* out,
                       double* loss) override;
  absl::Status Backward(int mb, absl::Span<const float> grad_out, std::vector<float>* grad_in) override;
  double GradSquaredNorm() const override;
  absl::Status TiedGradient(std::vector<uint32_t>* rows, std::vector<float>* values) override;
  absl::Status AddTiedGradient(absl::Span<const uint32_t> rows, absl::Span<const float> values) override;
  absl::Status Eval(absl::Span<const int64_t> ids, absl::Span<const float> in, std::vector<float>* out,
                    double* loss) override;

 private:
  pipeline::StageWorker* const worker_;
  const pipeline::TokenCorpus* const corpus_;
  const int64_t b_, t_;
  const bool first_, last_;
  std::vector<int32_t> tokens_, targets_;  // scratch
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_WORKER_COMPUTE_H_
