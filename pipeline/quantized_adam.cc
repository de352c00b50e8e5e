#include "pipeline/quantized_adam.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "pipeline/layerwise_plan.h"

namespace aqswarm::pipeline {
namespace {

float Square(float x) { return x * x; }

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
  o.warmup_steps = std::max<int64_t>(job.dp().warmup_steps(), kMinQuantizedAdamWarmup);
  o.warmup_bits = static_cast<int>(job.dp().warmup_bits());
  o.compressed.codec.codec =
      job.dp().codec() == v1::DataParallelSpec::global_qsgd ? v1::CODEC_GLOBAL_QSGD : v1::CODEC_MINMAX;
  o.compressed.codec.levels = v1::LEVELS_EXPONENTIAL;  // Global-QSGD only (the paper's choice for Adam)
  o.compressed.codec.bits = static_cast<int>(job.dp().bits());
  o.compressed.codec.bucket_size = job.dp().bucket_size();
  o.compressed.codec.entropy = job.dp().entropy_coding();
  o.raise_variance_at_bound = job.dp().frozen_variance() != v1::DataParallelSpec::fixed;
  o.variance_refresh_steps = job.dp().variance_refresh_steps();
  o.refresh_growth = job.dp().refresh_growth();
  o.max_local_steps = job.dp().max_local_steps();
  o.local_step_growth = job.dp().local_step_growth();
  o.layerwise_every_steps = job.dp().layerwise_every_steps();
  if (o.layerwise_every_steps > 0) {
    o.layerwise_min_bits = static_cast<int>(job.dp().layerwise_min_bits());
    o.layerwise_max_bits = static_cast<int>(job.dp().layerwise_max_bits());
  }
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

int64_t VarianceRefreshInterval(int64_t k, int64_t refresh_steps, int64_t growth) {
  if (refresh_steps <= 0 || k <= 0) return 0;
  if (growth <= 0) return k % refresh_steps == 0 ? refresh_steps : 0;
  // Phase p: `growth` intervals of refresh_steps * 2^p, from `start`.
  int64_t start = 0, interval = refresh_steps;
  while (k > start + growth * interval) {
    start += growth * interval;
    interval *= 2;
  }
  return (k - start) % interval == 0 ? interval : 0;
}

bool LocalStepsSyncAt(int64_t k, int64_t max_local_steps, int64_t growth) {
  if (max_local_steps <= 1) return true;
  if (growth <= 0) return k % max_local_steps == 0;
  int64_t start = 0, interval = 1;
  while (interval < max_local_steps) {
    if (k <= start + growth * interval) return (k - start) % interval == 0;
    start += growth * interval;
    interval = std::min(max_local_steps, interval * 2);
  }
  return (k - start) % interval == 0;
}

QuantizedAdam::QuantizedAdam(int64_t n, int64_t num_compressed, std::vector<uint8_t> decay,
                             const QuantizedAdamOptions& options, std::vector<int64_t> tensor_sizes)
    : n_(n),
      num_compressed_(num_compressed),
      decay_(std::move(decay)),
      tensor_sizes_(tensor_sizes.empty() ? std::vector<int64_t>{n} : std::move(tensor_sizes)),
      options_(options),
      m_(n, 0.0f),
      v_(n, 0.0f) {
  int64_t off = 0;
  for (int64_t len : tensor_sizes_) {
    if (off >= num_compressed_) break;
    compressed_sizes_.push_back(std::min(len, num_compressed_ - off));
    off += len;
  }
}

int64_t QuantizedAdam::WarmupSteps() const {
  return options_.quantized ? std::max<int64_t>(options_.warmup_steps, 1) : 0;
}

std::vector<int> QuantizedAdam::layerwise_bits() const {
  if (layerwise_.size() < 2) return {};
  return std::vector<int>(layerwise_.begin() + 1, layerwise_.end());
}

absl::Status QuantizedAdam::Step(ReplicaExchange& ex, double lr, absl::Span<float> params,
                                 absl::Span<const float> grads) {
  if (static_cast<int64_t>(params.size()) != n_ || static_cast<int64_t>(grads.size()) != n_) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizedAdam: expected ", n_, " values"));
  }
  const float b1 = static_cast<float>(options_.beta1), b2 = static_cast<float>(options_.beta2);
  const float eps = static_cast<float>(options_.eps), wd = static_cast<float>(lr * options_.weight_decay);
  const float flr = static_cast<float>(lr);
  // A compressed step needs a frozen variance: a step at or after the warm-up
  // with none yet (warm-up 0, or a state saved unfrozen) is a warm-up step
  // that freezes it.
  const int64_t warmup = WarmupSteps();
  const bool compressed = options_.quantized && step_ >= warmup && frozen_;
  // Post-freeze step k (1-based) and what it is: refresh, local step, or a
  // compressed exchange (a sync when local steps are pending). The step
  // before a refresh always syncs, so a refresh finds the replicas identical.
  const int64_t k = step_ + 1 - warmup;
  const int64_t R = options_.variance_refresh_steps, G = options_.refresh_growth;
  const int64_t refresh_interval = compressed ? VarianceRefreshInterval(k, R, G) : 0;
  const bool local = compressed && refresh_interval == 0 && options_.max_local_steps > 1 &&
                     !LocalStepsSyncAt(k, options_.max_local_steps, options_.local_step_growth) &&
                     VarianceRefreshInterval(k + 1, R, G) == 0;
  if (refresh_interval > 0 && !local_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("QuantizedAdam: local steps pending at the refresh of step ",
                                                      step_ + 1, " (the state's schedule is not this job's)"));
  }
  const uint64_t s = static_cast<uint64_t>(step_);
  ++step_;
  if (!compressed) {
    last_step_kind_ = options_.quantized ? DpStepKind::kWarmup : DpStepKind::kAdamW;
    AQSWARM_RETURN_IF_ERROR(GradientMean(ex, s, grads));
    const float bc1 = static_cast<float>(1 - std::pow(options_.beta1, static_cast<double>(step_)));
    const float bc2 = static_cast<float>(1 - std::pow(options_.beta2, static_cast<double>(step_)));
    for (int64_t i = 0; i < n_; ++i) {
      const float g = g_[i];
      m_[i] = b1 * m_[i] + (1 - b1) * g;
      v_[i] = b2 * v_[i] + (1 - b2) * (g * g);
      if (decay_[i] && wd > 0) params[i] *= 1 - wd;
      params[i] -= flr * (m_[i] / bc1) / (std::sqrt(v_[i] / bc2) + eps);
    }
    if (options_.quantized && step_ >= warmup && !frozen_) {
      // Freeze the bias-corrected variance, floored per tensor (see header).
      for (float& x : v_) x /= bc2;
      FloorVariance(tensor_sizes_, v_);
      frozen_ = true;
    }
    return absl::OkStatus();
  }
  const float bc1 =
      options_.bias_correct_frozen ? static_cast<float>(1 - std::pow(options_.beta1, static_cast<double>(step_))) : 1;
  const float clip = static_cast<float>(
      options_.update_clip < 0 ? AdamUpdateBound(options_.beta1, options_.beta2, step_) : options_.update_clip);
  const bool raise = options_.raise_variance_at_bound && clip > 0;
  // Coordinate i moves by u lr, bounded by `clip`. Where the bound binds, v
  // rises so that this step is exactly the bound and later ones decay with m,
  // as Adam's would: v is a function of the exchanged m only, the same on
  // every replica (so never at a local step, whose m is the replica's own).
  auto bound = [&](int64_t i, float u, bool may_raise) {
    if (clip > 0 && std::fabs(u) > clip) {
      if (raise && may_raise) v_[i] = Square(std::fabs(m_[i]) / bc1 / clip);
      u = std::copysign(clip, u);
    }
    return u;
  };
  auto apply = [&](int64_t i, float u, bool may_raise) {
    u = bound(i, u, may_raise);
    if (decay_[i] && wd > 0) params[i] *= 1 - wd;
    params[i] -= flr * u;
  };
  const bool pre = options_.precondition_exchange;
  if (refresh_interval > 0) {
    // Variance refresh: the mean gradient, exchanged as in the warm-up; v
    // takes it with the weight of the `refresh_interval` steps since the last one.
    last_step_kind_ = DpStepKind::kRefresh;
    AQSWARM_RETURN_IF_ERROR(GradientMean(ex, s, grads));
    const double t = static_cast<double>(step_);
    const double keep = std::pow(options_.beta2, static_cast<double>(refresh_interval));
    const double bc2_now = 1 - std::pow(options_.beta2, t);
    const double bc2_then = 1 - std::pow(options_.beta2, std::max(0.0, t - static_cast<double>(refresh_interval)));
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
    for (int64_t i = 0; i < n_; ++i) apply(i, m_[i] / bc1 / (std::sqrt(v_[i]) + eps), true);
    return absl::OkStatus();
  }
  if (local) {
    // A local step: this replica's own momentum and a step from the anchor's
    // trajectory, no traffic; lr x is summed for the next sync.
    last_step_kind_ = DpStepKind::kLocal;
    if (local_.empty()) {
      anchor_.assign(params.begin(), params.end());
      local_update_.assign(n_, 0.0f);
      local_ = {0.0f, 1.0f};
    }
    for (int64_t i = 0; i < n_; ++i) {
      const float denom = std::sqrt(v_[i]) + eps;
      m_[i] = b1 * m_[i] + (1 - b1) * grads[i];
      const float x = pre ? m_[i] / denom : m_[i];
      local_update_[i] += flr * x;
      apply(i, pre ? x / bc1 : m_[i] / bc1 / denom, false);
    }
    local_[0] += flr;
    local_[1] *= 1 - wd;
    return absl::OkStatus();
  }
  // x = m (or the preconditioned momentum m / (sqrt(v_frozen) + eps), see the
  // header) is what travels; the means come back in g_. At a sync after local
  // steps, the lr-weighted mean of x over the interval travels instead.
  last_step_kind_ = DpStepKind::kCompressed;
  const bool sync = !local_.empty();
  const float lr_sum = sync ? local_[0] + flr : flr;
  scratch_.resize(n_);
  g_.resize(n_);
  for (int64_t i = 0; i < n_; ++i) {
    m_[i] = b1 * m_[i] + (1 - b1) * grads[i];
    scratch_[i] = pre ? m_[i] / (std::sqrt(v_[i]) + eps) : m_[i];
    if (sync) {
      local_update_[i] += flr * scratch_[i];
      if (lr_sum > 0) scratch_[i] = local_update_[i] / lr_sum;  // lr 0 throughout (min_lr 0): x itself
    }
  }
  absl::Span<const float> x(scratch_);
  absl::Span<float> mean(g_);
  // The float32 part (tiny tensors) shares the min-max exchange's round
  // trips; after Global-QSGD's it has its own.
  std::vector<AllReducePart> tail;
  if (num_compressed_ < n_) {
    tail.push_back({Float32Like(options_.compressed), options_.first_round + 1, x.subspan(num_compressed_),
                    mean.subspan(num_compressed_)});
  }
  if (num_compressed_ == 0) {
    AQSWARM_RETURN_IF_ERROR(AllReduceMeanParts(ex, s, tail, &stats_));
  } else if (options_.compressed.codec.codec == v1::CODEC_GLOBAL_QSGD) {
    AQSWARM_RETURN_IF_ERROR(GlobalQsgdAllReduceMean(ex, GlobalQsgdOptionsOf(options_.compressed.codec), s,
                                                    options_.first_round, x.subspan(0, num_compressed_),
                                                    mean.subspan(0, num_compressed_), &stats_));
    AQSWARM_RETURN_IF_ERROR(AllReduceMeanParts(ex, s, tail, &stats_));
  } else {
    // Error buffers of another replica (or of unknown owner) are not ours
    // to feed back: start from zero buffers of our own sizes (see the header).
    const std::vector<float> me = {static_cast<float>(ex.rank()), static_cast<float>(ex.size())};
    if (error_owner_ != me) {
      worker_error_.clear();
      server_error_.clear();
      error_owner_ = me;
    }
    AQSWARM_RETURN_IF_ERROR(
        CompressedExchange(ex, s, x.subspan(0, num_compressed_), mean.subspan(0, num_compressed_), tail));
  }
  // No residue outweighs the largest step: |x / bc1| <= clip is all a step
  // can apply, so error feedback keeps at most bc1 clip per coordinate (a
  // residue past it, e.g. of a coordinate whose x is far past the bound,
  // would otherwise arrive whole at a later step).
  if (clip > 0) {
    const float cap = bc1 * clip;
    for (std::vector<float>* e : {&worker_error_, &server_error_}) {
      for (float& r : *e) r = std::clamp(r, -cap, cap);
    }
  }
  // After local steps every replica restarts from the anchor: decayed as the
  // local steps and this one decayed, minus lr_sum times the mean's step.
  const float decayed = sync ? local_[1] * (1 - wd) : 1;
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
    if (sync) {
      params[i] = (decay_[i] ? anchor_[i] * decayed : anchor_[i]) - lr_sum * bound(i, u, true);
    } else {
      apply(i, u, true);
    }
  }
  if (sync) {
    local_.clear();
    anchor_.clear();
    local_update_.clear();
  }
  return absl::OkStatus();
}

