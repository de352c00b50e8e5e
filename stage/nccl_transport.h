// The RoundTransport over NCCL (-DAQSWARM_WITH_CUDA=ON; in other builds every
// function here fails with FAILED_PRECONDITION, saying so): the
// replicas of a stage that sit on GPUs average their updates through
// RoundReplicaExchange (round_exchange.h), the same ReplicaExchange interface
// and the same compressed all-reduce as over gRPC, with NCCL moving the bytes.
//
//   // the replicas' gRPC exchange is connected; bootstrap NCCL over it:
//   auto ex = StartNcclReplicaExchange(grpc_exchange, exchange_options);   // collective
//   pipeline::AllReduceMean(**ex, ...);
// or by hand:
//   std::string id = *NewNcclUniqueId();       // on rank 0; give it to the others out of band
//   NcclTransportOptions o;  o.rank = r;  o.size = d;  o.unique_id = id;
//   auto t = StartNcclTransport(o);            // collective: all d ranks at once
//   auto ex = RoundReplicaExchange::Start(exchange_options, std::move(*t));
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): every call
// is polled against `timeout`, and one that does not complete (a replica died
// or hangs) aborts the communicator and fails with DEADLINE_EXCEEDED, so a
// step fails with a clear status as it does over gRPC. Chunks are host
// protobufs (the exchange interface is host-side): they are staged through
// device buffers that grow to the largest chunk seen.
//
// Status: compiled and its argument/no-GPU paths tested in CI; the one-GPU
// tests ran on an H200 (scripts/cuda_check.sh); the D >= 2 test needs two GPUs
// (NCCL refuses two ranks on one device) and has not run.
#ifndef AQSWARM_STAGE_NCCL_TRANSPORT_H_
#define AQSWARM_STAGE_NCCL_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "stage/round_exchange.h"

namespace aqswarm::stage {

struct NcclTransportOptions {
  int rank = 0;
  int size = 1;
  // CUDA device of this rank. Default -1: rank % device count.
  int device = -1;
  // The 128 bytes of rank 0's NewNcclUniqueId().
  std::string unique_id;
  // Bound on forming the communicator and on every collective. Default: 120 s.
  absl::Duration timeout = absl::Seconds(120);
};

// CUDA devices this process sees (0 without CUDA, or in builds without it).
int CudaDeviceCount();

absl::StatusOr<std::string> NewNcclUniqueId();

// INVALID_ARGUMENT for bad options (checked before any CUDA call),
// FAILED_PRECONDITION when there is no CUDA device, DEADLINE_EXCEEDED when the
// other ranks do not join within `timeout`.
absl::StatusOr<std::unique_ptr<RoundTransport>> StartNcclTransport(const NcclTransportOptions& options);

// The NCCL exchange of a stage's replicas, bootstrapped over `bootstrap`, an
// exchange among the same replicas that already works (the gRPC one): rank 0
// draws the unique id and sends it to every other rank (a chunk of step
// kNcclBootstrapStep), then all form the communicator (device: rank % devices).
// Collective; errors as StartNcclTransport, or the bootstrap's.
inline constexpr uint64_t kNcclBootstrapStep = ~uint64_t{0};
absl::StatusOr<std::unique_ptr<RoundReplicaExchange>> StartNcclReplicaExchange(pipeline::ReplicaExchange& bootstrap,
                                                                               const RoundExchangeOptions& options);

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_NCCL_TRANSPORT_H_
