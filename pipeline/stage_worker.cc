#include "pipeline/stage_worker.h"

#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "compression/codec.h"
#include "common/status_macros.h"
#include "pipeline/stage_model.h"
#include "pipeline/job_spec.h"
#include "pipeline/optimizer.h"
#include "pipeline/quantized_adam.h"
#include "pipeline/safetensors.h"
#include "pipeline/stage_io.h"

namespace aqswarm::pipeline {
namespace {

// Converts torch exceptions (shape errors, OOM) into statuses at the boundary.
template <typename F>
absl::Status Guard(const char* what, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

class StageWorkerImpl final : public StageWorker {
 public:
  StageWorkerImpl(const v1::JobSpec& job, std::shared_ptr<StageModel> model)
      : job_(job), model_(std::move(model)), opt_(model_->named_params(), job.optimizer()), device_(job.device()) {
    model_->to(device_);
    // AdamW holds references to the parameters moved above: rebuild it.
    opt_ = AdamW(model_->named_params(), job.optimizer());
  }

  int stage() const override { return model_->range().stage; }
  bool is_first() const override { return model_->range().has_embedding(); }
  bool is_last() const override { return model_->range().has_head(); }
  int64_t boundary_elements_per_sample() const override {
    return static_cast<int64_t>(job_.model().seq_len()) * job_.model().d_model();
  }

  absl::Status ForwardTokens(int mb, absl::Span<const int32_t> tokens, int64_t batch,
                             std::vector<float>* out) override {
    if (!is_first()) return absl::FailedPreconditionError("ForwardTokens on a stage without embeddings");
    AQSWARM_ASSIGN_OR_RETURN(torch::Tensor ids, TokenTensor(tokens, batch));
    return Guard("forward", [&] {
      torch::Tensor y = model_->forward(ids);
      saved_[mb] = {torch::Tensor(), y};
      CopyOut(y, out);
      return absl::OkStatus();
    });
  }

  absl::Status ForwardHidden(int mb, absl::Span<const float> in, int64_t batch, std::vector<float>* out) override {
    if (is_first() || is_last()) return absl::FailedPreconditionError("ForwardHidden needs a middle stage");
    AQSWARM_ASSIGN_OR_RETURN(torch::Tensor x, HiddenTensor(in, batch));
    return Guard("forward", [&] {
      x.requires_grad_(true);
      torch::Tensor y = model_->forward(x);
      saved_[mb] = {x, y};
      CopyOut(y, out);
      return absl::OkStatus();
    });
  }

  absl::Status ForwardLoss(int mb, absl::Span<const float> in, absl::Span<const int32_t> tokens,
                           absl::Span<const int32_t> targets, int64_t batch, double* loss) override {
    if (!is_last()) return absl::FailedPreconditionError("ForwardLoss on a stage without the head");
    AQSWARM_ASSIGN_OR_RETURN(torch::Tensor t, TokenTensor(targets, batch));
    AQSWARM_ASSIGN_OR_RETURN(torch::Tensor x, StageInput(in, tokens, batch));
    return Guard("forward", [&] {
      if (!is_first()) x.requires_grad_(true);
      torch::Tensor l = NextTokenLoss(model_->forward(x), t);
      *loss = l.item<double>();
      saved_[mb] = {x, l / static_cast<double>(job_.micro_batches_per_step())};
      return absl::OkStatus();
    });
  }

  absl::Status Backward(int mb, absl::Span<const float> grad_out, std::vector<float>* grad_in) override {
    auto it = saved_.find(mb);
    if (it == saved_.end()) return absl::FailedPreconditionError(absl::StrCat("no forward saved for micro-batch ", mb));
    auto [x, y] = it->second;
    saved_.erase(it);
    return Guard("backward", [&]() -> absl::Status {
      if (is_last()) {
        y.backward();
      } else {
        if (static_cast<int64_t>(grad_out.size()) != y.numel()) {
          return absl::InvalidArgumentError(absl::StrCat("gradient has ", grad_out.size(), " values, output has ",
                                                         y.numel()));
        }
        torch::Tensor g = torch::from_blob(const_cast<float*>(grad_out.data()), y.sizes(), torch::kFloat32)
                              .to(device_, /*non_blocking=*/false, /*copy=*/true);
        y.backward(g);
      }
      if (!is_first() && grad_in != nullptr) CopyOut(x.grad(), grad_in);
      return absl::OkStatus();
    });
  }

  absl::Status EvalHidden(absl::Span<const float> in, absl::Span<const int32_t> tokens, int64_t batch,
                          std::vector<float>* out) override {
    torch::NoGradGuard ng;
    AQSWARM_ASSIGN_OR_RETURN(torch::Tensor x, StageInput(in, tokens, batch));
    return Guard("eval", [&] {
      CopyOut(model_->forward(x), out);
      return absl::OkStatus();
    });
  }

  absl::Status EvalLoss(absl::Span<const float> in, absl::Span<const int32_t> tokens,
                        absl::Span<const int32_t> targets, int64_t batch, double* loss) override {
    torch::NoGradGuard ng;
    AQSWARM_ASSIGN_OR_RETURN(torch::Tensor x, StageInput(in, tokens, batch));
    AQSWARM_ASSIGN_OR_RETURN(torch::Tensor t, TokenTensor(targets, batch));
    return Guard("eval", [&] {
      *loss = NextTokenLoss(model_->forward(x), t).item<double>();
      return absl::OkStatus();
    });
  }

  double GradSquaredNorm() const override { return opt_.GradSquaredNorm(); }

  absl::Status Step(int64_t step, double total_grad_squared_norm) override {
    saved_.clear();
    return Guard("step", [&] {
      opt_.Step(LearningRateAt(job_.optimizer(), step), total_grad_squared_norm);
      return absl::OkStatus();
    });
  }

  absl::Status StepDataParallel(int64_t step, double total_sq, ReplicaExchange& ex) override {
    saved_.clear();
    AQSWARM_RETURN_IF_ERROR(JoinUpdate());
    const bool delayed = job_.dp().delayed_update();
    return Guard("data-parallel step", [&]() -> absl::Status {
      torch::NoGradGuard ng;
      if (dp_ == nullptr) InitDataParallel();
      const double norm = std::sqrt(total_sq);
      const double clip = job_.optimizer().grad_clip();
      const float scale = (clip > 0 && norm > clip) ? static_cast<float>(clip / (norm + 1e-6)) : 1.0f;
      // Flatten (big tensors first: they are the compressed part). A delayed
      // update keeps its own parameters in dp_params_, ahead of the model's.
      const bool from_model = !master_;
      int64_t off = 0;
      for (const torch::Tensor& p : dp_order_) {
        const int64_t n = p.numel();
        if (from_model) {
          torch::Tensor pc = p.detach().to(torch::kCPU).contiguous();
          std::memcpy(dp_params_.data() + off, pc.data_ptr<float>(), n * sizeof(float));
        }
        if (p.grad().defined()) {
          torch::Tensor g = p.grad().to(torch::kCPU).contiguous();
          const float* gp = g.data_ptr<float>();
          for (int64_t i = 0; i < n; ++i) dp_grads_[off + i] = gp[i] * scale;
        } else {
          std::fill(dp_grads_.begin() + off, dp_grads_.begin() + off + n, 0.0f);
        }
        off += n;
      }
      const double lr = LearningRateAt(job_.optimizer(), step);
      if (delayed) {
        // The model takes the previous step's result, extrapolated by that
        // update (the next one, in flight, is about as large: Adam's steps
        // follow its momentum), so the next gradient is computed about where
        // it will be applied; this step's update starts in the background on
        // the optimizer's own copy (dp_params_, dp_grads_).
        master_ = true;
        ApplyMaster(/*predict=*/true);
        prev_params_ = dp_params_;
        update_ = std::thread([this, &ex, lr] {
          try {
            update_status_ = dp_->Step(ex, lr, absl::MakeSpan(dp_params_), dp_grads_);
          } catch (const std::exception& e) {
            update_status_ = absl::InternalError(absl::StrCat("delayed data-parallel update: ", e.what()));
          }
        });
        return absl::OkStatus();
      }
      AQSWARM_RETURN_IF_ERROR(dp_->Step(ex, lr, absl::MakeSpan(dp_params_), dp_grads_));
      stats_ = dp_->stats();
      ApplyMaster();
      return absl::OkStatus();
    });
  }

  absl::Status FinishDataParallel() override {
    AQSWARM_RETURN_IF_ERROR(JoinUpdate());
    if (!master_) return absl::OkStatus();
    return Guard("data-parallel finish", [&] {
      torch::NoGradGuard ng;
      ApplyMaster();
      return absl::OkStatus();
    });
  }

  ~StageWorkerImpl() override {
    if (update_.joinable()) update_.join();
  }

  uint64_t dp_bytes_sent() const override { return stats_.bytes_sent; }
  uint64_t dp_raw_bytes() const override { return stats_.raw_bytes; }

  int64_t num_parameters() const override {
    int64_t n = 0;
    for (const auto& [name, p] : model_->named_params()) n += p.numel();
    return n;
  }

  uint64_t ParameterHash() const override {
    Checksummer c;
    for (const auto& [name, p] : model_->named_params()) {
      torch::Tensor t = p.detach().to(torch::kCPU).contiguous();
      c.Update(t.data_ptr<float>(), t.numel() * sizeof(float));
    }
    return c.Digest();
  }

  // With data parallelism the checkpoint also holds QuantizedAdam's state
  // (m, v, worker and server error, step, frozen flag): a replica that
  // replaces a lost one resumes exactly where the group is.
  // A delayed update's result is saved too ("delayed/params"), so a loader
  // applies it at its next step as this worker would.
  absl::Status SaveCheckpoint(const std::string& path) override {
    if (dp_ == nullptr) return SaveStageCheckpoint(path, *model_, opt_, job_.name());
    AQSWARM_RETURN_IF_ERROR(JoinUpdate());
    ExtraCheckpointState extra;
    for (const auto& [name, buf] : dp_->NamedState()) extra.tensors.emplace_back("dp/" + name, *buf);
    if (master_) extra.tensors.emplace_back(kDelayedParams, dp_params_);
    if (master_ && !prev_params_.empty()) extra.tensors.emplace_back(kDelayedPrevParams, prev_params_);
    extra.metadata = {{"dp_step", std::to_string(dp_->step())}, {"dp_frozen", dp_->frozen() ? "1" : "0"}};
    return SaveStageCheckpoint(path, *model_, opt_, job_.name(), &extra);
  }
  absl::Status LoadCheckpoint(const std::string& path) override {
    if (update_.joinable()) update_.join();  // the state it was updating is replaced
    update_status_ = absl::OkStatus();
    ExtraCheckpointState extra;
    AQSWARM_RETURN_IF_ERROR(LoadStageCheckpoint(path, *model_, opt_, &extra));
    master_ = false;
    prev_params_.clear();
    if (extra.tensors.empty()) return absl::OkStatus();
    if (dp_ == nullptr) InitDataParallel();
    std::vector<std::pair<std::string, std::vector<float>>> state;
    for (auto& [name, values] : extra.tensors) {
      if (name.rfind("dp/", 0) == 0) {
        state.emplace_back(name.substr(3), std::move(values));
      } else if (name == kDelayedParams || name == kDelayedPrevParams) {
        if (values.size() != dp_params_.size()) {
          return absl::DataLossError(absl::StrCat(path, ": ", name, " holds ", values.size(),
                                                  " values, the stage has ", dp_params_.size(), " parameters"));
        }
        if (name == kDelayedParams) {
          dp_params_ = std::move(values);
          master_ = true;
        } else {
          prev_params_ = std::move(values);
        }
      }
    }
    int64_t step = 0;
    if (!absl::SimpleAtoi(extra.metadata["dp_step"], &step) || step < 0) {
      return absl::DataLossError(absl::StrCat(path, ": bad dp_step"));
    }
    AQSWARM_RETURN_IF_ERROR(dp_->LoadState(state, step, extra.metadata["dp_frozen"] == "1"));
    stats_ = {};
    // A job without delayed updates applies a saved one now.
    if (master_ && !job_.dp().delayed_update()) {
      AQSWARM_RETURN_IF_ERROR(FinishDataParallel());
      master_ = false;
    }
    return absl::OkStatus();
  }
  int64_t optimizer_step() const override { return opt_.step(); }

  absl::Status LoadInitialWeights() {
    if (job_.model().init_weights().empty()) return absl::OkStatus();
    AQSWARM_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(job_.model().init_weights()));
    return LoadGpt2Weights(*file, *model_);
  }

 private:
  absl::StatusOr<torch::Tensor> TokenTensor(absl::Span<const int32_t> tokens, int64_t batch) {
    const int64_t t = job_.model().seq_len();
    if (batch <= 0 || static_cast<int64_t>(tokens.size()) != batch * t) {
      return absl::InvalidArgumentError(absl::StrCat("expected ", batch, "x", t, " tokens, got ", tokens.size()));
    }
    for (int32_t id : tokens) {
      if (id < 0 || static_cast<uint32_t>(id) >= job_.model().vocab_size()) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", id, " outside the vocabulary"));
      }
    }
    return torch::from_blob(const_cast<int32_t*>(tokens.data()), {batch, t}, torch::kInt32)
        .to(device_, torch::kLong);
  }

