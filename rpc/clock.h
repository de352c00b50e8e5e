// Time, injected: the coordinator's leases and the links' emulated wires
// read it, so tests drive them with a FakeClock instead of sleeping.
//
//   rpc::FakeClock clock(absl::FromUnixSeconds(1'700'000'000));
//   options.clock = &clock;
//   clock.Advance(absl::Seconds(11));   // every 10 s lease is now expired
//
// Thread-safety: both implementations are thread-safe.
#ifndef AQSWARM_RPC_CLOCK_H_
#define AQSWARM_RPC_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace aqswarm::rpc {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // Returns once `d` has passed on this clock.
  virtual void SleepFor(absl::Duration d) const = 0;
};

// Wall-clock time (absl::Now()).
class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  void SleepFor(absl::Duration d) const override { absl::SleepFor(d); }
  // A process-wide instance (never destroyed).
  static RealClock* Get() {
    static RealClock* clock = new RealClock();
    return clock;
  }
};

// Time that moves only when told to; SleepFor moves it at once.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void SleepFor(absl::Duration d) const override {
    absl::MutexLock lock(&mu_);
    if (d > absl::ZeroDuration()) now_ += d;
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
  mutable absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aqswarm::rpc

#endif  // AQSWARM_RPC_CLOCK_H_
