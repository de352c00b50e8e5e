// In-process ReplicaExchange for unit tests: D replicas in one process, one
// thread each, sharing mailboxes. A rank can be "killed": sends to it fail
// and receives from it time out, like a vanished peer.
#ifndef AQSWARM_PIPELINE_DP_TEST_UTIL_H_
#define AQSWARM_PIPELINE_DP_TEST_UTIL_H_

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/random.h"
#include "pipeline/dp_allreduce.h"

namespace aqswarm::pipeline::testing {

// n floats uniform in [-0.5, 0.5), seeded.
inline std::vector<float> RandomFloats(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.UnitDouble() - 0.5);
  return v;
}

// Min-max exchange options: `bits` per code, `bucket_size` values per
// scale, chunks of fewer than `min_compress` values raw, all-reduce buckets
// of `bucket_elements`.
inline AllReduceOptions MinMaxAllReduce(int bits, int64_t bucket_size, int64_t min_compress,
                                        int64_t bucket_elements) {
  AllReduceOptions o;
  o.codec.codec = v1::CODEC_MINMAX;
  o.codec.bits = bits;
  o.codec.bucket_size = bucket_size;
  o.codec.min_compress_elements = min_compress;
  o.bucket_elements = bucket_elements;
  return o;
}

class Hub {
 public:
  using Key = std::tuple<int, int, uint64_t, uint32_t, int, uint32_t, uint32_t>;  // to, from, step, round, phase, bucket, chunk
  explicit Hub(absl::Duration timeout = absl::Seconds(10)) : timeout_(timeout) {}
  void Kill(int rank) {
    absl::MutexLock l(&mu_);
    dead_[rank] = true;
  }
  absl::Status Put(int to, const v1::ExchangeChunk& c) {
    absl::MutexLock l(&mu_);
    if (dead_[to]) return absl::UnavailableError(absl::StrCat("replica ", to, " is gone"));
    box_[Key(to, c.from_rank(), c.step(), c.round(), c.phase(), c.bucket(), c.chunk())] = c;
    return absl::OkStatus();
  }
  absl::StatusOr<v1::ExchangeChunk> Take(const Key& k) {
    absl::MutexLock l(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return box_.count(k) > 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout_)) {
      return absl::DeadlineExceededError(absl::StrCat("replica ", std::get<1>(k), " sent nothing within ",
                                                      absl::FormatDuration(timeout_)));
    }
    v1::ExchangeChunk c = std::move(box_[k]);
    box_.erase(k);
    return c;
  }

 private:
  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::map<Key, v1::ExchangeChunk> box_ ABSL_GUARDED_BY(mu_);
  std::map<int, bool> dead_ ABSL_GUARDED_BY(mu_);
};

class HubExchange final : public ReplicaExchange {
 public:
  HubExchange(Hub* hub, int rank, int size) : hub_(hub), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status Send(int to, const v1::ExchangeChunk& chunk) override {
    ++sent_;
    return hub_->Put(to, chunk);
  }
  absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                            uint32_t bucket, uint32_t chunk) override {
    return hub_->Take(Hub::Key(rank_, from, step, round, phase, bucket, chunk));
  }
  int sent() const { return sent_; }

 private:
  Hub* hub_;
  int rank_, size_;
  int sent_ = 0;
};

}  // namespace aqswarm::pipeline::testing

#endif  // AQSWARM_PIPELINE_DP_TEST_UTIL_H_