  absl::StatusOr<torch::Tensor> HiddenTensor(absl::Span<const float> in, int64_t batch) {
    const int64_t t = job_.model().seq_len(), d = job_.model().d_model();
    if (batch <= 0 || static_cast<int64_t>(in.size()) != batch * t * d) {
      return absl::InvalidArgumentError(absl::StrCat("expected ", batch, "x", t, "x", d, " activations, got ",
                                                     in.size()));
    }
    return torch::from_blob(const_cast<float*>(in.data()), {batch, t, d}, torch::kFloat32)
        .to(device_, /*non_blocking=*/false, /*copy=*/true);
  }

  // The stage's input: token ids on stage 0, hidden activations elsewhere.
  absl::StatusOr<torch::Tensor> StageInput(absl::Span<const float> in, absl::Span<const int32_t> tokens,
                                           int64_t batch) {
    return is_first() ? TokenTensor(tokens, batch) : HiddenTensor(in, batch);
  }

  static void CopyOut(const torch::Tensor& t, std::vector<float>* out) {
    torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    out->assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }

  v1::JobSpec job_;
  std::shared_ptr<StageModel> model_;
  AdamW opt_;
  void InitDataParallel() {
    std::vector<torch::Tensor> big, small;
    for (const auto& [name, p] : model_->named_params()) {
      (p.numel() >= compression::kDefaultMinCompressElements ? big : small).push_back(p);
    }
    int64_t n = 0, nbig = 0;
    std::vector<uint8_t> decay;
    std::vector<int64_t> sizes;
    for (auto* group : {&big, &small}) {
      for (const torch::Tensor& p : *group) {
        dp_order_.push_back(p);
        sizes.push_back(p.numel());
        decay.insert(decay.end(), p.numel(), p.dim() >= 2 ? 1 : 0);
        n += p.numel();
        if (group == &big) nbig += p.numel();
      }
    }
    dp_params_.resize(n);
    dp_grads_.resize(n);
    dp_ = std::make_unique<QuantizedAdam>(n, nbig, std::move(decay), QuantizedAdamOptionsFromJob(job_),
                                          std::move(sizes));
  }

