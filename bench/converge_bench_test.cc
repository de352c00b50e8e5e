// `aqswarm bench converge` end to end: the real binary runs a tiny synthetic
// job (2 stages x 2 pipelines) under 2 configurations x 2 shapings; and its
// errors for a missing or corrupt job and bad flags.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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

class ConvergeBenchTest : public ::testing::Test {
 protected:
  // A tiny job on synthetic tokens: 6 steps, evaluated after the last only
  // (random tokens: the val loss is noise, so an earlier eval could reach
  // the target first).
  std::string WriteJob(int data_parallel = 2) {
    const std::string path = dir_.Sub("job.json");
    std::ofstream(path) << R"({"name":"tiny","seed":3,
      "model":{"vocabSize":256,"seqLen":16,"dModel":16,"nLayer":2,"nHead":2},
      "data":{"syntheticTokens":4000},
      "optimizer":{"lr":0.01,"warmupSteps":1,"gradClip":1.0},
      "microBatchSize":2,"microBatchesPerStep":2,"epochs":2,"maxSteps":6,
      "stages":2,"threads":1,"evalEverySteps":6,"evalBatches":2,"dataParallel":)"
                        << data_parallel << "}\n";
    return path;
  }

  Result Bench(std::vector<std::string> flags) {
    std::vector<std::string> argv = {kBinary, "bench", "converge"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return testing::RunForJsonLines(argv, dir_.Sub("bench.err"), absl::Seconds(120));
  }

  testing::ScratchDir dir_;
};

