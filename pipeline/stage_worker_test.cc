#include "pipeline/stage_worker.h"

#include <cmath>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "pipeline/dp_test_util.h"
#include "pipeline/job_spec.h"
#include "pipeline/safetensors.h"
#include "pipeline/worker_pipeline_test_util.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::pipeline {
namespace {

v1::JobSpec Job(int stages) {
  auto job = ParseJobSpec(R"({"seed":3,"model":{"vocabSize":61,"seqLen":8,"dModel":16,"nLayer":4,"nHead":2},
      "optimizer":{"lr":0.003,"warmupSteps":2,"totalSteps":20,"weightDecay":0.01,"gradClip":1.0},
      "microBatchSize":2,"microBatchesPerStep":3})");
  EXPECT_TRUE(job.ok()) << job.status();
  job->set_stages(stages);
  return *job;
}

std::vector<int32_t> Tokens(int mb, int step, int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 7 + mb * 3 + step) % 61;
  return t;
}

// Runs `steps` steps over K workers in one process; returns step losses.
std::vector<double> Train(int k, int steps) {
  testing::WorkerPipeline p(Job(k));
  return p.Train(steps, [](int mb, int step, int n) {
    return testing::Batch{Tokens(mb, step, n), Tokens(mb, step + 1, n)};
  });
}

TEST(StageWorkerTest, TwoStageWorkersTrainLikeOne) {
  std::vector<double> one = Train(1, 6), two = Train(2, 6), four = Train(4, 6);
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(two[i], one[i], 1e-4) << i;
    EXPECT_NEAR(four[i], one[i], 1e-4) << i;
  }
  EXPECT_LT(one.back(), one.front());
}

TEST(StageWorkerTest, BadInputsAreStatusesNotCrashes) {
  v1::JobSpec job = Job(2);
  auto w0 = StageWorker::Create(job, 0);
  auto w1 = StageWorker::Create(job, 1);
  ASSERT_TRUE(w0.ok() && w1.ok());
  std::vector<float> out;
  std::vector<int32_t> tok(16, 1);
  EXPECT_EQ((*w0)->ForwardTokens(0, tok, 3, &out).code(), absl::StatusCode::kInvalidArgument);  // wrong count
  tok[3] = 61;
  EXPECT_EQ((*w0)->ForwardTokens(0, tok, 2, &out).code(), absl::StatusCode::kInvalidArgument);  // out of vocab
  std::vector<float> act(2 * 8 * 16 - 1);
  double loss;
  EXPECT_EQ((*w1)->ForwardLoss(0, act, {}, std::vector<int32_t>(16, 0), 2, &loss).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*w1)->Backward(5, {}, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StageWorker::Create(job, 2).status().code(), absl::StatusCode::kInvalidArgument);
  // An untied model has no tied copy to exchange.
  std::vector<uint32_t> rows;
  std::vector<float> values;
  EXPECT_EQ((*w0)->TiedGradient(&rows, &values).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(StageWorkerTest, ReplicasWithTheSameSeedHashEqual) {
  v1::JobSpec job = Job(2);
  auto a = StageWorker::Create(job, 1), b = StageWorker::Create(job, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->ParameterHash(), (*b)->ParameterHash());
  job.set_seed(4);
  auto c = StageWorker::Create(job, 1);
  EXPECT_NE((*a)->ParameterHash(), (*c)->ParameterHash());
}

}  // namespace
}  // namespace aqswarm::pipeline

