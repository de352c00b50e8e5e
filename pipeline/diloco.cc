#include "pipeline/diloco.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/outer_schedule.h"
#include "common/status_macros.h"
#include "pipeline/layerwise_plan.h"

namespace aqswarm::pipeline {
namespace {

// Fragment bounds: contiguous groups of whole tensors of about n / F
// elements. A tensor joins the current fragment while its middle is at or
// below the fragment's target end (and always when the fragment is still
// empty); with fewer tensors than fragments the last fragments are empty.
std::vector<int64_t> FragmentBounds(int64_t n, const std::vector<int64_t>& tensor_sizes, int64_t fragments) {
  const int64_t f_count = std::max<int64_t>(fragments, 1);
  std::vector<int64_t> bounds = {0};
  size_t i = 0;
  int64_t off = 0;
  for (int64_t f = 0; f + 1 < f_count; ++f) {
    const int64_t target = n * (f + 1) / f_count;
    while (i < tensor_sizes.size() && (off == bounds.back() || off + tensor_sizes[i] / 2 <= target)) {
      off += tensor_sizes[i++];
    }
    bounds.push_back(off);
  }
  bounds.push_back(n);
  return bounds;
}

// {rank, replicas} with 0 <= rank < replicas, both integers.
bool ValidOwner(const std::vector<float>& o) {
  return o.size() == 2 && o[1] >= 1 && o[1] <= 65536 && o[0] >= 0 && o[0] < o[1] && o[0] == std::floor(o[0]) &&
         o[1] == std::floor(o[1]);
}

}  // namespace

DiLoCoOptions DiLoCoOptionsFromJob(const v1::JobSpec& job) {
  const QuantizedAdamOptions q = QuantizedAdamOptionsFromJob(job);
  DiLoCoOptions o;
  o.beta1 = q.beta1;
  o.beta2 = q.beta2;
  o.eps = q.eps;
  o.weight_decay = q.weight_decay;
  o.compressed = q.compressed;
  o.layerwise_every_steps = q.layerwise_every_steps;
  o.layerwise_min_bits = q.layerwise_min_bits;
  o.layerwise_max_bits = q.layerwise_max_bits;
  o.inner_steps = std::max<int64_t>(job.dp().inner_steps(), 1);
  o.outer_lr = job.dp().outer_lr();
  o.outer_momentum = job.dp().outer_momentum();
  o.fragments = std::max<int64_t>(job.dp().fragments(), 1);
  return o;
}

DiLoCo::DiLoCo(int64_t n, int64_t num_compressed, std::vector<uint8_t> decay, const DiLoCoOptions& options,
               std::vector<int64_t> tensor_sizes)
    : n_(n), num_compressed_(num_compressed), decay_(std::move(decay)), options_(options), m_(n, 0.0f), v_(n, 0.0f) {
  int64_t total = 0;
  for (int64_t s : tensor_sizes) total += s;
  if (total != n) tensor_sizes = {n};
  bounds_ = FragmentBounds(n, tensor_sizes, options.fragments);
  // Each fragment's compressed part [b, min(e, num_compressed)) as pieces of tensors.
  int64_t next = num_fragments();
  for (int f = 0; f < num_fragments(); ++f) {
    const int64_t b = bounds_[f], ce = std::clamp(num_compressed_, b, bounds_[f + 1]);
    std::vector<int64_t> pieces;
    int64_t off = 0;
    for (int64_t len : tensor_sizes) {
      const int64_t lo = std::max(off, b), hi = std::min(off + len, ce);
      if (hi > lo) pieces.push_back(hi - lo);
      off += len;
    }
    piece_begin_.push_back(next);
    next += static_cast<int64_t>(pieces.size());
    pieces_.push_back(std::move(pieces));
  }
}

std::vector<int> DiLoCo::FragmentBits(int f) const {
  if (layerwise_.empty()) return {};
  std::vector<int> bits;
  for (size_t i = 0; i < pieces_[f].size(); ++i) {
    const int b = static_cast<int>(layerwise_[piece_begin_[f] + i]);
    if (b == 0) return {};
    bits.push_back(b);
  }
  return bits;
}

int64_t DiLoCo::OwnedOf(int f, int rank, int size) const {
  const int64_t b = bounds_[f], ce = std::clamp(num_compressed_, b, bounds_[f + 1]);
  const int64_t bucket = options_.compressed.bucket_elements;
  const std::vector<int> bits = FragmentBits(f);
  return bits.empty() ? OwnedElements(ce - b, rank, size, bucket)
                      : LayerwiseOwnedElements(pieces_[f], bits, rank, size, bucket);
}

absl::Status DiLoCo::UpdatePlan(ReplicaExchange& ex, int f, absl::Span<const float> momentum) {
  if (options_.layerwise_every_steps <= 0 || pieces_[f].empty()) return absl::OkStatus();
  if (layerwise_.empty()) layerwise_.assign(piece_begin_.back() + pieces_.back().size(), 0.0f);
  layerwise_[f] += 1;
  if (static_cast<int64_t>(layerwise_[f]) % options_.layerwise_every_steps != 0) return absl::OkStatus();
  const LayerwisePlanOptions lo = LayerwisePlanOptionsOf(options_.compressed, options_.layerwise_min_bits,
                                                         options_.layerwise_max_bits, ex.size());
  AQSWARM_ASSIGN_OR_RETURN(LayerwisePlan plan, ChooseLayerwiseBits(momentum, pieces_[f], lo));
  std::vector<int> current = FragmentBits(f);
  if (current.empty()) current.assign(pieces_[f].size(), lo.uniform_bits);
  if (plan.bits != current) {
    // The error buffers are laid out by the plans: start them from zero.
    worker_error_.clear();
    server_error_.clear();
  }
  for (size_t i = 0; i < plan.bits.size(); ++i) layerwise_[piece_begin_[f] + i] = static_cast<float>(plan.bits[i]);
  return absl::OkStatus();
}

absl::Status DiLoCo::Step(ReplicaExchange& ex, double lr, absl::Span<float> params, absl::Span<const float> grads) {
  if (static_cast<int64_t>(params.size()) != n_ || static_cast<int64_t>(grads.size()) != n_) {
    return absl::InvalidArgumentError(absl::StrCat("DiLoCo: expected ", n_, " values, got ", params.size(),
                                                   " parameters and ", grads.size(), " gradients"));
  }
  if (anchor_.empty()) anchor_.assign(params.begin(), params.end());
  if (momentum_.empty()) momentum_.assign(n_, 0.0f);
  if (adam_step_.empty()) adam_step_ = {static_cast<float>(step_)};
  // Outer steps SkipTo passed over: params are the anchor, the
  // pseudo-gradient is zero; the mean and the new anchor are the replicas'.
  for (const auto& [f, at] : skipped_syncs_) {
    AQSWARM_RETURN_IF_ERROR(SyncFragment(ex, f, static_cast<uint64_t>(at), params));
  }
  skipped_syncs_.clear();
  const uint64_t s = static_cast<uint64_t>(step_);
  ++step_;
  // Inner AdamW on this replica's own gradient.
  adam_step_[0] += 1;
  const double t = adam_step_[0];
  const float b1 = static_cast<float>(options_.beta1), b2 = static_cast<float>(options_.beta2);
  const float eps = static_cast<float>(options_.eps), wd = static_cast<float>(lr * options_.weight_decay);
  const float flr = static_cast<float>(lr);
  const float bc1 = static_cast<float>(1 - std::pow(options_.beta1, t));
  const float bc2 = static_cast<float>(1 - std::pow(options_.beta2, t));
  for (int64_t i = 0; i < n_; ++i) {
    const float g = grads[i];
    m_[i] = b1 * m_[i] + (1 - b1) * g;
    v_[i] = b2 * v_[i] + (1 - b2) * (g * g);
    if (decay_[i] && wd > 0) params[i] *= 1 - wd;
    params[i] -= flr * (m_[i] / bc1) / (std::sqrt(v_[i] / bc2) + eps);
  }
  // Outer steps of the fragments due now (at most one when F <= H).
  const int64_t h = options_.inner_steps, frags = num_fragments();
  bool outer = false;
  for (int f = 0; f < frags; ++f) {
    if (!OuterStepDue(step_, h, frags, f) || bounds_[f] == bounds_[f + 1]) continue;
    AQSWARM_RETURN_IF_ERROR(SyncFragment(ex, f, s, params));
    outer = true;
  }
  last_step_kind_ = outer ? DpStepKind::kOuter : DpStepKind::kLocal;
  return absl::OkStatus();
}

absl::Status DiLoCo::SyncFragment(ReplicaExchange& ex, int f, uint64_t s, absl::Span<float> params) {
  const int64_t b = bounds_[f], e = bounds_[f + 1], len = e - b;
  const int64_t ce = std::clamp(num_compressed_, b, e);  // [b, ce) compressed, [ce, e) float32
  delta_.resize(len);
  mean_.resize(len);
  for (int64_t i = 0; i < len; ++i) delta_[i] = anchor_[b + i] - params[b + i];
  const absl::Span<const float> d(delta_);
  const absl::Span<float> mean(mean_);
  // The float32 part shares the min-max exchange's round trips; after
  // Global-QSGD's it has its own.
  std::vector<AllReducePart> tail;
  if (e > ce) {
    tail.push_back(
        {Float32Like(options_.compressed), options_.first_round + 1, d.subspan(ce - b), mean.subspan(ce - b)});
  }
  if (ce > b) {
    if (options_.compressed.codec.codec == v1::CODEC_GLOBAL_QSGD) {
      AQSWARM_RETURN_IF_ERROR(GlobalQsgdAllReduceMean(ex, GlobalQsgdOptionsOf(options_.compressed.codec), s,
                                                      options_.first_round, d.subspan(0, ce - b),
                                                      mean.subspan(0, ce - b), &stats_));
      AQSWARM_RETURN_IF_ERROR(AllReduceMeanParts(ex, s, tail, &stats_));
    } else {
      // The server error concatenates every fragment's owned chunks.
      int64_t se_begin = 0, se_total = 0;
      for (int g = 0; g < num_fragments(); ++g) {
        const int64_t owned = OwnedOf(g, ex.rank(), ex.size());
        if (g < f) se_begin += owned;
        se_total += owned;
      }
      // Error buffers of another replica (or of unknown owner) are not ours
      // to feed back: start from zero buffers (see the header).
      const std::vector<float> me = {static_cast<float>(ex.rank()), static_cast<float>(ex.size())};
      if (error_owner_ != me || static_cast<int64_t>(worker_error_.size()) != num_compressed_ ||
          static_cast<int64_t>(server_error_.size()) != se_total) {
        worker_error_.assign(num_compressed_, 0.0f);
        server_error_.assign(se_total, 0.0f);
        error_owner_ = me;
      }
      const int64_t se_len = OwnedOf(f, ex.rank(), ex.size());
      we_.assign(worker_error_.begin() + b, worker_error_.begin() + ce);
      se_.assign(server_error_.begin() + se_begin, server_error_.begin() + se_begin + se_len);
      const std::vector<int> bits = FragmentBits(f);
      if (bits.empty()) {
        std::vector<AllReducePart> parts = {
            {options_.compressed, options_.first_round, d.subspan(0, ce - b), mean.subspan(0, ce - b), &we_, &se_}};
        parts.insert(parts.end(), tail.begin(), tail.end());
        AQSWARM_RETURN_IF_ERROR(AllReduceMeanParts(ex, s, parts, &stats_));
      } else {
        AQSWARM_RETURN_IF_ERROR(AllReduceMeanLayerwise(ex, options_.compressed, pieces_[f], bits, s,
                                                       16 + 8 * options_.first_round, d.subspan(0, ce - b),
                                                       mean.subspan(0, ce - b), &we_, &se_, &stats_, tail));
      }
      std::copy(we_.begin(), we_.end(), worker_error_.begin() + b);
      std::copy(se_.begin(), se_.end(), server_error_.begin() + se_begin);
    }
  } else {
    AQSWARM_RETURN_IF_ERROR(AllReduceMeanParts(ex, s, tail, &stats_));
  }
  // Outer Nesterov step from the anchor; the parameters restart from it.
  const float mu = static_cast<float>(options_.outer_momentum), olr = static_cast<float>(options_.outer_lr);
  for (int64_t i = 0; i < len; ++i) {
    const int64_t j = b + i;
    momentum_[j] = mu * momentum_[j] + mean_[i];
    anchor_[j] -= olr * (mean_[i] + mu * momentum_[j]);
    params[j] = anchor_[j];
  }
  if (ce > b && options_.compressed.codec.codec == v1::CODEC_MINMAX) {
    AQSWARM_RETURN_IF_ERROR(UpdatePlan(ex, f, absl::MakeConstSpan(momentum_).subspan(b, ce - b)));
  }
  return absl::OkStatus();
}

absl::Status DiLoCo::RestartFromAnchor(absl::Span<float> params) {
  if (static_cast<int64_t>(params.size()) != n_) {
    return absl::InvalidArgumentError(absl::StrCat("DiLoCo: expected ", n_, " parameters, got ", params.size()));
  }
  if (anchor_.empty()) return absl::OkStatus();
  std::copy(anchor_.begin(), anchor_.end(), params.begin());
  std::fill(m_.begin(), m_.end(), 0.0f);
  std::fill(v_.begin(), v_.end(), 0.0f);
  adam_step_ = {0.0f};
  return absl::OkStatus();
}

absl::Status DiLoCo::SkipTo(int64_t step) {
  if (step < step_) {
    return absl::InvalidArgumentError(absl::StrCat("DiLoCo: cannot skip back from step ", step_, " to ", step));
  }
  // The outer steps skipped over are still the replicas' to take: this
  // replica joins them, contributing nothing, at the next Step.
  const int64_t h = options_.inner_steps, frags = num_fragments();
  for (int64_t t = step_ + 1; t <= step; ++t) {
    for (int f = 0; f < frags; ++f) {
      if (OuterStepDue(t, h, frags, f) && bounds_[f] != bounds_[f + 1]) skipped_syncs_.push_back({f, t - 1});
    }
  }
  step_ = step;
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::vector<float>*>> DiLoCo::NamedState() {
  return {{"m", &m_},
          {"v", &v_},
          {"anchor", &anchor_},
          {"outer_momentum", &momentum_},
          {"worker_error", &worker_error_},
          {"server_error", &server_error_},
          {"error_owner", &error_owner_},
          {"adam_step", &adam_step_},
          {"layerwise", &layerwise_}};
}

std::vector<std::pair<std::string, const std::vector<float>*>> DiLoCo::NamedState() const {
  std::vector<std::pair<std::string, const std::vector<float>*>> out;
  for (const auto& [name, buf] : const_cast<DiLoCo*>(this)->NamedState()) out.emplace_back(name, buf);  // read only
  return out;
}

absl::Status DiLoCo::LoadState(const DpState& state, const DpStateMeta& meta) {
  const int64_t step = meta.step;
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("DiLoCo state: step ", step, " is negative"));
  std::vector<std::pair<std::vector<float>*, const std::vector<float>*>> loads;
  for (auto& [name, buf] : NamedState()) {
    const std::vector<float>* found = nullptr;
    for (const auto& [k, v] : state) {
      if (k == name) found = &v;
    }
    const bool optional = name == "error_owner" || name == "adam_step" || name == "layerwise";
    if (found == nullptr && !optional) return absl::NotFoundError(absl::StrCat("DiLoCo state lacks ", name));
    const size_t size = found == nullptr ? 0 : found->size();
    const size_t n = static_cast<size_t>(n_), nc = static_cast<size_t>(num_compressed_);
    std::string want;
    if (name == "m" || name == "v") {
      if (size != n) want = absl::StrCat(n);
    } else if (name == "anchor" || name == "outer_momentum") {
      if (size != 0 && size != n) want = absl::StrCat("0 or ", n);
    } else if (name == "worker_error") {
      if (size != 0 && size != nc) want = absl::StrCat("0 or ", nc);
    } else if (name == "server_error") {
      if (size > nc) want = absl::StrCat("at most ", nc);
    } else if (name == "error_owner") {
      if (size != 0 && !ValidOwner(*found)) want = "0 or 2 ({rank, replicas} with 0 <= rank < replicas)";
    } else if (name == "adam_step") {
      if (found != nullptr &&
          (size != 1 || !((*found)[0] >= 0 && (*found)[0] <= step && (*found)[0] == std::floor((*found)[0])))) {
        want = absl::StrCat("1 (a whole number of steps in [0, ", step, "])");
      }
    } else if (name == "layerwise" && size != 0) {
      const size_t want_size = piece_begin_.back() + pieces_.back().size();
      bool ok = size == want_size;
      for (int f = 0; ok && f < num_fragments(); ++f) {
        const float c = (*found)[f];
        ok = c >= 0 && c < (1 << 24) && c == std::floor(c);
        const size_t p0 = piece_begin_[f], p1 = p0 + pieces_[f].size();
        const bool planned = p1 > p0 && (*found)[p0] != 0;
        for (size_t i = p0; ok && i < p1; ++i) {
          const float w = (*found)[i];
          ok = w == std::floor(w) && (planned ? w >= 1 && w <= 8 : w == 0);
        }
      }
      if (!ok) {
        want = absl::StrCat("0 or ", want_size, " (an exchange count per fragment, then its tensors' widths: all 0 or "
                            "all in [1, 8])");
      }
    }
    if (!want.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("DiLoCo state ", name, " holds ", size,
                                                     size == 1 ? " value" : " values", ", expected ", want));
    }
    loads.emplace_back(buf, found);
  }
  for (auto& [buf, from] : loads) {
    if (from == nullptr) {
      buf->clear();  // error_owner: unknown; adam_step: the step (see Step)
    } else {
      *buf = *from;
    }
  }
  step_ = step;
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
