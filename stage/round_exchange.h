// A ReplicaExchange over a collective transport that has no receive-any
// (NCCL): a receiver must post a receive of known size from a known sender,
// and every replica must issue the same collectives in the same order. So a
// progress thread runs ROUNDS that all D replicas join, in lockstep:
//   1. all-gather a D x (D + 1) table of int64: row r holds the byte size of
//      replica r's next queued chunk to each destination (0 = none) and a
//      "closing" flag;
//   2. one grouped exchange: a send per non-zero entry of my row, a receive
//      per non-zero entry of my column;
//   3. the received chunks are parsed and validated into the mailbox
//      (exchange_mailbox.h), exactly as the gRPC transport's are.
// Send() only queues (bounded); Receive() waits on the mailbox. Each pair
// keeps FIFO order, one chunk per round. Idle rounds back off to `max_idle`
// (woken at once by a Send), so a replica that is computing costs its peers
// one tiny collective per `max_idle`.
//
// Ending: Close() (or the destructor) raises the closing flag; the rounds go
// on until every replica is closing with nothing queued (all replicas see the
// same table, so all leave in the same round). A transport call that fails
// or times out (a replica died) ends the rounds: the transport is aborted and
// every pending and later Send/Receive fails with that status.
//
//   auto transport = StartNcclTransport(...);               // nccl_transport.h
//   auto ex = RoundReplicaExchange::Start(options, std::move(*transport));
//   pipeline::AllReduceMean(*ex, ...);
#ifndef AQSWARM_STAGE_ROUND_EXCHANGE_H_
#define AQSWARM_STAGE_ROUND_EXCHANGE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "stage/exchange_mailbox.h"
#include "pipeline/dp_allreduce.h"

namespace aqswarm::stage {

// The collectives a round needs. Every call is collective over the D ranks
// and bounded by the transport's own timeout.
class RoundTransport {
 public:
  virtual ~RoundTransport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // table[r * row.size() + i] = row i of rank r. row.size() is the same on every rank.
  virtual absl::Status AllGather(absl::Span<const int64_t> row, absl::Span<int64_t> table) = 0;
  // Sends sends[j] to rank j where non-empty, and receives recv_bytes[j]
  // bytes from rank j into (*received)[j] where non-zero, as one group.
  virtual absl::Status Exchange(const std::vector<absl::string_view>& sends, absl::Span<const int64_t> recv_bytes,
                                std::vector<std::string>* received) = 0;
  // After the last round. `clean`: every rank left together; otherwise abort.
  virtual void Finish(bool clean) = 0;
};

struct RoundExchangeOptions {
  std::string group;  // as ReplicaExchangeOptions::group
  // Bound on a Receive and on queueing one chunk. Default: 120 s.
  absl::Duration timeout = absl::Seconds(120);
  uint64_t max_buffered_bytes = 1ull << 30;
  // Longest pause between idle rounds. Default: 2 ms.
  absl::Duration max_idle = absl::Milliseconds(2);
  // Largest chunk a peer may announce (a corrupt table entry must not make
  // this replica allocate it). Default: 1 GiB.
  int64_t max_chunk_bytes = 1ll << 30;
};

class RoundReplicaExchange final : public pipeline::ReplicaExchange {
 public:
  static absl::StatusOr<std::unique_ptr<RoundReplicaExchange>> Start(const RoundExchangeOptions& options,
                                                                     std::unique_ptr<RoundTransport> transport);
  // Raises this replica's closing flag and returns at once; queued chunks are
  // still delivered. The destructor calls it, then waits until every replica
  // has closed (or `timeout` passes): in one process, Close() all replicas of
  // a group before destroying the first.
  void Close();
  ~RoundReplicaExchange() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status Send(int to, const v1::ExchangeChunk& chunk) override;
  absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                            uint32_t bucket, uint32_t chunk) override;
  uint64_t bytes_sent() const;
  uint64_t rounds() const;

 private:
  RoundReplicaExchange(const RoundExchangeOptions& options, std::unique_ptr<RoundTransport> transport);
  void Loop();
  absl::Status RunRound(bool* all_closed, bool* moved);

  const RoundExchangeOptions options_;
  std::unique_ptr<RoundTransport> transport_;
  const int rank_;
  const int size_;
  ExchangeMailbox mailbox_;
  mutable absl::Mutex mu_;
  std::vector<std::deque<std::string>> queues_ ABSL_GUARDED_BY(mu_);  // serialized chunks, per destination
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t rounds_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_ROUND_EXCHANGE_H_
