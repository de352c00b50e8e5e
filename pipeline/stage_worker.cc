#include "pipeline/stage_worker.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "compression/codec.h"
#include "common/status_macros.h"
#include "pipeline/stage_model.h"
#include "pipeline/job_spec.h"
#include "pipeline/diloco.h"
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
    AQSWARM_RETURN_IF_ERROR(JoinUpdate());
    const bool delayed = job_.dp().delayed_update();
    return Guard("data-parallel step", [&]() -> absl::Status {
      torch::NoGradGuard ng;
      if (!dp_ready()) InitDataParallel();
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
      // A NaN or infinite gradient here would reach every replica through
      // the exchange: the step stops before it (dynamic loss scaling, whose
      // overflows skip steps, does not run with data parallelism).
      if (!std::isfinite(total_sq)) {
        return absl::FailedPreconditionError(absl::StrCat("data-parallel step ", step,
                                                          ": the pipeline's gradient norm is not finite (squared ",
                                                          total_sq, "); nothing was sent to the replicas"));
      }
      if (const absl::Status s = compression::CheckReceivedFinite(dp_grads_, "local gradient"); !s.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("data-parallel step ", step, ": this replica's ",
                                                          s.message(), "; nothing was sent to the replicas"));
      }
      const double lr = LearningRateAt(job_.optimizer(), step);
      // The baseline of the DP traffic: AdamW's float32 all-reduce of the
      // whole stage (tied copy included), every step, whatever this
      // optimizer sent.
      const int64_t raw_bucket = QuantizedAdamOptionsFromJob(job_).compressed.bucket_elements;
      dp_raw_total_ += Float32AllReduceBytes(tied_n_, ex.rank(), ex.size(), raw_bucket) +
                       Float32AllReduceBytes(static_cast<int64_t>(dp_params_.size()) - tied_n_, ex.rank(), ex.size(),
                                             raw_bucket);
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
            update_status_ = StepOptimizers(ex, lr);
          } catch (const std::exception& e) {
            update_status_ = absl::InternalError(absl::StrCat("delayed data-parallel update: ", e.what()));
          }
        });
        return absl::OkStatus();
      }
      AQSWARM_RETURN_IF_ERROR(StepOptimizers(ex, lr));
      stats_ = OptimizerStats();
      ApplyMaster();
      return absl::OkStatus();
    });
  }

  absl::Status FinishDataParallel() override {
    if (diloco_ != nullptr && !diloco_->anchor().empty()) {
      // The job ends on the anchors, the model every replica shares (see the
      // header).
      if (diloco_tied_ != nullptr) {
        const std::vector<float>& a = diloco_tied_->anchor();
        if (!a.empty()) std::copy(a.begin(), a.end(), dp_params_.begin());
      }
      std::copy(diloco_->anchor().begin(), diloco_->anchor().end(), dp_params_.begin() + tied_n_);
      return Guard("data-parallel finish", [&] {
        torch::NoGradGuard ng;
        ApplyMaster();
        return absl::OkStatus();
      });
    }
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
  std::string dp_step_kind() const override {
    if (diloco_ != nullptr) return diloco_->last_step_kind();
    return dp_ != nullptr ? dp_->last_step_kind() : "";
  }
  uint64_t dp_raw_bytes() const override { return dp_raw_total_; }
  uint64_t dp_robust_dropped() const override { return stats_.robust_dropped; }
  uint64_t dp_robust_clipped() const override { return stats_.robust_clipped; }

  int64_t num_parameters() const override {
    int64_t n = 0;
    for (const auto& [name, p] : model_->named_params()) n += p.numel();
    return n;
  }

  uint64_t ParameterHash() const override {
    Checksummer c;
    if (diloco_ != nullptr) {  // the anchors: the replicas' common state (see the header)
      if (diloco_tied_ != nullptr) c.Update(diloco_tied_->anchor().data(), diloco_tied_->anchor().size() * sizeof(float));
      c.Update(diloco_->anchor().data(), diloco_->anchor().size() * sizeof(float));
      return c.Digest();
    }
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
    if (diloco_ != nullptr) {
      for (const auto& [name, buf] : std::as_const(*diloco_).NamedState()) extra.tensors.emplace_back("dp/" + name, *buf);
      if (diloco_tied_ != nullptr) {
        for (const auto& [name, buf] : std::as_const(*diloco_tied_).NamedState()) {
          extra.tensors.emplace_back(kTiedState + name, *buf);
        }
      }
      extra.metadata["dp_step"] = std::to_string(diloco_->step());
      extra.metadata[kDpOptimizer] = "diloco";
    }
    if (dp_ != nullptr) {
      AQSWARM_RETURN_IF_ERROR(JoinUpdate());
      for (const auto& [name, buf] : dp_->NamedState()) extra.tensors.emplace_back("dp/" + name, *buf);
      if (dp_tied_ != nullptr) {
        for (const auto& [name, buf] : dp_tied_->NamedState()) extra.tensors.emplace_back(kTiedState + name, *buf);
      }
      if (master_) extra.tensors.emplace_back(kDelayedParams, dp_params_);
      if (master_ && !prev_params_.empty()) extra.tensors.emplace_back(kDelayedPrevParams, prev_params_);
      extra.metadata["dp_step"] = std::to_string(dp_->step());
      extra.metadata["dp_frozen"] = dp_->frozen() ? "1" : "0";
    }
    return SaveStageCheckpoint(path, *model_, opt_, job_.name(), &extra);
  }
  absl::Status LoadCheckpoint(const std::string& path) override {
    if (update_.joinable()) update_.join();  // the state it was updating is replaced
    update_status_ = absl::OkStatus();
    ExtraCheckpointState extra;
    AQSWARM_RETURN_IF_ERROR(LoadStageCheckpoint(path, *model_, opt_, &extra));
    master_ = false;
    prev_params_.clear();
    if (loss_scale_ > 0 && extra.metadata.count(kLossScale) > 0) {
      if (!absl::SimpleAtod(extra.metadata[kLossScale], &loss_scale_) || !(loss_scale_ > 0) ||
          !absl::SimpleAtoi(extra.metadata[kGoodSteps], &good_steps_)) {
        return absl::DataLossError(absl::StrCat(path, ": bad loss scale"));
      }
    }
    if (extra.tensors.empty()) return absl::OkStatus();
    // A DiLoCo state has an anchor and no frozen variance: it does not fit
    // QuantizedAdam, nor the other way round.
    const bool job_diloco = job_.dp().optimizer() == v1::DataParallelSpec::diloco;
    const bool saved_diloco = extra.metadata[kDpOptimizer] == "diloco";
    if (job_diloco != saved_diloco) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": its data-parallel optimizer state is ", saved_diloco ? "diloco's" : "quantized_adam's (or adamw's)",
          " but the job's dp.optimizer is ", v1::DataParallelSpec::Optimizer_Name(job_.dp().optimizer()),
          "; resume with the optimizer the state was saved with"));
    }
    if (!dp_ready()) InitDataParallel();
    std::vector<std::pair<std::string, std::vector<float>>> state, tied_state;
    for (auto& [name, values] : extra.tensors) {
      if (name.rfind("dp/", 0) == 0) {
        state.emplace_back(name.substr(3), std::move(values));
      } else if (name.rfind(kTiedState, 0) == 0) {
        tied_state.emplace_back(name.substr(std::strlen(kTiedState)), std::move(values));
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
    if (diloco_ != nullptr) {
      AQSWARM_RETURN_IF_ERROR(diloco_->LoadState(state, step));
      if (diloco_tied_ != nullptr) {
        AQSWARM_RETURN_IF_ERROR(diloco_tied_->LoadState(tied_state, step));
        // The tied copy's inner progress (parameters, m, v) is this
        // pipeline's own, and the two ends of a pipeline may load states of
        // different replicas (a joiner takes another pipeline's): both
        // restart it from the anchor, the same everywhere.
        const torch::Tensor tied = model_->tied_embedding();
        std::vector<float> p(tied_n_);
        AQSWARM_RETURN_IF_ERROR(diloco_tied_->RestartFromAnchor(absl::MakeSpan(p)));
        if (!diloco_tied_->anchor().empty()) {
          tied.detach().copy_(torch::from_blob(p.data(), tied.sizes(), torch::kFloat32));
        }
      }
      stats_ = {};
      return absl::OkStatus();
    }
    AQSWARM_RETURN_IF_ERROR(dp_->LoadState(state, step, extra.metadata["dp_frozen"] == "1"));
    if (dp_tied_ != nullptr) {
      AQSWARM_RETURN_IF_ERROR(dp_tied_->LoadState(tied_state, step, extra.metadata["dp_frozen"] == "1"));
    }
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
  // The flat vector: a tied-embedding copy first (its own optimizer, see
  // StepOptimizers), then big tensors (the compressed part), then small ones.
  void InitDataParallel() {
    const torch::Tensor tied = model_->tied_embedding();
    tied_n_ = tied.defined() ? tied.numel() : 0;
    if (tied.defined()) dp_order_.push_back(tied);
    std::vector<torch::Tensor> big, small;
    for (const auto& [name, p] : model_->named_params()) {
      if (p.is_same(tied)) continue;
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
    dp_params_.resize(tied_n_ + n);
    dp_grads_.resize(tied_n_ + n);
    if (job_.dp().optimizer() == v1::DataParallelSpec::diloco) {
      const DiLoCoOptions options = DiLoCoOptionsFromJob(job_);
      diloco_ = std::make_unique<DiLoCo>(n, nbig, std::move(decay), options, std::move(sizes));
      if (tied_n_ > 0) {
        // As QuantizedAdam's tied copy below: the same rounds, inputs and
        // state at both ends, Global-QSGD (no error feedback: the anchor,
        // the outer momentum and the step are all the state that is not the
        // pipeline's own, see LoadCheckpoint), its own rounds, one fragment.
        DiLoCoOptions to = options;
        to.first_round = 2;
        to.fragments = 1;
        to.compressed.codec.codec = v1::CODEC_GLOBAL_QSGD;
        to.compressed.codec.bits = TiedGlobalQsgdBits(job_);
        // Global-QSGD sums codes without decoding them: under dp.robust the
        // tied copy's pseudo-gradient goes float32.
        if (to.compressed.robust != RobustAggregation::kOff) to.compressed.codec.codec = v1::CODEC_RAW_F32;
        diloco_tied_ = std::make_unique<DiLoCo>(
            tied_n_, tied_n_ >= compression::kDefaultMinCompressElements ? tied_n_ : 0,
            std::vector<uint8_t>(tied_n_, 1), to, std::vector<int64_t>{tied_n_});
      }
      return;
    }
    const QuantizedAdamOptions options = QuantizedAdamOptionsFromJob(job_);
    dp_ = std::make_unique<QuantizedAdam>(n, nbig, std::move(decay), options, std::move(sizes));
    if (tied_n_ > 0) {
      // Stage 0's and the last stage's replica groups run this one with the
      // same rounds, inputs and state: their copies stay bit-identical. Its
      // state must not depend on the replica, since a replica that replaces
      // a lost one takes another replica's state (and the other stage keeps
      // its own): Global-QSGD's exchange keeps no error feedback (min-max's
      // worker and server errors are the replica's own), so m and v, the
      // same on every replica, are all there is.
      QuantizedAdamOptions to = options;
      to.first_round = 2;
      to.compressed.codec.codec = v1::CODEC_GLOBAL_QSGD;
      to.compressed.codec.bits = TiedGlobalQsgdBits(job_);
      // Global-QSGD sums codes without decoding them, so no contribution can
      // be clipped: under dp.robust the tied copy exchanges float32 means
      // (AdamW, no error feedback either).
      if (to.compressed.robust != RobustAggregation::kOff) to.quantized = false;
      dp_tied_ = std::make_unique<QuantizedAdam>(
          tied_n_, tied_n_ >= compression::kDefaultMinCompressElements ? tied_n_ : 0,
          std::vector<uint8_t>(tied_n_, 1), to, std::vector<int64_t>{tied_n_});
    }
  }

  // One data-parallel update of dp_params_ with dp_grads_: the tied copy's
  // optimizer first, then the stage's.
  absl::Status StepOptimizers(ReplicaExchange& ex, double lr) {
    const auto params = absl::MakeSpan(dp_params_);
    const auto grads = absl::MakeConstSpan(dp_grads_);
    if (diloco_ != nullptr) {
      if (diloco_tied_ != nullptr) {
        AQSWARM_RETURN_IF_ERROR(
            diloco_tied_->Step(ex, lr, params.subspan(0, tied_n_), grads.subspan(0, tied_n_)));
      }
      return diloco_->Step(ex, lr, params.subspan(tied_n_), grads.subspan(tied_n_));
    }
    if (dp_tied_ != nullptr) {
      AQSWARM_RETURN_IF_ERROR(dp_tied_->Step(ex, lr, params.subspan(0, tied_n_), grads.subspan(0, tied_n_)));
    }
    return dp_->Step(ex, lr, params.subspan(tied_n_), grads.subspan(tied_n_));
  }

  AllReduceStats OptimizerStats() const {
    AllReduceStats st = diloco_ != nullptr ? diloco_->stats() : dp_->stats();
    const AllReduceStats* tied = diloco_tied_ != nullptr ? &diloco_tied_->stats()
                                 : dp_tied_ != nullptr   ? &dp_tied_->stats()
                                                         : nullptr;
    if (tied != nullptr) {
      st.bytes_sent += tied->bytes_sent;
      st.raw_bytes += tied->raw_bytes;
      st.robust_dropped += tied->robust_dropped;
      st.robust_clipped += tied->robust_clipped;
    }
    return st;
  }
  bool dp_ready() const { return dp_ != nullptr || diloco_ != nullptr; }

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
      stats_ = OptimizerStats();
    }
    return update_status_;
  }

  static constexpr char kDelayedParams[] = "delayed/params";
  static constexpr char kDelayedPrevParams[] = "delayed/prev_params";
  static constexpr char kTiedState[] = "dp_tied/";
  static constexpr char kDpOptimizer[] = "dp_optimizer";
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
  // Data-parallel optimizer over a flat copy of the parameters.
  std::unique_ptr<QuantizedAdam> dp_;
  std::unique_ptr<QuantizedAdam> dp_tied_;  // the tied-embedding copy's (first and last stage), or null
  // dp.optimizer diloco: these instead of dp_ and dp_tied_.
  std::unique_ptr<DiLoCo> diloco_;
  std::unique_ptr<DiLoCo> diloco_tied_;
  int64_t tied_n_ = 0;                      // its elements, at the front of dp_params_
  // Dynamic loss scaling (optimizer.lossScale): the scale (0 = off), good
  // steps since it last changed, and whether this step overflowed here.
  double loss_scale_ = 0;
  int64_t good_steps_ = 0;
  bool overflow_ = false;
  std::vector<torch::Tensor> dp_order_;
  std::vector<float> dp_params_, dp_grads_;
  AllReduceStats stats_;
  uint64_t dp_raw_total_ = 0;  // dp_raw_bytes()  // dp_'s, as of the last update this thread saw finish
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
