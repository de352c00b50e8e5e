// `aqswarm bench swarmsim` on a small swarm: the real coordinator (gRPC on
// loopback, RocksDB) with simulated peers under heavy churn.
#include <sstream>

#include "absl/status/status.h"
#include "bench/bench.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace aqswarm::bench {
namespace {

TEST(SwarmsimTest, UnderChurnEveryChangeReachesEveryLivePeerAndNoHonestLeaseIsLost) {
  SwarmsimOptions o;
  o.sizes = "24";
  o.virtual_seconds = 90;
  o.churn_per_peer_hour = 120;  // ~70 departures in 90 s among 24 peers
  o.stages = 2;
  o.data_parallel = 4;
  o.client_threads = 2;
  std::ostringstream out;
  ASSERT_TRUE(RunSwarmsimBench(o, out).ok()) << out.str();
  const std::string line = out.str().substr(0, out.str().find('\n'));
  const nlohmann::json j = nlohmann::json::parse(line);
  EXPECT_EQ(j["peers"], 24);
  // Churn happened, of every kind, and each change was measured.
  EXPECT_GT(j["kills"].get<int>(), 0) << line;
  EXPECT_GT(j["leaves"].get<int>(), 0) << line;
  EXPECT_GT(j["joins"].get<int>(), 24) << line;
  EXPECT_GE(j["events"].get<int>(), j["leaves"].get<int>()) << line;
  EXPECT_GT(j["replan_seconds_p50"].get<double>(), 0) << line;
  EXPECT_GT(j["heartbeats"].get<int>(), 0) << line;
  EXPECT_GT(j["probes"].get<int>(), 0) << line;
  // Every change reached every live peer's watch; nobody honest was dropped.
  EXPECT_EQ(j["undelivered"], 0) << line;
  EXPECT_EQ(j["watch_errors"], 0) << line;
  EXPECT_EQ(j["heartbeat_errors"], 0) << line;
  EXPECT_EQ(j["report_errors"], 0) << line;
  EXPECT_EQ(j["honest_leases_lost"], 0) << line;
  // Placed peers mostly keep their slots: at most the grid moves per change.
  EXPECT_LE(j["peers_moved_max"].get<int>(), 8) << line;
}

TEST(SwarmsimTest, BadOptionsAreRefused) {
  std::ostringstream out;
  auto refused = [&](SwarmsimOptions o) { return RunSwarmsimBench(o, out).code() == absl::StatusCode::kInvalidArgument; };
  SwarmsimOptions o;
  o.sizes = "0";
  EXPECT_TRUE(refused(o));
  o.sizes = "ten";
  EXPECT_TRUE(refused(o));
  o = {};
  o.tick_seconds = 5;  // more than lease / 3
  EXPECT_TRUE(refused(o));
  o = {};
  o.kill_fraction = 1.5;
  EXPECT_TRUE(refused(o));
  o = {};
  o.stages = 0;
  EXPECT_TRUE(refused(o));
  o = {};
  o.virtual_seconds = -1;
  EXPECT_TRUE(refused(o));
  EXPECT_TRUE(out.str().empty());
}

}  // namespace
}  // namespace aqswarm::bench