absl::Status QuantizedAdam::GradientMean(ReplicaExchange& ex, uint64_t step, absl::Span<const float> grads) {
  g_.resize(n_);
  const absl::Span<float> mean(g_);
  const AllReduceOptions raw = Float32Like(options_.compressed);
  // Not quantized (the AdamW baseline): float32 whatever warmup_bits says.
  if (options_.warmup_bits == 0 || !options_.quantized || num_compressed_ == 0) {
    return AllReduceMean(ex, raw, step, options_.first_round, grads, mean, nullptr, nullptr, &stats_);
  }
  AllReduceOptions q = options_.compressed;  // its buckets, robust mode and smallest compressed size
  q.codec.codec = v1::CODEC_MINMAX;
  q.codec.bits = options_.warmup_bits;
  q.codec.rounding = v1::ROUNDING_STOCHASTIC;
  // The float32 part shares the codes' round trips.
  std::vector<AllReducePart> parts = {
      {q, options_.first_round, grads.subspan(0, num_compressed_), mean.subspan(0, num_compressed_)}};
  if (num_compressed_ < n_) {
    parts.push_back({raw, options_.first_round + 1, grads.subspan(num_compressed_), mean.subspan(num_compressed_)});
  }
  return AllReduceMeanParts(ex, step, parts, &stats_);
}

