#include "stage/stage_metrics.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "stage/link_transport.h"

namespace aqswarm::stage {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

// Every metric of a peer process: the one place they are declared.
struct PeerFamilies {
  // Links, per link and kind.
  Family<Counter>& link_bytes = DeclareCounter(
      "aqswarm_link_bytes_total", "Bytes on the wire (serialized frames), per link, kind and direction.",
      {"link", "kind", "direction"});
  Family<Counter>& link_raw_bytes = DeclareCounter(
      "aqswarm_link_raw_bytes_total", "What the tensors sent on a link would cost as float32, in bytes.",
      {"link", "kind"});
  Family<Gauge>& link_ratio = DeclareGauge(
      "aqswarm_link_compression_ratio",
      "Effective compression ratio of the last step's sends: float32 bytes / bytes on the wire.", {"link", "kind"});
  Family<Gauge>& link_error = DeclareGauge(
      "aqswarm_link_quantization_error_ratio",
      "Relative quantization error of the last step's sends: ||x - x_hat|| / ||x|| (x_hat as the receiver sees it).",
      {"link", "kind"});
  // AQ-SGD rows.
  Family<Counter>& aqsgd_rows = DeclareCounter(
      "aqswarm_aqsgd_rows_sent_total", "Activation rows sent, by type: full (m reset), delta (Q(a - m)), direct.",
      {"link", "type"});
  Family<Counter>& aqsgd_resent = DeclareCounter(
      "aqswarm_aqsgd_resent_rows_total",
      "Rows sent again in full because the receiver's m(xi) differed (role=sender: resent, receiver: asked).",
      {"link", "role"});
  // Message store and prefetcher.
  Family<Counter>& store_hits =
      DeclareCounter("aqswarm_store_hits_total", "Message store reads that found the sample's m(xi).");
  Family<Counter>& store_misses = DeclareCounter(
      "aqswarm_store_misses_total", "Message store reads of unseen rows (never written, evicted, other generation).");
  Family<Counter>& store_evictions =
      DeclareCounter("aqswarm_store_evictions_total", "Rows deleted (or not stored) by the store's byte budget.");
  Family<Counter>& store_corrupt =
      DeclareCounter("aqswarm_store_corrupt_rows_total", "Rows that failed their checksum on read (treated as unseen).");
  Family<Counter>& store_written = DeclareCounter("aqswarm_store_rows_written_total", "Rows stored by puts.");
  Family<Counter>& store_op_seconds = DeclareCounter(
      "aqswarm_store_operation_seconds_total", "Wall time spent in store batch operations, by op (get, put).", {"op"});
  Family<Counter>& store_ops =
      DeclareCounter("aqswarm_store_operations_total", "Store batch operations, by op (get, put).", {"op"});
  Family<Gauge>& store_live_bytes =
      DeclareGauge("aqswarm_store_live_bytes", "Logical bytes of the rows the message store holds.");
  Family<Gauge>& store_capacity =
      DeclareGauge("aqswarm_store_capacity_bytes", "The message store's byte budget (0 = unlimited).");
  Family<Counter>& prefetch_hits = DeclareCounter(
      "aqswarm_prefetch_hits_total",
      "m(xi) rows served from memory: prefetched, still queued for writing, or (small rows) read from the store's "
      "memory on the stage's thread.",
      {"link", "role"});
  Family<Counter>& prefetch_misses = DeclareCounter(
      "aqswarm_prefetch_misses_total", "m(xi) rows the prefetcher had to read synchronously (with I/O if need be).",
      {"link", "role"});
  // Steps.
  Family<Counter>& step_phase = DeclareCounter(
      "aqswarm_step_phase_seconds_total",
      "Step wall time by phase: compute, network_wait (a neighbour's frame), store_wait (m(xi) loads/writes), "
      "dp_exchange.",
      {"phase"});
  Family<Histogram>& step_duration =
      DeclareHistogram("aqswarm_step_duration_seconds", "Wall time of one training step of this stage.");
  Family<Counter>& steps = DeclareCounter("aqswarm_steps_total", "Training steps this stage finished.");
  Family<Gauge>& train_step = DeclareGauge("aqswarm_train_step", "The last finished step.");
  Family<Gauge>& train_loss =
      DeclareGauge("aqswarm_train_loss", "Training loss of the last step (first and last stages).");
  Family<Gauge>& train_tps = DeclareGauge("aqswarm_train_tokens_per_second", "Tokens/s of this stage's pipeline.");
  Family<Counter>& train_tokens = DeclareCounter("aqswarm_train_tokens_total", "Tokens this stage trained on.");
  // Identity and validation.
  Family<Gauge>& info =
      DeclareGauge("aqswarm_peer_info", "1, labelled with the job, stage and pipeline of this process.",
                   {"job", "stage", "pipeline"});
  Family<Counter>& rejected = DeclareCounter(
      "aqswarm_peer_rejected_messages_total", "Messages refused by validation, by reason.", {"reason"});
  Family<Counter>& state_refused = DeclareCounter(
      "aqswarm_peer_state_transfer_refused_total",
      "StateTransfer fetches refused, by reason: busy (served side: too many at once); fetching side: too_large, "
      "bad_chunk, checksum, sha256_mismatch, truncated.",
      {"reason"});
  Family<Counter>& dp_robust = DeclareCounter(
      "aqswarm_dp_robust_contributions_total",
      "Replica contributions to the chunks this stage owns that robust aggregation (dp.robust) dropped "
      "(not finite) or clipped, by action.",
      {"link", "action"});
};

PeerFamilies& Families() {
  static PeerFamilies* f = new PeerFamilies();
  return *f;
}

// Growth of a cumulative counter since `*last` (0 when it went backwards:
// the source was replaced).
template <typename T>
T Delta(T now, T* last) {
  const T d = now >= *last ? now - *last : 0;
  *last = now;
  return d;
}

double Ratio(double num, double den) { return den > 0 ? num / den : 0; }

}  // namespace

