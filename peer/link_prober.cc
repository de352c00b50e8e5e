#include "peer/link_prober.h"

#include <algorithm>

#include "common/logging.h"
#include "peer/state_transfer.h"

namespace aqswarm::peer {

LinkProber::LinkProber(Options options, CoordinatorClient* client, Session session,
                       std::function<void(const v1::PeerEvent&)> report)
    : o_(std::move(options)), client_(client), session_(std::move(session)), report_(std::move(report)) {
  thread_ = std::thread([this] { ProbeLoop(); });
}

LinkProber::~LinkProber() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void LinkProber::Enqueue(const google::protobuf::RepeatedPtrField<v1::Neighbor>& peers) {
  if (o_.probe_bytes == 0) return;
  absl::MutexLock l(&mu_);
  for (const v1::Neighbor& n : peers) {
    const bool queued =
        std::any_of(probes_.begin(), probes_.end(), [&](const v1::Neighbor& q) { return q.peer_id() == n.peer_id(); });
    if (!queued && probes_.size() < 64 && !n.state_transfer_address().empty()) probes_.push_back(n);
  }
}

void LinkProber::SetNextPeer(uint64_t peer_id) {
  absl::MutexLock l(&mu_);
  next_peer_ = peer_id;
  passive_at_.reset();
}

void LinkProber::Report(const v1::LinkProbeReport& request, double rtt_seconds) {
  v1::LinkProbeReport req = request;
  const auto [id, session] = session_();
  req.set_peer_id(id);
  req.set_session_token(session);
  const absl::Status s = client_->ReportLinkProbe(req);
  v1::PeerEvent e;
  v1::LinkMeasuredEvent& m = *e.mutable_link_measured();
  m.set_to(req.to_peer_id());
  m.set_mbit_s(req.bandwidth_bytes_per_second() * 8 / 1e6);
  m.set_rtt_ms(rtt_seconds * 1e3);
  m.set_passive(req.passive());
  m.set_reported(s.ok());
  if (report_) report_(e);
}

void LinkProber::ProbeLoop() {
  while (true) {
    v1::Neighbor target;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !probes_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      target = probes_.front();
    }
    ProbeOptions po;
    po.payload_bytes = o_.probe_bytes;
    po.uplink_mbps = o_.uplink_mbps;
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
    req.set_to_peer_id(target.peer_id());
    req.set_bandwidth_bytes_per_second(r->bandwidth_bytes_per_second);
    req.set_rtt_seconds(r->rtt_seconds);
    Report(req, r->rtt_seconds);
  }
}

void LinkProber::ObserveForwardLink(uint64_t bytes, double seconds) {
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
    req.set_to_peer_id(next_peer_);
    req.set_bandwidth_bytes_per_second(db / ds);
    req.set_passive(true);
  }
  Report(req, 0);
}

}  // namespace aqswarm::peer
