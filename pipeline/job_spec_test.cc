#include "pipeline/job_spec.h"

#include "gtest/gtest.h"
#include "pipeline/quantized_adam.h"

namespace aqswarm::pipeline {
namespace {

TEST(JobSpecTest, ParsesAndFillsDefaults) {
  auto job = ParseJobSpec(R"({"name":"t","seed":7,"model":{"nLayer":4,"dModel":64,"nHead":4},
      "compression":{"mode":"aqsgd","fwBits":3,"bwBits":6},"stages":2})");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->model().vocab_size(), 50257u);
  EXPECT_EQ(job->compression().mode(), v1::LinkCompression::aqsgd);
  EXPECT_EQ(job->compression().m_precision(), "fp16");
  EXPECT_EQ(job->compression().store(), "rocksdb");
  EXPECT_EQ(job->stages(), 2u);
  EXPECT_EQ(job->schedule(), "adaptive");
}

TEST(JobSpecTest, SnakeCaseFieldNamesWork) {
  auto job = ParseJobSpec(R"({"model":{"n_layer":2,"d_model":64,"n_head":2},"micro_batch_size":3})");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->micro_batch_size(), 3u);
}

TEST(JobSpecTest, PreciseErrors) {
  struct Case {
    const char* json;
    const char* needle;
  } cases[] = {
      {R"({"modle":{}})", "modle"},
      {R"({"model":{"dModel":65,"nHead":4}})", "model.d_model"},
      {R"({"compression":{"fwBits":9}})", "compression.fw_bits"},
      {R"({"compression":{"mode":"zip"}})", "zip"},
      {R"({"compression":{"mPrecision":"bf16"}})", "compression.m_precision"},
      {R"({"compression":{"store":"disk"}})", "compression.store"},
      {R"({"compression":{"residentBytes":"2000000000000"}})", "compression.resident_bytes"},
      {R"({"model":{"nLayer":2},"stages":3})", "stages"},
      {R"({"optimizer":{"lr":-1}})", "optimizer.lr"},
      {R"({"device":"tpu"})", "device"},
      {R"({"seed":"x"})", "seed"},
      {R"(not json)", "job spec"},
      {R"({"dp":{"codec":"global_qsgd"}})", "dp.codec"},  // adamw: nothing to compress
      {R"({"dp":{"optimizer":"quantized_adam","codec":"global_qsgd","bits":1}})", "dp.bits"},
      {R"({"dataParallel":2,"dp":{"optimizer":"quantized_adam","codec":"global_qsgd","bits":2}})", "dp.bits"},
      {R"({"dp":{"codec":"zstd"}})", "zstd"},
      {R"({"dp":{"varianceRefreshSteps":4}})", "dp.variance_refresh_steps"},  // adamw: nothing frozen
      {R"({"dp":{"optimizer":"quantized_adam","varianceRefreshSteps":2000000}})", "dp.variance_refresh_steps"},
      {R"({"dp":{"optimizer":"quantized_adam","frozenVariance":"thawed"}})", "thawed"},
      {R"({"dataParallel":2,"shaping":{"bandwidthMbps":100},"dp":{"transport":"nccl"}})", "dp.transport"},
      {R"({"dataParallel":2,"shaping":{"bandwidthScheduleMbps":[0,100]},"dp":{"transport":"nccl"}})", "dp.transport"},
      {R"({"dataParallel":2,"dp":{"transport":"nccl","delayedUpdate":true}})", "dp.delayed_update"},
      {R"({"shaping":{"bandwidthScheduleMbps":[100,-1]}})", "shaping.bandwidth_schedule_mbps"},
      {R"({"shaping":{"bandwidthScheduleMbps":["fast"]}})", "fast"},
      {R"({"shaping":{"bandwidthScheduleMbps":[0,1e-300]}})", "shaping.bandwidth_schedule_mbps"},
      {R"({"shaping":{"bandwidthMbps":1e-9}})", "shaping.bandwidth_mbps"},
      {R"({"shaping":{"bandwidthMbps":-5}})", "shaping.bandwidth_mbps"},
      {R"({"dp":{"transport":"infiniband"}})", "infiniband"},
      {R"({"schedule":"interleaved"})", "schedule: 'interleaved'"},
      {R"({"scheduleInFlight":5000})", "schedule_in_flight"},
  };
  std::string many = R"({"shaping":{"bandwidthScheduleMbps":[1)";
  for (int i = 0; i < 1024; ++i) many += ",1";
  many += "]}}";
  auto too_many = ParseJobSpec(many);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("at most 1024"), std::string::npos) << too_many.status();
  for (const auto& c : cases) {
    auto job = ParseJobSpec(c.json);
    ASSERT_FALSE(job.ok()) << c.json;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(job.status().message().find(c.needle), std::string::npos)
        << c.json << " -> " << job.status();
  }
}

