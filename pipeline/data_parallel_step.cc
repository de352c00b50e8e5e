#include "pipeline/data_parallel_step.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "compression/codec.h"
#include "pipeline/job_spec.h"
#include "pipeline/quantized_adam.h"

namespace aqswarm::pipeline {
namespace {

constexpr char kDelayedParams[] = "delayed/params";
constexpr char kDelayedPrevParams[] = "delayed/prev_params";
constexpr char kState[] = "dp/";
constexpr char kTiedState[] = "dp_tied/";
constexpr char kDpOptimizer[] = "dp_optimizer";
constexpr char kDpStep[] = "dp_step";
constexpr char kDpFrozen[] = "dp_frozen";

}  // namespace

void DpCheckpointMeta::WriteTo(std::map<std::string, std::string>& metadata) const {
  metadata[kDpStep] = std::to_string(state.step);
  if (diloco) {
    metadata[kDpOptimizer] = "diloco";
  } else {
    metadata[kDpFrozen] = state.frozen ? "1" : "0";
  }
}

absl::StatusOr<DpCheckpointMeta> DpCheckpointMeta::ReadFrom(const std::map<std::string, std::string>& metadata,
                                                            const std::string& path) {
  const auto get = [&](const char* key) {
    const auto it = metadata.find(key);
    return it == metadata.end() ? std::string() : it->second;
  };
  DpCheckpointMeta m;
  m.diloco = get(kDpOptimizer) == "diloco";
  if (!absl::SimpleAtoi(get(kDpStep), &m.state.step) || m.state.step < 0) {
    return absl::DataLossError(absl::StrCat(path, ": bad dp_step"));
  }
  m.state.frozen = get(kDpFrozen) == "1";
  return m;
}

DataParallelStep::DataParallelStep(const v1::JobSpec& job, StageModel* model) : job_(job), model_(model) {}

DataParallelStep::~DataParallelStep() {
  if (update_.joinable()) update_.join();
}

void DataParallelStep::Init() {
  const torch::Tensor tied = model_->tied_embedding();
  tied_n_ = tied.defined() ? tied.numel() : 0;
  if (tied.defined()) order_.push_back(tied);
  std::vector<torch::Tensor> big, small;
  for (const auto& [name, p] : model_->named_params()) {
    if (p.is_same(tied)) continue;
    (p.numel() >= compression::kDefaultMinCompressElements ? big : small).push_back(p);
  }
  DpLayout layout;
  layout.tied_n = tied_n_;
  for (auto* group : {&big, &small}) {
    for (const torch::Tensor& p : *group) {
      order_.push_back(p);
      layout.sizes.push_back(p.numel());
      layout.decay.insert(layout.decay.end(), p.numel(), p.dim() >= 2 ? 1 : 0);
      if (group == &big) layout.num_compressed += p.numel();
    }
  }
  params_.resize(tied_n_ + layout.decay.size());
  grads_.resize(params_.size());
  opt_ = MakeDataParallelOptimizers(job_, layout);
}

absl::Status DataParallelStep::Step(int64_t step, double total_sq, ReplicaExchange& ex) {
  AQSWARM_RETURN_IF_ERROR(Join());
  torch::NoGradGuard ng;
  if (opt_.stage == nullptr) Init();
  const double norm = std::sqrt(total_sq);
  const double clip = job_.optimizer().grad_clip();
  const float scale = (clip > 0 && norm > clip) ? static_cast<float>(clip / (norm + 1e-6)) : 1.0f;
  // A delayed update keeps its own parameters in params_, ahead of the model's.
  const bool from_model = !master_;
  int64_t off = 0;
  for (const torch::Tensor& p : order_) {
    const int64_t n = p.numel();
    if (from_model) {
      torch::Tensor pc = p.detach().to(torch::kCPU).contiguous();
      std::memcpy(params_.data() + off, pc.data_ptr<float>(), n * sizeof(float));
    }
    if (p.grad().defined()) {
      torch::Tensor g = p.grad().to(torch::kCPU).contiguous();
      const float* gp = g.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) grads_[off + i] = gp[i] * scale;
    } else {
      std::fill(grads_.begin() + off, grads_.begin() + off + n, 0.0f);
    }
    off += n;
  }
  // A NaN or infinite gradient here would reach every replica through the
  // exchange: the step stops before it (dynamic loss scaling, whose
  // overflows skip steps, does not run with data parallelism).
  if (!std::isfinite(total_sq)) {
    return absl::FailedPreconditionError(absl::StrCat("data-parallel step ", step,
                                                      ": the pipeline's gradient norm is not finite (squared ",
                                                      total_sq, "); nothing was sent to the replicas"));
  }
  if (const absl::Status s = compression::CheckReceivedFinite(grads_, "local gradient"); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("data-parallel step ", step, ": this replica's ", s.message(),
                                                      "; nothing was sent to the replicas"));
  }
  const double lr = LearningRateAt(job_.optimizer(), step);
  // The baseline of the DP traffic: AdamW's float32 all-reduce of the whole
  // stage (tied copy included), every step, whatever this optimizer sent.
  const int64_t raw_bucket = QuantizedAdamOptionsFromJob(job_).compressed.bucket_elements;
  raw_total_ += Float32AllReduceBytes(tied_n_, ex.rank(), ex.size(), raw_bucket) +
                Float32AllReduceBytes(static_cast<int64_t>(params_.size()) - tied_n_, ex.rank(), ex.size(),
                                      raw_bucket);
  if (job_.dp().delayed_update()) {
    // The model takes the previous step's result, extrapolated by that update
    // (the next one, in flight, is about as large: Adam's steps follow its
    // momentum), so the next gradient is computed about where it will be
    // applied; this step's update starts in the background on the
    // optimizer's own copy (params_, grads_).
    master_ = true;
    Apply(/*predict=*/true);
    prev_params_ = params_;
    update_ = std::thread([this, &ex, lr] {
      try {
        update_status_ = StepOptimizers(ex, lr);
      } catch (const std::exception& e) {
        update_status_ = absl::InternalError(absl::StrCat("delayed data-parallel update: ", e.what()));
      }
    });
    return absl::OkStatus();
  }
  AQSWARM_RETURN_IF_ERROR(StepOptimizers(ex, lr));
  stats_ = OptimizerStats();
  kind_ = opt_.stage->last_step_kind();
  Apply();
  return absl::OkStatus();
}

