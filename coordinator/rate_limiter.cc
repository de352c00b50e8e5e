#include "coordinator/rate_limiter.h"

#include <algorithm>

namespace aqswarm::coordinator {

RateLimiter::RateLimiter(RateLimit limit, size_t max_keys)
    : limit_{limit.per_second, std::max(1.0, limit.burst)}, max_keys_(std::max<size_t>(1, max_keys)) {}

void RateLimiter::DropIdleLocked(absl::Time now) {
  for (auto it = buckets_.begin(); it != buckets_.end();) {
    const double refilled = it->second.tokens + absl::ToDoubleSeconds(now - it->second.updated) * limit_.per_second;
    it = refilled >= limit_.burst ? buckets_.erase(it) : std::next(it);
  }
}

bool RateLimiter::Allow(absl::string_view key, absl::Time now) {
  if (limit_.per_second <= 0) return true;
  absl::MutexLock lock(&mu_);
  auto it = buckets_.find(key);
  if (it == buckets_.end()) {
    if (buckets_.size() >= max_keys_) {
      DropIdleLocked(now);
      if (buckets_.size() >= max_keys_) return false;
    }
    it = buckets_.emplace(std::string(key), Bucket{limit_.burst, now}).first;
  }
  Bucket& b = it->second;
  if (now > b.updated) {
    b.tokens = std::min(limit_.burst, b.tokens + absl::ToDoubleSeconds(now - b.updated) * limit_.per_second);
    b.updated = now;
  }
  if (b.tokens < 1) return false;
  b.tokens -= 1;
  return true;
}

void RateLimiter::Forget(absl::string_view key) {
  absl::MutexLock lock(&mu_);
  auto it = buckets_.find(key);
  if (it != buckets_.end()) buckets_.erase(it);
}

Backoff::Backoff(BackoffPolicy policy, size_t max_keys) : policy_(policy), max_keys_(std::max<size_t>(1, max_keys)) {}

int Backoff::Record(absl::string_view key, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(key);
  if (it == runs_.end()) {
    if (runs_.size() >= max_keys_) {
      runs_.erase(std::min_element(runs_.begin(), runs_.end(),
                                   [](const auto& a, const auto& b) { return a.second.last < b.second.last; }));
    }
    it = runs_.emplace(std::string(key), Run{}).first;
  }
  Run& r = it->second;
  if (r.offences > 0 && now - r.last >= policy_.decay) r = Run{};
  r.offences += 1;
  r.last = now;
  if (r.offences >= 2) {
    // first * 2^(offences - 2), computed without overflow: doubling stops at `most`.
    absl::Duration hold = policy_.first;
    for (int i = 2; i < r.offences && hold < policy_.most; ++i) hold *= 2;
    r.held_until = now + std::min(hold, policy_.most);
  }
  return r.offences;
}

absl::Time Backoff::HeldUntil(absl::string_view key) const {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(key);
  return it == runs_.end() ? absl::InfinitePast() : it->second.held_until;
}

int Backoff::Offences(absl::string_view key, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(key);
  if (it == runs_.end() || now - it->second.last >= policy_.decay) return 0;
  return it->second.offences;
}

int64_t LogLimiter::Admit(absl::string_view kind, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = kinds_.find(kind);
  if (it == kinds_.end()) it = kinds_.emplace(std::string(kind), Kind{}).first;
  Kind& k = it->second;
  ++k.suppressed;
  if (now - k.last_logged < every_) return 0;
  const int64_t n = k.suppressed;
  k.suppressed = 0;
  k.last_logged = now;
  return n;
}

}  // namespace aqswarm::coordinator