TEST(JobSpecTest, DataParallelCodecDefaultsToMinMaxAndAcceptsGlobalQsgd) {
  auto plain = ParseJobSpec(R"({"dataParallel":2,"dp":{"optimizer":"quantized_adam"}})");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->dp().codec(), v1::DataParallelSpec::minmax);
  EXPECT_EQ(plain->dp().transport(), v1::DataParallelSpec::gradient_exchange);
  auto nccl = ParseJobSpec(R"({"dataParallel":2,"dp":{"transport":"nccl"}})");
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_EQ(nccl->dp().transport(), v1::DataParallelSpec::nccl);
  auto global = ParseJobSpec(R"({"dataParallel":4,"dp":{"optimizer":"quantized_adam","codec":"global_qsgd","bits":4}})");
  ASSERT_TRUE(global.ok()) << global.status();
  EXPECT_EQ(global->dp().codec(), v1::DataParallelSpec::global_qsgd);
}

TEST(JobSpecTest, FrozenVarianceDefaultsToRaiseAtBoundAndRefreshToEveryFourthStep) {
  auto plain = ParseJobSpec(R"({"dataParallel":2,"dp":{"optimizer":"quantized_adam"}})");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->dp().frozen_variance(), v1::DataParallelSpec::raise_at_bound);
  EXPECT_EQ(plain->dp().variance_refresh_steps(), 4u);
  auto never = ParseJobSpec(R"({"dataParallel":2,"dp":{"optimizer":"quantized_adam","varianceRefreshSteps":0}})");
  ASSERT_TRUE(never.ok()) << never.status();
  EXPECT_EQ(never->dp().variance_refresh_steps(), 0u);
  EXPECT_EQ(QuantizedAdamOptionsFromJob(*never).variance_refresh_steps, 0);
  auto adamw = ParseJobSpec(R"({"dataParallel":2})");  // nothing frozen, nothing to refresh
  ASSERT_TRUE(adamw.ok()) << adamw.status();
  EXPECT_EQ(adamw->dp().variance_refresh_steps(), 0u);
  auto set = ParseJobSpec(
      R"({"dataParallel":2,"dp":{"optimizer":"quantized_adam","frozenVariance":"fixed","varianceRefreshSteps":8}})");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->dp().frozen_variance(), v1::DataParallelSpec::fixed);
  EXPECT_EQ(set->dp().variance_refresh_steps(), 8u);
  const QuantizedAdamOptions o = QuantizedAdamOptionsFromJob(*set);
  EXPECT_FALSE(o.raise_variance_at_bound);
  EXPECT_EQ(o.variance_refresh_steps, 8);
  EXPECT_TRUE(QuantizedAdamOptionsFromJob(*plain).raise_variance_at_bound);
}

TEST(JobSpecTest, MissingFileIsNotFound) {
  EXPECT_EQ(LoadJobSpec("/nonexistent/job.json").status().code(), absl::StatusCode::kNotFound);
}

TEST(JobSpecTest, LearningRateSchedule) {
  v1::OptimizerSpec o;
  o.set_lr(1.0);
  o.set_min_lr(0.1);
  o.set_warmup_steps(10);
  o.set_total_steps(110);
  EXPECT_DOUBLE_EQ(LearningRateAt(o, 0), 0.1);
  EXPECT_DOUBLE_EQ(LearningRateAt(o, 9), 1.0);
  EXPECT_DOUBLE_EQ(LearningRateAt(o, 10), 1.0);
  EXPECT_NEAR(LearningRateAt(o, 60), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(LearningRateAt(o, 200), 0.1);
}

}  // namespace
}  // namespace aqswarm::pipeline
