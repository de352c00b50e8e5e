// Every Prometheus metric a stage process exports (and the StateTransfer
// counters of the peer daemon), declared in one place (stage_metrics.cc;
// the catalogue is `aqswarm metrics list`). Served by common/metrics.h's
// MetricsServer when the launch names a metrics_listen.
//
// storage/, compression/ and pipeline/ know nothing of Prometheus: they keep
// plain counters (MessageStoreStats, PrefetcherStats, LinkEndpointStats,
// GradientCodecStats) and StageMetrics samples them once per step:
//
//   StageMetrics metrics(job, stage, pipeline);
//   metrics.SetSources({.down = down, .up = up, .sender = sender, .receiver = receiver, .store = store});
//   ... every step:
//   metrics.ObserveStep(step_observation, gradient_codec.stats());
//
// Labels: `link` names a pipeline link "p<P>:s<J>-s<J+1>" or a stage's DP
// group "s<J>:dp"; `kind` is activation | gradient | dp; `direction` is
// sent | received. One process runs one stage, so Prometheus's `instance`
// tells stages apart and aqswarm_peer_info{job,stage,pipeline} names them.
//
// Thread-safety: ObserveStep/SetSources from one thread (the stage's);
// CountRejectedMessage from any thread.
#ifndef AQSWARM_STAGE_STAGE_METRICS_H_
#define AQSWARM_STAGE_STAGE_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "pipeline/link_endpoint.h"
#include "stage/reject_reason.h"
#include "proto/job.pb.h"
#include "storage/message_store.h"

namespace aqswarm::stage {

class LinkConnection;

// Declares every peer metric (idempotent). ObserveStep etc. call it; `aqswarm
// metrics list` calls it to print the catalogue.
void DeclarePeerMetrics();

// Counts one message refused by validation
// (aqswarm_peer_rejected_messages_total{reason}: stage/reject_reason.h).
void CountRejectedMessage(RejectReason reason);
// Counts one StateTransfer fetch refused (aqswarm_peer_state_transfer_refused_total;
// reasons in peer/state_transfer.h). Any thread.
void CountStateTransferRefused(absl::string_view reason);

// One finished training step of this stage, as the stage runner measured it.
struct StepObservation {
  int64_t step = 0;
  bool has_loss = false;  // the first and last stages know the pipeline's loss
  double loss = 0;
  int64_t tokens = 0;             // tokens of the pipeline's step
  double step_seconds = 0;        // wall time of the whole step
  double compute_seconds = 0;     // forward/backward/encode/optimizer (store waits included)
  double network_wait_seconds = 0;  // blocked on a neighbour's frame
  double dp_seconds = 0;          // data-parallel exchange + step
  uint64_t dp_bytes_sent = 0;     // cumulative, from the StageWorker
  uint64_t dp_raw_bytes = 0;      // cumulative: the same updates as float32
  uint64_t dp_robust_dropped = 0;  // cumulative: contributions robust aggregation dropped
  uint64_t dp_robust_clipped = 0;  // cumulative: contributions it clipped
};

class StageMetrics {
 public:
  // What the metrics sample every step; any may be null.
  struct Sources {
    const LinkConnection* down = nullptr;  // to stage + 1: activations out, gradients in
    const LinkConnection* up = nullptr;    // from stage - 1: activations in, gradients out
    const pipeline::ActivationSender* sender = nullptr;
    const pipeline::ActivationReceiver* receiver = nullptr;
    const storage::MessageStore* store = nullptr;
  };

  StageMetrics(const v1::JobSpec& job, int stage, int pipeline);
  ~StageMetrics();
  // Call again whenever the links or the store change (new assignment).
  void SetSources(const Sources& sources);
  // `grads`: the counters of the gradient codec of this step only (the
  // runner makes one codec per step).
  void ObserveStep(const StepObservation& step, const pipeline::GradientCodecStats& grads);

 private:
  struct Last;
  std::string fw_link_, bw_link_, dp_link_;
  Sources sources_;
  std::unique_ptr<Last> last_;
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_STAGE_METRICS_H_
