// The coordinator's notion of time, injected so that tests drive leases with a
// FakeClock instead of sleeping.
//
//   FakeClock clock(absl::FromUnixSeconds(1'700'000'000));
//   options.clock = &clock;
//   clock.Advance(absl::Seconds(11));   // every 10 s lease is now expired
//
// Thread-safety: both implementations are thread-safe.
#ifndef AQSWARM_COORDINATOR_CLOCK_H_
#define AQSWARM_COORDINATOR_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace aqswarm::coordinator {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// Wall-clock time (absl::Now()).
class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  // A process-wide instance (never destroyed).
  static RealClock* Get() {
    static RealClock* clock = new RealClock();
    return clock;
  }
};

// Time that moves only when told to.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  void Set(absl::Time t) {
    absl::MutexLock lock(&mu_);
    now_ = t;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_CLOCK_H_
