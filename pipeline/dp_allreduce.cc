#include "pipeline/dp_allreduce.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "compression/global_qsgd.h"

namespace aqswarm::pipeline {
namespace {

absl::Status EncodeChunk(const compression::CodecOptions& codec, absl::Span<const float> values, uint32_t key,
                         v1::EncodedTensor* out) {
  const int64_t shape[] = {static_cast<int64_t>(values.size())};
  return compression::Encode(codec, values, shape, key, out);
}

// Decodes and checks that the message has exactly `n` elements.
absl::Status DecodeChunk(const v1::EncodedTensor& msg, absl::Span<float> out) {
  if (msg.num_elements() != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat("exchange chunk has ", msg.num_elements(), " values, expected ",
                                                   out.size()));
  }
  return compression::Decode(msg, out);
}

// Fault injection for tests (never set in production): with
// AQSWARM_TEST_FAULT_DP_SCATTER="<rank>:<factor>" or "<rank>:nan" in the
// environment, the replica of that rank corrupts the float32 SCATTER
// contributions it sends to the other replicas after encoding them (values
// times <factor>, or a NaN), as a hostile or broken peer would; its own
// chunk and everything else stay honest. Read once per process.
struct ScatterFault {
  int rank = -1;
  float factor = 1;
  bool nan = false;
};

const ScatterFault& TestScatterFault() {
  static const ScatterFault fault = [] {
    ScatterFault f;
    const char* v = std::getenv("AQSWARM_TEST_FAULT_DP_SCATTER");
    if (v == nullptr) return f;
    const std::string spec(v);
    const size_t colon = spec.find(':');
    if (colon == std::string::npos || !absl::SimpleAtoi(spec.substr(0, colon), &f.rank)) return ScatterFault();
    const std::string what = spec.substr(colon + 1);
    if (what == "nan") {
      f.nan = true;
    } else if (!absl::SimpleAtof(what, &f.factor)) {
      return ScatterFault();
    }
    std::fprintf(stderr, "aqswarm: TEST FAULT INJECTION: replica %d corrupts its data-parallel contributions (%s)\n",
                 f.rank, what.c_str());
    return f;
  }();
  return fault;
}

// AQSWARM_TEST_FAULT_DIE_IN_EXCHANGE_AT_STEP=<step>: in that step's
// exchange, once this replica has taken a contribution from another, the
// process SIGKILLs its parent (the peer daemon that launched this stage)
// and itself: a peer that dies mid-round, some of its chunks delivered.
void MaybeDieInExchange(uint64_t step) {
  static const int64_t at = [] {
    const char* v = std::getenv("AQSWARM_TEST_FAULT_DIE_IN_EXCHANGE_AT_STEP");
    int64_t s = -1;
    if (v != nullptr && absl::SimpleAtoi(v, &s)) {
      std::fprintf(stderr, "aqswarm: TEST FAULT INJECTION: this peer dies in its data-parallel exchange of step %lld\n",
                   static_cast<long long>(s));
    }
    return s;
  }();
  if (at < 0 || step != static_cast<uint64_t>(at)) return;
  ::kill(::getppid(), SIGKILL);
  ::raise(SIGKILL);
}

void InjectScatterFault(int rank, v1::EncodedTensor* t) {
  const ScatterFault& f = TestScatterFault();
  if (f.rank != rank || t->codec() != v1::CODEC_RAW_F32) return;
  std::string& p = *t->mutable_payload();
  for (size_t i = 0; i + 4 <= p.size(); i += 4) {
    float x;
    std::memcpy(&x, p.data() + i, 4);
    x = f.nan ? std::nanf("") : x * f.factor;
    std::memcpy(p.data() + i, &x, 4);
  }
  t->clear_checksum();
}

double Norm(absl::Span<const float> x) {
  double sq = 0;
  for (float v : x) sq += static_cast<double>(v) * v;
  return std::sqrt(sq);
}

// The lower median of `v` (reordered).
double LowerMedian(std::vector<double>& v) {
  const size_t k = (v.size() - 1) / 2;
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

// Scales `x` down to norm `limit` when it is longer; returns whether it did.
bool ClipTo(std::vector<float>& x, double norm, double limit) {
  if (!(norm > limit)) return false;
  const float f = limit > 0 ? static_cast<float>(limit / norm) : 0.0f;
  for (float& v : x) v *= f;
  return true;
}

}  // namespace

absl::Status CombineContributions(RobustAggregation mode, double clip,
                                  const std::vector<std::vector<float>>& contributions,
                                  const std::vector<bool>& keep, absl::Span<float> out, AllReduceStats* stats) {
  const size_t n = out.size();
  std::vector<const std::vector<float>*> kept;
  for (size_t i = 0; i < contributions.size(); ++i) {
    if (!keep[i]) continue;
    if (contributions[i].size() != n) return absl::InvalidArgumentError("allreduce: contribution of a wrong size");
    kept.push_back(&contributions[i]);
  }
  if (kept.empty()) {
    return absl::FailedPreconditionError("allreduce: every replica's contribution to this chunk was dropped");
  }
  const float inv = 1.0f / static_cast<float>(kept.size());
  std::vector<float> center(n, 0.0f);
  if (mode == RobustAggregation::kCenteredClip) {
    std::vector<float> column(kept.size());
    const size_t k = (kept.size() - 1) / 2;
    for (size_t j = 0; j < n; ++j) {
      for (size_t i = 0; i < kept.size(); ++i) column[i] = (*kept[i])[j];
      std::nth_element(column.begin(), column.begin() + k, column.end());
      center[j] = column[k];
    }
  }
  // Each kept contribution's part: x_i (off, clip_norm) or x_i - center.
  std::vector<std::vector<float>> parts(kept.size());
  std::vector<double> norms(kept.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    parts[i] = *kept[i];
    if (mode == RobustAggregation::kCenteredClip) {
      for (size_t j = 0; j < n; ++j) parts[i][j] -= center[j];
    }
    norms[i] = Norm(parts[i]);
  }
  if (mode != RobustAggregation::kOff) {
    std::vector<double> sorted = norms;
    const double limit = clip * LowerMedian(sorted);
    for (size_t i = 0; i < kept.size(); ++i) {
      if (ClipTo(parts[i], norms[i], limit) && stats != nullptr) ++stats->robust_clipped;
    }
  }
  std::fill(out.begin(), out.end(), 0.0f);
  for (const std::vector<float>& p : parts) {
    for (size_t j = 0; j < n; ++j) out[j] += p[j];
  }
  for (size_t j = 0; j < n; ++j) out[j] = center[j] + out[j] * inv;
  return absl::OkStatus();
}

std::pair<int64_t, int64_t> ChunkRange(int64_t len, int rank, int size) {
  const int64_t base = len / size, extra = len % size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

int64_t OwnedElements(int64_t n, int rank, int size, int64_t bucket_elements) {
  int64_t owned = 0;
  for (int64_t bs = 0; bs < n; bs += bucket_elements) {
    const auto [a, b] = ChunkRange(std::min(bucket_elements, n - bs), rank, size);
    owned += b - a;
  }
  return owned;
}

uint64_t Float32AllReduceBytes(int64_t n, int rank, int size, int64_t bucket_elements) {
  if (size < 2 || n <= 0) return 0;
  const int64_t owned = OwnedElements(n, rank, size, bucket_elements);
  return static_cast<uint64_t>(4 * ((n - owned) + static_cast<int64_t>(size - 1) * owned));
}

namespace {

// One part of AllReduceMeanParts: its checks, then each bucket's three
// phases (the banner's SCATTER; reduce + GATHER send; GATHER receive), run
// by the caller in any interleaving that keeps a bucket's phases in order.
class PartRun {
 public:
  PartRun(ReplicaExchange& ex, uint64_t step, const AllReducePart& part)
      : ex_(ex), step_(step), p_(part), d_(ex.size()), r_(ex.rank()), n_(static_cast<int64_t>(part.in.size())) {}

  absl::Status Check() {
    const AllReduceOptions& o = p_.options;
    if (static_cast<int64_t>(p_.out.size()) != n_) return absl::InvalidArgumentError("allreduce: in/out sizes differ");
    if (o.bucket_elements <= 0) return absl::InvalidArgumentError("allreduce: bucket_elements must be > 0");
    if (o.codec.codec == v1::CODEC_FIXED_POINT) {
      return absl::InvalidArgumentError("allreduce: fixed point is per channel; use a bucketed codec");
    }
    AQSWARM_RETURN_IF_ERROR(compression::ValidateCodecOptions(o.codec));
    if (p_.worker_error != nullptr) {
      if (p_.worker_error->empty()) p_.worker_error->assign(n_, 0.0f);
      if (static_cast<int64_t>(p_.worker_error->size()) != n_) {
        return absl::InvalidArgumentError("worker error: wrong size");
      }
    }
    const int64_t owned = OwnedElements(n_, r_, d_, o.bucket_elements);
    if (p_.server_error != nullptr) {
      if (p_.server_error->empty()) p_.server_error->assign(owned, 0.0f);
      if (static_cast<int64_t>(p_.server_error->size()) != owned) {
        return absl::InvalidArgumentError("server error: wrong size");
      }
    }
    if (robust() && !(o.robust_clip > 0 && std::isfinite(o.robust_clip))) {
      return absl::InvalidArgumentError("allreduce: robust_clip must be finite and > 0");
    }
    buckets_ = n_ == 0 ? 0 : (n_ + o.bucket_elements - 1) / o.bucket_elements;
    own_.resize(buckets_);
    if (robust()) {
      contributions_.resize(d_);
      keep_.assign(d_, false);
    }
    return absl::OkStatus();
  }

  int64_t buckets() const { return buckets_; }
  const AllReduceStats& stats() const { return local_; }

  // Encodes chunk k of bucket j for each owner k and sends the others theirs.
  absl::Status Scatter(int64_t j) {
    const auto [bs, len] = Bucket(j);
    const uint32_t bucket = static_cast<uint32_t>(j);
    for (int k = 0; k < d_; ++k) {
      const auto [a, b] = ChunkRange(len, k, d_);
      u_.assign(p_.in.begin() + bs + a, p_.in.begin() + bs + b);
      if (p_.worker_error != nullptr) {
        for (int64_t i = 0; i < b - a; ++i) u_[i] += (*p_.worker_error)[bs + a + i];
      }
      v1::ExchangeChunk msg = Header(bucket, k, v1::ExchangeChunk::SCATTER);
      AQSWARM_RETURN_IF_ERROR(EncodeChunk(p_.options.codec, u_,
                                          StreamKey(step_ * 1024 + p_.round, bucket * 4096 + k * 64 + r_),
                                          msg.mutable_tensor()));
      if (p_.worker_error != nullptr) {
        dec_.resize(u_.size());
        AQSWARM_RETURN_IF_ERROR(DecodeChunk(msg.tensor(), absl::MakeSpan(dec_)));
        for (int64_t i = 0; i < b - a; ++i) (*p_.worker_error)[bs + a + i] = u_[i] - dec_[i];
      }
      if (k == r_) {
        own_[j] = std::move(msg);
      } else {
        InjectScatterFault(r_, msg.mutable_tensor());  // tests only (see TestScatterFault)
        local_.bytes_sent += compression::EncodedBytes(msg.tensor());
        local_.raw_bytes += (b - a) * 4;
        AQSWARM_RETURN_IF_ERROR(ex_.Send(k, msg));
      }
    }
    return absl::OkStatus();
  }

  // Reduces this replica's chunk of bucket j in rank order and sends its mean
  // to every other replica (the owner decodes the same bytes).
  absl::Status ReduceAndGather(int64_t j) {
    const auto [bs, len] = Bucket(j);
    const uint32_t bucket = static_cast<uint32_t>(j);
    const auto [ra, rb] = ChunkRange(len, r_, d_);
    const int64_t mine = rb - ra;
    sum_.assign(mine, 0.0f);
    dec_.resize(mine);
    if (!robust()) {
      for (int src = 0; src < d_; ++src) {
        if (src == r_) {
          AQSWARM_RETURN_IF_ERROR(DecodeChunk(own_[j].tensor(), absl::MakeSpan(dec_)));
        } else {
          AQSWARM_ASSIGN_OR_RETURN(v1::ExchangeChunk c,
                                   ex_.Receive(src, step_, p_.round, v1::ExchangeChunk::SCATTER, bucket, r_));
          MaybeDieInExchange(step_);  // tests only
          AQSWARM_RETURN_IF_ERROR(DecodeChunk(c.tensor(), absl::MakeSpan(dec_)));
        }
        for (int64_t i = 0; i < mine; ++i) sum_[i] += dec_[i];
      }
      const float inv = 1.0f / static_cast<float>(d_);
      for (float& v : sum_) v *= inv;
    } else {
      // Every contribution first; one that is not finite is dropped.
      for (int src = 0; src < d_; ++src) {
        contributions_[src].resize(mine);
        absl::Status s;
        if (src == r_) {
          s = DecodeChunk(own_[j].tensor(), absl::MakeSpan(contributions_[src]));
        } else {
          AQSWARM_ASSIGN_OR_RETURN(v1::ExchangeChunk c,
                                   ex_.Receive(src, step_, p_.round, v1::ExchangeChunk::SCATTER, bucket, r_));
          s = DecodeChunk(c.tensor(), absl::MakeSpan(contributions_[src]));
        }
        keep_[src] = s.ok();
        if (compression::IsNonFiniteError(s)) {
          ++local_.robust_dropped;
          continue;
        }
        AQSWARM_RETURN_IF_ERROR(s);
      }
      AQSWARM_RETURN_IF_ERROR(CombineContributions(p_.options.robust, p_.options.robust_clip, contributions_, keep_,
                                                   absl::MakeSpan(sum_), &local_));
    }
    own_[j].Clear();
    const int64_t owned_offset = OwnedElements(bs, r_, d_, p_.options.bucket_elements);
    if (p_.server_error != nullptr) {
      for (int64_t i = 0; i < mine; ++i) sum_[i] += (*p_.server_error)[owned_offset + i];
    }
    v1::ExchangeChunk mean = Header(bucket, r_, v1::ExchangeChunk::GATHER);
    AQSWARM_RETURN_IF_ERROR(EncodeChunk(p_.options.codec, sum_,
                                        StreamKey(step_ * 1024 + p_.round, (1u << 30) + bucket * 64 + r_),
                                        mean.mutable_tensor()));
    for (int k = 0; k < d_; ++k) {
      if (k == r_) continue;
      local_.bytes_sent += compression::EncodedBytes(mean.tensor());
      local_.raw_bytes += mine * 4;
      AQSWARM_RETURN_IF_ERROR(ex_.Send(k, mean));
    }
    AQSWARM_RETURN_IF_ERROR(DecodeChunk(mean.tensor(), p_.out.subspan(bs + ra, mine)));
    if (p_.server_error != nullptr) {
      for (int64_t i = 0; i < mine; ++i) (*p_.server_error)[owned_offset + i] = sum_[i] - p_.out[bs + ra + i];
    }
    return absl::OkStatus();
  }

  // Decodes the other owners' means of bucket j into the output.
  absl::Status ReceiveGather(int64_t j) {
    const auto [bs, len] = Bucket(j);
    for (int src = 0; src < d_; ++src) {
      if (src == r_) continue;
      const auto [sa, sb] = ChunkRange(len, src, d_);
      AQSWARM_ASSIGN_OR_RETURN(v1::ExchangeChunk c, ex_.Receive(src, step_, p_.round, v1::ExchangeChunk::GATHER,
                                                                static_cast<uint32_t>(j), src));
      AQSWARM_RETURN_IF_ERROR(DecodeChunk(c.tensor(), p_.out.subspan(bs + sa, sb - sa)));
    }
    return absl::OkStatus();
  }

 private:
  bool robust() const { return p_.options.robust != RobustAggregation::kOff; }
  // Bucket j's first element and length.
  std::pair<int64_t, int64_t> Bucket(int64_t j) const {
    const int64_t bs = j * p_.options.bucket_elements;
    return {bs, std::min(p_.options.bucket_elements, n_ - bs)};
  }
  v1::ExchangeChunk Header(uint32_t bucket, int chunk, v1::ExchangeChunk::Phase phase) const {
    v1::ExchangeChunk msg;
    msg.set_step(step_);
    msg.set_round(p_.round);
    msg.set_phase(phase);
    msg.set_bucket(bucket);
    msg.set_chunk(chunk);
    msg.set_from_rank(r_);
    return msg;
  }

  ReplicaExchange& ex_;
  const uint64_t step_;
  const AllReducePart p_;
  const int d_, r_;
  const int64_t n_;
  int64_t buckets_ = 0;
  std::vector<v1::ExchangeChunk> own_;  // this replica's own SCATTER chunk, per bucket until reduced
  std::vector<float> u_, dec_, sum_;
  std::vector<std::vector<float>> contributions_;
  std::vector<bool> keep_;
  AllReduceStats local_;
};

}  // namespace

AllReduceOptions Float32Like(const AllReduceOptions& like) {
  AllReduceOptions a;
  a.bucket_elements = like.bucket_elements;
  a.robust = like.robust;
  a.robust_clip = like.robust_clip;
  return a;
}

GlobalQsgdAllReduceOptions GlobalQsgdOptionsOf(const compression::CodecOptions& codec) {
  GlobalQsgdAllReduceOptions go;
  go.bits = codec.bits;
  go.levels = codec.levels;
  go.bucket_size = codec.bucket_size;
  return go;
}

absl::Status AllReduceMeanParts(ReplicaExchange& ex, uint64_t step, absl::Span<const AllReducePart> parts,
                                AllReduceStats* stats) {
  std::vector<PartRun> runs;
  runs.reserve(parts.size());
  for (const AllReducePart& p : parts) {
    for (const AllReducePart& q : parts) {
      if (&q != &p && q.round == p.round) return absl::InvalidArgumentError("allreduce: two parts share a round");
    }
    runs.emplace_back(ex, step, p);
    AQSWARM_RETURN_IF_ERROR(runs.back().Check());
  }
  // Units: (part, bucket), bucket-major, so the parts' first buckets go first.
  std::vector<std::pair<size_t, int64_t>> units;
  for (int64_t j = 0;; ++j) {
    const size_t before = units.size();
    for (size_t i = 0; i < runs.size(); ++i) {
      if (j < runs[i].buckets()) units.emplace_back(i, j);
    }
    if (units.size() == before) break;
  }
  // A unit's three phases run kAllReduceUnitsInFlight units apart: the SCATTER
  // of the next units leaves before this one's chunks are awaited, and its
  // means before the previous units' means are awaited.
  const int64_t u = static_cast<int64_t>(units.size()), lag = kAllReduceUnitsInFlight;
  for (int64_t t = 0; t < u + 2 * lag; ++t) {
    if (t < u) AQSWARM_RETURN_IF_ERROR(runs[units[t].first].Scatter(units[t].second));
    if (const int64_t k = t - lag; k >= 0 && k < u) {
      AQSWARM_RETURN_IF_ERROR(runs[units[k].first].ReduceAndGather(units[k].second));
    }
    if (const int64_t k = t - 2 * lag; k >= 0 && k < u) {
      AQSWARM_RETURN_IF_ERROR(runs[units[k].first].ReceiveGather(units[k].second));
    }
  }
  if (stats != nullptr) {
    for (const PartRun& run : runs) {
      stats->bytes_sent += run.stats().bytes_sent;
      stats->raw_bytes += run.stats().raw_bytes;
      stats->robust_dropped += run.stats().robust_dropped;
      stats->robust_clipped += run.stats().robust_clipped;
    }
  }
  return absl::OkStatus();
}

absl::Status AllReduceMean(ReplicaExchange& ex, const AllReduceOptions& options, uint64_t step, uint32_t round,
                           absl::Span<const float> in, absl::Span<float> out, std::vector<float>* worker_error,
                           std::vector<float>* server_error, AllReduceStats* stats) {
  const AllReducePart part{options, round, in, out, worker_error, server_error};
  return AllReduceMeanParts(ex, step, absl::MakeConstSpan(&part, 1), stats);
}

absl::Status GlobalQsgdAllReduceMean(ReplicaExchange& ex, const GlobalQsgdAllReduceOptions& options, uint64_t step,
                                     uint32_t round, absl::Span<const float> in, absl::Span<float> out,
                                     AllReduceStats* stats) {
  const int d = ex.size(), r = ex.rank();
  const int64_t n = static_cast<int64_t>(in.size());
  const int64_t b = options.bucket_size;
  if (static_cast<int64_t>(out.size()) != n) return absl::InvalidArgumentError("allreduce: in/out sizes differ");
  if (b <= 0) return absl::InvalidArgumentError("allreduce: bucket_size must be > 0");
  const int64_t nb = (n + b - 1) / b;
  AllReduceStats local;
  // 1. Shared scales: all-gather local maxima, take the element-wise max.
  std::vector<float> scales(nb);
  AQSWARM_RETURN_IF_ERROR(compression::LocalBucketMaxAbs(in, b, absl::MakeSpan(scales)));
  compression::CodecOptions raw;
  raw.codec = v1::CODEC_RAW_F32;
  const uint32_t scale_round = round + (1u << 20);
  v1::ExchangeChunk mine;
  mine.set_step(step);
  mine.set_round(scale_round);
  mine.set_phase(v1::ExchangeChunk::GATHER);
  mine.set_chunk(r);
  mine.set_from_rank(r);
  AQSWARM_RETURN_IF_ERROR(EncodeChunk(raw, scales, 0, mine.mutable_tensor()));
  for (int k = 0; k < d; ++k) {
    if (k != r) AQSWARM_RETURN_IF_ERROR(ex.Send(k, mine));
  }
  std::vector<float> theirs(nb);
  for (int src = 0; src < d; ++src) {
    if (src == r) continue;
    AQSWARM_ASSIGN_OR_RETURN(v1::ExchangeChunk c, ex.Receive(src, step, scale_round, v1::ExchangeChunk::GATHER, 0, src));
    AQSWARM_RETURN_IF_ERROR(DecodeChunk(c.tensor(), absl::MakeSpan(theirs)));
    for (int64_t i = 0; i < nb; ++i) scales[i] = std::max(scales[i], theirs[i]);
  }
  compression::GlobalQsgdOptions go;
  go.bits = options.bits;
  go.levels = options.levels;
  go.bucket_size = static_cast<size_t>(b);
  go.num_workers = d;
  // 2. Encode every chunk (whole buckets) against the shared scales; scatter.
  auto chunk_range = [&](int k) {
    const auto [ba, bb] = ChunkRange(nb, k, d);
    return std::make_pair(std::min(n, ba * b), std::min(n, bb * b));
  };
  auto encode = [&](int k, v1::ExchangeChunk* msg) -> absl::Status {
    const auto [a, e] = chunk_range(k);
    const auto [ba, bb] = ChunkRange(nb, k, d);
    msg->set_step(step);
    msg->set_round(round);
    msg->set_phase(v1::ExchangeChunk::SCATTER);
    msg->set_chunk(k);
    msg->set_from_rank(r);
    const int64_t shape[] = {e - a};
    return compression::EncodeGlobalQsgd(go, in.subspan(a, e - a), shape,
                                         absl::MakeConstSpan(scales).subspan(ba, bb - ba),
                                         StreamKey(step * 1024 + round, k * 64 + r), msg->mutable_tensor());
  };
  v1::ExchangeChunk own;
  for (int k = 0; k < d; ++k) {
    v1::ExchangeChunk msg;
    AQSWARM_RETURN_IF_ERROR(encode(k, &msg));
    if (k == r) {
      own = std::move(msg);
      continue;
    }
    local.bytes_sent += compression::EncodedBytes(msg.tensor());
    local.raw_bytes += (chunk_range(k).second - chunk_range(k).first) * 4;
    AQSWARM_RETURN_IF_ERROR(ex.Send(k, msg));
  }
  // 3. Combine the D code messages of my chunk in a balanced tree over ranks.
  std::vector<v1::EncodedTensor> level(d);
  for (int src = 0; src < d; ++src) {
    if (src == r) {
      level[src] = own.tensor();
    } else {
      AQSWARM_ASSIGN_OR_RETURN(v1::ExchangeChunk c, ex.Receive(src, step, round, v1::ExchangeChunk::SCATTER, 0, r));
      level[src] = std::move(*c.mutable_tensor());
    }
  }
  for (int width = 1, hop = 0; width < d; width *= 2, ++hop) {
    for (int i = 0; i + width < d; i += 2 * width) {
      compression::CombineOptions co;
      co.rng_key = StreamKey(step * 1024 + round, (1u << 24) + hop * 4096 + i * 64 + r);
      v1::EncodedTensor sum;
      AQSWARM_RETURN_IF_ERROR(compression::CombineGlobalQsgd(level[i], level[i + width], co, &sum));
      level[i] = std::move(sum);
    }
  }
  // 4. Gather: everyone decodes the same combined bytes.
  v1::ExchangeChunk combined;
  combined.set_step(step);
  combined.set_round(round);
  combined.set_phase(v1::ExchangeChunk::GATHER);
  combined.set_chunk(r);
  combined.set_from_rank(r);
  *combined.mutable_tensor() = std::move(level[0]);
  const auto [ra, re] = chunk_range(r);
  for (int k = 0; k < d; ++k) {
    if (k == r) continue;
    local.bytes_sent += compression::EncodedBytes(combined.tensor());
    local.raw_bytes += (re - ra) * 4;
    AQSWARM_RETURN_IF_ERROR(ex.Send(k, combined));
  }
  AQSWARM_RETURN_IF_ERROR(DecodeChunk(combined.tensor(), out.subspan(ra, re - ra)));
  for (int src = 0; src < d; ++src) {
    if (src == r) continue;
    const auto [sa, se] = chunk_range(src);
    AQSWARM_ASSIGN_OR_RETURN(v1::ExchangeChunk c, ex.Receive(src, step, round, v1::ExchangeChunk::GATHER, 0, src));
    AQSWARM_RETURN_IF_ERROR(DecodeChunk(c.tensor(), out.subspan(sa, se - sa)));
  }
  if (stats != nullptr) {
    stats->bytes_sent += local.bytes_sent;
    stats->raw_bytes += local.raw_bytes;
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
