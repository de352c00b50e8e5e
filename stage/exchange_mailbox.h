// The receive side every ReplicaExchange transport shares: incoming chunks are
// validated (group, rank range, chunk index, phase, step window) and kept,
// bounded in bytes, until Take() asks for them by (from, step, round, phase,
// bucket, chunk).
//
//   ExchangeMailbox box(group, rank, size, 1 << 30);
//   box.Deliver(chunk);                               // transport thread
//   auto c = box.Take(from, step, round, phase, bucket, k, timeout, [&] { return SenderStatus(from); });
//
// Step window: once Take has asked for step s, only chunks of steps within
// `step_window` of the highest s asked for are accepted (a replica runs at
// most a step or two past this one's last exchange, or one diloco inner
// period / 0/1 Adam local interval: the stage widens the window by it);
// buffered chunks that fall behind
// the window are dropped. A Take of step kUnanchoredStep (the NCCL
// bootstrap's, before any training step) does not move the window. First
// chunk wins: a chunk whose key was already
// delivered (buffered or taken) is refused, never replaces the first.
//
// Thread-safe. `Fail(status)` makes every present and future Take return that
// status (a transport whose connection to the group broke).
#ifndef AQSWARM_STAGE_EXCHANGE_MAILBOX_H_
#define AQSWARM_STAGE_EXCHANGE_MAILBOX_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/exchange.pb.h"

namespace aqswarm::stage {

class ExchangeMailbox {
 public:
  static constexpr uint64_t kStepWindow = 8;
  // A step outside training (stage/nccl_transport.h kNcclBootstrapStep).
  static constexpr uint64_t kUnanchoredStep = ~uint64_t{0};
  // Keys remembered (buffered or taken, within the window) at most.
  static constexpr size_t kMaxKeys = 1 << 20;

  ExchangeMailbox(std::string group, int rank, int size, uint64_t max_buffered_bytes,
                  uint64_t step_window = kStepWindow);

  // PERMISSION_DENIED for another group's chunk, INVALID_ARGUMENT for an
  // impossible rank/chunk/phase, OUT_OF_RANGE for a step outside the window,
  // ALREADY_EXISTS for a chunk already delivered, RESOURCE_EXHAUSTED when
  // full; each counted as a rejected message by reason (dp_wrong_group,
  // dp_chunk_invalid, dp_step_out_of_window, dp_duplicate_chunk,
  // dp_mailbox_full).
  absl::Status Deliver(v1::ExchangeChunk chunk);

  // Waits for the chunk, at most `timeout`. `check` (may be empty) is polled
  // on every delivery and every 200 ms; a non-OK result is returned at once.
  absl::StatusOr<v1::ExchangeChunk> Take(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                         uint32_t bucket, uint32_t chunk, absl::Duration timeout,
                                         const std::function<absl::Status()>& check);

  void Fail(absl::Status status);

 private:
  using Key = std::tuple<int, uint64_t, uint32_t, int, uint32_t, uint32_t>;  // from, step, round, phase, bucket, chunk

  const std::string group_;
  const int rank_;
  const int size_;
  // Drops buffered chunks and remembered keys of steps behind the window.
  void Prune() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t max_buffered_bytes_;
  const uint64_t step_window_;
  absl::Mutex mu_;
  std::map<Key, v1::ExchangeChunk> chunks_ ABSL_GUARDED_BY(mu_);
  std::set<Key> seen_ ABSL_GUARDED_BY(mu_);  // delivered keys, buffered or taken
  bool anchored_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t current_step_ ABSL_GUARDED_BY(mu_) = 0;  // the highest step Take asked for
  uint64_t buffered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_EXCHANGE_MAILBOX_H_
