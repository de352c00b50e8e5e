#include "pipeline/stage_worker.h"

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/status_macros.h"
#include "pipeline/stage_model.h"
#include "pipeline/job_spec.h"
#include "pipeline/data_parallel_step.h"
#include "pipeline/optimizer.h"
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
    model_->set_compute_dtype(ComputeDtypeFor(job.precision()));
    // AdamW holds references to the parameters moved above: rebuild it.
    opt_ = AdamW(model_->named_params(), job.optimizer());
    if (DynamicLossScaling(job)) {
      loss_scale_ = job.optimizer().initial_loss_scale() > 0 ? job.optimizer().initial_loss_scale() : 65536.0;
    }
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
    if (holds_tied_copy()) step_tokens_.insert(tokens.begin(), tokens.end());
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
      saved_[mb] = {x, l * (LossScale() / static_cast<double>(job_.micro_batches_per_step()))};
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
      if (!is_first() && grad_in != nullptr) {
        if (loss_scale_ > 0 && !torch::isfinite(x.grad()).all().item<bool>()) {
          // An overflow: the step will be skipped everywhere (GradSquaredNorm
          // is infinite), so upstream gets zeros rather than a refused message.
          overflow_ = true;
          grad_in->assign(x.grad().numel(), 0.0f);
        } else {
          CopyOut(x.grad(), grad_in);
        }
      }
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

  double GradSquaredNorm() const override {
    if (loss_scale_ == 0 && (!holds_tied_copy() || is_first())) return opt_.GradSquaredNorm();
    if (overflow_) return std::numeric_limits<double>::infinity();
    // The last stage leaves its tied copy out; with loss scaling the norm is
    // of the unscaled gradients (infinite after an overflow).
    torch::NoGradGuard ng;
    const torch::Tensor tied = is_first() ? torch::Tensor() : model_->tied_embedding();
    double sq = 0;
    for (const auto& [name, p] : model_->named_params()) {
      if (!p.grad().defined() || (tied.defined() && p.is_same(tied))) continue;
      const torch::Tensor g = loss_scale_ > 0 ? p.grad().mul(1.0 / loss_scale_) : p.grad();
      sq += g.pow(2).sum().item<double>();
    }
    return std::isfinite(sq) ? sq : std::numeric_limits<double>::infinity();
  }

  bool holds_tied_copy() const override { return model_->tied_embedding().defined(); }

  absl::Status TiedGradient(std::vector<uint32_t>* rows, std::vector<float>* values) override {
    const torch::Tensor t = model_->tied_embedding();
    if (!t.defined()) return absl::FailedPreconditionError("this stage holds no tied embedding copy");
    return Guard("tied gradient", [&] {
      torch::NoGradGuard ng;
      torch::Tensor g = t.grad().defined() ? t.grad() : torch::zeros_like(t);
      if (loss_scale_ > 0 && !torch::isfinite(g).all().item<bool>()) {
        overflow_ = true;  // the step is skipped everywhere: send zeros
        g = torch::zeros_like(t);
      }
      rows->clear();
      if (!is_first()) {
        CopyOut(g, values);
        return absl::OkStatus();
      }
      rows->assign(step_tokens_.begin(), step_tokens_.end());
      std::vector<int64_t> idx(rows->begin(), rows->end());
      CopyOut(g.index_select(0, torch::tensor(idx, torch::kLong).to(g.device())), values);
      return absl::OkStatus();
    });
  }

  absl::Status AddTiedGradient(absl::Span<const uint32_t> rows, absl::Span<const float> values) override {
    torch::Tensor t = model_->tied_embedding();
    if (!t.defined()) return absl::FailedPreconditionError("this stage holds no tied embedding copy");
    const int64_t v = t.size(0), d = t.size(1);
    // Stage 0 receives the head's dense gradient, the last stage the rows.
    if (is_first() && (!rows.empty() || static_cast<int64_t>(values.size()) != v * d)) {
      return absl::InvalidArgumentError(absl::StrCat("tied gradient: expected a dense ", v, "x", d, " matrix, got ",
                                                     rows.size(), " rows and ", values.size(), " values"));
    }
    if (!is_first()) {
      if (static_cast<int64_t>(values.size()) != static_cast<int64_t>(rows.size()) * d) {
        return absl::InvalidArgumentError(absl::StrCat("tied gradient: ", rows.size(), " rows of ", d, " need ",
                                                       rows.size() * d, " values, got ", values.size()));
      }
      for (size_t i = 0; i < rows.size(); ++i) {
        if (rows[i] >= v || (i > 0 && rows[i] <= rows[i - 1])) {
          return absl::InvalidArgumentError(absl::StrCat("tied gradient: row ", rows[i], " at ", i,
                                                         " is outside the vocabulary or out of order"));
        }
      }
    }
    for (float x : values) {
      if (!std::isfinite(x)) return absl::InvalidArgumentError("tied gradient: a value is not finite");
    }
    return Guard("add tied gradient", [&] {
      torch::NoGradGuard ng;
      torch::Tensor other;
      if (is_first()) {
        other = torch::from_blob(const_cast<float*>(values.data()), {v, d}, torch::kFloat32);
      } else {
        std::vector<int64_t> idx(rows.begin(), rows.end());
        other = torch::zeros({v, d}, torch::kFloat32);
        other.index_copy_(0, torch::tensor(idx, torch::kLong),
                          torch::from_blob(const_cast<float*>(values.data()),
                                           {static_cast<int64_t>(rows.size()), d}, torch::kFloat32));
      }
      other = other.to(device_, /*non_blocking=*/false, /*copy=*/true);
      if (!t.grad().defined()) t.mutable_grad() = torch::zeros_like(t);
      // Elementwise g_here + g_there: IEEE addition is commutative, so both
      // copies get the same bits.
      t.mutable_grad().add_(other);
      return absl::OkStatus();
    });
  }

  uint64_t TiedEmbeddingHash() const override {
    const torch::Tensor t = model_->tied_embedding();
    if (!t.defined()) return 0;
    Checksummer c;
    torch::Tensor h = t.detach().to(torch::kCPU).contiguous();
    c.Update(h.data_ptr<float>(), h.numel() * sizeof(float));
    return c.Digest();
  }

  absl::Status Step(int64_t step, double total_grad_squared_norm) override {
    saved_.clear();
    step_tokens_.clear();
    return Guard("step", [&] {
      if (loss_scale_ > 0 && !UnscaleOrSkip(total_grad_squared_norm)) return absl::OkStatus();
      opt_.Step(LearningRateAt(job_.optimizer(), step), total_grad_squared_norm);
      return absl::OkStatus();
    });
  }

  absl::Status StepDataParallel(int64_t step, double total_sq, ReplicaExchange& ex) override {
    saved_.clear();
    step_tokens_.clear();
    return Guard("data-parallel step", [&] { return dp_.Step(step, total_sq, ex); });
  }

  absl::Status FinishDataParallel() override {
    return Guard("data-parallel finish", [&] { return dp_.Finish(); });
  }

  uint64_t dp_bytes_sent() const override { return dp_.stats().bytes_sent; }
  std::string dp_step_kind() const override { return std::string(DpStepKindName(dp_.last_step_kind())); }
  uint64_t dp_raw_bytes() const override { return dp_.raw_bytes(); }
  uint64_t dp_robust_dropped() const override { return dp_.stats().robust_dropped; }
  uint64_t dp_robust_clipped() const override { return dp_.stats().robust_clipped; }

  int64_t num_parameters() const override {
    int64_t n = 0;
    for (const auto& [name, p] : model_->named_params()) n += p.numel();
    return n;
  }

  uint64_t ParameterHash() const override {
    Checksummer c;
    if (dp_.HashShared(c)) return c.Digest();  // DiLoCo's anchors: the replicas' common state (see the header)
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
    ExtraCheckpointState extra;
    if (loss_scale_ > 0) {
      extra.metadata = {{kLossScale, absl::StrCat(loss_scale_)}, {kGoodSteps, absl::StrCat(good_steps_)}};
    }
    AQSWARM_RETURN_IF_ERROR(dp_.Save(extra));
    return SaveStageCheckpoint(path, *model_, opt_, job_.name(), &extra);
  }
  absl::Status LoadCheckpoint(const std::string& path) override {
    ExtraCheckpointState extra;
    AQSWARM_RETURN_IF_ERROR(LoadStageCheckpoint(path, *model_, opt_, &extra));
    if (loss_scale_ > 0 && extra.metadata.count(kLossScale) > 0) {
      if (!absl::SimpleAtod(extra.metadata[kLossScale], &loss_scale_) || !(loss_scale_ > 0) ||
          !absl::SimpleAtoi(extra.metadata[kGoodSteps], &good_steps_)) {
        return absl::DataLossError(absl::StrCat(path, ": bad loss scale"));
      }
    }
    return Guard("data-parallel state", [&] { return dp_.Load(extra, path); });
  }
  int64_t optimizer_step() const override { return opt_.step(); }
  absl::Status RestartFromShared(int64_t step) override {
    return Guard("data-parallel restart", [&] { return dp_.RestartFromShared(step); });
  }

  absl::Status LoadInitialWeights() {
    // A Hugging Face directory (pipeline/hf_checkpoint.h): this stage's shards only.
    if (!job_.model().init_from().empty()) return LoadHfCheckpoint(job_.model().init_from(), *model_);
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
  static constexpr char kLossScale[] = "loss_scale";
  static constexpr char kGoodSteps[] = "loss_scale_good_steps";

  double LossScale() const { return loss_scale_ > 0 ? loss_scale_ : 1.0; }

  // Dynamic loss scaling at the step: a non-finite whole-model norm skips
  // the step (gradients dropped) and halves the scale; otherwise the
  // gradients are divided by the scale (a power of two: exact) and every
  // kGrowthInterval good steps it doubles. Returns whether to step.
  bool UnscaleOrSkip(double total_grad_squared_norm) {
    torch::NoGradGuard ng;
    const bool skip = !std::isfinite(total_grad_squared_norm);
    for (const auto& [name, p] : model_->named_params()) {
      if (!p.grad().defined()) continue;
      if (skip) {
        p.mutable_grad().zero_();
      } else {
        p.mutable_grad().mul_(1.0 / loss_scale_);
      }
    }
    overflow_ = false;
    if (skip) {
      loss_scale_ = std::max(loss_scale_ * 0.5, 1.0);
      good_steps_ = 0;
      return false;
    }
    if (++good_steps_ >= kGrowthInterval) {
      loss_scale_ = std::min(loss_scale_ * 2, 1.0 * (int64_t{1} << 60));
      good_steps_ = 0;
    }
    return true;
  }
  static constexpr int64_t kGrowthInterval = 2000;

  torch::Device device_;
  std::map<int, std::pair<torch::Tensor, torch::Tensor>> saved_;  // mb -> (input, output or scaled loss)
  std::set<uint32_t> step_tokens_;  // stage 0 with a tied copy: the tokens embedded this step
  // Dynamic loss scaling (optimizer.lossScale): the scale (0 = off), good
  // steps since it last changed, and whether this step overflowed here.
  double loss_scale_ = 0;
  int64_t good_steps_ = 0;
  bool overflow_ = false;
  DataParallelStep dp_{job_, model_.get()};
};

}  // namespace

absl::StatusOr<std::unique_ptr<StageWorker>> StageWorker::Create(const v1::JobSpec& job, int stage) {
  AQSWARM_RETURN_IF_ERROR(ValidateJobSpec(job));
  if (stage < 0 || stage >= static_cast<int>(job.stages())) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", stage, " outside [0, ", job.stages(), ")"));
  }
  // A stage that cannot fit in RAM fails here with the sizes, not by an OOM kill.
  AQSWARM_RETURN_IF_ERROR(CheckStageMemory(job, stage));
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