absl::Status DataParallelStep::StepOptimizers(ReplicaExchange& ex, double lr) {
  const auto params = absl::MakeSpan(params_);
  const auto grads = absl::MakeConstSpan(grads_);
  if (opt_.tied != nullptr) {
    AQSWARM_RETURN_IF_ERROR(opt_.tied->Step(ex, lr, params.subspan(0, tied_n_), grads.subspan(0, tied_n_)));
  }
  return opt_.stage->Step(ex, lr, params.subspan(tied_n_), grads.subspan(tied_n_));
}

AllReduceStats DataParallelStep::OptimizerStats() const {
  AllReduceStats st = opt_.stage->stats();
  if (opt_.tied != nullptr) {
    const AllReduceStats& tied = opt_.tied->stats();
    st.bytes_sent += tied.bytes_sent;
    st.raw_bytes += tied.raw_bytes;
    st.robust_dropped += tied.robust_dropped;
    st.robust_clipped += tied.robust_clipped;
  }
  return st;
}

void DataParallelStep::Apply(bool predict) {
  const float* src = params_.data();
  if (predict && prev_params_.size() == params_.size()) {
    predicted_.resize(params_.size());
    for (size_t i = 0; i < predicted_.size(); ++i) predicted_[i] = 2.0f * params_[i] - prev_params_[i];
    src = predicted_.data();
  }
  int64_t off = 0;
  for (torch::Tensor& p : order_) {
    const int64_t n = p.numel();
    p.copy_(torch::from_blob(const_cast<float*>(src) + off, p.sizes(), torch::kFloat32));
    if (p.grad().defined()) p.mutable_grad().zero_();
    off += n;
  }
}

absl::Status DataParallelStep::Join() {
  if (update_.joinable()) {
    update_.join();
    stats_ = OptimizerStats();
    kind_ = opt_.stage->last_step_kind();
  }
  return update_status_;
}

absl::Status DataParallelStep::Finish() {
  const std::vector<float>* shared = opt_.stage != nullptr ? opt_.stage->shared_params() : nullptr;
  if (shared != nullptr && !shared->empty()) {
    // The job ends on the shared parameters (DiLoCo's anchors), the model
    // every replica holds.
    const std::vector<float>* tied = opt_.tied != nullptr ? opt_.tied->shared_params() : nullptr;
    if (tied != nullptr && !tied->empty()) std::copy(tied->begin(), tied->end(), params_.begin());
    std::copy(shared->begin(), shared->end(), params_.begin() + tied_n_);
  } else {
    AQSWARM_RETURN_IF_ERROR(Join());
    if (!master_) return absl::OkStatus();
  }
  torch::NoGradGuard ng;
  Apply();
  return absl::OkStatus();
}

absl::Status DataParallelStep::RestartFromShared(int64_t step) {
  AQSWARM_RETURN_IF_ERROR(Join());
  if (opt_.stage == nullptr) Init();
  AQSWARM_RETURN_IF_ERROR(opt_.stage->SkipTo(step));
  if (opt_.tied != nullptr) AQSWARM_RETURN_IF_ERROR(opt_.tied->SkipTo(step));
  const std::vector<float>* shared = opt_.stage->shared_params();
  if (shared == nullptr || shared->empty()) return absl::OkStatus();
  torch::NoGradGuard ng;
  int64_t off = 0;
  for (const torch::Tensor& p : order_) {
    torch::Tensor pc = p.detach().to(torch::kCPU).contiguous();
    std::memcpy(params_.data() + off, pc.data_ptr<float>(), p.numel() * sizeof(float));
    off += p.numel();
  }
  AQSWARM_RETURN_IF_ERROR(opt_.stage->RestartFromShared(absl::MakeSpan(params_).subspan(tied_n_)));
  master_ = false;
  prev_params_.clear();
  Apply();
  return absl::OkStatus();
}

