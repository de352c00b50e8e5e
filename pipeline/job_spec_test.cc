#include "pipeline/job_spec.h"

#include <filesystem>
#include <iostream>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/dp_optimizer.h"
#include "pipeline/quantized_adam.h"

namespace aqswarm::pipeline {
namespace {

TEST(JobSpecTest, ParsesAndFillsDefaults) {
  auto job = ParseJobSpec(R"({"name":"t","seed":7,"model":{"nLayer":4,"dModel":64,"nHead":4},
      "compression":{"mode":"aqsgd","fwBits":3,"bwBits":6},"stages":2})");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->model().vocab_size(), 50257u);
  EXPECT_EQ(job->compression().mode(), v1::LinkCompression::aqsgd);
  EXPECT_EQ(job->compression().m_precision(), v1::LinkCompression::MPrecision::fp16);
  EXPECT_EQ(job->compression().store(), v1::LinkCompression::Store::rocksdb);
  EXPECT_EQ(job->stages(), 2u);
  EXPECT_EQ(job->schedule(), v1::JobSpec::Schedule::adaptive);
}

TEST(JobSpecTest, SnakeCaseFieldNamesWork) {
  auto job = ParseJobSpec(R"({"model":{"n_layer":2,"d_model":64,"n_head":2},"micro_batch_size":3})");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->micro_batch_size(), 3u);
}

// A choice is written by its JSON name ("1f1b"; "" for one left to its
// default) and read back to the same job; an older build's job.json, with ""
// for every choice it left unset, reads as unset.
TEST(JobSpecTest, ChoicesAreWrittenByTheirJsonNamesAndReadBack) {
  auto job = ParseJobSpec(R"({"schedule":"1f1b","model":{"family":"llama","nLayer":2,"dModel":64,"nHead":2},
      "compression":{"mode":"aqsgd","tileGrid":"midtread","rotation":"none"}})");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->schedule(), v1::JobSpec::Schedule::one_f_one_b);
  EXPECT_EQ(job->compression().rotation(), v1::LinkCompression::Rotation::none);
  const std::string json = JobSpecJson(*job);
  for (const char* want : {R"("schedule": "1f1b")", R"("family": "llama")", R"("mPrecision": "fp16")",
                           R"("tileGrid": "midtread")", R"("rotation": "none")", R"("firstVisit": "")",
                           R"("bwCodec": "")", R"("lossScale": "")", R"("precision": "fp32")"}) {
    EXPECT_NE(json.find(want), std::string::npos) << want << " in " << json;
  }
  EXPECT_EQ(json.find("one_f_one_b"), std::string::npos) << json;
  EXPECT_EQ(json.find("UNSPECIFIED"), std::string::npos) << json;
  auto back = ParseJobSpec(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), job->SerializeAsString());
  auto older = ParseJobSpec(R"({"schedule":"","optimizer":{"lossScale":""},"compression":{"firstVisit":"",
      "bwCodec":"","rotation":"","tileAlong":""}})");
  ASSERT_TRUE(older.ok()) << older.status();
  EXPECT_EQ(older->schedule(), v1::JobSpec::Schedule::adaptive);  // then defaulted
  EXPECT_EQ(older->optimizer().loss_scale(), v1::OptimizerSpec::LossScale::UNSPECIFIED);
  EXPECT_EQ(older->compression().first_visit(), v1::LinkCompression::FirstVisit::UNSPECIFIED);
  EXPECT_EQ(older->compression().tile_along(), v1::LinkCompression::TileAlong::UNSPECIFIED);
}

