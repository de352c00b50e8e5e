#include "pipeline/layerwise_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "compression/layerwise.h"

namespace aqswarm::pipeline {
namespace {

constexpr int kMaxBits = 8;

absl::Status CheckSizes(absl::Span<const int64_t> tensor_sizes, size_t n, const char* what) {
  int64_t sum = 0;
  for (int64_t s : tensor_sizes) {
    if (s <= 0) return absl::InvalidArgumentError(absl::StrCat(what, ": tensor size ", s, " is not positive"));
    sum += s;
  }
  if (sum != static_cast<int64_t>(n)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": tensor sizes add up to ", sum, ", the vector holds ", n));
  }
  return absl::OkStatus();
}

// Element ranges [begin, end) of the tensors whose width is `b`, in order.
std::vector<std::pair<int64_t, int64_t>> GroupRanges(absl::Span<const int64_t> tensor_sizes,
                                                     absl::Span<const int> bits, int b) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t off = 0;
  for (size_t t = 0; t < tensor_sizes.size(); ++t) {
    if (bits[t] == b) ranges.emplace_back(off, off + tensor_sizes[t]);
    off += tensor_sizes[t];
  }
  return ranges;
}

int64_t Length(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  int64_t n = 0;
  for (const auto& [a, b] : ranges) n += b - a;
  return n;
}

void Gather(absl::Span<const float> from, const std::vector<std::pair<int64_t, int64_t>>& ranges,
            std::vector<float>& to) {
  to.clear();
  for (const auto& [a, b] : ranges) to.insert(to.end(), from.begin() + a, from.begin() + b);
}

void Scatter(const std::vector<float>& from, const std::vector<std::pair<int64_t, int64_t>>& ranges,
             absl::Span<float> to) {
  int64_t k = 0;
  for (const auto& [a, b] : ranges) {
    std::copy(from.begin() + k, from.begin() + k + (b - a), to.begin() + a);
    k += b - a;
  }
}

}  // namespace

namespace {

absl::Status CheckWidths(const LayerwisePlanOptions& options) {
  if (options.min_bits < 1 || options.max_bits > kMaxBits || options.min_bits > options.max_bits ||
      options.uniform_bits < options.min_bits || options.uniform_bits > options.max_bits) {
    return absl::InvalidArgumentError(absl::StrCat("ChooseLayerwiseBits: widths [", options.min_bits, ", ",
                                                   options.max_bits, "] with uniform ", options.uniform_bits,
                                                   " are not a range in [1, 8] holding the uniform width"));
  }
  if (options.replicas < 1) return absl::InvalidArgumentError("ChooseLayerwiseBits: replicas < 1");
  return absl::OkStatus();
}

}  // namespace

LayerwisePlanOptions LayerwisePlanOptionsOf(const AllReduceOptions& exchange, int min_bits, int max_bits,
                                            int replicas) {
  LayerwisePlanOptions lo;
  lo.codec = exchange.codec;
  lo.min_bits = min_bits;
  lo.max_bits = max_bits;
  lo.uniform_bits = exchange.codec.bits;
  lo.replicas = replicas;
  return lo;
}

absl::StatusOr<LayerwiseMeasurements> MeasureLayerwise(absl::Span<const float> data,
                                                       absl::Span<const int64_t> tensor_sizes,
                                                       const LayerwisePlanOptions& options) {
  AQSWARM_RETURN_IF_ERROR(CheckSizes(tensor_sizes, data.size(), "ChooseLayerwiseBits"));
  AQSWARM_RETURN_IF_ERROR(CheckWidths(options));
  const int widths = options.max_bits - options.min_bits + 1;
  LayerwiseMeasurements m(tensor_sizes.size() * widths * 2);
  std::vector<float> decoded;
  int64_t off = 0;
  for (size_t t = 0; t < tensor_sizes.size(); ++t) {
    const absl::Span<const float> x = data.subspan(off, tensor_sizes[t]);
    decoded.resize(x.size());
    for (int b = options.min_bits; b <= options.max_bits; ++b) {
      compression::CodecOptions c = options.codec;
      c.codec = v1::CODEC_MINMAX;
      c.bits = b;
      v1::EncodedTensor msg;
      const int64_t shape[] = {static_cast<int64_t>(x.size())};
      AQSWARM_RETURN_IF_ERROR(compression::Encode(c, x, shape, /*rng_key=*/0, &msg));
      AQSWARM_RETURN_IF_ERROR(compression::Decode(msg, absl::MakeSpan(decoded)));
      double err = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const double d = static_cast<double>(x[i]) - decoded[i];
        err += d * d;
      }
      const size_t at = 2 * (t * widths + (b - options.min_bits));
      m[at] = static_cast<float>(compression::EncodedBytes(msg));
      m[at + 1] = static_cast<float>(std::min(err, static_cast<double>(std::numeric_limits<float>::max())));
    }
    off += tensor_sizes[t];
  }
  return m;
}