  // Copies dp_params_ into the model's parameters and zeroes their gradients.
  // predict (delayed updates, once an update has landed): dp_params_ plus the
  // update that took prev_params_ to it, 2 dp_params_ - prev_params_.
  void ApplyMaster(bool predict = false) {
    const float* src = dp_params_.data();
    if (predict && prev_params_.size() == dp_params_.size()) {
      predicted_.resize(dp_params_.size());
      for (size_t i = 0; i < predicted_.size(); ++i) predicted_[i] = 2.0f * dp_params_[i] - prev_params_[i];
      src = predicted_.data();
    }
    int64_t off = 0;
    for (torch::Tensor& p : dp_order_) {
      const int64_t n = p.numel();
      p.copy_(torch::from_blob(const_cast<float*>(src) + off, p.sizes(), torch::kFloat32));
      if (p.grad().defined()) p.mutable_grad().zero_();
      off += n;
    }
  }

  // Waits for the delayed update in flight, if any. A failed update leaves
  // the optimizer's state mid-step: every later call fails with it.
  absl::Status JoinUpdate() {
    if (update_.joinable()) {
      update_.join();
      stats_ = dp_->stats();
    }
    return update_status_;
  }

  static constexpr char kDelayedParams[] = "delayed/params";
  static constexpr char kDelayedPrevParams[] = "delayed/prev_params";

