// `aqswarm metrics list` (the catalogue of every metric the binary exports),
// `aqswarm metrics scrape` (GET a running process's /metrics), and the
// --metrics_listen / --metrics_port_base flags shared by the commands that
// serve metrics (coordinator, stage, pipeline, peer).
#include <iostream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/command.h"
#include "common/metrics.h"
#include "coordinator/coordinator_metrics.h"
#include "nlohmann/json.hpp"
#include "stage/stage_metrics.h"

ABSL_DECLARE_FLAG(bool, json);

ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT where this process serves Prometheus metrics at /metrics (empty = off; port 0 = any, "
          "printed as metrics_port in the listening event). Deploy: 0.0.0.0:9090.");
ABSL_FLAG(int32_t, metrics_port_base, 0,
          "aqswarm pipeline: stage process i (pipeline p, stage s: i = p * stages + s) serves metrics on "
          "127.0.0.1:BASE+i (0 = off).");
ABSL_FLAG(std::string, metrics_target, "127.0.0.1:9090", "aqswarm metrics scrape: HOST:PORT of the process.");

namespace aqswarm::cli {
namespace {

int RunList(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::cerr << "aqswarm metrics list: unexpected argument " << args[0] << "\n";
    return 2;
  }
  stage::DeclarePeerMetrics();
  coordinator::DeclareCoordinatorMetrics();
  const std::vector<MetricInfo> all = MetricCatalog();
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json out = nlohmann::json::array();
    for (const MetricInfo& m : all) {
      out.push_back({{"name", m.name}, {"type", m.type}, {"help", m.help}, {"labels", m.labels}});
    }
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  for (const MetricInfo& m : all) {
    std::cout << m.name << " " << m.type << (m.labels.empty() ? "" : " {" + absl::StrJoin(m.labels, ",") + "}")
              << "  " << m.help << "\n";
  }
  return 0;
}

int RunScrape(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::cerr << "aqswarm metrics scrape: unexpected argument " << args[0] << "\n";
    return 2;
  }
  auto body = HttpGet(absl::GetFlag(FLAGS_metrics_target), "/metrics");
  if (!body.ok()) {
    std::cerr << "aqswarm metrics scrape: " << body.status() << "\n";
    return 1;
  }
  std::cout << *body;
  return 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> StartMetricsFromFlags() {
  const std::string listen = absl::GetFlag(FLAGS_metrics_listen);
  if (listen.empty()) return std::unique_ptr<MetricsServer>();
  return MetricsServer::Start(listen);
}

std::vector<Command> MetricsCommands() {
  return {
      {"metrics list", "Print every Prometheus metric this binary exports (name, type, labels, help).",
       "example: aqswarm metrics list [--json]", {"json"}, RunList},
      {"metrics scrape", "Print a running aqswarm process's /metrics.",
       "example: aqswarm metrics scrape --metrics_target 127.0.0.1:9090", {"metrics_target"}, RunScrape},
  };
}

}  // namespace aqswarm::cli
