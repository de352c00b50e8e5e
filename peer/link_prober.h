// Measures a peer's links for the coordinator's planner: timed probes of the
// peers that heartbeat answers name (transfers to their StateTransfer
// server, peer/state_transfer.h ProbeLink), one at a time on its own
// thread, and the forward link's send rate while busy (passive: from the
// stage's cumulative counters in its step events, at most every 20 s).
// Each measurement is reported (ReportLinkProbe) and told as a
// LinkMeasuredEvent.
//
//   LinkProber prober(options, client, session, report);   // starts its thread
//   prober.Enqueue(heartbeat.probe());                     // peers to probe
//   prober.SetNextPeer(assignment.next().peer_id());
//   prober.ObserveForwardLink(step.down_busy().bytes(), step.down_busy().seconds());
#ifndef AQSWARM_PEER_LINK_PROBER_H_
#define AQSWARM_PEER_LINK_PROBER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "peer/coordinator_client.h"
#include "proto/events.pb.h"
#include "rpc/tls.h"

namespace aqswarm::peer {

class LinkProber {
 public:
  struct Options {
    size_t probe_bytes = 1 << 20;  // per timed transfer; 0: no probes
    double uplink_mbps = 0;        // emulated uplink (ProbeOptions::uplink_mbps)
    rpc::TlsOptions tls;
    std::string name;  // this peer's, for logs
  };
  // The current (peer id, session token).
  using Session = std::function<std::pair<uint64_t, std::string>()>;

  LinkProber(Options options, CoordinatorClient* client, Session session,
             std::function<void(const v1::PeerEvent&)> report);
  // Stops and joins its thread (a probe under way ends within its timeout).
  ~LinkProber();

  // Peers to probe (heartbeat answers): queued unless already queued, at
  // most 64, only those with a StateTransfer address.
  void Enqueue(const google::protobuf::RepeatedPtrField<v1::Neighbor>& peers);
  // The forward link's far end from now on (0: none); starts a new passive
  // measurement window.
  void SetNextPeer(uint64_t peer_id);
  // The stage's cumulative busy counters of its forward link.
  void ObserveForwardLink(uint64_t busy_bytes, double busy_seconds);

 private:
  void ProbeLoop();
  void Report(const v1::LinkProbeReport& request, double rtt_seconds);

  const Options o_;
  CoordinatorClient* const client_;
  const Session session_;
  const std::function<void(const v1::PeerEvent&)> report_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<v1::Neighbor> probes_ ABSL_GUARDED_BY(mu_);
  uint64_t next_peer_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<absl::Time> passive_at_ ABSL_GUARDED_BY(mu_);  // the passive window's start
  uint64_t passive_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  double passive_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_LINK_PROBER_H_