  torch::Device device_;
  std::map<int, std::pair<torch::Tensor, torch::Tensor>> saved_;  // mb -> (input, output or scaled loss)
  // Data-parallel optimizer over a flat copy of the parameters.
  std::unique_ptr<QuantizedAdam> dp_;
  std::vector<torch::Tensor> dp_order_;
  std::vector<float> dp_params_, dp_grads_;
  AllReduceStats stats_;  // dp_'s, as of the last update this thread saw finish
  // dp.delayed_update: dp_params_ holds the optimizer's parameters (one update
  // ahead of the model's while update_ runs or until the next step applies it).
  bool master_ = false;
  std::vector<float> prev_params_;  // dp_params_ before the update in flight (empty before the first)
  std::vector<float> predicted_;    // ApplyMaster's scratch for the prediction (kept between steps)
  std::thread update_;
  absl::Status update_status_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StageWorker>> StageWorker::Create(const v1::JobSpec& job, int stage) {
  AQSWARM_RETURN_IF_ERROR(ValidateJobSpec(job));
  if (stage < 0 || stage >= static_cast<int>(job.stages())) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", stage, " outside [0, ", job.stages(), ")"));
  }
  if (job.model().tie_embeddings() && job.stages() > 1) {
    return absl::UnimplementedError(
        "tie_embeddings with more than one stage needs the tied-gradient exchange between the first and last "
        "stage, which is not built yet; set model.tie_embeddings=false");
  }
  if (job.device() != "cpu") {
    try {
      torch::Device d(job.device());
      if (d.is_cuda() && !torch::cuda::is_available()) {
        return absl::FailedPreconditionError(absl::StrCat("device ", job.device(), " requested but this libtorch has no CUDA"));
      }
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("bad device '", job.device(), "': ", e.what()));
    }
  }
  at::set_num_threads(static_cast<int>(job.threads()));
  std::unique_ptr<StageWorkerImpl> w;
  AQSWARM_RETURN_IF_ERROR(Guard("create stage", [&]() -> absl::Status {
    AQSWARM_ASSIGN_OR_RETURN(std::shared_ptr<StageModel> model,
                             MakeStageModel(job.model(), StageRangeFor(job.model(), stage, job.stages()), job.seed()));
    w = std::make_unique<StageWorkerImpl>(job, std::move(model));
    return absl::OkStatus();
  }));
  AQSWARM_RETURN_IF_ERROR(w->LoadInitialWeights());
  return std::unique_ptr<StageWorker>(std::move(w));
}

}  // namespace aqswarm::pipeline
