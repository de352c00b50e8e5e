#include "stage/worker_compute.h"

#include <sys/resource.h>

#include "absl/strings/str_cat.h"
#include "common/data_identity.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "pipeline/dataset.h"
#include "pipeline/job_spec.h"

namespace aqswarm::stage {

absl::StatusOr<std::unique_ptr<pipeline::TokenCorpus>> LoadCorpus(const v1::JobSpec& job) {
  const v1::DataSpec& data = job.data();
  if (data.synthetic_tokens() > 0) {
    if (data.synthetic_tokens() > (1ull << 31)) return absl::InvalidArgumentError("data.synthetic_tokens too large");
    std::vector<int32_t> tokens(data.synthetic_tokens());
    Rng rng(job.seed() ^ 0x5eed);
    for (auto& t : tokens) t = static_cast<int32_t>(rng.Uniform(job.model().vocab_size()));
    return pipeline::TokenCorpus::FromTokens(std::move(tokens));
  }
  AQSWARM_ASSIGN_OR_RETURN(pipeline::OpenedData opened, pipeline::OpenData(pipeline::DataSourceFor(data)));
  AQSWARM_RETURN_IF_ERROR(CheckDataIdentity({data.dataset_hash(), data.tokenizer_hash()}, opened.identity,
                                            "this machine's data"));
  if (opened.tokenizer->vocab_size() > static_cast<int64_t>(job.model().vocab_size())) {
    return absl::FailedPreconditionError(absl::StrCat("the tokenizer has ", opened.tokenizer->vocab_size(),
                                                      " ids but model.vocabSize is ", job.model().vocab_size()));
  }
  return std::move(opened.corpus);
}

ProcessUsage Usage() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  ProcessUsage r;
  r.sys_seconds = u.ru_stime.tv_sec + 1e-6 * u.ru_stime.tv_usec;
  r.cpu_seconds = u.ru_utime.tv_sec + 1e-6 * u.ru_utime.tv_usec + r.sys_seconds;
  r.minor_faults = u.ru_minflt;
  r.ctx_switches = u.ru_nvcsw;
  r.invol_ctx_switches = u.ru_nivcsw;
  r.peak_rss_bytes = int64_t{u.ru_maxrss} * 1024;
  return r;
}

WorkerCompute::WorkerCompute(pipeline::StageWorker* worker, const pipeline::TokenCorpus* corpus,
                             const v1::JobSpec& job, int stage)
    : worker_(worker),
      corpus_(corpus),
      b_(job.micro_batch_size()),
      t_(job.model().seq_len()),
      first_(stage == 0),
      last_(stage + 1 == static_cast<int>(job.stages())) {}

absl::Status WorkerCompute::Forward(int mb, absl::Span<const int64_t> ids, absl::Span<const float> in,
                                    std::vector<float>* out, double* loss) {
  corpus_->GatherBatch(ids, t_, &tokens_, &targets_);
  if (last_) return worker_->ForwardLoss(mb, in, tokens_, targets_, b_, loss);
  if (first_) return worker_->ForwardTokens(mb, tokens_, b_, out);
  return worker_->ForwardHidden(mb, in, b_, out);
}

absl::Status WorkerCompute::Backward(int mb, absl::Span<const float> grad_out, std::vector<float>* grad_in) {
  return worker_->Backward(mb, grad_out, grad_in);
}

double WorkerCompute::GradSquaredNorm() const { return worker_->GradSquaredNorm(); }

absl::Status WorkerCompute::TiedGradient(std::vector<uint32_t>* rows, std::vector<float>* values) {
  return worker_->TiedGradient(rows, values);
}

absl::Status WorkerCompute::AddTiedGradient(absl::Span<const uint32_t> rows, absl::Span<const float> values) {
  return worker_->AddTiedGradient(rows, values);
}

absl::Status WorkerCompute::Eval(absl::Span<const int64_t> ids, absl::Span<const float> in, std::vector<float>* out,
                                 double* loss) {
  corpus_->GatherBatch(ids, t_, &tokens_, &targets_);
  if (last_) return worker_->EvalLoss(in, tokens_, targets_, b_, loss);
  return worker_->EvalHidden(in, tokens_, b_, out);
}

}  // namespace aqswarm::stage
