#include "pipeline/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace aqswarm::pipeline {

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> params, const v1::OptimizerSpec& spec)
    : spec_(spec) {
  for (auto& [name, p] : params) {
    slots_.push_back({name, p, torch::zeros_like(p), torch::zeros_like(p), p.dim() >= 2});
  }
}

void AdamW::ZeroGrad() {
  for (auto& s : slots_) {
    if (s.param.grad().defined()) s.param.mutable_grad().zero_();
  }
}

double AdamW::GradSquaredNorm() const {
  torch::NoGradGuard no_grad;
  double sq = 0;
  for (const auto& s : slots_) {
    if (s.param.grad().defined()) sq += s.param.grad().pow(2).sum().item<double>();
  }
  return sq;
}

void AdamW::Step(double lr, double total_grad_squared_norm) {
  torch::NoGradGuard no_grad;
  const double norm = std::sqrt(total_grad_squared_norm);
  const double clip = spec_.grad_clip();
  const double scale = (clip > 0 && norm > clip) ? clip / (norm + 1e-6) : 1.0;
  ++step_;
  const double b1 = spec_.beta1(), b2 = spec_.beta2();
  const double bc1 = 1 - std::pow(b1, static_cast<double>(step_));
  const double bc2 = 1 - std::pow(b2, static_cast<double>(step_));
  for (auto& s : slots_) {
    if (!s.param.grad().defined()) continue;
    torch::Tensor g = s.param.grad();
    if (scale != 1.0) g = g * scale;
    s.exp_avg.mul_(b1).add_(g, 1 - b1);
    s.exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2);
    if (s.decay && spec_.weight_decay() > 0) s.param.mul_(1 - lr * spec_.weight_decay());
    torch::Tensor denom = (s.exp_avg_sq / bc2).sqrt_().add_(spec_.eps());
    s.param.addcdiv_(s.exp_avg, denom, -lr / bc1);
  }
  ZeroGrad();
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::NamedState() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& s : slots_) {
    out.emplace_back("exp_avg/" + s.name, s.exp_avg);
    out.emplace_back("exp_avg_sq/" + s.name, s.exp_avg_sq);
  }
  return out;
}

absl::Status AdamW::LoadState(const std::map<std::string, torch::Tensor>& state, int64_t step) {
  for (auto& s : slots_) {
    for (auto* pair : {&s.exp_avg, &s.exp_avg_sq}) {
      const std::string key = (pair == &s.exp_avg ? "exp_avg/" : "exp_avg_sq/") + s.name;
      auto it = state.find(key);
      if (it == state.end()) return absl::NotFoundError(absl::StrCat("optimizer state lacks ", key));
      if (!it->second.sizes().equals(pair->sizes())) {
        return absl::InvalidArgumentError(absl::StrCat("optimizer state ", key, " has the wrong shape"));
      }
      torch::NoGradGuard ng;
      pair->copy_(it->second);
    }
  }
  step_ = step;
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
