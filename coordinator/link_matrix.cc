#include "coordinator/link_matrix.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace aqswarm::coordinator {

absl::Status ValidateLinkEstimate(double bandwidth, double rtt) {
  if (!std::isfinite(bandwidth) || bandwidth <= 0 || bandwidth > 1e12) {
    return absl::InvalidArgumentError(
        absl::StrCat("bandwidth_bytes_per_second ", bandwidth, " is not finite in (0, 1e12]"));
  }
  if (!std::isfinite(rtt) || rtt < 0 || rtt > 60) {
    return absl::InvalidArgumentError(absl::StrCat("rtt_seconds ", rtt, " is not finite in [0, 60]"));
  }
  return absl::OkStatus();
}

void LinkMatrix::Report(uint64_t from, uint64_t to, double bandwidth, double rtt, absl::Time at) {
  measured_[{from, to}] = LinkEstimate{bandwidth, rtt, true, at};
}

const LinkEstimate* LinkMatrix::Measured(uint64_t from, uint64_t to) const {
  auto it = measured_.find({from, to});
  return it == measured_.end() ? nullptr : &it->second;
}

LinkEstimate LinkMatrix::Get(uint64_t from, uint64_t to) const {
  auto it = measured_.find({from, to});
  if (it != measured_.end()) return it->second;
  it = measured_.find({to, from});
  if (it != measured_.end()) return it->second;
  return guess_;
}

std::vector<std::pair<uint64_t, LinkEstimate>> LinkMatrix::MeasuredFrom(uint64_t from) const {
  std::vector<std::pair<uint64_t, LinkEstimate>> out;
  for (auto it = measured_.lower_bound({from, 0}); it != measured_.end() && it->first.first == from; ++it) {
    out.emplace_back(it->first.second, it->second);
  }
  return out;
}

void LinkMatrix::RemovePeer(uint64_t peer) {
  for (auto it = measured_.begin(); it != measured_.end();) {
    if (it->first.first == peer || it->first.second == peer) {
      it = measured_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace aqswarm::coordinator
