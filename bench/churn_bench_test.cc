// `aqswarm bench churn` end to end: the real binary runs a tiny synthetic
// job on a 2 x 2 grid with a standby, undisturbed and with kills; and its
// errors for a missing job, a grid without replicas and bad flags.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/json_lines.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm {
namespace {

using ::testing::HasSubstr;

const char* kBinary = AQSWARM_BINARY;

using Result = testing::JsonLinesRun;

class ChurnBenchTest : public ::testing::Test {
 protected:
  std::string WriteJob(int data_parallel) {
    const std::string path = dir_.Sub("job.json");
    std::ofstream(path) << R"({"name":"churn-it","seed":3,
      "model":{"vocabSize":256,"seqLen":16,"dModel":16,"nLayer":2,"nHead":2},
      "data":{"syntheticTokens":20000},
      "optimizer":{"lr":0.01,"warmupSteps":1,"gradClip":1.0},
      "microBatchSize":2,"microBatchesPerStep":2,"epochs":50,"maxSteps":100000,
      "stages":2,"threads":1,"evalEverySteps":0,"dataParallel":)"
                        << data_parallel << "}\n";
    return path;
  }

  Result Bench(std::vector<std::string> flags) {
    std::vector<std::string> argv = {kBinary, "bench", "churn"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return testing::RunForJsonLines(argv, dir_.Sub("bench.err"), absl::Seconds(300));
  }

  testing::ScratchDir dir_;
};

// Kills every ~6 s for 24 s: the churn run has kills, each with a measured
// stall, and the undisturbed run is its own baseline (ratio 1, nothing
// redone). Numbers are not asserted: this machine's are noise at this size.
TEST_F(ChurnBenchTest, AnUndisturbedAndAChurnRunGiveOneRowEachWithTheKillsCosts) {
  Result r = Bench({"--job=" + WriteJob(2), "--churn_seconds=24", "--kill_every_s=6", "--standbys=1", "--lease_s=3",
                    "--link_timeout_s=20", "--out_dir=" + dir_.Sub("runs")});
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_EQ(r.rows.size(), 2u) << r.err;
  const nlohmann::json& base = r.rows[0];
  const nlohmann::json& churn = r.rows[1];
  EXPECT_EQ(base["run"], "undisturbed");
  EXPECT_EQ(churn["run"], "churn");
  EXPECT_EQ(base["grid"], "2x2");
  EXPECT_EQ(base["events"], 0);
  EXPECT_GT(base["steps"].get<double>(), 0) << base.dump();
  EXPECT_DOUBLE_EQ(base["throughput_ratio_vs_undisturbed"].get<double>(), 1.0);
  EXPECT_EQ(base["healthy_steps_redone"], 0) << "an undisturbed run redoes nothing";
  EXPECT_GE(churn["events"].get<int>(), 1) << churn.dump();
  EXPECT_EQ(churn["swarm_seconds_lost_per_event"]["n"], churn["events"]);
  EXPECT_GE(churn["swarm_seconds_lost_per_event"]["p50"].get<double>(), 0) << churn.dump();
  EXPECT_GE(churn["throughput_ratio_vs_undisturbed"].get<double>(), 0);
  EXPECT_EQ(churn["loss_kind"], "train");
  EXPECT_TRUE(std::filesystem::exists(churn["dir"].get<std::string>())) << "--out_dir keeps the runs";
}

TEST_F(ChurnBenchTest, AMissingOrCorruptJobAGridWithoutReplicasAndBadFlagsAreRefused) {
  Result missing = Bench({"--job=" + dir_.Sub("nope.json")});
  EXPECT_NE(missing.code, 0);
  EXPECT_THAT(missing.err, HasSubstr("cannot read the job"));
  Result single = Bench({"--job=" + WriteJob(1)});
  EXPECT_NE(single.code, 0);
  EXPECT_THAT(single.err, HasSubstr("dataParallel >= 2"));
  const std::string corrupt = dir_.Sub("corrupt.json");
  std::ofstream(corrupt) << "{\"name\": \"churn-it\", ";
  Result garbled = Bench({"--job=" + corrupt});
  EXPECT_NE(garbled.code, 0);
  EXPECT_THAT(garbled.err, HasSubstr("is not a JSON job"));
  EXPECT_TRUE(garbled.rows.empty());
  Result bad = Bench({"--job=" + WriteJob(2), "--kill_every_s=0"});
  EXPECT_NE(bad.code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--kill_every_s"));
  EXPECT_TRUE(missing.rows.empty() && single.rows.empty() && bad.rows.empty());
}

}  // namespace
}  // namespace aqswarm