// An unknown field names its message, its path and the closest valid name.
TEST(JobSpecTest, AnUnknownFieldNamesTheMessageAndTheClosestValidName) {
  struct Case {
    const char* json;
    const char* path;
    const char* message;
    const char* closest;
  } cases[] = {
      {R"({"data":{"tokenzier":"data/gpt2"}})", "data.tokenzier", "DataSpec", "'tokenizer'"},
      {R"({"modle":{}})", "modle", "JobSpec", "'model'"},
      {R"({"dp":{"optimizer":"diloco","innerStep":4}})", "dp.innerStep", "DataParallelSpec", "'innerSteps'"},
      {R"({"shaping":{"bandwithMbps":10}})", "shaping.bandwithMbps", "LinkShaping", "'bandwidthMbps'"},
  };
  for (const Case& c : cases) {
    const auto job = ParseJobSpec(c.json);
    ASSERT_FALSE(job.ok()) << c.json;
    const std::string m(job.status().message());
    EXPECT_NE(m.find(c.path), std::string::npos) << m;
    EXPECT_NE(m.find(c.message), std::string::npos) << m;
    EXPECT_NE(m.find(c.closest), std::string::npos) << m;
  }
  // A scalar field given an object or an array, and JSON that is not JSON.
  for (const char* bad : {R"({"name":{"a":1}})", R"({"seed":[1]})", R"({"model":[[1]]})", R"({"model":)", "[1]"}) {
    const auto job = ParseJobSpec(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(job.status())) << bad << ": " << job.status();
  }
}

// A renamed field (data.tokenizerDir, now data.tokenizer) still reads, with
// a warning naming both; both names at once are refused.
TEST(JobSpecTest, ARenamedFieldIsReadUnderItsOldNameWithAWarning) {
  std::vector<std::string> warnings;
  const auto job = ParseJobSpec(R"({"data":{"corpus":"data/sotu","tokenizerDir":"data/gpt2"}})", &warnings);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->data().tokenizer(), "data/gpt2");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("data.tokenizerDir"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("data.tokenizer;"), std::string::npos) << warnings[0];
  warnings.clear();
  ASSERT_TRUE(ParseJobSpec(R"({"data":{"tokenizer":"data/gpt2"}})", &warnings).ok());
  EXPECT_TRUE(warnings.empty());
  const auto both = ParseJobSpec(R"({"data":{"tokenizer":"a","tokenizerDir":"b"}})", &warnings);
  EXPECT_TRUE(absl::IsInvalidArgument(both.status())) << both.status();
  EXPECT_NE(both.status().message().find("both set"), std::string::npos) << both.status();
}