absl::StatusOr<LayerwisePlan> ChooseLayerwiseBitsFrom(absl::Span<const float> measurements,
                                                      absl::Span<const int64_t> tensor_sizes,
                                                      const LayerwisePlanOptions& options) {
  AQSWARM_RETURN_IF_ERROR(CheckWidths(options));
  const size_t widths = static_cast<size_t>(options.max_bits - options.min_bits + 1);
  if (measurements.size() != tensor_sizes.size() * widths * 2) {
    return absl::InvalidArgumentError(absl::StrCat("ChooseLayerwiseBits: ", measurements.size(),
                                                   " measurements for ", tensor_sizes.size(), " tensors x ", widths,
                                                   " widths (expected ", tensor_sizes.size() * widths * 2, ")"));
  }
  std::vector<std::vector<compression::LayerOption>> layers(tensor_sizes.size());
  for (size_t t = 0; t < tensor_sizes.size(); ++t) {
    for (size_t w = 0; w < widths; ++w) {
      const float bytes = measurements[2 * (t * widths + w)], err = measurements[2 * (t * widths + w) + 1];
      if (!(bytes >= 0) || !(err >= 0) || !std::isfinite(bytes) || !std::isfinite(err)) {
        return absl::InvalidArgumentError(absl::StrCat("ChooseLayerwiseBits: tensor ", t, " width ",
                                                       options.min_bits + static_cast<int>(w), " measured bytes ",
                                                       bytes, " error ", err, " (not finite and >= 0)"));
      }
      layers[t].push_back({bytes, err});
    }
  }
  const std::vector<int> uniform(tensor_sizes.size(), options.uniform_bits - options.min_bits);
  AQSWARM_ASSIGN_OR_RETURN(compression::Allocation a,
                           compression::AllocateAgainstUniform(layers, uniform, options.error_bins));
  LayerwisePlan plan;
  for (int c : a.choice) plan.bits.push_back(options.min_bits + c);
  // A width group too small to be compressed per chunk joins the next wider
  // group present (more bits: no more error than measured).
  const int64_t smallest = options.codec.min_compress_elements * options.replicas;
  for (int b = options.min_bits; b < options.max_bits; ++b) {
    const int64_t len = Length(GroupRanges(tensor_sizes, plan.bits, b));
    if (len == 0 || len >= smallest) continue;
    int wider = b + 1;
    while (wider <= options.max_bits && Length(GroupRanges(tensor_sizes, plan.bits, wider)) == 0) ++wider;
    if (wider > options.max_bits) break;
    for (int& x : plan.bits) {
      if (x == b) x = wider;
    }
  }
  for (size_t t = 0; t < layers.size(); ++t) {
    const auto& chosen = layers[t][plan.bits[t] - options.min_bits];
    const auto& uni = layers[t][uniform[t]];
    plan.cost_bytes += chosen.cost_bytes;
    plan.error += chosen.error;
    plan.uniform_cost_bytes += uni.cost_bytes;
    plan.uniform_error += uni.error;
  }
  return plan;
}

absl::StatusOr<LayerwisePlan> ChooseLayerwiseBits(absl::Span<const float> data,
                                                  absl::Span<const int64_t> tensor_sizes,
                                                  const LayerwisePlanOptions& options) {
  AQSWARM_ASSIGN_OR_RETURN(const LayerwiseMeasurements m, MeasureLayerwise(data, tensor_sizes, options));
  return ChooseLayerwiseBitsFrom(m, tensor_sizes, options);
}

int64_t LayerwiseOwnedElements(absl::Span<const int64_t> tensor_sizes, absl::Span<const int> bits, int rank, int size,
                               int64_t bucket_elements) {
  int64_t owned = 0;
  for (int b = 1; b <= kMaxBits; ++b) {
    const int64_t len = Length(GroupRanges(tensor_sizes, bits, b));
    if (len > 0) owned += OwnedElements(len, rank, size, bucket_elements);
  }
  return owned;
}