TEST_F(ConvergeBenchTest, TwoConfigsTwoShapingsGiveOneRowPerRunWithRatiosAgainstTheBaseline) {
  Result r = Bench({"--job=" + WriteJob(), "--configs=adamw-fp32,qadam_w2_wb8_lr2-aqsgd_gt", "--shapings=0/0,200/5",
                    "--shaped_steps=2", "--out_dir=" + dir_.Sub("runs")});
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_EQ(r.rows.size(), 4u) << r.err;
  const std::vector<std::string> runs = {"adamw-fp32@0/0", "adamw-fp32@200/5", "qadam_w2_wb8_lr2-aqsgd_gt@0/0",
                                         "qadam_w2_wb8_lr2-aqsgd_gt@200/5"};
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const nlohmann::json& row = r.rows[i];
    for (const char* key :
         {"run", "dp_optimizer", "link_mode", "fw_bits", "bw_bits", "bandwidth_mbps", "latency_ms", "steps",
          "target_val_loss", "steps_to_target", "seconds_to_target", "final_val_loss", "val_loss_vs_baseline",
          "dp_bytes_per_replica", "dp_bytes_ratio_vs_adamw", "link_bytes_ratio_vs_fp32", "extrapolated"}) {
      EXPECT_TRUE(row.contains(key)) << key << " missing in " << row.dump();
    }
    EXPECT_EQ(row["run"], runs[i]);
    EXPECT_EQ(row["job_steps"], 6);
    // One target for every run.
    EXPECT_EQ(row["target_val_loss"], r.rows[0]["target_val_loss"]);
    const bool shaped = i % 2 == 1;
    EXPECT_EQ(row["bandwidth_mbps"], shaped ? 200.0 : 0.0);
    EXPECT_EQ(row["latency_ms"], shaped ? 5.0 : 0.0);
    // A shaped run trains its first steps (adamw: past its 2nd adamw step
    // after step 0), each checked against the unshaped run.
    EXPECT_EQ(row["training_checked_steps"], shaped ? row["steps"].get<int>() : 0);
    if (!row["steps_to_target"].is_null()) {
      EXPECT_EQ(row["extrapolated"], row["steps_to_target"].get<int>() > row["steps"].get<int>()) << row.dump();
      EXPECT_GT(row["seconds_to_target"].get<double>(), 0);
    }
  }
  const nlohmann::json& base = r.rows[0];
  EXPECT_EQ(base["dp_optimizer"], "adamw");
  EXPECT_EQ(base["link_mode"], "fp32");
  EXPECT_EQ(base["fw_bits"], 32);
  EXPECT_EQ(base["steps"], 6);
  EXPECT_EQ(base["dp_bytes_ratio_vs_adamw"], 1.0);
  EXPECT_EQ(base["link_bytes_ratio_vs_fp32"], 1.0);
  EXPECT_EQ(base["val_loss_vs_baseline"], 0.0);
  // The default target: the baseline's final val loss + 1%, reached at the
  // only eval, after the last step.
  EXPECT_NEAR(base["target_val_loss"].get<double>(), base["final_val_loss"].get<double>() * 1.01, 1e-9);
  EXPECT_EQ(base["steps_to_target"], 6);
  // The shaped baseline: cut after 3 steps, its later steps at its own mean
  // step time (one DP step kind; step 0, the start-up, left out).
  const nlohmann::json& cut = r.rows[1];
  EXPECT_EQ(cut["steps"], 3);
  EXPECT_EQ(cut["steps_to_target"], base["steps_to_target"]);
  ASSERT_EQ(cut["extrapolated"], true) << cut.dump();
  EXPECT_NEAR(cut["seconds_to_target"].get<double>(),
              cut["seconds_measured"].get<double>() +
                  (cut["steps_to_target"].get<int>() - 3) * cut["seconds_per_step"].get<double>(),
              1e-9);
  const nlohmann::json& qadam = r.rows[2];
  EXPECT_EQ(qadam["dp_optimizer"], "quantized_adam");
  EXPECT_EQ(qadam["link_mode"], "aqsgd");
  EXPECT_EQ(qadam["fw_bits"], 3);
  EXPECT_EQ(qadam["bw_bits"], 6);
  // The configuration's settings: 2 warm-up steps exchanged as 8-bit
  // min-max, twice the lr, gradients on the links tiled.
  EXPECT_EQ(qadam["warmup_steps"], 2);
  EXPECT_EQ(qadam["warmup_bits"], 8);
  EXPECT_EQ(qadam["bw_codec"], "tiled");
  EXPECT_DOUBLE_EQ(qadam["lr"].get<double>(), 0.02);  // _lr2: twice the job's
  EXPECT_DOUBLE_EQ(base["lr"].get<double>(), 0.01);
  EXPECT_EQ(base["warmup_bits"], 0);
  EXPECT_EQ(base["bw_codec"], "raw");
  EXPECT_GT(qadam["dp_bytes_ratio_vs_adamw"].get<double>(), 1.0);
  EXPECT_LT(qadam["dp_bytes_per_replica"].get<double>(), base["dp_bytes_per_replica"].get<double>());
  // Shaped rows report their configuration's (unshaped) bytes and final loss.
  EXPECT_EQ(r.rows[3]["dp_bytes_per_replica"], qadam["dp_bytes_per_replica"]);
  EXPECT_EQ(r.rows[3]["final_val_loss"], qadam["final_val_loss"]);
}