namespace aqswarm::pipeline {
namespace {

// The data-parallel step of replica `a` (rank 0) and `c` (rank 1) of one
// stage, given their pipelines' squared gradient norms; their
// ParameterHash must agree after it.
void ExchangeStep(StageWorker& a, StageWorker& c, int s, double sq_a, double sq_c) {
  testing::Hub hub;
  absl::Status sa, sc;
  std::thread ta([&] {
    testing::HubExchange ex(&hub, 0, 2);
    sa = a.StepDataParallel(s, sq_a, ex);
  });
  std::thread tc([&] {
    testing::HubExchange ex(&hub, 1, 2);
    sc = c.StepDataParallel(s, sq_c, ex);
  });
  ta.join();
  tc.join();
  ASSERT_TRUE(sa.ok()) << sa;
  ASSERT_TRUE(sc.ok()) << sc;
  ASSERT_EQ(a.ParameterHash(), c.ParameterHash()) << "step " << s;
}

// One step of a 2-stage x 2-pipeline grid: each pipeline's forwards and
// backwards on its own tokens, then each stage's data-parallel step; after
// it the replicas agree (ExchangeStep) and each pipeline's tied copies are
// bit-identical.
void GridStep(std::vector<std::unique_ptr<testing::WorkerPipeline>>& pipes, int s) {
  std::vector<double> sq;
  for (int p = 0; p < 2; ++p) {
    sq.push_back(pipes[p]->Run(s, [p](int mb, int step, int n) {
      return testing::Batch{Tokens(mb, step + 11 * p, n), Tokens(mb, step + 11 * p + 1, n)};
    }).grad_sq);
  }
  for (int stage = 0; stage < 2; ++stage) ExchangeStep(*pipes[0]->w[stage], *pipes[1]->w[stage], s, sq[0], sq[1]);
  for (int p = 0; p < 2; ++p) {
    ASSERT_EQ(pipes[p]->w[0]->TiedEmbeddingHash(), pipes[p]->w[1]->TiedEmbeddingHash())
        << "step " << s << " pipeline " << p;
  }
}

// One data-parallel step of a one-stage job: replica `a` at rank 0 and `c`
// at rank 1, each on its own tokens (seeded by the worker's index `ia`/`ic`);
// their ParameterHash must agree after it.
void StepReplicas(const v1::JobSpec& job, StageWorker& a, StageWorker& c, int s, int ia = 0, int ic = 1) {
  const int b = job.micro_batch_size(), t = job.model().seq_len();
  for (auto [w, r] : {std::pair{&a, ia}, std::pair{&c, ic}}) {
    double loss;
    ASSERT_TRUE(w->ForwardLoss(0, {}, Tokens(0, s + 7 * r, b * t), Tokens(1, s + 7 * r, b * t), b, &loss).ok());
    ASSERT_TRUE(w->Backward(0, {}, nullptr).ok());
  }
  ExchangeStep(a, c, s, a.GradSquaredNorm(), c.GradSquaredNorm());
}

// Data parallelism in one process: two replicas of a one-stage job exchange
// through the in-process hub; a third worker restored from replica 0's
// checkpoint takes replica 1's place.
TEST(StageWorkerDataParallelTest, ReplicasStayBitIdenticalAndACheckpointedJoinerContinuesInLockstep) {
  v1::JobSpec job = Job(1);
  job.set_data_parallel(2);
  job.mutable_dp()->set_optimizer(v1::DataParallelSpec::quantized_adam);
  job.mutable_dp()->set_warmup_steps(2);
  job.mutable_dp()->set_bits(4);
  std::vector<std::unique_ptr<StageWorker>> w;
  for (int r = 0; r < 3; ++r) w.push_back(*StageWorker::Create(job, 0));
  auto step = [&](int a, int c, int s) { StepReplicas(job, *w[a], *w[c], s, a, c); };
  const uint64_t initial = w[0]->ParameterHash();
  for (int s = 0; s < 4; ++s) step(0, 1, s);  // two warm-up steps, two compressed
  EXPECT_NE(w[0]->ParameterHash(), initial);
  EXPECT_GT(w[0]->dp_bytes_sent(), 0u);
  const ::aqswarm::testing::ScratchDir scratch;
  const std::string path = scratch.Sub("dp_ckpt.safetensors");
  ASSERT_TRUE(w[0]->SaveCheckpoint(path).ok());
  ASSERT_TRUE(w[2]->LoadCheckpoint(path).ok());
  EXPECT_EQ(w[2]->ParameterHash(), w[0]->ParameterHash());
  for (int s = 4; s < 6; ++s) step(0, 2, s);  // replica 1 is gone; the joiner keeps lockstep
}

// dp.optimizer diloco (H = 2): the replicas' anchors (ParameterHash under
// diloco) agree after every step, local and outer; a joiner restored from
// replica 0's checkpoint keeps them agreeing; a QuantizedAdam state does not
// load into a DiLoCo worker, nor the other way round.
TEST(StageWorkerDataParallelTest, DiLoCoAnchorsStayIdenticalAndStatesOfTheOtherOptimizerAreRefused) {
  v1::JobSpec job = Job(1);
  job.set_data_parallel(2);
  job.mutable_dp()->set_optimizer(v1::DataParallelSpec::diloco);
  job.mutable_dp()->set_inner_steps(2);
  job.mutable_dp()->set_outer_lr(0.7);
  job.mutable_dp()->set_outer_momentum(0.9);
  job.mutable_dp()->set_bits(4);
  std::vector<std::unique_ptr<StageWorker>> w;
  for (int r = 0; r < 3; ++r) w.push_back(*StageWorker::Create(job, 0));
  uint64_t before = 0;
  for (int s = 0; s < 4; ++s) {
    StepReplicas(job, *w[0], *w[1], s);
    const bool outer = s % 2 == 1;
    EXPECT_EQ(w[0]->dp_step_kind(), outer ? "outer" : "local") << "step " << s;
    // The anchor moves at outer steps only.
    if (s > 0) EXPECT_EQ(w[0]->ParameterHash() != before, outer) << "step " << s;
    before = w[0]->ParameterHash();
  }
  const ::aqswarm::testing::ScratchDir scratch;
  const std::string path = scratch.Sub("diloco.safetensors");
  ASSERT_TRUE(w[0]->SaveCheckpoint(path).ok());
  ASSERT_TRUE(w[2]->LoadCheckpoint(path).ok());
  EXPECT_EQ(w[2]->ParameterHash(), w[0]->ParameterHash());
  for (int s = 4; s < 8; ++s) StepReplicas(job, *w[0], *w[2], s, 0, 2);

  v1::JobSpec qjob = job;
  qjob.mutable_dp()->clear_inner_steps();
  qjob.mutable_dp()->clear_outer_lr();
  qjob.mutable_dp()->clear_outer_momentum();
  qjob.mutable_dp()->set_optimizer(v1::DataParallelSpec::quantized_adam);
  std::vector<std::unique_ptr<StageWorker>> q;
  for (int r = 0; r < 2; ++r) q.push_back(*StageWorker::Create(qjob, 0));
  StepReplicas(qjob, *q[0], *q[1], 0);
  const std::string qpath = scratch.Sub("qadam.safetensors");
  ASSERT_TRUE(q[0]->SaveCheckpoint(qpath).ok());
  const absl::Status into_diloco = w[1]->LoadCheckpoint(qpath);
  EXPECT_TRUE(absl::IsFailedPrecondition(into_diloco)) << into_diloco;
  EXPECT_NE(into_diloco.message().find("quantized_adam's"), std::string::npos) << into_diloco;
  EXPECT_NE(into_diloco.message().find("dp.optimizer is diloco"), std::string::npos) << into_diloco;
  const absl::Status into_qadam = q[1]->LoadCheckpoint(path);
  EXPECT_TRUE(absl::IsFailedPrecondition(into_qadam)) << into_qadam;
  EXPECT_NE(into_qadam.message().find("diloco's"), std::string::npos) << into_qadam;
}

// A 2 x 2 diloco grid (H = 4) with tied embeddings across the two stages:
// after every step the replicas' anchors agree and each pipeline's two tied
// copies are bit-identical. Then a re-plan at a step between outer steps:
// as the swarm does, every replica of a stage resumes from one state, stage
// 0 from pipeline 0's and stage 1 from pipeline 1's, so each pipeline's ends
// hold different inner progress of the tied copy; both restart it from its
// anchor and the copies stay identical. Finishing between outer steps puts
// all four copies on the anchor.
TEST(StageWorkerDataParallelTest, DiLoCoGridKeepsTiedCopiesIdenticalThroughAResumeFromMixedStates) {
  v1::JobSpec job = Job(2);
  job.mutable_model()->set_tie_embeddings(true);
  job.set_data_parallel(2);
  job.mutable_dp()->set_optimizer(v1::DataParallelSpec::diloco);
  job.mutable_dp()->set_inner_steps(4);
  job.mutable_dp()->set_outer_lr(0.7);
  job.mutable_dp()->set_outer_momentum(0.9);
  job.mutable_dp()->set_bits(4);
  std::vector<std::unique_ptr<testing::WorkerPipeline>> pipes;
  for (int p = 0; p < 2; ++p) pipes.push_back(std::make_unique<testing::WorkerPipeline>(job));
  const auto train = [&](int from, int to) {
    for (int s = from; s < to && !::testing::Test::HasFatalFailure(); ++s) GridStep(pipes, s);
  };
  train(0, 6);
  // Pipelines differ between outer steps: their tied copies too.
  ASSERT_NE(pipes[0]->w[0]->TiedEmbeddingHash(), pipes[1]->w[0]->TiedEmbeddingHash());
  const ::aqswarm::testing::ScratchDir scratch;
  const std::string s0 = scratch.Sub("stage0.safetensors"), s1 = scratch.Sub("stage1.safetensors");
  ASSERT_TRUE(pipes[0]->w[0]->SaveCheckpoint(s0).ok());
  ASSERT_TRUE(pipes[1]->w[1]->SaveCheckpoint(s1).ok());
  for (int p = 0; p < 2; ++p) {
    pipes[p] = std::make_unique<testing::WorkerPipeline>(job);
    ASSERT_TRUE(pipes[p]->w[0]->LoadCheckpoint(s0).ok());
    ASSERT_TRUE(pipes[p]->w[1]->LoadCheckpoint(s1).ok());
    ASSERT_EQ(pipes[p]->w[0]->TiedEmbeddingHash(), pipes[p]->w[1]->TiedEmbeddingHash());
  }
  train(6, 10);
  // The job ends between outer steps: finishing puts every copy on the anchor.
  ASSERT_NE(pipes[0]->w[0]->TiedEmbeddingHash(), pipes[1]->w[0]->TiedEmbeddingHash());
  for (int p = 0; p < 2; ++p) {
    for (int stage = 0; stage < 2; ++stage) ASSERT_TRUE(pipes[p]->w[stage]->FinishDataParallel().ok());
  }
  for (int p = 0; p < 2; ++p) {
    for (int stage = 0; stage < 2; ++stage) {
      EXPECT_EQ(pipes[p]->w[stage]->TiedEmbeddingHash(), pipes[0]->w[0]->TiedEmbeddingHash());
    }
  }
}

// A replica whose gradient norm is NaN or infinite stops the step before it
// sends anything to the other replicas, and its parameters stay as they were.
TEST(StageWorkerDataParallelTest, ANonFiniteGradientStopsTheStepBeforeAnyExchange) {
  v1::JobSpec job = Job(1);
  job.set_data_parallel(2);
  auto w = *StageWorker::Create(job, 0);
  const int b = job.micro_batch_size(), t = job.model().seq_len();
  for (double bad : {std::nan(""), HUGE_VAL}) {
    double loss;
    ASSERT_TRUE(w->ForwardLoss(0, {}, Tokens(0, 1, b * t), Tokens(1, 1, b * t), b, &loss).ok());
    ASSERT_TRUE(w->Backward(0, {}, nullptr).ok());
    const uint64_t before = w->ParameterHash();
    testing::Hub hub(absl::Milliseconds(200));
    testing::HubExchange ex(&hub, 0, 2);
    const absl::Status s = w->StepDataParallel(4, bad, ex);
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_NE(s.message().find("data-parallel step 4"), std::string::npos) << s;
    EXPECT_EQ(ex.sent(), 0) << "a non-finite gradient reached the exchange";
    EXPECT_EQ(w->ParameterHash(), before);
  }
}

// dp.delayed_update against the synchronous step: each step's update lands
// one step late (the model runs on it extrapolated by the last update),
// replicas stay bit-identical, a checkpoint carries the update in flight and
// the one before it, and a failed update fails the call that waits for it.
TEST(StageWorkerDataParallelTest, DelayedUpdateLandsOneStepLateAndSurvivesACheckpoint) {
  v1::JobSpec job = Job(1);
  job.set_data_parallel(2);
  job.mutable_dp()->set_optimizer(v1::DataParallelSpec::quantized_adam);
  job.mutable_dp()->set_warmup_steps(1);
  job.mutable_dp()->set_bits(4);
  v1::JobSpec delayed = job;
  delayed.mutable_dp()->set_delayed_update(true);
  // 0, 1: synchronous pair; 2, 3: delayed pair; 4: delayed joiner; 5: synchronous loader.
  std::vector<std::unique_ptr<StageWorker>> w;
  for (int r = 0; r < 6; ++r) w.push_back(*StageWorker::Create(r >= 2 && r <= 4 ? delayed : job, 0));
  testing::Hub sync_hub, delayed_hub;
  // The delayed pair's exchanges outlive each call (the update runs on).
  std::vector<std::unique_ptr<testing::HubExchange>> ex;
  for (int r = 0; r < 6; ++r) {
    ex.push_back(std::make_unique<testing::HubExchange>(r < 2 ? &sync_hub : &delayed_hub, r % 2, 2));
  }
  ex[4] = std::make_unique<testing::HubExchange>(&delayed_hub, 1, 2);  // the joiner takes rank 1
  const int b = job.micro_batch_size(), t = job.model().seq_len();
  auto step = [&](int a, int c, int s) {
    absl::Status st[2];
    std::thread th[2];
    int k = 0;
    for (int r : {a, c}) {
      const int data = r % 2;  // each rank reads its own shard, whoever holds the rank
      double loss;
      ASSERT_TRUE(w[r]->ForwardLoss(0, {}, Tokens(0, s + 7 * data, b * t), Tokens(1, s + 7 * data, b * t), b, &loss)
                      .ok());
      ASSERT_TRUE(w[r]->Backward(0, {}, nullptr).ok());
      th[k] = std::thread([&, r, k] { st[k] = w[r]->StepDataParallel(s, w[r]->GradSquaredNorm(), *ex[r]); });
      ++k;
    }
    for (auto& x : th) x.join();
    ASSERT_TRUE(st[0].ok()) << st[0];
    ASSERT_TRUE(st[1].ok()) << st[1];
    ASSERT_EQ(w[a]->ParameterHash(), w[c]->ParameterHash()) << "step " << s;
  };
  const uint64_t initial = w[0]->ParameterHash();
  ASSERT_EQ(w[2]->ParameterHash(), initial);
  std::vector<uint64_t> sync_hash;
  for (int s = 0; s < 3; ++s) {
    step(0, 1, s);
    sync_hash.push_back(w[0]->ParameterHash());
  }
  step(2, 3, 0);
  EXPECT_EQ(w[2]->ParameterHash(), initial) << "step 0's update is still in flight";
  ASSERT_TRUE(w[2]->FinishDataParallel().ok());
  ASSERT_TRUE(w[3]->FinishDataParallel().ok());
  EXPECT_EQ(w[2]->ParameterHash(), sync_hash[0]) << "step 0's update, applied, is the synchronous one";
  EXPECT_EQ(w[3]->ParameterHash(), sync_hash[0]);
  step(2, 3, 1);
  const uint64_t predicted = w[2]->ParameterHash();  // step 1 runs on 2 x (after 1 update) - (after 0)
  EXPECT_NE(predicted, sync_hash[0]);
  step(2, 3, 2);
  EXPECT_GT(w[2]->dp_bytes_sent(), 0u);

  // Replica 3 leaves; a joiner restored from replica 2's state (its update
  // of step 2 included) keeps lockstep with it.
  const ::aqswarm::testing::ScratchDir scratch;
  const std::string path = scratch.Sub("dp_delayed.safetensors");
  ASSERT_TRUE(w[2]->SaveCheckpoint(path).ok());
  ASSERT_TRUE(w[4]->LoadCheckpoint(path).ok());
  ASSERT_TRUE(w[3]->FinishDataParallel().ok());  // its half of step 2's exchange is done
  EXPECT_EQ(w[4]->ParameterHash(), w[2]->ParameterHash());
  for (int s = 3; s < 5; ++s) step(2, 4, s);
  // A job without delayed updates applies the saved one when it loads it.
  ASSERT_TRUE(w[2]->SaveCheckpoint(path).ok());
  ASSERT_TRUE(w[5]->LoadCheckpoint(path).ok());
  {
    // The same checkpoint with delayed/params one value short is refused.
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    std::vector<std::vector<float>> values;
    std::vector<StTensor> tensors;
    for (const auto& e : (*file)->entries()) values.push_back((*file)->ToFloat32(e));
    for (size_t i = 0; i < values.size(); ++i) {
      const auto& e = (*file)->entries()[i];
      if (e.name == "extra/delayed/params") values[i].pop_back();
      tensors.push_back({e.name, e.name == "extra/delayed/params" ? std::vector<int64_t>{int64_t(values[i].size())}
                                                                     : e.shape, values[i]});
    }
    const std::string bad = path + ".short";
    ASSERT_TRUE(WriteSafetensors(bad, tensors, (*file)->metadata()).ok());
    auto fresh = StageWorker::Create(delayed, 0);
    ASSERT_TRUE(fresh.ok());
    const absl::Status refused = (*fresh)->LoadCheckpoint(bad);
    EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
    EXPECT_NE(refused.message().find("delayed/params holds"), std::string::npos) << refused;
  }
  const uint64_t before_finish = w[2]->ParameterHash();
  ASSERT_TRUE(w[2]->FinishDataParallel().ok());
  EXPECT_NE(w[2]->ParameterHash(), before_finish);
  EXPECT_EQ(w[5]->ParameterHash(), w[2]->ParameterHash());
  ASSERT_TRUE(w[4]->FinishDataParallel().ok());
  EXPECT_EQ(w[4]->ParameterHash(), w[2]->ParameterHash());

  // The joiner's peer vanishes: the update it starts fails, and so does
  // every call that waits for it.
  delayed_hub.Kill(0);
  double loss;
  ASSERT_TRUE(w[4]->ForwardLoss(0, {}, Tokens(0, 5, b * t), Tokens(1, 5, b * t), b, &loss).ok());
  ASSERT_TRUE(w[4]->Backward(0, {}, nullptr).ok());
  ASSERT_TRUE(w[4]->StepDataParallel(5, w[4]->GradSquaredNorm(), *ex[4]).ok());
  const absl::Status failed = w[4]->FinishDataParallel();
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_NE(failed.message().find("replica 0"), std::string::npos) << failed;
  EXPECT_EQ(w[4]->StepDataParallel(6, 0, *ex[4]).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
// Every combination of dp.optimizer x dp.codec x dp.bits x tied embeddings x
// dp.fragments x layer-wise widths on a 2 x 2 grid is either refused when
// the job is loaded, naming one of the fields, or runs 4 steps with
// compressed exchanges (warm-up 2, DiLoCo H = 2, a re-plan every exchange;
// d 32 x 61 tokens: the tied copy is large enough to be compressed) and
// keeps replicas and tied copies identical.
TEST(StageWorkerDataParallelTest, EveryOptimizerCodecBitsTieFragmentsLayerwiseCombinationLoadsAndRunsOrIsRefused) {
  const char* optimizers[] = {"adamw", "quantized_adam", "diloco"};
  const char* codecs[] = {"minmax", "global_qsgd"};
  int refused = 0, ran = 0;
  for (const char* opt : optimizers) {
    for (const char* codec : codecs) {
      for (int bits : {1, 2, 3, 8}) {
        for (bool tie : {false, true}) {
          for (int fragments : {0, 2}) {
            for (int layerwise : {0, 1}) {
              std::string dp = absl::StrCat(R"("optimizer":")", opt, R"(","codec":")", codec, R"(","bits":)", bits);
              if (std::string(opt) == "quantized_adam") absl::StrAppend(&dp, R"(,"warmupSteps":2)");
              if (std::string(opt) == "diloco") absl::StrAppend(&dp, R"(,"innerSteps":2)");
              if (fragments > 0) absl::StrAppend(&dp, R"(,"fragments":)", fragments);
              if (layerwise > 0) absl::StrAppend(&dp, R"(,"layerwiseEverySteps":)", layerwise, R"(,"layerwiseMinBits":1)");
              const std::string json = absl::StrCat(
                  R"({"seed":3,"model":{"vocabSize":61,"seqLen":8,"dModel":32,"nLayer":2,"nHead":2,"tieEmbeddings":)",
                  tie ? "true" : "false",
                  R"(},"optimizer":{"lr":0.003,"warmupSteps":2,"totalSteps":20,"gradClip":1.0},
                     "microBatchSize":2,"microBatchesPerStep":2,"stages":2,"dataParallel":2,"dp":{)",
                  dp, "}}");
              SCOPED_TRACE(json);
              const absl::StatusOr<v1::JobSpec> job = ParseJobSpec(json);
              if (!job.ok()) {
                const std::string m(job.status().message());
                EXPECT_TRUE(absl::IsInvalidArgument(job.status())) << m;
                EXPECT_TRUE(m.find("dp.") != std::string::npos || m.find("tie_embeddings") != std::string::npos) << m;
                ++refused;
                continue;
              }
              std::vector<std::unique_ptr<testing::WorkerPipeline>> pipes;
              for (int p = 0; p < 2; ++p) pipes.push_back(std::make_unique<testing::WorkerPipeline>(*job));
              for (int s = 0; s < 4 && !::testing::Test::HasFailure(); ++s) GridStep(pipes, s);
              if (::testing::Test::HasFailure()) return;
              ++ran;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(ran, 40);
  EXPECT_GT(refused, 0);
}

}  // namespace aqswarm::pipeline
