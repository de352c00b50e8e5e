// Token buckets by key, growing holds by key, and a log limiter: what
// bounds how often one caller (a peer name, a peer id, the whole swarm) may
// do something expensive at the coordinator, and how often one kind of
// refusal is logged.
//
//   RateLimiter joins({.per_second = 0.3, .burst = 3});
//   if (!joins.Allow(name, clock->Now())) return absl::ResourceExhaustedError(...);
//
//   Backoff replans({.first = absl::Seconds(10), .most = absl::Minutes(5), .decay = absl::Minutes(30)});
//   replans.Record(name, now);                      // it cost the swarm a re-plan
//   if (replans.HeldUntil(name) > now) return absl::ResourceExhaustedError(...);
//
//   LogLimiter log(absl::Seconds(10));
//   if (int64_t n = log.Admit("unauthenticated", absl::Now()); n > 0)
//     AQSWARM_LOG(WARNING) << "join refused: ... (" << n - 1 << " more of this kind since the last line)";
//
// Thread-safety: both are thread-safe (one mutex each, never held while
// calling out).
#ifndef AQSWARM_COORDINATOR_RATE_LIMITER_H_
#define AQSWARM_COORDINATOR_RATE_LIMITER_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace aqswarm::coordinator {

struct RateLimit {
  // Tokens added per second (the sustained rate). <= 0: no limit.
  double per_second = 0;
  // Bucket size (the most calls at once after a quiet spell); at least 1.
  double burst = 1;
};

class RateLimiter {
 public:
  // At most `max_keys` buckets are kept; beyond that, full (idle) buckets are
  // dropped, and when none is idle the call is refused (a caller cannot grow
  // memory by inventing keys). Default: 100000.
  explicit RateLimiter(RateLimit limit, size_t max_keys = 100000);

  // Takes one token from `key`'s bucket: false when it is empty (the call
  // should be refused). `now` need not be monotonic; time going back adds nothing.
  bool Allow(absl::string_view key, absl::Time now);
  // Forgets `key` (a peer that left).
  void Forget(absl::string_view key);
  const RateLimit& limit() const { return limit_; }

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time updated;
  };
  void DropIdleLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RateLimit limit_;
  const size_t max_keys_;
  absl::Mutex mu_;
  std::map<std::string, Bucket, std::less<>> buckets_ ABSL_GUARDED_BY(mu_);
};

struct BackoffPolicy {
  // The hold after a key's second offence; each later one doubles it, up to
  // `most`. The first offence earns no hold.
  absl::Duration first = absl::Seconds(10);
  absl::Duration most = absl::Minutes(5);
  // A key with no offence for this long starts over.
  absl::Duration decay = absl::Minutes(30);
};

class Backoff {
 public:
  // At most `max_keys` keys are kept; beyond that, the key whose last
  // offence is oldest is forgotten. Default: 100000.
  explicit Backoff(BackoffPolicy policy, size_t max_keys = 100000);

  // Counts one offence of `key` at `now`; returns its offences in the
  // current run (1 after a quiet `decay`).
  int Record(absl::string_view key, absl::Time now);
  // Until when `key` is held back (InfinitePast: not held).
  absl::Time HeldUntil(absl::string_view key) const;
  // The offences of `key` in its current run (0 if none or decayed at `now`).
  int Offences(absl::string_view key, absl::Time now) const;

 private:
  struct Run {
    int offences = 0;
    absl::Time last;
    absl::Time held_until = absl::InfinitePast();
  };
  const BackoffPolicy policy_;
  const size_t max_keys_;
  mutable absl::Mutex mu_;
  std::map<std::string, Run, std::less<>> runs_ ABSL_GUARDED_BY(mu_);
};

// Logs one line per kind per `every`: Admit() returns how many events of
// `kind` happened since the last admitted one, this one included (>= 1),
// when this one should be logged, and 0 when it should not.
class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration every) : every_(every) {}
  int64_t Admit(absl::string_view kind, absl::Time now);

 private:
  struct Kind {
    absl::Time last_logged = absl::InfinitePast();
    int64_t suppressed = 0;
  };
  const absl::Duration every_;
  absl::Mutex mu_;
  std::map<std::string, Kind, std::less<>> kinds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_RATE_LIMITER_H_