// --baseline: an earlier bench's adamw-fp32@0/0 row is the baseline, which
// then does not run; a row of another job, a corrupt or a missing file is
// refused before anything runs.
TEST_F(ConvergeBenchTest, AnEarlierBaselineRowStandsInForTheBaselineRun) {
  const std::string job = WriteJob();
  Result first = Bench({"--job=" + job, "--configs=adamw-fp32", "--shapings=0/0"});
  ASSERT_EQ(first.code, 0) << first.err;
  ASSERT_EQ(first.rows.size(), 1u);
  const nlohmann::json& base = first.rows[0];
  ASSERT_TRUE(base.contains("job_sha256")) << base.dump();
  const std::string file = dir_.Sub("base.jsonl");
  std::ofstream(file) << base.dump() << "\n";

  Result r = Bench({"--job=" + job, "--configs=qadam-aqsgd", "--shapings=0/0", "--baseline=" + file});
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_EQ(r.rows.size(), 1u) << r.err;  // no adamw-fp32 row: it did not run
  const nlohmann::json& q = r.rows[0];
  EXPECT_EQ(q["run"], "qadam-aqsgd@0/0");
  EXPECT_EQ(q["baseline"], file);
  EXPECT_EQ(q["job_sha256"], base["job_sha256"]);
  EXPECT_EQ(q["target_val_loss"], base["target_val_loss"]);
  EXPECT_DOUBLE_EQ(q["dp_bytes_ratio_vs_adamw"].get<double>(),
                   base["dp_bytes_per_replica"].get<double>() / q["dp_bytes_per_replica"].get<double>());
  EXPECT_DOUBLE_EQ(q["val_loss_vs_baseline"].get<double>(),
                   (q["final_val_loss"].get<double>() - base["final_val_loss"].get<double>()) /
                       base["final_val_loss"].get<double>());
  EXPECT_THAT(r.err, HasSubstr("baseline: adamw-fp32@0/0 of " + file));

  // Another job (twice the lr): refused by its job_sha256, and, in a row
  // without one (an older bench), by its lr.
  std::stringstream text;
  text << std::ifstream(job).rdbuf();
  std::string other_text = text.str();
  other_text.replace(other_text.find("\"lr\":0.01"), 9, "\"lr\":0.02");
  const std::string other = dir_.Sub("other.json");
  std::ofstream(other) << other_text;
  Result by_sha = Bench({"--job=" + other, "--configs=qadam-aqsgd", "--shapings=0/0", "--baseline=" + file});
  EXPECT_EQ(by_sha.code, 1);
  EXPECT_THAT(by_sha.err, HasSubstr("another job (job_sha256"));
  nlohmann::json old_row = base;
  old_row.erase("job_sha256");
  const std::string old_file = dir_.Sub("old.jsonl");
  std::ofstream(old_file) << old_row.dump() << "\n";
  Result by_lr = Bench({"--job=" + other, "--configs=qadam-aqsgd", "--shapings=0/0", "--baseline=" + old_file});
  EXPECT_EQ(by_lr.code, 1);
  EXPECT_THAT(by_lr.err, HasSubstr("another job (6 steps at lr 0.01; this job: 6 at 0.02)"));

  const std::string corrupt = dir_.Sub("corrupt.jsonl");
  std::ofstream(corrupt) << "{\"config\": \"adamw-fp32\",\n";
  Result bad = Bench({"--job=" + job, "--configs=qadam-aqsgd", "--baseline=" + corrupt});
  EXPECT_EQ(bad.code, 1);
  EXPECT_THAT(bad.err, HasSubstr("line 1: not a JSON object"));
  const std::string no_row = dir_.Sub("qadam.jsonl");
  std::ofstream(no_row) << q.dump() << "\n{\"config\": 7, \"bandwidth_mbps\": 0}\n";  // not a config name
  Result none = Bench({"--job=" + job, "--configs=qadam-aqsgd", "--baseline=" + no_row});
  EXPECT_THAT(none.err, HasSubstr("no adamw-fp32@0/0 row"));
  Result missing = Bench({"--job=" + job, "--configs=qadam-aqsgd", "--baseline=" + dir_.Sub("nothing.jsonl")});
  EXPECT_THAT(missing.err, HasSubstr("cannot read it"));
  for (const Result* e : {&by_sha, &by_lr, &bad, &none, &missing}) {
    EXPECT_EQ(e->code, 1);
    EXPECT_TRUE(e->rows.empty());
    EXPECT_THAT(e->err, ::testing::Not(HasSubstr("aqswarm bench converge: job")));  // nothing ran: no banner
  }
}