absl::Status QuantizedAdam::CompressedExchange(ReplicaExchange& ex, uint64_t step, absl::Span<const float> x,
                                               absl::Span<float> mean, absl::Span<const AllReducePart> also) {
  const bool layerwise = options_.layerwise_every_steps > 0;
  const std::vector<int> bits = layerwise_bits();
  const int64_t exchanges = layerwise ? (layerwise_.empty() ? 0 : static_cast<int64_t>(layerwise_[0])) + 1 : 0;
  const bool replan = layerwise && exchanges % options_.layerwise_every_steps == 0;
  const LayerwisePlanOptions lo = LayerwisePlanOptionsOf(options_.compressed, options_.layerwise_min_bits,
                                                         options_.layerwise_max_bits, ex.size());
  // A re-plan measures each width's error on this replica's own momentum x
  // (not on the exchanged mean: it lies on the exchange's min-max grid, where
  // the current width measures no error), and the replicas average their
  // measurements in a float32 round of this exchange: every replica then
  // chooses from the same numbers, the same plan.
  LayerwiseMeasurements measured, measured_mean;
  std::vector<AllReducePart> parts(also.begin(), also.end());
  if (replan) {
    AQSWARM_ASSIGN_OR_RETURN(measured, MeasureLayerwise(x, compressed_sizes_, lo));
    measured_mean.resize(measured.size());
    parts.push_back({Float32Like(options_.compressed), LayerwiseMeasureRound(options_.first_round),
                     absl::MakeConstSpan(measured), absl::MakeSpan(measured_mean)});
  }
  if (bits.empty()) {
    parts.insert(parts.begin(),
                 AllReducePart{options_.compressed, options_.first_round, x, mean, &worker_error_, &server_error_});
    AQSWARM_RETURN_IF_ERROR(AllReduceMeanParts(ex, step, parts, &stats_));
  } else {
    AQSWARM_RETURN_IF_ERROR(AllReduceMeanLayerwise(ex, options_.compressed, compressed_sizes_, bits, step,
                                                   16 + 8 * options_.first_round, x, mean, &worker_error_,
                                                   &server_error_, &stats_, parts));
  }
  if (!layerwise) return absl::OkStatus();
  layerwise_.resize(std::max<size_t>(layerwise_.size(), 1));
  layerwise_[0] = static_cast<float>(exchanges);
  if (!replan) return absl::OkStatus();
  absl::StatusOr<LayerwisePlan> planned = ChooseLayerwiseBitsFrom(measured_mean, compressed_sizes_, lo);
  // A mean no plan can come from (a replica that sent negative or
  // overflowing measurements) keeps the current widths: every replica got
  // the same mean, so every replica keeps them, and the step goes on.
  if (absl::IsInvalidArgument(planned.status())) return absl::OkStatus();
  AQSWARM_ASSIGN_OR_RETURN(LayerwisePlan plan, std::move(planned));
  const std::vector<int> current = bits.empty() ? std::vector<int>(compressed_sizes_.size(), lo.uniform_bits) : bits;
  if (plan.bits != current) {
    // The error buffers are laid out (and their residues sized) by the old
    // plan's groups: start them from zero, as a refresh does.
    worker_error_.clear();
    server_error_.clear();
  }
  layerwise_.resize(1);
  layerwise_.insert(layerwise_.end(), plan.bits.begin(), plan.bits.end());
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::vector<float>*>> QuantizedAdam::AllState() {
  return {{"m", &m_},
          {"v", &v_},
          {"worker_error", &worker_error_},
          {"server_error", &server_error_},
          {"error_owner", &error_owner_},
          {"local", &local_},
          {"anchor", &anchor_},
          {"local_update", &local_update_},
          {"layerwise", &layerwise_}};
}

std::vector<std::pair<std::string, std::vector<float>*>> QuantizedAdam::NamedState() {
  std::vector<std::pair<std::string, std::vector<float>*>> all = AllState();
  // "m" .. "error_owner" always; the rest only when they hold something (see the header).
  all.erase(std::remove_if(all.begin() + 5, all.end(), [](const auto& e) { return e.second->empty(); }), all.end());
  return all;
}

std::vector<std::pair<std::string, const std::vector<float>*>> QuantizedAdam::NamedState() const {
  std::vector<std::pair<std::string, const std::vector<float>*>> out;
  // The same list; const_cast only to share it (nothing is written through it).
  for (const auto& [name, buf] : const_cast<QuantizedAdam*>(this)->NamedState()) out.emplace_back(name, buf);
  return out;
}

absl::Status QuantizedAdam::LoadState(const DpState& state, const DpStateMeta& meta) {
  const int64_t step = meta.step;
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("optimizer state: step ", step, " is negative"));
  std::vector<std::pair<std::vector<float>*, const std::vector<float>*>> loads;
  for (auto& [name, buf] : AllState()) {
    const std::vector<float>* found = nullptr;
    for (const auto& [k, v] : state) {
      if (k == name) found = &v;
    }
    if (found == nullptr) {
      if (name == "error_owner" || name == "local" || name == "anchor" || name == "local_update" ||
          name == "layerwise") {  // older states: the owner is unknown, nothing pending
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
    } else if (name == "anchor" || name == "local_update") {
      if (size != 0 && size != n) want = absl::StrCat("0 or ", n);
    } else if (name == "local") {
      if (size != 0 && (size != 2 || !((*found)[0] >= 0 && std::isfinite((*found)[0]) && (*found)[1] > 0 &&
                                       (*found)[1] <= 1))) {
        want = "0 or 2 ({sum of lr >= 0, decay product in (0, 1]})";
      }
    } else if (name == "layerwise") {
      const size_t tensors = compressed_sizes_.size();
      bool ok = size == 0 || ((size == 1 || size == 1 + tensors) && (*found)[0] >= 0 && (*found)[0] < (1 << 24) &&
                              (*found)[0] == std::floor((*found)[0]));
      for (size_t i = 1; ok && i < size; ++i) {
        ok = (*found)[i] >= 1 && (*found)[i] <= 8 && (*found)[i] == std::floor((*found)[i]);
      }
      if (!ok) want = absl::StrCat("0, 1 or ", 1 + tensors, " ({exchanges, a width in [1, 8] per compressed tensor})");
    }
    if (!want.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state ", name, " holds ", size, " values, expected ", want));
    }
    loads.emplace_back(buf, found);
  }
  // Pending local steps need their anchor and summed update.
  const auto loaded_size = [&](std::vector<float>* buf) {
    for (const auto& [b, from] : loads) {
      if (b == buf) return from == nullptr ? size_t{0} : from->size();
    }
    return size_t{0};
  };
  const size_t pending = loaded_size(&local_) > 0 ? static_cast<size_t>(n_) : 0;
  for (auto* buf : {&anchor_, &local_update_}) {
    if (loaded_size(buf) != pending) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state ", buf == &anchor_ ? "anchor" : "local_update",
                                                     " holds ", loaded_size(buf), " values, expected ", pending,
                                                     " (", pending > 0 ? "local steps pending" : "none pending", ")"));
    }
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
  frozen_ = meta.frozen;
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
