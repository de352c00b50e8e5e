// The receive side every ReplicaExchange transport shares: incoming chunks are
// validated (group, rank range, chunk index, phase) and kept, bounded in bytes,
// until Take() asks for them by (from, step, round, phase, bucket, chunk).
//
//   ExchangeMailbox box(group, rank, size, 1 << 30);
//   box.Deliver(chunk);                               // transport thread
//   auto c = box.Take(from, step, round, phase, bucket, k, timeout, [&] { return SenderStatus(from); });
//
// Thread-safe. `Fail(status)` makes every present and future Take return that
// status (a transport whose connection to the group broke).
#ifndef AQSWARM_PEER_EXCHANGE_MAILBOX_H_
#define AQSWARM_PEER_EXCHANGE_MAILBOX_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/exchange.pb.h"

namespace aqswarm::peer {

class ExchangeMailbox {
 public:
  ExchangeMailbox(std::string group, int rank, int size, uint64_t max_buffered_bytes);

  // PERMISSION_DENIED for another group's chunk, INVALID_ARGUMENT for an
  // impossible rank/chunk/phase, RESOURCE_EXHAUSTED when full; each counted
  // as a rejected message by reason. A chunk already present is replaced.
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
  const uint64_t max_buffered_bytes_;
  absl::Mutex mu_;
  std::map<Key, v1::ExchangeChunk> chunks_ ABSL_GUARDED_BY(mu_);
  uint64_t buffered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_EXCHANGE_MAILBOX_H_
