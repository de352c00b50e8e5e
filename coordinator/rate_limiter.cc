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
