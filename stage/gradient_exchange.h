// GradientExchange over gRPC: the ReplicaExchange the replicas of one stage
// use to average updates (pipeline/dp_allreduce.h runs the algorithm).
//
//   AQSWARM_ASSIGN_OR_RETURN(auto ex, GrpcReplicaExchange::Start(options));
//   report(ex->port());                       // peers learn each other's address
//   AQSWARM_RETURN_IF_ERROR(ex->Connect({"127.0.0.1:7001", "127.0.0.1:7002"}));
//   pipeline::AllReduceMean(*ex, ...);
//
// Each destination has its own sender thread and bounded queue, so a replica
// feeds all its peers at once (each over its own emulated link: an
// rpc::EmulatedWire, the FIFO of rpc/link_shaping.h, whose Transmit() holds
// each chunk for its wire time at the link's bandwidth; the receiver adds the
// one-way latency); Send() only queues. Incoming
// chunks are validated (group, the caller's certificate against the rank it
// claims, rank range, sizes, step window, first chunk wins: a sender whose
// chunk is refused as a duplicate counts it delivered) and kept in a
// bounded mailbox until Receive() takes them. The receiver's one-way latency
// wait trusts the sender's timestamp no further than shaping.latency_ms. A peer that vanished makes Send fail
// (sticky, naming the replica) and Receive time out after `timeout` or fail
// at once when the sender to that peer already failed.
//
// Thread-safety: Send/Receive may be called from one compute thread while
// gRPC threads deliver.
#ifndef AQSWARM_STAGE_GRADIENT_EXCHANGE_H_
#define AQSWARM_STAGE_GRADIENT_EXCHANGE_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "stage/exchange_mailbox.h"
#include "stage/link_transport.h"
#include "rpc/tls.h"
#include "pipeline/dp_allreduce.h"
#include "proto/exchange.grpc.pb.h"

namespace aqswarm::stage {

struct ReplicaExchangeOptions {
  // Names the group (e.g. "<job>/stage-1/gen-3/plan-5"); chunks of other groups
  // are refused with PERMISSION_DENIED, which a sender retries until `timeout`
  // (an old incarnation of a replica may still hold the address).
  std::string group;
  int rank = 0;
  int size = 1;
  // Address the GradientExchange server binds. Default: loopback, any port.
  std::string listen = "127.0.0.1:0";
  rpc::ShapingOptions shaping;
  // When non-empty, a chunk of step s is shaped at schedule[s % size] Mbit/s
  // (0 = unshaped) instead of shaping.bandwidth_mbps: the job's
  // shaping.bandwidth_schedule_mbps, whose step s is DP step s. A delayed
  // update (dp.delayed_update) sends step s's chunks while step s+1 runs.
  std::vector<double> bandwidth_schedule_mbps;
  // Bound on a Receive and on delivering one chunk. Default: 120 s.
  absl::Duration timeout = absl::Seconds(120);
  // Bound on chunk bytes buffered before Receive takes them. Default: 1 GiB.
  uint64_t max_buffered_bytes = 1ull << 30;
  // Mutual TLS on the server and on every channel to a replica. Default: off.
  rpc::TlsOptions tls;
  // Under mutual TLS: the certificate name (subject CN) of the replica of
  // each rank. A chunk whose from_rank is r is taken only from a caller
  // presenting peer_names[r] (else PERMISSION_DENIED, counted as
  // dp_wrong_peer). Empty: any certificate of the swarm CA. Default: empty.
  std::vector<std::string> peer_names;
  // Chunks are accepted for steps within this many of the step this replica
  // last asked for (ExchangeMailbox). Default: ExchangeMailbox::kStepWindow.
  uint64_t step_window = ExchangeMailbox::kStepWindow;
  // Keep a copy of the chunks of the newest step each replica took, for a
  // successor Retarget names (the vanished one may have been mid-round): one
  // step's traffic in memory; and a replica whose connection is lost is
  // retried until `timeout` (a successor may come) instead of failing the
  // step at once. Default: off.
  bool keep_delivered = false;
  // Each rank's incarnation to begin with (Retarget); empty: all 0.
  std::vector<uint64_t> incarnations;
};

class GrpcReplicaExchange final : public pipeline::ReplicaExchange {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcReplicaExchange>> Start(const ReplicaExchangeOptions& options);
  ~GrpcReplicaExchange() override;

  int port() const { return port_; }
  // Addresses of all replicas, indexed by rank (this one's entry is ignored).
  absl::Status Connect(const std::vector<std::string>& addresses);
  // After Connect: replica `rank` is now at `address` with certificate name
  // `peer_name` (a new peer took that pipeline's place). Its chunks queued
  // or in flight go there (and, with keep_delivered, those of the newest
  // step the old one took), a send failure to the old one is forgotten, and
  // only `peer_name` may push as that rank (under mutual TLS; "" = any
  // certificate of the swarm CA). Thread-safe.
  // `incarnation` names the replica's run: a new one at the same address is
  // retargeted too (0 = unknown: address and name decide).
  absl::Status Retarget(int rank, const std::string& address, const std::string& peer_name,
                        uint64_t incarnation = 0);

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  absl::Status Send(int to, const v1::ExchangeChunk& chunk) override;
  absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                            uint32_t bucket, uint32_t chunk) override;
  // Bytes of the chunks this replica has put on its (emulated) wire; a chunk
  // counts before its push, so once a peer has received it, it is counted.
  uint64_t bytes_sent() const;

 private:
  class Service;
  struct Peer;
  explicit GrpcReplicaExchange(const ReplicaExchangeOptions& options);
  // From the service; `caller`: the certificate name of the pushing peer
  // ("" under plaintext).
  absl::Status Deliver(v1::ExchangeChunk chunk, const std::string& caller);
  void SenderLoop(Peer* peer);

  const ReplicaExchangeOptions options_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::vector<std::unique_ptr<Peer>> peers_;  // [rank], from the start
  std::atomic<bool> connected_{false};        // Connect done: sender threads run
  ExchangeMailbox mailbox_;
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_GRADIENT_EXCHANGE_H_