void DeclarePeerMetrics() {
  PeerFamilies& f = Families();
  for (int r = 0; r < kNumRejectReasons; ++r) {
    f.rejected.Add({{"reason", std::string(RejectReasonName(static_cast<RejectReason>(r)))}});
  }
  for (const char* r : {"busy", "too_large", "bad_chunk", "checksum", "sha256_mismatch", "truncated"}) {
    f.state_refused.Add({{"reason", r}});
  }
}

void CountStateTransferRefused(absl::string_view reason) {
  Families().state_refused.Add({{"reason", std::string(reason)}}).Increment();
}

void CountRejectedMessage(RejectReason reason) {
  Families().rejected.Add({{"reason", std::string(RejectReasonName(reason))}}).Increment();
}

struct StageMetrics::Last {
  uint64_t down_sent = 0, down_received = 0, up_sent = 0, up_received = 0, dp_sent = 0, dp_raw = 0;
  uint64_t robust_dropped = 0, robust_clipped = 0;
  pipeline::LinkEndpointStats sender, receiver;
  storage::PrefetcherStats sender_prefetch, receiver_prefetch;
  storage::MessageStoreStats store;
};

StageMetrics::StageMetrics(const v1::JobSpec& job, int stage, int pipeline) : last_(std::make_unique<Last>()) {
  DeclarePeerMetrics();
  fw_link_ = absl::StrCat("p", pipeline, ":s", stage, "-s", stage + 1);
  bw_link_ = absl::StrCat("p", pipeline, ":s", stage - 1, "-s", stage);
  dp_link_ = absl::StrCat("s", stage, ":dp");
  PeerFamilies& f = Families();
  f.info.Add({{"job", job.name()}, {"stage", absl::StrCat(stage)}, {"pipeline", absl::StrCat(pipeline)}}).Set(1);
  for (const char* phase : {"compute", "network_wait", "store_wait", "dp_exchange"}) f.step_phase.Add({{"phase", phase}});
  for (const char* op : {"get", "put"}) {
    f.store_op_seconds.Add({{"op", op}});
    f.store_ops.Add({{"op", op}});
  }
  f.steps.Add({});
  f.train_tokens.Add({});
  f.train_step.Add({});
  f.train_tps.Add({});
}

StageMetrics::~StageMetrics() = default;