TEST(JobSpecTest, PreciseErrors) {
  struct Case {
    const char* json;
    const char* needle;
  } cases[] = {
      {R"({"modle":{}})", "modle"},
      {R"({"model":{"dModel":65,"nHead":4}})", "model.d_model"},
      {R"({"compression":{"fwBits":9}})", "compression.fw_bits"},
      {R"({"compression":{"mPrecision":"bf16"}})", "compression.mPrecision: 'bf16' is not fp32, fp16 or int8"},
      {R"({"compression":{"store":"disk"}})", "compression.store: 'disk' is not rocksdb or memory"},
      {R"({"compression":{"tileGrid":"midway"}})", "compression.tileGrid: 'midway' is not midrise or midtread"},
      {R"({"compression":{"mode":"tiled","fwBits":1,"tileGrid":"midtread"}})", "compression.tile_grid"},
      {R"({"compression":{"mode":"aqsgd","firstVisit":"tiled","firstVisitBits":1,"tileGrid":"midtread"}})",
       "compression.tile_grid"},
      {R"({"compression":{"mode":"aqsgd","firstVisitReference":true}})", "compression.first_visit_reference"},
      {R"({"compression":{"mode":"aqsgd","bwCodec":"qsgd"}})", "compression.bwCodec: 'qsgd' is not fixed_point or tiled"},
      {R"({"compression":{"mode":"fp32","bwCodec":"tiled"}})", "compression.bw_codec"},
      {R"({"compression":{"mode":"tiled","bwCodec":"fixed_point"}})", "compression.bw_codec"},
      {R"({"compression":{"mode":"aqsgd","bwCodec":"tiled","bwBits":1,"tileGrid":"midtread"}})",
       "compression.tile_grid"},
      {R"({"compression":{"mode":"directq","firstVisit":"fixed_point"}})", "compression.first_visit"},
      {R"({"compression":{"mode":"aqsgd","firstVisit":"zstd"}})", "compression.firstVisit: 'zstd' is not raw, tiled or fixed_point"},
      {R"({"compression":{"mode":"tiled","firstVisitReference":true}})", "compression.first_visit_reference"},
      {R"({"model":{"vocabSize":1000000,"dModel":512,"nHead":8},"compression":{"mode":"aqsgd","firstVisit":"tiled","firstVisitReference":true}})",
       "compression.first_visit_reference"},
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
      {R"({"model":{"dModel":131072,"nHead":4}})", "model.d_model"},  // counts must fit int64
      {R"({"model":{"nLayer":5000}})", "model.n_layer"},
      {R"({"model":{"vocabSize":20000000}})", "model.vocab_size"},
      {R"({"model":{"dFf":2000000}})", "model.d_ff"},
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
      {R"({"schedule":"interleaved"})", "schedule: 'interleaved' is not adaptive, 1f1b or gpipe"},
      {R"({"precision":"fp8"})", "precision: 'fp8' is not fp32, bf16 or fp16"},
      {R"({"model":{"family":"mamba"}})", "model.family: 'mamba' is not gpt2 or llama"},
      {R"({"optimizer":{"lossScale":"sometimes"}})", "optimizer.lossScale: 'sometimes' is not dynamic or off"},
      {R"({"compression":{"rotation":"half"}})", "compression.rotation: 'half' is not outliers, all or none"},
      {R"({"compression":{"tileAlong":"rows"}})", "compression.tileAlong: 'rows' is not channels or tokens"},
      {R"({"compression":{"mode":"zip"}})", "compression.mode: 'zip' is not fp32, directq, aqsgd or tiled"},
      {R"({"precision":7})", "precision: 7 is not fp32, bf16 or fp16"},
      {R"({"compression":{"mPrecision":9}})", "compression.m_precision: 9 is not fp32, fp16 or int8"},
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

// dp.warmupSteps: unset, 0/1 Adam's 16 full-precision steps, at most a
// sixteenth of the job's steps and at least 2; set, as given, but a job runs
// at least kMinQuantizedAdamWarmup (0 and 1 run as 2). The tied copy's
// Global-QSGD width carries D replicas' sums whatever dp.bits says.
TEST(JobSpecTest, QuantizedAdamWarmupDefaultsToZeroOneAdamsFirstPhaseAndRunsAtLeastTwoSteps) {
  const auto warmup = [](const std::string& extra, const std::string& dp) {
    auto job = ParseJobSpec(absl::StrCat(R"({"dataParallel":2,"optimizer":{"totalSteps":1000})", extra,
                                         R"(,"dp":{"optimizer":"quantized_adam")", dp, "}}"));
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? std::pair<uint32_t, int64_t>(job->dp().warmup_steps(),
                                                   QuantizedAdamOptionsFromJob(*job).warmup_steps)
                    : std::pair<uint32_t, int64_t>(0, 0);
  };
  EXPECT_EQ(warmup("", ""), (std::pair<uint32_t, int64_t>(16, 16)));
  EXPECT_EQ(warmup(R"(,"maxSteps":64)", ""), (std::pair<uint32_t, int64_t>(4, 4)));
  EXPECT_EQ(warmup(R"(,"maxSteps":8)", ""), (std::pair<uint32_t, int64_t>(2, 2)));
  EXPECT_EQ(warmup("", R"(,"warmupSteps":0)"), (std::pair<uint32_t, int64_t>(0, 2)));
  EXPECT_EQ(warmup("", R"(,"warmupSteps":1)"), (std::pair<uint32_t, int64_t>(1, 2)));
  EXPECT_EQ(warmup("", R"(,"warmupSteps":40)"), (std::pair<uint32_t, int64_t>(40, 40)));
  auto adamw = ParseJobSpec(R"({"dataParallel":2})");
  ASSERT_TRUE(adamw.ok());
  EXPECT_FALSE(adamw->dp().has_warmup_steps());
  for (auto [replicas, bits, want] : {std::tuple{2, 1, 3}, {2, 2, 3}, {4, 2, 3}, {8, 1, 4}, {2, 6, 6}}) {
    v1::JobSpec job;
    job.set_data_parallel(replicas);
    job.mutable_dp()->set_bits(bits);
    EXPECT_EQ(TiedGlobalQsgdBits(job), want) << replicas << " replicas, dp.bits " << bits;
  }
}

TEST(JobSpecTest, RobustAggregationIsOffByDefaultAndValidated) {
  auto plain = ParseJobSpec(R"({"dataParallel":3})");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->dp().robust(), v1::DataParallelSpec::robust_off);
  EXPECT_EQ(QuantizedAdamOptionsFromJob(*plain).compressed.robust, RobustAggregation::kOff);
  auto clip = ParseJobSpec(R"({"dataParallel":3,"dp":{"robust":"clip_norm"}})");
  ASSERT_TRUE(clip.ok()) << clip.status();
  EXPECT_EQ(clip->dp().robust_clip(), 2);
  EXPECT_EQ(QuantizedAdamOptionsFromJob(*clip).compressed.robust, RobustAggregation::kClipNorm);
  auto centered = ParseJobSpec(
      R"({"dataParallel":4,"dp":{"optimizer":"quantized_adam","robust":"centered_clip","robustClip":3}})");
  ASSERT_TRUE(centered.ok()) << centered.status();
  EXPECT_EQ(QuantizedAdamOptionsFromJob(*centered).compressed.robust, RobustAggregation::kCenteredClip);
  EXPECT_EQ(QuantizedAdamOptionsFromJob(*centered).compressed.robust_clip, 3);
  for (const char* bad : {R"({"dataParallel":3,"dp":{"robust":"clip_norm","robustClip":-1}})",
                          R"({"dataParallel":3,"dp":{"robust":"clip_norm","robustClip":"NaN"}})",
                          R"({"dataParallel":3,"dp":{"robust":"clip_norm","transport":"nccl"}})",
                          R"({"dataParallel":3,"dp":{"optimizer":"quantized_adam","codec":"global_qsgd",)"
                          R"("robust":"centered_clip"}})"}) {
    auto r = ParseJobSpec(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << bad << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("dp.robust")) << bad;
  }
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

TEST(JobSpecTest, DiLoCoAndZeroOneAdamFieldsHaveDefaultsAndPreciseErrors) {
  auto diloco = ParseJobSpec(R"({"dataParallel":2,"dp":{"optimizer":"diloco"}})");
  ASSERT_TRUE(diloco.ok()) << diloco.status();
  EXPECT_EQ(diloco->dp().inner_steps(), 32u);
  EXPECT_DOUBLE_EQ(diloco->dp().outer_lr(), 0.7);
  EXPECT_DOUBLE_EQ(diloco->dp().outer_momentum(), 0.9);
  auto zero_momentum = ParseJobSpec(R"({"dataParallel":2,"dp":{"optimizer":"diloco","outerMomentum":0}})");
  ASSERT_TRUE(zero_momentum.ok()) << zero_momentum.status();
  EXPECT_EQ(zero_momentum->dp().outer_momentum(), 0.0);  // explicitly 0 stays 0
  auto layerwise = ParseJobSpec(R"({"dataParallel":2,"dp":{"optimizer":"quantized_adam","layerwiseEverySteps":8}})");
  ASSERT_TRUE(layerwise.ok()) << layerwise.status();
  EXPECT_EQ(layerwise->dp().layerwise_min_bits(), 2u);
  EXPECT_EQ(layerwise->dp().layerwise_max_bits(), 8u);
  const std::pair<const char*, const char*> bad[] = {
      {R"({"dp":{"innerSteps":8}})", "dp.inner_steps"},  // adamw
      {R"({"dp":{"optimizer":"quantized_adam","outerLr":0.5}})", "dp.outer_lr"},
      {R"({"dp":{"optimizer":"diloco","innerSteps":200000}})", "dp.inner_steps"},
      {R"({"dp":{"optimizer":"diloco","outerLr":0}})", "dp.outer_lr"},
      {R"({"dp":{"optimizer":"diloco","outerMomentum":1}})", "dp.outer_momentum"},
      {R"({"dp":{"optimizer":"diloco","innerSteps":4,"fragments":8}})", "dp.fragments"},
      {R"({"dp":{"optimizer":"diloco","delayedUpdate":true}})", "dp.delayed_update"},
      {R"({"dp":{"optimizer":"diloco","codec":"global_qsgd","robust":"clip_norm"}})", "dp.robust"},
      {R"({"dp":{"refreshGrowth":2}})", "dp.refresh_growth"},
      {R"({"dp":{"warmupBits":8}})", "dp.warmup_bits"},  // adamw
      {R"({"dp":{"optimizer":"quantized_adam","warmupBits":1}})", "dp.warmup_bits"},
      {R"({"dp":{"optimizer":"quantized_adam","warmupBits":9}})", "dp.warmup_bits"},
      {R"({"dp":{"entropyCoding":true}})", "dp.entropy_coding"},  // adamw
      {R"({"dp":{"optimizer":"quantized_adam","codec":"global_qsgd","entropyCoding":true}})", "dp.entropy_coding"},
      {R"({"dp":{"optimizer":"quantized_adam","varianceRefreshSteps":0,"refreshGrowth":2}})", "dp.refresh_growth"},
      {R"({"dp":{"maxLocalSteps":4}})", "dp.max_local_steps"},
      {R"({"dp":{"optimizer":"quantized_adam","localStepGrowth":2}})", "dp.local_step_growth"},
      {R"({"dp":{"layerwiseEverySteps":4}})", "dp.layerwise_every_steps"},  // adamw
      {R"({"dp":{"optimizer":"quantized_adam","codec":"global_qsgd","layerwiseEverySteps":4}})",
       "dp.layerwise_every_steps"},
      {R"({"dp":{"optimizer":"quantized_adam","layerwiseEverySteps":4,"layerwiseMinBits":6,"layerwiseMaxBits":3}})",
       "dp.layerwise_min_bits"},
      {R"({"dp":{"optimizer":"quantized_adam","bits":2,"layerwiseEverySteps":4,"layerwiseMinBits":3}})", "dp.bits"},
      {R"({"dp":{"optimizer":"quantized_adam","layerwiseMaxBits":4}})", "dp.layerwise_min_bits"},
  };
  for (const auto& [json, field] : bad) {
    auto job = ParseJobSpec(json);
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_THAT(job.status().message(), ::testing::HasSubstr(field)) << json;
  }
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

v1::ModelSpec Gpt2Small(bool tied) {
  v1::ModelSpec m;
  m.set_family(v1::ModelSpec::Family::gpt2);
  m.set_vocab_size(50257);
  m.set_seq_len(1024);
  m.set_d_model(768);
  m.set_n_layer(12);
  m.set_n_head(12);
  m.set_tie_embeddings(tied);
  return m;
}

TEST(ParameterCountTest, Gpt2SmallIsTheFamous124M) {
  EXPECT_EQ(TotalParameterCount(Gpt2Small(true)), 124439808);
  EXPECT_EQ(TotalParameterCount(Gpt2Small(false)), 124439808 + 50257 * 768);
}

TEST(ParameterCountTest, LlamaCountedByHand) {
  v1::ModelSpec m;
  m.set_family(v1::ModelSpec::Family::llama);
  m.set_vocab_size(32000);
  m.set_seq_len(64);
  m.set_d_model(64);
  m.set_n_layer(2);
  m.set_n_head(4);
  m.set_n_kv_head(2);  // head_dim 16: k and v project to 32
  // d_ff default: 256 * ceil(floor(8 * 64 / 3) / 256) = 256.
  EXPECT_EQ(FeedForwardDim(m), 256);
  // Per block: norms 2*64, q 64*64, k+v 2*32*64, o 64*64, gate/up/down 3*64*256
  // = 128 + 4096 + 4096 + 4096 + 49152 = 61568.
  // Embedding 32000*64 = 2048000, final norm 64, head 2048000 when untied.
  EXPECT_EQ(TotalParameterCount(m), 2048000 + 2 * 61568 + 64 + 2048000);
  m.set_tie_embeddings(true);
  EXPECT_EQ(TotalParameterCount(m), 2048000 + 2 * 61568 + 64);
  m.set_d_ff(100);
  EXPECT_EQ(TotalParameterCount(m), 2048000 + 2 * (128 + 4096 + 4096 + 4096 + 3 * 64 * 100) + 64);
  // Llama-7B's shape gives its known count: 6,738,415,616.
  v1::ModelSpec l7;
  l7.set_family(v1::ModelSpec::Family::llama);
  l7.set_vocab_size(32000);
  l7.set_seq_len(4096);
  l7.set_d_model(4096);
  l7.set_n_layer(32);
  l7.set_n_head(32);
  EXPECT_EQ(FeedForwardDim(l7), 11008);
  EXPECT_EQ(TotalParameterCount(l7), 6738415616);
}

TEST(ParameterCountTest, StagesSplitLikeStageRangeForAndCopyATiedHead) {
  for (bool tied : {false, true}) {
    v1::ModelSpec m = Gpt2Small(tied);
    m.set_n_layer(7);  // 7 blocks over 3 stages: 3, 2, 2
    const int64_t total = TotalParameterCount(m);
    const int64_t block = 12 * 768 * 768 + 13 * 768;
    const int64_t v_d = 50257 * 768;
    EXPECT_EQ(StageParameterCount(m, 0, 3), v_d + 1024 * 768 + 3 * block);
    EXPECT_EQ(StageParameterCount(m, 1, 3), 2 * block);
    EXPECT_EQ(StageParameterCount(m, 2, 3), 2 * block + 2 * 768 + v_d);
    int64_t sum = 0;
    for (int s = 0; s < 3; ++s) sum += StageParameterCount(m, s, 3);
    EXPECT_EQ(sum, total + (tied ? v_d : 0)) << tied;  // across stages the tied head is a copy
    EXPECT_EQ(StageParameterCount(m, 0, 1), total);
  }
}

v1::JobSpec Job(const std::string& json) {
  auto job = ParseJobSpec(json);
  EXPECT_TRUE(job.ok()) << job.status();
  return job.ok() ? *job : v1::JobSpec();
}

TEST(StageMemoryTest, EstimateCountsStateActivationsAndLogits) {
  v1::JobSpec job = Job(R"({"model":{"seqLen":32,"dModel":64,"nLayer":4,"nHead":4,"vocabSize":1000},
      "microBatchSize":2,"microBatchesPerStep":4,"stages":2,"schedule":"gpipe"})");
  const int64_t process = int64_t{512} << 20;
  // Stage 0: 28 B/param (state + checkpoint) + 4 in flight x 2 blocks x 64 tokens x (17*64 + 4*32) values x 4 B.
  EXPECT_EQ(EstimateStageBytes(job, 0),
            process + 28 * StageParameterCount(job.model(), 0, 2) + 4 * 2 * 64 * (17 * 64 + 4 * 32) * 4);
  // The last stage adds 6 x one micro-batch's float32 logits.
  EXPECT_EQ(EstimateStageBytes(job, 1), process + 28 * StageParameterCount(job.model(), 1, 2) +
                                            4 * 2 * 64 * (17 * 64 + 4 * 32) * 4 + 6 * 64 * 1000 * 4);
  // Recompute keeps each block's input per micro-batch plus one block's set.
  job.mutable_model()->set_recompute(true);
  EXPECT_EQ(EstimateStageBytes(job, 0),
            process + 28 * StageParameterCount(job.model(), 0, 2) + 4 * 64 * 2 * 64 * 4 + 64 * (17 * 64 + 4 * 32) * 4);
  // Tied across stages: three [V, d] float32 tied gradients on every stage.
  v1::JobSpec tied = job;
  tied.mutable_model()->set_tie_embeddings(true);
  EXPECT_EQ(EstimateStageBytes(tied, 0) - EstimateStageBytes(job, 0), 3 * 1000 * 64 * 4);
  EXPECT_EQ(EstimateStageBytes(tied, 1) - EstimateStageBytes(job, 1), 3 * 1000 * 64 * 4);
  // bf16 halves the activations and adds 2 B/param of compute copies.
  job.mutable_model()->set_recompute(false);
  job.set_precision(v1::JobSpec::Precision::bf16);
  EXPECT_EQ(EstimateStageBytes(job, 0),
            process + 30 * StageParameterCount(job.model(), 0, 2) + 4 * 2 * 64 * (17 * 64 + 4 * 32) * 2);
}

TEST(StageMemoryTest, ASeventyBillionModelIsRefusedWithAClearMessage) {
  v1::JobSpec job = Job(R"({"model":{"family":"llama","vocabSize":32000,"seqLen":4096,"dModel":8192,"nLayer":80,
      "nHead":64,"nKvHead":8,"dFf":28672},"microBatchSize":1,"microBatchesPerStep":8})");
  EXPECT_EQ(TotalParameterCount(job.model()), 68976648192);  // Llama-2-70B
  const int64_t available = int64_t{64} << 30;
  const absl::Status st = CheckStageMemory(job, 0, available);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  const std::string msg(st.message());
  EXPECT_NE(msg.find("stage 0 of 1 needs about "), std::string::npos) << msg;
  EXPECT_NE(msg.find("68976648192 parameters"), std::string::npos) << msg;
  EXPECT_NE(msg.find("64.0 GiB available (MemAvailable)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("more stages"), std::string::npos) << msg;
  // On 80 stages the last one (a block, the head, one micro-batch in flight)
  // needs ~42 GB: it fits.
  job.set_stages(80);
  EXPECT_TRUE(CheckStageMemory(job, 79, available).ok()) << CheckStageMemory(job, 79, available);
}

TEST(StageMemoryTest, TinyJobFitsThisMachine) {
  v1::JobSpec job = Job(R"({"model":{"seqLen":16,"dModel":32,"nLayer":2,"nHead":2}})");
  auto available = AvailableMemoryBytes();
  ASSERT_TRUE(available.ok()) << available.status();
  EXPECT_GT(*available, 0);
  EXPECT_TRUE(CheckStageMemory(job, 0).ok());
  // GPU stages are not checked against host memory.
  job.set_device("cuda:0");
  EXPECT_TRUE(CheckStageMemory(job, 0, 0).code() == absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(CheckStageMemory(job, 0).ok());
}

// The example jobs parse and have the sizes examples/README.md states.
TEST(ExampleJobsTest, ParseWithTheirStatedSizes) {
  const std::filesystem::path dir = std::filesystem::path(__FILE__).parent_path().parent_path() / "examples";
  struct Case {
    const char* file;
    int64_t parameters;
  } cases[] = {{"gpt2_124m.json", 124439808}, {"llama_150m.json", 152711424}, {"llama_1b.json", 1076072448}};
  for (const Case& c : cases) {
    auto job = LoadJobSpec((dir / c.file).string());
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(TotalParameterCount(job->model()), c.parameters) << c.file;
    // The estimates docs/MODELS.md quotes (stated there in GiB, rounded).
    std::string estimates;
    for (int s = 0; s < static_cast<int>(job->stages()); ++s) {
      estimates += absl::StrFormat(" %.1f", EstimateStageBytes(*job, s) / 1073741824.0);
    }
    std::cout << c.file << " stage estimates (GiB):" << estimates << "\n";
  }
}

}  // namespace
}  // namespace aqswarm::pipeline
