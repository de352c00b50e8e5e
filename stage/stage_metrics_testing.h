// Test helper: reads a peer counter back from the process's metrics registry.
#ifndef AQSWARM_STAGE_STAGE_METRICS_TESTING_H_
#define AQSWARM_STAGE_STAGE_METRICS_TESTING_H_

#include <string>

#include "common/metrics.h"

namespace aqswarm::stage {

// aqswarm_peer_rejected_messages_total{reason}, 0 when never counted.
inline double Rejected(const std::string& reason) {
  for (const auto& family : MetricsRegistry().Collect()) {
    if (family.name != "aqswarm_peer_rejected_messages_total") continue;
    for (const auto& m : family.metric) {
      for (const auto& l : m.label) {
        if (l.name == "reason" && l.value == reason) return m.counter.value;
      }
    }
  }
  return 0;
}

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_STAGE_METRICS_TESTING_H_
