#include "peer/peer_daemon_impl.h"

namespace aqswarm::peer::daemon {

// Probes the peers heartbeat answers asked for, one at a time.
void PeerDaemonImpl::ProbeLoop() {
  while (true) {
    v1::Neighbor target;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](PeerDaemonImpl* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) { return d->stop_ || !d->probes_.empty(); },
          this));
      if (stop_) return;
      target = probes_.front();
    }
    ProbeOptions po;
    po.payload_bytes = o_.probe_bytes;
    po.tls = o_.tls;
    po.timeout = absl::Seconds(10);
    absl::StatusOr<LinkProbeResult> r = ProbeLink(target.state_transfer_address(), po);
    {
      absl::MutexLock l(&mu_);
      probes_.pop_front();
    }
    if (!r.ok()) {
      AQSWARM_LOG(INFO) << "peer " << o_.name << ": probe of " << target.peer_name() << " failed: " << r.status();
      continue;
    }
    v1::LinkProbeReport req;
    {
      absl::MutexLock l(&mu_);
      req.set_peer_id(peer_id_);
      req.set_session_token(session_);
    }
    req.set_to_peer_id(target.peer_id());
    req.set_bandwidth_bytes_per_second(r->bandwidth_bytes_per_second);
    req.set_rtt_seconds(r->rtt_seconds);
    const absl::Status s = client_->ReportLinkProbe(req);
    v1::PeerEvent e;
    v1::LinkMeasuredEvent& m = *e.mutable_link_measured();
    m.set_to(target.peer_id());
    m.set_mbit_s(r->bandwidth_bytes_per_second * 8 / 1e6);
    m.set_rtt_ms(r->rtt_seconds * 1e3);
    m.set_reported(s.ok());
    Event(e);
  }
}

// Every kPassiveInterval, the forward link's send rate while busy (from
// the stage's cumulative counters) becomes a passive ReportLinkProbe.
void PeerDaemonImpl::MaybeReportPassive(uint64_t bytes, double seconds) {
  static constexpr absl::Duration kPassiveInterval = absl::Seconds(20);
  v1::LinkProbeReport req;
  {
    absl::MutexLock l(&mu_);
    const absl::Time now = absl::Now();
    if (next_peer_ == 0) return;
    if (!passive_at_.has_value() || bytes < passive_bytes_ || seconds < passive_seconds_) {  // a new child
      passive_at_ = now;
      passive_bytes_ = bytes;
      passive_seconds_ = seconds;
      return;
    }
    const double db = static_cast<double>(bytes - passive_bytes_), ds = seconds - passive_seconds_;
    if (now - *passive_at_ < kPassiveInterval || db < (256 << 10) || ds <= 0) return;
    passive_at_ = now;
    passive_bytes_ = bytes;
    passive_seconds_ = seconds;
    req.set_peer_id(peer_id_);
    req.set_session_token(session_);
    req.set_to_peer_id(next_peer_);
    req.set_bandwidth_bytes_per_second(db / ds);
    req.set_passive(true);
  }
  const absl::Status s = client_->ReportLinkProbe(req);
  v1::PeerEvent e;
  v1::LinkMeasuredEvent& m = *e.mutable_link_measured();
  m.set_to(req.to_peer_id());
  m.set_mbit_s(req.bandwidth_bytes_per_second() * 8 / 1e6);
  m.set_passive(true);
  m.set_reported(s.ok());
  Event(e);
}

}  // namespace aqswarm::peer::daemon