void StageMetrics::SetSources(const Sources& sources) {
  sources_ = sources;
  // New sources start from zero (or from their current totals): count growth only.
  Last& l = *last_;
  l.down_sent = sources.down ? sources.down->bytes_sent() : 0;
  l.down_received = sources.down ? sources.down->bytes_received() : 0;
  l.up_sent = sources.up ? sources.up->bytes_sent() : 0;
  l.up_received = sources.up ? sources.up->bytes_received() : 0;
  l.sender = sources.sender ? sources.sender->stats() : pipeline::LinkEndpointStats();
  l.receiver = sources.receiver ? sources.receiver->stats() : pipeline::LinkEndpointStats();
  l.sender_prefetch = sources.sender ? sources.sender->prefetcher_stats() : storage::PrefetcherStats();
  l.receiver_prefetch = sources.receiver ? sources.receiver->prefetcher_stats() : storage::PrefetcherStats();
  l.store = sources.store ? sources.store->GetStats() : storage::MessageStoreStats();
  PeerFamilies& f = Families();
  // Create the series a dashboard expects from the start (zeros until data).
  auto link = [&](const std::string& name, const char* kind, bool sends) {
    f.link_bytes.Add({{"link", name}, {"kind", kind}, {"direction", sends ? "sent" : "received"}});
    if (sends) f.link_raw_bytes.Add({{"link", name}, {"kind", kind}});
  };
  if (sources.down) {
    link(fw_link_, "activation", true);
    link(fw_link_, "gradient", false);
  }
  if (sources.up) {
    link(bw_link_, "activation", false);
    link(bw_link_, "gradient", true);
  }
  if (sources.sender) {
    for (const char* t : {"full", "delta", "direct"}) f.aqsgd_rows.Add({{"link", fw_link_}, {"type", t}});
    f.aqsgd_resent.Add({{"link", fw_link_}, {"role", "sender"}});
    f.prefetch_hits.Add({{"link", fw_link_}, {"role", "sender"}});
    f.prefetch_misses.Add({{"link", fw_link_}, {"role", "sender"}});
  }
  if (sources.receiver) {
    f.aqsgd_resent.Add({{"link", bw_link_}, {"role", "receiver"}});
    f.prefetch_hits.Add({{"link", bw_link_}, {"role", "receiver"}});
    f.prefetch_misses.Add({{"link", bw_link_}, {"role", "receiver"}});
  }
  if (sources.store) {
    f.store_hits.Add({});
    f.store_misses.Add({});
    f.store_evictions.Add({});
    f.store_corrupt.Add({});
    f.store_written.Add({});
  }
}

