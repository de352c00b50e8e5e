// LinkMatrix: measured bandwidth and round-trip time between peers, from
// ReportLinkProbe, with a configured guess for pairs nobody measured.
//
//   LinkMatrix links({.bandwidth_bytes_per_second = 12.5e6, .rtt_seconds = 0.05});
//   links.Report(/*from=*/3, /*to=*/7, 40e6, 0.020);
//   LinkEstimate e = links.Get(7, 3);   // 7->3 unmeasured: the 3->7 measurement
//
// Lookup order for from->to: the from->to report, else the to->from report
// (links are usually near-symmetric), else the default guess.
//
// Thread-safety: not thread-safe; SwarmCoordinator serialises access.
#ifndef AQSWARM_COORDINATOR_LINK_MATRIX_H_
#define AQSWARM_COORDINATOR_LINK_MATRIX_H_

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace aqswarm::coordinator {

struct LinkEstimate {
  // Bytes per second, > 0. Default: 12.5e6 (100 Mbit/s).
  double bandwidth_bytes_per_second = 12.5e6;
  // Seconds, >= 0. Default: 0.05.
  double rtt_seconds = 0.05;
  bool measured = false;
  absl::Time measured_at = absl::InfinitePast();
};

// INVALID_ARGUMENT unless bandwidth is finite in (0, 1e12] B/s and rtt finite in [0, 60] s.
absl::Status ValidateLinkEstimate(double bandwidth_bytes_per_second, double rtt_seconds);

class LinkMatrix {
 public:
  // `guess`: what an unmeasured pair is assumed to be.
  explicit LinkMatrix(LinkEstimate guess = {}) : guess_(guess) {}

  void Report(uint64_t from, uint64_t to, double bandwidth_bytes_per_second, double rtt_seconds,
              absl::Time at = absl::InfinitePast());
  // The from->to measurement itself (not the reverse or the guess), if any.
  const LinkEstimate* Measured(uint64_t from, uint64_t to) const;
  LinkEstimate Get(uint64_t from, uint64_t to) const;
  // Measured links from `from` (to, estimate), by `to`.
  std::vector<std::pair<uint64_t, LinkEstimate>> MeasuredFrom(uint64_t from) const;
  // Forgets every link to or from `peer`.
  void RemovePeer(uint64_t peer);
  const LinkEstimate& guess() const { return guess_; }

 private:
  LinkEstimate guess_;
  std::map<std::pair<uint64_t, uint64_t>, LinkEstimate> measured_;
};

}  // namespace aqswarm::coordinator

#endif  // AQSWARM_COORDINATOR_LINK_MATRIX_H_
