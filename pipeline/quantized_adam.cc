#include "pipeline/quantized_adam.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace aqswarm::pipeline {
namespace {

float Square(float x) { return x * x; }

// Float32 rounds: the compressed exchange's buckets and robust aggregation.
AllReduceOptions RawOptions(const AllReduceOptions& compressed) {
  AllReduceOptions a;
  a.bucket_elements = compressed.bucket_elements;
  a.robust = compressed.robust;
  a.robust_clip = compressed.robust_clip;
  return a;
}

// Where v is 0 (no gradient yet), v = 1% of its tensor's mean, tensor by
// tensor (see the header).
void FloorVariance(absl::Span<const int64_t> tensor_sizes, std::vector<float>& v) {
  int64_t off = 0;
  for (int64_t len : tensor_sizes) {
    double mean = 0;
    for (int64_t i = off; i < off + len; ++i) mean += v[i];
    const float floor = static_cast<float>(0.01 * mean / std::max<int64_t>(len, 1));
    for (int64_t i = off; i < off + len; ++i) {
      if (v[i] == 0) v[i] = floor;
    }
    off += len;
  }
}

}  // namespace

QuantizedAdamOptions QuantizedAdamOptionsFromJob(const v1::JobSpec& job) {
  QuantizedAdamOptions o;
  o.beta1 = job.optimizer().beta1();
  o.beta2 = job.optimizer().beta2();
  o.eps = job.optimizer().eps();
  o.weight_decay = job.optimizer().weight_decay();
  o.quantized = job.dp().optimizer() == v1::DataParallelSpec::quantized_adam;
  o.warmup_steps = job.dp().warmup_steps();
  o.compressed.codec.codec =
      job.dp().codec() == v1::DataParallelSpec::global_qsgd ? v1::CODEC_GLOBAL_QSGD : v1::CODEC_MINMAX;
  o.compressed.codec.levels = v1::LEVELS_EXPONENTIAL;  // Global-QSGD only (the paper's choice for Adam)
  o.compressed.codec.bits = static_cast<int>(job.dp().bits());
  o.compressed.codec.bucket_size = job.dp().bucket_size();
  o.raise_variance_at_bound = job.dp().frozen_variance() != v1::DataParallelSpec::fixed;
  o.variance_refresh_steps = job.dp().variance_refresh_steps();
  switch (job.dp().robust()) {
    case v1::DataParallelSpec::clip_norm: o.compressed.robust = RobustAggregation::kClipNorm; break;
    case v1::DataParallelSpec::centered_clip: o.compressed.robust = RobustAggregation::kCenteredClip; break;
    default: o.compressed.robust = RobustAggregation::kOff; break;
  }
  o.compressed.robust_clip = job.dp().robust_clip() > 0 ? job.dp().robust_clip() : 2.0;
  return o;
}

double AdamUpdateBound(double beta1, double beta2, int64_t step) {
  // Adam's step: m^ / sqrt(v^) = sum_i w_i g_i / sqrt(sum_i u_i g_i^2) with
  // w_i = (1-b1) b1^(t-i) / bc1 and u_i = (1-b2) b2^(t-i) / bc2; by
  // Cauchy-Schwarz its largest value over all g is sqrt(sum_i w_i^2 / u_i),
  // reached by some gradient sequence.
  const double t = static_cast<double>(std::max<int64_t>(step, 1));
  const double bc1 = 1 - std::pow(beta1, t), bc2 = 1 - std::pow(beta2, t);
  const double r = beta1 * beta1 / beta2;
  const double sum = std::fabs(1 - r) < 1e-12 ? t : (1 - std::pow(r, t)) / (1 - r);
  return (1 - beta1) / bc1 * std::sqrt(bc2 / (1 - beta2) * sum);
}

QuantizedAdam::QuantizedAdam(int64_t n, int64_t num_compressed, std::vector<uint8_t> decay,
                             const QuantizedAdamOptions& options, std::vector<int64_t> tensor_sizes)
    : n_(n),
      num_compressed_(num_compressed),
      decay_(std::move(decay)),
      tensor_sizes_(tensor_sizes.empty() ? std::vector<int64_t>{n} : std::move(tensor_sizes)),
      options_(options),
      m_(n, 0.0f),
      v_(n, 0.0f) {}