void StageMetrics::ObserveStep(const StepObservation& s, const pipeline::GradientCodecStats& grads) {
  PeerFamilies& f = Families();
  Last& l = *last_;
  auto bytes = [&](const std::string& link, const char* kind, const char* dir) -> Counter& {
    return f.link_bytes.Add({{"link", link}, {"kind", kind}, {"direction", dir}});
  };
  auto publish = [&](const std::string& link, const char* kind, double raw, double wire, double err_sq,
                     double sig_sq, bool with_error) {
    f.link_raw_bytes.Add({{"link", link}, {"kind", kind}}).Increment(raw);
    if (wire > 0) f.link_ratio.Add({{"link", link}, {"kind", kind}}).Set(Ratio(raw, wire));
    if (with_error && sig_sq > 0) {
      f.link_error.Add({{"link", link}, {"kind", kind}}).Set(std::sqrt(err_sq / sig_sq));
    }
  };

  // Forward link (this stage sends activations, receives gradients).
  if (const LinkConnection* down = sources_.down) {
    const double wire = Delta(down->bytes_sent(), &l.down_sent);
    bytes(fw_link_, "activation", "sent").Increment(wire);
    bytes(fw_link_, "gradient", "received").Increment(Delta(down->bytes_received(), &l.down_received));
    if (const pipeline::ActivationSender* snd = sources_.sender) {
      const pipeline::LinkEndpointStats now = snd->stats();
      const pipeline::LinkEndpointStats& was = l.sender;
      publish(fw_link_, "activation", now.raw_bytes - was.raw_bytes, wire, now.error_sq - was.error_sq,
              now.signal_sq - was.signal_sq, true);
      f.aqsgd_rows.Add({{"link", fw_link_}, {"type", "full"}}).Increment(now.full_rows - was.full_rows);
      f.aqsgd_rows.Add({{"link", fw_link_}, {"type", "delta"}}).Increment(now.delta_rows - was.delta_rows);
      f.aqsgd_rows.Add({{"link", fw_link_}, {"type", "direct"}}).Increment(now.direct_rows - was.direct_rows);
      f.aqsgd_resent.Add({{"link", fw_link_}, {"role", "sender"}}).Increment(now.resend_rows - was.resend_rows);
      l.sender = now;
    }
  }
  // Backward link (this stage receives activations, sends gradients).
  if (const LinkConnection* up = sources_.up) {
    const double wire = Delta(up->bytes_sent(), &l.up_sent);
    bytes(bw_link_, "gradient", "sent").Increment(wire);
    bytes(bw_link_, "activation", "received").Increment(Delta(up->bytes_received(), &l.up_received));
    publish(bw_link_, "gradient", grads.raw_bytes, wire, grads.error_sq, grads.signal_sq, true);
    if (const pipeline::ActivationReceiver* rcv = sources_.receiver) {
      const pipeline::LinkEndpointStats now = rcv->stats();
      f.aqsgd_resent.Add({{"link", bw_link_}, {"role", "receiver"}}).Increment(now.resend_rows - l.receiver.resend_rows);
      l.receiver = now;
    }
  }
  // Data-parallel exchange of this stage's replicas.
  if (s.dp_bytes_sent > 0 || l.dp_sent > 0) {
    const double wire = Delta(s.dp_bytes_sent, &l.dp_sent);
    const double raw = Delta(s.dp_raw_bytes, &l.dp_raw);
    bytes(dp_link_, "dp", "sent").Increment(wire);
    publish(dp_link_, "dp", raw, wire, 0, 0, false);
  }
  if (s.dp_robust_dropped > l.robust_dropped || s.dp_robust_clipped > l.robust_clipped) {
    f.dp_robust.Add({{"link", dp_link_}, {"action", "dropped"}}).Increment(Delta(s.dp_robust_dropped, &l.robust_dropped));
    f.dp_robust.Add({{"link", dp_link_}, {"action", "clipped"}}).Increment(Delta(s.dp_robust_clipped, &l.robust_clipped));
  }

  // Store and prefetchers; store stalls are carved out of compute time.
  double store_wait = 0;
  auto prefetch = [&](const storage::PrefetcherStats& now, storage::PrefetcherStats* was, const std::string& link,
                      const char* role) {
    f.prefetch_hits.Add({{"link", link}, {"role", role}}).Increment(Delta(now.hits, &was->hits));
    f.prefetch_misses.Add({{"link", link}, {"role", role}}).Increment(Delta(now.misses, &was->misses));
    store_wait += 1e-9 * static_cast<double>(Delta(now.get_stall_nanos, &was->get_stall_nanos) +
                                             Delta(now.put_stall_nanos, &was->put_stall_nanos));
  };
  if (sources_.sender) prefetch(sources_.sender->prefetcher_stats(), &l.sender_prefetch, fw_link_, "sender");
  if (sources_.receiver) prefetch(sources_.receiver->prefetcher_stats(), &l.receiver_prefetch, bw_link_, "receiver");
  if (const storage::MessageStore* store = sources_.store) {
    const storage::MessageStoreStats now = store->GetStats();
    storage::MessageStoreStats& was = l.store;
    f.store_hits.Add({}).Increment(Delta(now.rows_found, &was.rows_found));
    f.store_misses.Add({}).Increment(Delta(now.rows_unseen, &was.rows_unseen));
    f.store_evictions.Add({}).Increment(Delta(now.rows_evicted, &was.rows_evicted));
    f.store_corrupt.Add({}).Increment(Delta(now.rows_corrupt, &was.rows_corrupt));
    f.store_written.Add({}).Increment(Delta(now.rows_written, &was.rows_written));
    f.store_ops.Add({{"op", "get"}}).Increment(Delta(now.get_batches, &was.get_batches));
    f.store_ops.Add({{"op", "put"}}).Increment(Delta(now.put_batches, &was.put_batches));
    f.store_op_seconds.Add({{"op", "get"}}).Increment(1e-9 * Delta(now.get_nanos_total, &was.get_nanos_total));
    f.store_op_seconds.Add({{"op", "put"}}).Increment(1e-9 * Delta(now.put_nanos_total, &was.put_nanos_total));
    f.store_live_bytes.Add({}).Set(static_cast<double>(now.live_bytes));
    f.store_capacity.Add({}).Set(static_cast<double>(now.capacity_bytes));
  }

  // Step time split.
  store_wait = std::min(store_wait, s.compute_seconds);
  f.step_phase.Add({{"phase", "compute"}}).Increment(s.compute_seconds - store_wait);
  f.step_phase.Add({{"phase", "store_wait"}}).Increment(store_wait);
  f.step_phase.Add({{"phase", "network_wait"}}).Increment(s.network_wait_seconds);
  f.step_phase.Add({{"phase", "dp_exchange"}}).Increment(s.dp_seconds);
  f.step_duration
      .Add({}, Histogram::BucketBoundaries{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300})
      .Observe(s.step_seconds);
  f.steps.Add({}).Increment();
  f.train_step.Add({}).Set(static_cast<double>(s.step));
  if (s.has_loss) f.train_loss.Add({}).Set(s.loss);
  f.train_tokens.Add({}).Increment(static_cast<double>(s.tokens));
  f.train_tps.Add({}).Set(Ratio(static_cast<double>(s.tokens), s.step_seconds));
}

}  // namespace aqswarm::stage