TEST_F(ConvergeBenchTest, AMissingJobFileFailsWithItsName) {
  const std::string missing = dir_.Sub("no-such-job.json");
  Result r = Bench({"--job=" + missing, "--configs=adamw-fp32"});
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(r.rows.empty());
  EXPECT_THAT(r.err, HasSubstr("converge: job '" + missing + "'"));
}

TEST_F(ConvergeBenchTest, ACorruptJobFileFailsWithItsName) {
  const std::string path = dir_.Sub("corrupt.json");
  std::ofstream(path) << R"({"name":"x","stages":2,"dataParallel":)";
  Result r = Bench({"--job=" + path});
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(r.rows.empty());
  EXPECT_THAT(r.err, HasSubstr("converge: job '" + path + "'"));
}

TEST_F(ConvergeBenchTest, AJobWithoutDataParallelismRunsOnlyLinkConfigurations) {
  Result r = Bench({"--job=" + WriteJob(/*data_parallel=*/1), "--configs=adamw-fp32,qadam-aqsgd"});
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(r.rows.empty());
  EXPECT_THAT(r.err, HasSubstr("configuration qadam-aqsgd compares DP optimizers"));
  EXPECT_THAT(r.err, HasSubstr("2 stages x 1 pipelines: want dataParallel >= 2"));
}

TEST_F(ConvergeBenchTest, BadFlagsGiveClearErrorsBeforeAnythingRuns) {
  const std::string job = WriteJob();
  Result shaping = Bench({"--job=" + job, "--shapings=0/0,fast/50"});
  EXPECT_EQ(shaping.code, 1);
  EXPECT_THAT(shaping.err, HasSubstr("bad shaping 'fast/50' (want MBIT/MS"));
  Result one = Bench({"--job=" + job, "--shapings=100"});
  EXPECT_THAT(one.err, HasSubstr("bad shaping '100'"));
  Result config = Bench({"--job=" + job, "--configs=adamw-fp32,sgd-fp32"});
  EXPECT_EQ(config.code, 1);
  EXPECT_THAT(config.err, HasSubstr("unknown configuration 'sgd-fp32'"));
  // Unknown names, among them: _tok is for tiled links, fp32 links send raw
  // gradients (_gt) and carry no codes (_ent), OPT settings belong to their
  // optimizer and have ranges.
  for (const char* name : {"diloco-h0-aqsgd", "adamw-tiled9", "adamw-fp32_ent", "adamw-aqsgd_tok", "adamw-fp32_gt",
                           "adamw_w8-fp32", "qadam_wb9-aqsgd", "diloco-h8_olr0-aqsgd", "adamw_lr0-fp32",
                           "diloco-h8_dpu-aqsgd", "adamw_b8-fp32", "diloco-h8_b1-aqsgd", "qadam_b9-aqsgd",
                           "qadam_ls1-aqsgd", "adamw_ls2-fp32", "diloco-h8_lsg2-aqsgd",
                           "adamw_steps0-fp32", "adamw_ent-fp32", "diloco-h8_stepsx-aqsgd"}) {
    Result r = Bench({"--job=" + job, std::string("--configs=adamw-fp32,") + name});
    EXPECT_EQ(r.code, 1) << name;
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat("unknown configuration '", name, "'")));
    EXPECT_TRUE(r.rows.empty()) << name;
    EXPECT_THAT(r.err, ::testing::Not(HasSubstr("aqswarm bench converge: job")));  // nothing ran: no banner
  }
  Result no_job = Bench({});
  EXPECT_EQ(no_job.code, 1);
  EXPECT_THAT(no_job.err, HasSubstr("--job is required"));
  for (const Result* r : {&shaping, &one, &config, &no_job}) {
    EXPECT_TRUE(r->rows.empty());
    EXPECT_THAT(r->err, ::testing::Not(HasSubstr("aqswarm bench converge: job")));  // nothing ran: no banner
  }
}

}  // namespace
}  // namespace aqswarm