bool DataParallelStep::HashShared(Checksummer& c) const {
  const std::vector<float>* shared = opt_.stage != nullptr ? opt_.stage->shared_params() : nullptr;
  if (shared == nullptr) return false;
  const std::vector<float>* tied = opt_.tied != nullptr ? opt_.tied->shared_params() : nullptr;
  if (tied != nullptr) c.Update(tied->data(), tied->size() * sizeof(float));
  c.Update(shared->data(), shared->size() * sizeof(float));
  return true;
}

absl::Status DataParallelStep::Save(ExtraCheckpointState& extra) {
  if (opt_.stage == nullptr) return absl::OkStatus();
  AQSWARM_RETURN_IF_ERROR(Join());
  for (const auto& [name, buf] : opt_.stage->NamedState()) extra.tensors.emplace_back(kState + name, *buf);
  if (opt_.tied != nullptr) {
    for (const auto& [name, buf] : opt_.tied->NamedState()) extra.tensors.emplace_back(kTiedState + name, *buf);
  }
  if (master_) extra.tensors.emplace_back(kDelayedParams, params_);
  if (master_ && !prev_params_.empty()) extra.tensors.emplace_back(kDelayedPrevParams, prev_params_);
  DpCheckpointMeta meta;
  meta.diloco = job_.dp().optimizer() == v1::DataParallelSpec::diloco;
  meta.state = opt_.stage->meta();
  meta.WriteTo(extra.metadata);
  return absl::OkStatus();
}

absl::Status DataParallelStep::Load(ExtraCheckpointState& extra, const std::string& path) {
  if (update_.joinable()) update_.join();  // the state it was updating is replaced
  update_status_ = absl::OkStatus();
  master_ = false;
  prev_params_.clear();
  if (extra.tensors.empty()) return absl::OkStatus();
  AQSWARM_ASSIGN_OR_RETURN(const DpCheckpointMeta meta, DpCheckpointMeta::ReadFrom(extra.metadata, path));
  // A DiLoCo state has an anchor and no frozen variance: it does not fit
  // QuantizedAdam, nor the other way round.
  const bool job_diloco = job_.dp().optimizer() == v1::DataParallelSpec::diloco;
  const bool saved_diloco = meta.diloco;
  if (job_diloco != saved_diloco) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": its data-parallel optimizer state is ", saved_diloco ? "diloco's" : "quantized_adam's (or adamw's)",
        " but the job's dp.optimizer is ", v1::DataParallelSpec::Optimizer_Name(job_.dp().optimizer()),
        "; resume with the optimizer the state was saved with"));
  }
  if (opt_.stage == nullptr) Init();
  DpState state, tied_state;
  for (auto& [name, values] : extra.tensors) {
    if (name.rfind(kState, 0) == 0) {
      state.emplace_back(name.substr(std::strlen(kState)), std::move(values));
    } else if (name.rfind(kTiedState, 0) == 0) {
      tied_state.emplace_back(name.substr(std::strlen(kTiedState)), std::move(values));
    } else if (name == kDelayedParams || name == kDelayedPrevParams) {
      if (values.size() != params_.size()) {
        return absl::DataLossError(absl::StrCat(path, ": ", name, " holds ", values.size(),
                                                " values, the stage has ", params_.size(), " parameters"));
      }
      if (name == kDelayedParams) {
        params_ = std::move(values);
        master_ = true;
      } else {
        prev_params_ = std::move(values);
      }
    }
  }
  AQSWARM_RETURN_IF_ERROR(opt_.stage->LoadState(state, meta.state));
  if (opt_.tied != nullptr) {
    AQSWARM_RETURN_IF_ERROR(opt_.tied->LoadState(tied_state, meta.state));
    // The tied copy's progress since the last sync (DiLoCo's parameters, m,
    // v) is this pipeline's own, and the two ends of a pipeline may load
    // states of different replicas (a joiner takes another pipeline's): both
    // restart it from the shared parameters, the same everywhere.
    const std::vector<float>* shared = opt_.tied->shared_params();
    if (shared != nullptr) {
      const torch::Tensor tied = model_->tied_embedding();
      std::vector<float> p(tied_n_);
      AQSWARM_RETURN_IF_ERROR(opt_.tied->RestartFromShared(absl::MakeSpan(p)));
      if (!shared->empty()) tied.detach().copy_(torch::from_blob(p.data(), tied.sizes(), torch::kFloat32));
    }
  }
  stats_ = {};
  // A job without delayed updates applies a saved one now.
  if (master_ && !job_.dp().delayed_update()) {
    AQSWARM_RETURN_IF_ERROR(Finish());
    master_ = false;
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