absl::Status AllReduceMeanLayerwise(ReplicaExchange& ex, const AllReduceOptions& options,
                                    absl::Span<const int64_t> tensor_sizes, absl::Span<const int> bits, uint64_t step,
                                    uint32_t first_round, absl::Span<const float> in, absl::Span<float> out,
                                    std::vector<float>* worker_error, std::vector<float>* server_error,
                                    AllReduceStats* stats, absl::Span<const AllReducePart> also) {
  const int64_t n = static_cast<int64_t>(in.size());
  if (static_cast<int64_t>(out.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("AllReduceMeanLayerwise: in holds ", n, " values, out ",
                                                   out.size()));
  }
  AQSWARM_RETURN_IF_ERROR(CheckSizes(tensor_sizes, in.size(), "AllReduceMeanLayerwise"));
  if (bits.size() != tensor_sizes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("AllReduceMeanLayerwise: ", bits.size(), " bit widths for ",
                                                   tensor_sizes.size(), " tensors"));
  }
  for (int b : bits) {
    if (b < 1 || b > kMaxBits) {
      return absl::InvalidArgumentError(absl::StrCat("AllReduceMeanLayerwise: bit width ", b, " is not in [1, 8]"));
    }
  }
  if (options.codec.codec != v1::CODEC_MINMAX) {
    return absl::InvalidArgumentError("AllReduceMeanLayerwise: per-tensor widths are min-max's (options.codec)");
  }
  const int64_t owned = LayerwiseOwnedElements(tensor_sizes, bits, ex.rank(), ex.size(), options.bucket_elements);
  if (worker_error != nullptr && worker_error->empty()) worker_error->assign(n, 0.0f);
  if (server_error != nullptr && server_error->empty()) server_error->assign(owned, 0.0f);
  if (worker_error != nullptr && static_cast<int64_t>(worker_error->size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("AllReduceMeanLayerwise: worker error holds ",
                                                   worker_error->size(), " values, expected ", n));
  }
  if (server_error != nullptr && static_cast<int64_t>(server_error->size()) != owned) {
    return absl::InvalidArgumentError(absl::StrCat("AllReduceMeanLayerwise: server error holds ",
                                                   server_error->size(), " values, expected ", owned));
  }
  // One part per width, all in the same round trips (AllReduceMeanParts).
  struct Group {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    std::vector<float> x, mean, ew, es;
    int64_t server_off = 0;
  };
  std::vector<Group> groups;
  std::vector<AllReducePart> parts;
  groups.reserve(kMaxBits);
  int64_t server_off = 0;
  for (int b = 1; b <= kMaxBits; ++b) {
    auto ranges = GroupRanges(tensor_sizes, bits, b);
    const int64_t len = Length(ranges);
    if (len == 0) continue;
    Group& g = groups.emplace_back();
    g.ranges = std::move(ranges);
    Gather(in, g.ranges, g.x);
    g.mean.resize(len);
    if (worker_error != nullptr) Gather(*worker_error, g.ranges, g.ew);
    const int64_t mine = OwnedElements(len, ex.rank(), ex.size(), options.bucket_elements);
    g.server_off = server_off;
    if (server_error != nullptr) {
      g.es.assign(server_error->begin() + server_off, server_error->begin() + server_off + mine);
    }
    server_off += mine;
    AllReduceOptions o = options;
    o.codec.bits = b;
    parts.push_back({o, first_round + static_cast<uint32_t>(b - 1), g.x, absl::MakeSpan(g.mean),
                     worker_error != nullptr ? &g.ew : nullptr, server_error != nullptr ? &g.es : nullptr});
  }
  parts.insert(parts.end(), also.begin(), also.end());
  AQSWARM_RETURN_IF_ERROR(AllReduceMeanParts(ex, step, parts, stats));
  for (const Group& g : groups) {
    Scatter(g.mean, g.ranges, out);
    if (worker_error != nullptr) Scatter(g.ew, g.ranges, absl::MakeSpan(*worker_error));
    if (server_error != nullptr) std::copy(g.es.begin(), g.es.end(), server_error->begin() + g.server_off);
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
