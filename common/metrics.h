// Prometheus metrics for every aqswarm process: one process-wide registry, a
// catalogue of every declared metric (`aqswarm metrics list`), samplers that
// run just before each scrape, and the pull endpoint (prometheus-cpp's
// Exposer, civetweb inside).
//
// Each component declares all of its metrics in one place (STYLE.md), with the
// Declare* helpers below, e.g. stage/stage_metrics.cc, coordinator/coordinator_metrics.cc:
//   auto& sent = DeclareCounter("aqswarm_link_bytes_total", "Bytes on the wire.",
//                               {"link", "kind", "direction"});
//   sent.Add({{"link", "p0:s0-s1"}, {"kind", "activation"}, {"direction", "sent"}}).Increment(n);
// and the process serves them:
//   AQSWARM_ASSIGN_OR_RETURN(auto server, MetricsServer::Start("0.0.0.0:9090"));
//
// Names: aqswarm_<component>_<what>_<unit>, base units, counters end in _total.
// Only peer/, coordinator/ and cli/ link this library: storage/ and
// compression/ expose plain stats structs that their owners sample into it.
//
// civetweb + OpenBLAS (docs/design/STACK.md trap 2): Debian's civetweb creates its threads
// with 100 KiB stacks (USE_STACK_SIZE=102400), and glibc carves the static TLS
// of every loaded library (OpenBLAS, oneDNN, ...) out of that stack, so in a
// torch-linked process pthread_create fails and the Exposer throws "null
// context when constructing CivetServer". metrics.cc therefore interposes
// pthread_attr_setstacksize (exported from the executable, see
// common/CMakeLists.txt) so that no thread asks for less than 1 MiB
// (kMinThreadStackBytes). stage/stage_metrics_test.cc scrapes an exposer inside
// a torch-linked test binary.
//
// Thread-safety: everything here is thread-safe.
#ifndef AQSWARM_COMMON_METRICS_H_
#define AQSWARM_COMMON_METRICS_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}

namespace aqswarm {

// No thread of the process gets a smaller stack than this (see the banner).
inline constexpr size_t kMinThreadStackBytes = size_t{1} << 20;

// The process-wide registry (never destroyed).
prometheus::Registry& MetricsRegistry();

// One entry of the metric catalogue.
struct MetricInfo {
  std::string name;    // e.g. aqswarm_link_bytes_total
  std::string type;    // counter | gauge | histogram
  std::string help;
  std::vector<std::string> labels;
};

// Declares (or finds, when declared before with the same type) a family in
// MetricsRegistry() and records it in the catalogue. `labels` documents the
// label names every child uses.
prometheus::Family<prometheus::Counter>& DeclareCounter(const std::string& name, const std::string& help,
                                                         std::vector<std::string> labels = {});
prometheus::Family<prometheus::Gauge>& DeclareGauge(const std::string& name, const std::string& help,
                                                     std::vector<std::string> labels = {});
prometheus::Family<prometheus::Histogram>& DeclareHistogram(const std::string& name, const std::string& help,
                                                             std::vector<std::string> labels = {});

// Every metric declared so far in this process, sorted by name.
std::vector<MetricInfo> MetricCatalog();

// Runs `sample` before every scrape (e.g. to copy a component's plain stats
// into gauges). The sampler is removed when the handle is destroyed; after the
// handle's destructor returns `sample` is never running or called again.
class MetricsSampler {
 public:
  explicit MetricsSampler(std::function<void()> sample);
  ~MetricsSampler();
  MetricsSampler(const MetricsSampler&) = delete;
  MetricsSampler& operator=(const MetricsSampler&) = delete;

 private:
  uint64_t id_;
};

// Runs every sampler now (what a scrape does first); for tests and
// `aqswarm metrics`.
void RunMetricsSamplers();

// The pull endpoint: GET http://LISTEN/metrics (text format 0.0.4).
class MetricsServer {
 public:
  // `listen` is HOST:PORT; port 0 picks a free port (see port()).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

// Minimal HTTP/1.0 GET over a plain socket (for tests, `aqswarm metrics
// scrape` and readiness probes): the body of a 200 answer, else an error
// naming the status line. `host_port` like "127.0.0.1:9090".
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(10));

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_METRICS_H_
