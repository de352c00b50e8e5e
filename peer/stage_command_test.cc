#include "peer/stage_command.h"

#include <filesystem>

#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/job_spec.h"

namespace aqswarm::peer {
namespace {

// Every field away from its default.
StageCommand Full() {
  StageCommand c;
  c.job = "/w/job.json";
  c.stages = 4;
  c.dp = 2;
  c.stage = 3;
  c.pipeline = 1;
  c.listen = "0.0.0.0:7101";
  c.next = "10.0.0.2:7101";
  c.peers_on_stdin = true;
  c.store_dir = "/w/store";
  c.generation = 3;
  c.next_generation = 5;
  c.previous_generation = 4;
  c.exchange_listen = "0.0.0.0:7201";
  c.replicas = {"10.0.0.1:7201", "10.0.0.9:7201"};
  c.replica_generation = 6;
  c.plan = 12;
  c.die_with_parent = true;
  c.start_step = 40;
  c.init_checkpoint = "/w/checkpoints/stage-3/state-40.ckpt";
  c.checkpoint_dir = "/w/checkpoints/stage-3";
  c.keep_checkpoints = 6;
  c.link_timeout_s = 30;
  c.metrics_listen = "127.0.0.1:9300";
  c.tls_dir = "/w/tls";
  c.name = "gpu-7";
  c.previous_peer = "gpu-3";
  c.next_peer = "gpu-9";
  c.replica_peers = {"gpu-1", "gpu-7"};
  c.insecure = true;
  c.uplink_kbps = 500;
  c.previous = "10.0.0.3:7100";
  c.dial_previous = true;
  c.accept_next = true;
  return c;
}

std::vector<std::string> Args(const StageCommand& c) {
  std::vector<std::string> argv = c.ToArgv("aqswarm");
  return {argv.begin() + 2, argv.end()};
}

TEST(StageCommandTest, EveryFieldRoundTripsThroughArgv) {
  const StageCommand c = Full();
  const std::vector<std::string> argv = c.ToArgv("/usr/bin/aqswarm");
  ASSERT_GE(argv.size(), 2u);
  EXPECT_EQ(argv[0], "/usr/bin/aqswarm");
  EXPECT_EQ(argv[1], "stage");
  EXPECT_EQ(argv.size(), 2 + StageCommand::FlagNames().size());  // every field printed
  absl::StatusOr<StageCommand> back = StageCommand::FromArgs(Args(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == c);
  EXPECT_THAT(argv, ::testing::Contains("--replicas=10.0.0.1:7201,10.0.0.9:7201"));
  EXPECT_THAT(argv, ::testing::Contains("--die_with_parent"));
}

TEST(StageCommandTest, DefaultsAreLeftOutAndComeBack) {
  StageCommand c;
  c.job = "job.json";
  EXPECT_THAT(c.ToArgv("aqswarm"), ::testing::ElementsAre("aqswarm", "stage", "--job=job.json"));
  absl::StatusOr<StageCommand> back = StageCommand::FromArgs(Args(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == c);
  // Each single field differs from the default in exactly one flag.
  StageCommand d;
  d.start_step = 7;
  EXPECT_THAT(Args(d), ::testing::ElementsAre("--start_step=7"));
}

TEST(StageCommandTest, BadArgumentsAreRefusedWithTheFlagNamed) {
  for (const std::vector<std::string>& bad :
       std::vector<std::vector<std::string>>{{"--stage=x"}, {"--bogus=1"}, {"positional"}, {"--start_step"},
                                             {"--die_with_parent=maybe"}, {"--nodie_with_parent=true"},
                                             {"--generation=-1"}, {"--keep_checkpoints=99999999999"}}) {
    absl::StatusOr<StageCommand> c = StageCommand::FromArgs(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(c.status())) << bad[0] << ": " << c.status();
  }
  absl::StatusOr<StageCommand> c = StageCommand::FromArgs({"--die_with_parent", "--nodie_with_parent"});
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->die_with_parent);
}

TEST(StageCommandTest, RunnerOptionsCarryTheFields) {
  const StageCommand c = Full();
  v1::JobSpec job;
  job.set_name("j");
  const StageRunnerOptions o = StageRunnerOptionsFor(c, job);
  EXPECT_EQ(o.job.name(), "j");
  EXPECT_EQ(o.stage, 3);
  EXPECT_EQ(o.pipeline, 1);
  EXPECT_EQ(o.next, c.next);
  EXPECT_EQ(o.start_step, 40);
  EXPECT_EQ(o.plan, 12u);
  EXPECT_EQ(o.link_timeout, absl::Seconds(30));
  EXPECT_EQ(o.tls.dir, "/w/tls");
  EXPECT_EQ(o.tls.name, "gpu-7");
  EXPECT_EQ(o.previous_peer, "gpu-3");
  EXPECT_EQ(o.next_peer, "gpu-9");
  EXPECT_EQ(o.replica_peers, (std::vector<std::string>{"gpu-1", "gpu-7"}));
  // compression.storeBytes: unset is 64 GiB, 0 no limit, else as set.
  EXPECT_EQ(o.store_capacity_bytes, 64ull << 30);
  job.mutable_compression()->set_store_bytes(0);
  EXPECT_EQ(StageRunnerOptionsFor(c, job).store_capacity_bytes, 0u);
  job.mutable_compression()->set_store_bytes(5 << 20);
  EXPECT_EQ(StageRunnerOptionsFor(c, job).store_capacity_bytes, 5u << 20);
}

// The `aqswarm stage` command accepts every flag the struct writes (its
// flags are declared in cli/; --dry_run parses them and exits 0).
TEST(StageCommandTest, TheRealStageCommandAcceptsEveryFlag) {
  std::vector<std::string> argv = Full().ToArgv(AQSWARM_BINARY);
  argv.push_back("--dry_run");
  absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Spawn(argv, {.capture_stdout = true});
  ASSERT_TRUE(child.ok()) << child.status();
  std::string line;
  ASSERT_TRUE((*child)->ReadLine(&line, absl::Seconds(30)).ok());
  EXPECT_THAT(line, ::testing::HasSubstr("dry run: flags accepted"));
  absl::StatusOr<int> code = (*child)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
}

// compression.storeBytes reaches the message store; a budget that cannot
// hold one m(xi) row is refused naming the field.
TEST(StageCommandTest, AStoreBudgetBelowOneRowIsRefusedNamingStoreBytes) {
  auto job = pipeline::ParseJobSpec(R"({"name":"budget","seed":1,
      "model":{"seqLen":16,"dModel":16,"nLayer":2,"nHead":2,"vocabSize":64},
      "data":{"syntheticTokens":4096},
      "microBatchSize":2,"microBatchesPerStep":2,"epochs":1,
      "compression":{"mode":"aqsgd","store":"memory","storeBytes":100},"stages":2})");
  ASSERT_TRUE(job.ok()) << job.status();
  StageCommand c;
  c.stage = 1;
  StageRunnerOptions o = StageRunnerOptionsFor(c, *job);
  EXPECT_EQ(o.store_capacity_bytes, 100u);
  auto runner = StageRunner::Create(o);
  EXPECT_TRUE(absl::IsInvalidArgument(runner.status())) << runner.status();
  EXPECT_THAT(runner.status().message(), ::testing::HasSubstr("compression.storeBytes"));
  // One row (16 x 16 fp16 = 512 bytes) fits in 4096: the stage starts.
  job->mutable_compression()->set_store_bytes(4096);
  runner = StageRunner::Create(StageRunnerOptionsFor(c, *job));
  EXPECT_TRUE(runner.ok()) << runner.status();
}

}  // namespace
}  // namespace aqswarm::peer