absl::Status QuantizedAdam::Step(ReplicaExchange& ex, double lr, absl::Span<float> params,
                                 absl::Span<const float> grads) {
  if (static_cast<int64_t>(params.size()) != n_ || static_cast<int64_t>(grads.size()) != n_) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizedAdam: expected ", n_, " values"));
  }
  const float b1 = static_cast<float>(options_.beta1), b2 = static_cast<float>(options_.beta2);
  const float eps = static_cast<float>(options_.eps), wd = static_cast<float>(lr * options_.weight_decay);
  const float flr = static_cast<float>(lr);
  const bool compressed = options_.quantized && step_ >= options_.warmup_steps;
  const uint64_t s = static_cast<uint64_t>(step_);
  ++step_;
  if (!compressed) {
    last_step_kind_ = options_.quantized ? "warmup" : "adamw";
    g_.resize(n_);
    AQSWARM_RETURN_IF_ERROR(
        AllReduceMean(ex, RawOptions(options_.compressed), s, options_.first_round, grads, absl::MakeSpan(g_), nullptr,
                      nullptr, &stats_));
    const float bc1 = static_cast<float>(1 - std::pow(options_.beta1, static_cast<double>(step_)));
    const float bc2 = static_cast<float>(1 - std::pow(options_.beta2, static_cast<double>(step_)));
    for (int64_t i = 0; i < n_; ++i) {
      const float g = g_[i];
      m_[i] = b1 * m_[i] + (1 - b1) * g;
      v_[i] = b2 * v_[i] + (1 - b2) * (g * g);
      if (decay_[i] && wd > 0) params[i] *= 1 - wd;
      params[i] -= flr * (m_[i] / bc1) / (std::sqrt(v_[i] / bc2) + eps);
    }
    if (options_.quantized && step_ == options_.warmup_steps) {
      // Freeze the bias-corrected variance, floored per tensor (see header).
      for (float& x : v_) x /= bc2;
      FloorVariance(tensor_sizes_, v_);
      frozen_ = true;
    }
    return absl::OkStatus();
  }
  if (!frozen_) {  // warm-up of 0 steps: freeze what we have (zeros, floored to 0: steps of m / eps)
    frozen_ = true;
  }
  const float bc1 =
      options_.bias_correct_frozen ? static_cast<float>(1 - std::pow(options_.beta1, static_cast<double>(step_))) : 1;
  const float clip = static_cast<float>(
      options_.update_clip < 0 ? AdamUpdateBound(options_.beta1, options_.beta2, step_) : options_.update_clip);
  const bool raise = options_.raise_variance_at_bound && clip > 0;
  // Coordinate i moves by u lr, bounded by `clip`. Where the bound binds, v
  // rises so that this step is exactly the bound and later ones decay with m,
  // as Adam's would: v is a function of the exchanged m only, the same on
  // every replica.
  auto apply = [&](int64_t i, float u) {
    if (clip > 0 && std::fabs(u) > clip) {
      if (raise) v_[i] = Square(std::fabs(m_[i]) / bc1 / clip);
      u = std::copysign(clip, u);
    }
    if (decay_[i] && wd > 0) params[i] *= 1 - wd;
    params[i] -= flr * u;
  };
  const int64_t refresh = options_.variance_refresh_steps;
  if (refresh > 0 && (step_ - std::max<int64_t>(options_.warmup_steps, 0)) % refresh == 0) {
    // Variance refresh: the float32 mean gradient, as in the warm-up; v takes
    // it with the weight of the `refresh` steps since the last one.
    last_step_kind_ = "refresh";
    g_.resize(n_);
    AQSWARM_RETURN_IF_ERROR(AllReduceMean(ex, RawOptions(options_.compressed), s, options_.first_round, grads,
                                          absl::MakeSpan(g_), nullptr, nullptr, &stats_));
    const double t = static_cast<double>(step_);
    const double keep = std::pow(options_.beta2, static_cast<double>(refresh));
    const double bc2_now = 1 - std::pow(options_.beta2, t);
    const double bc2_then = 1 - std::pow(options_.beta2, std::max(0.0, t - static_cast<double>(refresh)));
    const float a = static_cast<float>(keep * bc2_then / bc2_now), c = static_cast<float>((1 - keep) / bc2_now);
    for (int64_t i = 0; i < n_; ++i) {
      const float g = g_[i];
      m_[i] = b1 * m_[i] + (1 - b1) * g;
      v_[i] = a * v_[i] + c * (g * g);
    }
    FloorVariance(tensor_sizes_, v_);
    // The error buffers hold residues in units of m / s of the old v: drop
    // them (m itself is exact this step), as 0/1 Adam does at its switches.
    std::fill(worker_error_.begin(), worker_error_.end(), 0.0f);
    std::fill(server_error_.begin(), server_error_.end(), 0.0f);
    for (int64_t i = 0; i < n_; ++i) apply(i, m_[i] / bc1 / (std::sqrt(v_[i]) + eps));
    return absl::OkStatus();
  }
  // x = m (or the preconditioned momentum m / (sqrt(v_frozen) + eps), see the
  // header) is what travels; the means come back in g_.
  last_step_kind_ = "compressed";
  const bool pre = options_.precondition_exchange;
  scratch_.resize(n_);
  g_.resize(n_);
  for (int64_t i = 0; i < n_; ++i) {
    m_[i] = b1 * m_[i] + (1 - b1) * grads[i];
    scratch_[i] = pre ? m_[i] / (std::sqrt(v_[i]) + eps) : m_[i];
  }
  absl::Span<const float> x(scratch_);
  absl::Span<float> mean(g_);
  if (num_compressed_ > 0) {
    if (options_.compressed.codec.codec == v1::CODEC_GLOBAL_QSGD) {
      GlobalQsgdAllReduceOptions go;
      go.bits = options_.compressed.codec.bits;
      go.levels = options_.compressed.codec.levels;
      go.bucket_size = options_.compressed.codec.bucket_size;
      AQSWARM_RETURN_IF_ERROR(GlobalQsgdAllReduceMean(ex, go, s, options_.first_round, x.subspan(0, num_compressed_),
                                                      mean.subspan(0, num_compressed_), &stats_));
    } else {
      // Error buffers of another replica (or of unknown owner) are not ours
      // to feed back: start from zero buffers of our own sizes (see the header).
      const std::vector<float> me = {static_cast<float>(ex.rank()), static_cast<float>(ex.size())};
      if (error_owner_ != me) {
        worker_error_.clear();
        server_error_.clear();
        error_owner_ = me;
      }
      AQSWARM_RETURN_IF_ERROR(AllReduceMean(ex, options_.compressed, s, options_.first_round, x.subspan(0, num_compressed_),
                                            mean.subspan(0, num_compressed_), &worker_error_, &server_error_,
                                            &stats_));
    }
  }
  if (num_compressed_ < n_) {
    AQSWARM_RETURN_IF_ERROR(AllReduceMean(ex, RawOptions(options_.compressed), s, options_.first_round + 1,
                                          x.subspan(num_compressed_), mean.subspan(num_compressed_), nullptr, nullptr,
                                          &stats_));
  }
  for (int64_t i = 0; i < n_; ++i) {
    const float denom = std::sqrt(v_[i]) + eps;
    float u;
    if (pre) {
      m_[i] = g_[i] * denom;
      u = g_[i] / bc1;
    } else {
      m_[i] = g_[i];
      u = m_[i] / bc1 / denom;
    }
    apply(i, u);
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::vector<float>*>> QuantizedAdam::NamedState() {
  return {{"m", &m_},
          {"v", &v_},
          {"worker_error", &worker_error_},
          {"server_error", &server_error_},
          {"error_owner", &error_owner_}};
}

std::vector<std::pair<std::string, const std::vector<float>*>> QuantizedAdam::NamedState() const {
  return {{"m", &m_},
          {"v", &v_},
          {"worker_error", &worker_error_},
          {"server_error", &server_error_},
          {"error_owner", &error_owner_}};
}

absl::Status QuantizedAdam::LoadState(const std::vector<std::pair<std::string, std::vector<float>>>& state,
                                      int64_t step, bool frozen) {
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("optimizer state: step ", step, " is negative"));
  std::vector<std::pair<std::vector<float>*, const std::vector<float>*>> loads;
  for (auto& [name, buf] : NamedState()) {
    const std::vector<float>* found = nullptr;
    for (const auto& [k, v] : state) {
      if (k == name) found = &v;
    }
    if (found == nullptr) {
      if (name == "error_owner") {  // older states: the owner is unknown
        loads.emplace_back(buf, nullptr);
        continue;
      }
      return absl::NotFoundError(absl::StrCat("optimizer state lacks ", name));
    }
    const size_t size = found->size(), n = static_cast<size_t>(n_), nc = static_cast<size_t>(num_compressed_);
    std::string want;
    if (name == "m" || name == "v") {
      if (size != n) want = absl::StrCat(n);
    } else if (name == "worker_error") {
      if (size != 0 && size != nc) want = absl::StrCat("0 or ", nc);
    } else if (name == "server_error") {
      if (size > nc) want = absl::StrCat("at most ", nc);
    } else if (name == "error_owner") {
      if (size != 0 && (size != 2 || !((*found)[1] >= 1 && (*found)[0] >= 0 && (*found)[0] < (*found)[1] &&
                                       (*found)[1] <= 65536 && (*found)[0] == std::floor((*found)[0]) &&
                                       (*found)[1] == std::floor((*found)[1])))) {
        want = "0 or 2 ({rank, replicas} with 0 <= rank < replicas)";
      }
    }
    if (!want.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state ", name, " holds ", size, " values, expected ", want));
    }
    loads.emplace_back(buf, found);
  }
  for (auto& [buf, from] : loads) {
    if (from == nullptr) {
      buf->clear();
    } else {
      *buf = *from;
    }
  }
  // Error buffers without an owner are of unknown origin: the next
  // compressed step starts them from zero (see the header).
  step_ = step;
  frozen_ = frozen;
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
