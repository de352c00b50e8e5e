// End to end: Debian's real `prometheus` server, configured with the shipped
// deploy/prometheus.yml (only targets and intervals rewritten to this test's
// local ports), scrapes a small local swarm (`aqswarm coordinator` and a 2x2
// AQ-SGD + QuantizedAdam `aqswarm pipeline`); then every query of every
// dashboard in dashboards/ must return data through Prometheus's HTTP API.
// Skipped when the `prometheus` binary is missing.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/metrics.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "proto/event_json.h"
#include "nlohmann/json.hpp"

namespace aqswarm {
namespace {

namespace fs = std::filesystem;

const char* kBinary = AQSWARM_BINARY;
const char* kDataDir = AQSWARM_DATA_DIR;
const char* kSourceDir = AQSWARM_SOURCE_DIR;

std::string FindPrometheus() {
  const char* path = std::getenv("PATH");
  for (const auto& dir : absl::StrSplit(path ? path : "/usr/bin", ':')) {
    fs::path p = fs::path(std::string(dir)) / "prometheus";
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "";
}

bool PortFree(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// First port of `n` consecutive free loopback ports.
int FreePorts(int n) {
  std::mt19937 rng(::getpid());
  for (int tries = 0; tries < 200; ++tries) {
    const int base = 20000 + static_cast<int>(rng() % 30000);
    bool ok = true;
    for (int i = 0; i < n && ok; ++i) ok = PortFree(base + i);
    if (ok) return base;
  }
  return 0;
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

std::string Replace(std::string text, const std::string& from, const std::string& to) {
  EXPECT_NE(text.find(from), std::string::npos) << "deploy/prometheus.yml no longer contains: " << from;
  return absl::StrReplaceAll(text, {{from, to}});
}

struct Query {
  std::string dashboard, panel, expr;
};

// Every target expression of every dashboard, with Grafana's variables
// replaced by what they mean over the whole swarm.
std::vector<Query> DashboardQueries() {
  std::vector<Query> out;
  for (const auto& e : fs::directory_iterator(fs::path(kSourceDir) / "dashboards")) {
    if (e.path().extension() != ".json") continue;
    std::ifstream in(e.path());
    nlohmann::json d = nlohmann::json::parse(in, nullptr, false);
    EXPECT_FALSE(d.is_discarded()) << e.path() << " is not valid JSON";
    if (d.is_discarded()) continue;
    for (const auto& p : d["panels"]) {
      for (const auto& t : p["targets"]) {
        std::string expr = absl::StrReplaceAll(t["expr"].get<std::string>(),
                                               {{"$__rate_interval", "30s"}, {"$instance", ".*"}});
        out.push_back({e.path().filename().string(), p["title"].get<std::string>(), expr});
      }
    }
  }
  return out;
}

class PrometheusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("aqswarm_prom_", ::getpid());
    aqswarm::RemoveTree(dir_).IgnoreError();
    fs::create_directories(dir_ / "corpus");
  }
  void TearDown() override { aqswarm::RemoveTree(dir_).IgnoreError(); }

  std::string WriteJob() {
    // A small real corpus: the first 9 kB of the first State of the Union.
    std::vector<fs::path> files;
    for (auto& e : fs::directory_iterator(fs::path(kDataDir) / "sotu")) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    std::ifstream in(files.at(0));
    std::string text(9000, '\0');
    in.read(text.data(), text.size());
    text.resize(in.gcount());
    std::ofstream(dir_ / "corpus" / "small.txt") << text;
    // Runs until stopped: 2 stages x 2 pipelines, AQ-SGD links, QuantizedAdam.
    const std::string json = absl::StrCat(R"({"name":"prom-e2e","seed":5,
      "model":{"seqLen":32,"dModel":32,"nLayer":2,"nHead":2},
      "data":{"corpus":")", (dir_ / "corpus").string(), R"(","tokenizer":")", kDataDir, R"(/gpt2",
              "cacheDir":")", (dir_ / "cache").string(), R"("},
      "optimizer":{"lr":0.003,"warmupSteps":2,"gradClip":1.0},
      "microBatchSize":2,"microBatchesPerStep":2,"epochs":100000,"maxSteps":0,
      "compression":{"mode":"aqsgd","fwBits":3,"bwBits":6,"warmupEpochs":0},
      "stages":2,"dataParallel":2,
      "dp":{"optimizer":"quantized_adam","warmupSteps":2,"bits":4,"bucketSize":512},
      "evalEverySteps":0,"evalBatches":1})");
    const std::string path = (dir_ / "job.json").string();
    std::ofstream(path) << json;
    return path;
  }

  fs::path dir_;
};

TEST_F(PrometheusTest, EveryDashboardQueryReturnsDataFromALocalSwarm) {
  const std::string prometheus = FindPrometheus();
  if (prometheus.empty()) GTEST_SKIP() << "the `prometheus` binary is not installed (apt-get install prometheus)";
  ASSERT_TRUE(fs::exists(fs::path(kDataDir) / "gpt2/encoder.json")) << "run scripts/fetch_data.sh";
  const std::vector<Query> queries = DashboardQueries();
  ASSERT_GE(queries.size(), 10u);
  const std::string job = WriteJob();

  // Coordinator: gRPC and metrics on any free port (it prints both).
  auto coord = Subprocess::Spawn({kBinary, "coordinator", "--job=" + job, "--listen=127.0.0.1:0",
                                  "--state_dir=" + (dir_ / "coord").string(), "--metrics_listen=127.0.0.1:0"},
                                 {.stderr_path = (dir_ / "coordinator.log").string()});
  ASSERT_TRUE(coord.ok()) << coord.status();
  std::string line;
  ASSERT_TRUE((*coord)->ReadLine(&line, absl::Seconds(60)).ok());
  absl::StatusOr<v1::CoordinatorEvent> ev = events::ParseCoordinatorEvent(line);
  ASSERT_TRUE(ev.ok() && ev->has_listening()) << line;
  const int coord_metrics = static_cast<int>(ev->listening().metrics_port());
  ASSERT_GT(coord_metrics, 0) << line;

  // The pipeline's 4 stage processes serve metrics on BASE..BASE+3.
  const int base = FreePorts(5);
  ASSERT_GT(base, 0);
  const int prom_port = base + 4;
  auto pipeline = Subprocess::Spawn({kBinary, "pipeline", "--job=" + job, "--out_dir=" + (dir_ / "run").string(),
                                     absl::StrCat("--metrics_port_base=", base)},
                                    {.stderr_path = (dir_ / "pipeline.log").string()});
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();

  // Prometheus with the shipped config, targets and intervals made local.
  std::ifstream in(fs::path(kSourceDir) / "deploy" / "prometheus.yml");
  std::stringstream shipped;
  shipped << in.rdbuf();
  std::string config = shipped.str();
  config = Replace(config, "'coordinator:9090'", absl::StrCat("'127.0.0.1:", coord_metrics, "'"));
  std::vector<std::string> peers;
  for (int i = 0; i < 4; ++i) peers.push_back(absl::StrCat("'127.0.0.1:", base + i, "'"));
  config = Replace(config, "'peer1:9090', 'peer2:9090', 'peer3:9090', 'peer4:9090', 'peer5:9090'",
                   absl::StrJoin(peers, ", "));
  config = Replace(config, "scrape_interval: 5s", "scrape_interval: 1s");
  std::ofstream(dir_ / "prometheus.yml") << config;
  auto prom = Subprocess::Spawn({prometheus, "--config.file=" + (dir_ / "prometheus.yml").string(),
                                 "--storage.tsdb.path=" + (dir_ / "tsdb").string(),
                                 absl::StrCat("--web.listen-address=127.0.0.1:", prom_port)},
                                {.capture_stdout = false, .stderr_path = (dir_ / "prometheus.log").string()});
  ASSERT_TRUE(prom.ok()) << prom.status();
  const std::string api = absl::StrCat("127.0.0.1:", prom_port);

  // Poll until every query has data (bounded), draining the pipeline's output.
  std::map<std::string, std::string> pending;  // expr -> last answer
  for (const Query& q : queries) pending[q.expr] = "(not asked yet)";
  pending["count(up == 1) == 5"] = "(not asked yet)";  // all 5 targets scraped
  const absl::Time deadline = absl::Now() + absl::Seconds(240);
  while (!pending.empty() && absl::Now() < deadline) {
    std::vector<std::string> lines;
    (void)(*pipeline)->DrainLines(&lines);
    ASSERT_FALSE((*pipeline)->exited()) << "pipeline stopped; see " << (dir_ / "pipeline.log");
    for (auto it = pending.begin(); it != pending.end();) {
      auto body = HttpGet(api, "/api/v1/query?query=" + UrlEncode(it->first), absl::Seconds(5));
      nlohmann::json r = body.ok() ? nlohmann::json::parse(*body, nullptr, false) : nlohmann::json();
      if (body.ok() && !r.is_discarded() && r.value("status", "") == "success" && !r["data"]["result"].empty()) {
        it = pending.erase(it);
      } else {
        it->second = body.ok() ? body->substr(0, 300) : body.status().ToString();
        ++it;
      }
    }
    if (!pending.empty()) absl::SleepFor(absl::Seconds(1));  // poll interval, not a wait for an event
  }
  for (const auto& [expr, answer] : pending) {
    std::string where;
    for (const Query& q : queries) {
      if (q.expr == expr) where = q.dashboard + " / " + q.panel;
    }
    ADD_FAILURE() << "no data for " << (where.empty() ? "" : where + ": ") << expr << "\n  last answer: " << answer;
  }
  (*pipeline)->Signal(SIGTERM);
  (*coord)->Signal(SIGTERM);
  (*prom)->Signal(SIGTERM);
  EXPECT_TRUE((*pipeline)->Wait(absl::Seconds(60)).ok());
  EXPECT_TRUE((*coord)->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE((*prom)->Wait(absl::Seconds(30)).ok());
}

}  // namespace
}  // namespace aqswarm
