// Tied embeddings across pipeline stages: the first and the last stage hold
// copies of one matrix, each step's two gradient contributions are exchanged
// (TiedGradient / AddTiedGradient, as the step protocol relays them) and the
// copies stay bit-identical, with AdamW, with QuantizedAdam over D = 2
// replicas, and across a checkpoint.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/dp_test_util.h"
#include "pipeline/job_spec.h"
#include "pipeline/stage_worker.h"
#include "pipeline/worker_pipeline_test_util.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm::pipeline {
namespace {

using ::aqswarm::testing::IsOk;
using ::aqswarm::testing::StatusIs;

v1::JobSpec Job(int stages, const std::string& dp = "", const std::string& optimizer = "",
               const std::string& tie = "true") {
  auto job = ParseJobSpec(absl::StrCat(
      R"({"seed":5,"model":{"vocabSize":67,"seqLen":8,"dModel":16,"nLayer":3,"nHead":2,"tieEmbeddings":)", tie,
      R"(},"optimizer":{"lr":0.01,"warmupSteps":1,"totalSteps":20,"weightDecay":0.01,"gradClip":1.0)", optimizer,
      R"(},"microBatchSize":2,"microBatchesPerStep":2)", dp, "}"));
  EXPECT_TRUE(job.ok()) << job.status();
  job->set_stages(stages);
  return *job;
}

std::vector<int32_t> Tokens(int mb, int step, int n, int replica = 0) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 5 + mb * 11 + step * 3 + replica * 17) % 40;  // rows 40..66 never seen
  return t;
}

using Pipeline = testing::WorkerPipeline;

// One step's forwards, backwards and tied exchange on `p` (replica `replica`'s
// data); returns the step loss and the whole model's squared gradient norm.
std::pair<double, double> RunStep(Pipeline& p, int step, int replica = 0) {
  const testing::StepResult r = p.Run(step, [replica](int mb, int step, int n) {
    return testing::Batch{Tokens(mb, step, n, replica), Tokens(mb, step + 1, n, replica)};
  });
  EXPECT_LE(r.tied_rows, 40u);
  return {r.loss, r.grad_sq};
}

std::vector<double> TrainAdamW(int k, int steps, std::vector<double>* grad_norms = nullptr) {
  const v1::JobSpec job = Job(k);
  Pipeline p(job);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    auto [loss, sq] = RunStep(p, step);
    for (auto& x : p.w) EXPECT_THAT(x->Step(step, sq), IsOk());
    if (k > 1) {
      EXPECT_TRUE(p.w[0]->holds_tied_copy());
      EXPECT_NE(p.w[0]->TiedEmbeddingHash(), 0u);
      EXPECT_EQ(p.w[0]->TiedEmbeddingHash(), p.w[k - 1]->TiedEmbeddingHash()) << "step " << step;
    }
    for (int s = 1; s + 1 < k; ++s) EXPECT_FALSE(p.w[s]->holds_tied_copy());
    losses.push_back(loss);
    if (grad_norms != nullptr) grad_norms->push_back(sq);
  }
  return losses;
}

TEST(TiedEmbeddingTest, SplitTiedModelTrainsLikeTheUnsplitOneAndItsCopiesStayIdentical) {
  std::vector<double> n1, n2, n3;
  const std::vector<double> one = TrainAdamW(1, 6, &n1), two = TrainAdamW(2, 6, &n2), three = TrainAdamW(3, 6, &n3);
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(two[i], one[i], 1e-4) << i;
    EXPECT_NEAR(three[i], one[i], 1e-4) << i;
    // The summed tied gradient is counted once in the clipping norm.
    EXPECT_NEAR(n2[i], n1[i], 1e-4 * n1[i]) << i;
    EXPECT_NEAR(n3[i], n1[i], 1e-4 * n1[i]) << i;
  }
  EXPECT_LT(one.back(), one.front());
}

TEST(TiedEmbeddingTest, WithoutTheExchangeTheCopiesDriftApart) {
  // The check above can fail: skipping the exchange leaves different copies.
  const v1::JobSpec job = Job(2);
  Pipeline p(job);
  const int m = job.micro_batches_per_step(), b = job.micro_batch_size(), t = job.model().seq_len();
  for (int mb = 0; mb < m; ++mb) {
    std::vector<float> act, g0;
    double loss = 0;
    ASSERT_THAT(p.w[0]->ForwardTokens(mb, Tokens(mb, 0, b * t), b, &act), IsOk());
    ASSERT_THAT(p.w[1]->ForwardLoss(mb, act, {}, Tokens(mb, 1, b * t), b, &loss), IsOk());
    ASSERT_THAT(p.w[1]->Backward(mb, {}, &g0), IsOk());
    ASSERT_THAT(p.w[0]->Backward(mb, g0, nullptr), IsOk());
  }
  EXPECT_EQ(p.w[0]->TiedEmbeddingHash(), p.w[1]->TiedEmbeddingHash());
  const double sq = p.w[0]->GradSquaredNorm() + p.w[1]->GradSquaredNorm();
  for (auto& x : p.w) ASSERT_THAT(x->Step(0, sq), IsOk());
  EXPECT_NE(p.w[0]->TiedEmbeddingHash(), p.w[1]->TiedEmbeddingHash());
}

TEST(TiedEmbeddingTest, BadTiedGradientsAreRefusedAndChangeNothing) {
  const v1::JobSpec job = Job(2);
  Pipeline p(job);
  RunStep(p, 0);  // leaves summed gradients in place
  std::vector<uint32_t> rows;
  std::vector<float> before, after, dense;
  ASSERT_THAT(p.w[1]->TiedGradient(&rows, &before), IsOk());
  const int64_t vd = 67 * 16;
  // Stage 0 takes a dense matrix only.
  EXPECT_THAT(p.w[0]->AddTiedGradient({}, std::vector<float>(vd - 1, 0.f)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(p.w[0]->AddTiedGradient({1}, std::vector<float>(vd, 0.f)), StatusIs(absl::StatusCode::kInvalidArgument));
  // The last stage takes sorted rows inside the vocabulary, 16 values each, finite.
  EXPECT_THAT(p.w[1]->AddTiedGradient(std::vector<uint32_t>{67}, std::vector<float>(16, 1.f)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(p.w[1]->AddTiedGradient(std::vector<uint32_t>{3, 3}, std::vector<float>(32, 1.f)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(p.w[1]->AddTiedGradient(std::vector<uint32_t>{3}, std::vector<float>(15, 1.f)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> nan(16, 1.f);
  nan[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(p.w[1]->AddTiedGradient(std::vector<uint32_t>{3}, nan), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(p.w[1]->TiedGradient(&rows, &after), IsOk());
  EXPECT_EQ(before, after);
  // A middle stage holds no copy.
  const v1::JobSpec job3 = Job(3);
  Pipeline p3(job3);
  EXPECT_FALSE(p3.w[1]->holds_tied_copy());
  EXPECT_THAT(p3.w[1]->TiedGradient(&rows, &after), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// D = 2 pipelines of K = 2 stages with QuantizedAdam: the tied matrix has four
// copies (two per stage) and all stay bit-identical, through the compressed
// phase and a checkpoint round trip.
class FourCopiesTest : public ::testing::TestWithParam<std::tuple<int, int>> {};  // vocab, steps before the checkpoint

TEST_P(FourCopiesTest, StayIdenticalUnderQuantizedAdamAndACheckpoint) {
  v1::JobSpec job =
      Job(2, R"(,"dataParallel":2,"dp":{"optimizer":"quantized_adam","warmupSteps":3,"bits":4,"bucketSize":512})");
  job.mutable_model()->set_vocab_size(std::get<0>(GetParam()));
  std::vector<std::unique_ptr<Pipeline>> pipes;
  for (int r = 0; r < 2; ++r) pipes.push_back(std::make_unique<Pipeline>(job));
  ::aqswarm::testing::ScratchDir dir;
  int step = 0;
  auto run_steps = [&](int n) {
    for (int i = 0; i < n; ++i, ++step) {
      std::vector<double> sq(2);
      for (int r = 0; r < 2; ++r) sq[r] = RunStep(*pipes[r], step, r).second;
      for (int s = 0; s < 2; ++s) {
        testing::Hub hub;
        absl::Status st[2];
        std::thread th[2];
        for (int r = 0; r < 2; ++r) {
          th[r] = std::thread([&, r] {
            testing::HubExchange ex(&hub, r, 2);
            st[r] = pipes[r]->w[s]->StepDataParallel(step, sq[r], ex);
          });
        }
        for (auto& x : th) x.join();
        ASSERT_THAT(st[0], IsOk());
        ASSERT_THAT(st[1], IsOk());
      }
      const uint64_t h = pipes[0]->w[0]->TiedEmbeddingHash();
      for (int r = 0; r < 2; ++r) {
        for (int s = 0; s < 2; ++s) EXPECT_EQ(pipes[r]->w[s]->TiedEmbeddingHash(), h) << "step " << step;
      }
      EXPECT_EQ(pipes[0]->w[1]->ParameterHash(), pipes[1]->w[1]->ParameterHash());
    }
  };
  run_steps(std::get<1>(GetParam()));  // 3 warm-up steps, then compressed
  for (int r = 0; r < 2; ++r) {
    for (int s = 0; s < 2; ++s) {
      ASSERT_THAT(pipes[r]->w[s]->SaveCheckpoint(dir.path() + "/r" + std::to_string(r) + "s" + std::to_string(s)),
                  IsOk());
    }
  }
  // Fresh workers resume from the checkpoints and go on identically, also
  // when (as a swarm's standby does) pipeline 1's last stage takes pipeline
  // 0's last stage's state: the tied copy's optimizer state must not depend
  // on the replica.
  for (int r = 0; r < 2; ++r) {
    pipes[r] = std::make_unique<Pipeline>(job);
    for (int s = 0; s < 2; ++s) {
      const int from = s == 1 ? 0 : r;
      ASSERT_THAT(pipes[r]->w[s]->LoadCheckpoint(dir.path() + "/r" + std::to_string(from) + "s" + std::to_string(s)),
                  IsOk());
    }
  }
  run_steps(3);
}

INSTANTIATE_TEST_SUITE_P(Sizes, FourCopiesTest, ::testing::Values(std::make_tuple(67, 4), std::make_tuple(50257, 5)));

// Steps `steps` steps of a K-stage pipeline; returns the losses and leaves
// the last parameter hashes per stage in *hashes.
std::vector<double> TrainJob(const v1::JobSpec& job, int steps, std::vector<uint64_t>* hashes,
                             std::vector<double>* norms = nullptr) {
  Pipeline p(job);
  const std::vector<double> losses = p.Train(steps, [](int mb, int step, int n) {
    return testing::Batch{Tokens(mb, step, n), Tokens(mb, step + 1, n)};
  }, norms);
  hashes->clear();
  for (auto& x : p.w) hashes->push_back(x->ParameterHash());
  return losses;
}

TEST(LossScalingTest, ScalingByAPowerOfTwoChangesNothingInFp32) {
  for (const char* tie : {"false", "true"}) {
    std::vector<uint64_t> off, on;
    std::vector<double> n_off, n_on;
    const auto l_off = TrainJob(Job(2, "", "", tie), 5, &off, &n_off);
    const auto l_on = TrainJob(Job(2, "", R"(,"lossScale":"dynamic","initialLossScale":1024)", tie), 5, &on, &n_on);
    EXPECT_EQ(l_off, l_on) << "tie " << tie;
    EXPECT_EQ(n_off, n_on) << "tie " << tie;  // the norm the pipeline sees is unscaled
    EXPECT_EQ(off, on) << "tie " << tie;
  }
}

TEST(LossScalingTest, AnOverflowSkipsTheStepOnEveryStageAndTheScaleComesDown) {
  // A scale of 1e38 overflows the last stage's scaled loss: the step is
  // skipped on both stages (stage 0 got zeros, not an error), the scale
  // halves each time, and once it is small enough training goes on.
  const v1::JobSpec job = Job(2, "", R"(,"lossScale":"dynamic","initialLossScale":1e38)", "true");
  Pipeline p(job);
  const uint64_t h0 = p.w[0]->ParameterHash(), h1 = p.w[1]->ParameterHash();
  auto [loss, sq] = RunStep(p, 0);
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_TRUE(std::isinf(sq));
  for (auto& x : p.w) ASSERT_THAT(x->Step(0, sq), IsOk());
  EXPECT_EQ(p.w[0]->ParameterHash(), h0);
  EXPECT_EQ(p.w[1]->ParameterHash(), h1);
  EXPECT_EQ(p.w[0]->TiedEmbeddingHash(), p.w[1]->TiedEmbeddingHash());
  int skipped = 1, step = 1;
  for (; step < 40; ++step) {
    auto [l, s] = RunStep(p, step);
    for (auto& x : p.w) ASSERT_THAT(x->Step(step, s), IsOk());
    if (std::isfinite(s)) break;
    ++skipped;
  }
  EXPECT_GT(skipped, 1);
  EXPECT_LT(step, 40) << "the scale never came down far enough";
  EXPECT_NE(p.w[0]->ParameterHash(), h0);
  EXPECT_NE(p.w[1]->ParameterHash(), h1);
  EXPECT_EQ(p.w[0]->TiedEmbeddingHash(), p.w[1]->TiedEmbeddingHash());
  // The scale is in the checkpoints: a restored pipeline takes the same next
  // step (a fresh one would overflow again at 1e38 and skip it).
  ::aqswarm::testing::ScratchDir dir;
  Pipeline restored(job);
  for (int s = 0; s < 2; ++s) {
    const std::string ck = dir.path() + "/s" + std::to_string(s);
    ASSERT_THAT(p.w[s]->SaveCheckpoint(ck), IsOk());
    ASSERT_THAT(restored.w[s]->LoadCheckpoint(ck), IsOk());
  }
  ++step;
  for (Pipeline* q : {&p, &restored}) {
    auto [l, sq2] = RunStep(*q, step);
    EXPECT_TRUE(std::isfinite(sq2));
    for (auto& x : q->w) ASSERT_THAT(x->Step(step, sq2), IsOk());
  }
  for (int s = 0; s < 2; ++s) EXPECT_EQ(restored.w[s]->ParameterHash(), p.w[s]->ParameterHash()) << s;
}

TEST(LossScalingTest, BadSettingsAreRefused) {
  // Set after parsing (ParseJobSpec validates too): the stage refuses them itself.
  v1::JobSpec job = Job(2);
  job.mutable_optimizer()->set_loss_scale(static_cast<v1::OptimizerSpec::LossScale::Value>(7));
  EXPECT_THAT(StageWorker::Create(job, 0).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  job = Job(2, R"(,"dataParallel":2)");
  job.mutable_optimizer()->set_loss_scale(v1::OptimizerSpec::LossScale::dynamic);
  EXPECT_THAT(StageWorker::Create(job, 0).status(), StatusIs(absl::StatusCode::kUnimplemented));
  job = Job(2, R"(,"dataParallel":2)");
  job.set_precision(v1::JobSpec::Precision::fp16);
  EXPECT_THAT(StageWorker::Create(job, 0).status(), StatusIs(absl::StatusCode::kUnimplemented));
  job = Job(2);
  job.mutable_optimizer()->set_initial_loss_scale(-1);
  EXPECT_THAT(StageWorker::Create(job, 0).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  // And the job's reader names the field.
  EXPECT_THAT(ParseJobSpec(R"({"optimizer":{"lossScale":"sometimes"}})").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("optimizer.lossScale")));
}

TEST(LossScalingTest, Fp16ScalesByDefaultAndTrainsAcrossStages) {
  // fp16 compute (emulated on CPU: values rounded to fp16) with the default
  // dynamic scale of 65536: no overflow at this size, the loss falls, and the
  // tied copies stay identical.
  const v1::JobSpec job = Job(2, R"(,"precision":"fp16")");
  Pipeline p(job);
  std::vector<double> losses;
  for (int step = 0; step < 12; ++step) {
    auto [loss, sq] = RunStep(p, step);
    EXPECT_TRUE(std::isfinite(sq)) << step;
    for (auto& x : p.w) ASSERT_THAT(x->Step(step, sq), IsOk());
    losses.push_back(loss);
  }
  EXPECT_LT(losses.back(), losses.front() - 0.1);
  EXPECT_EQ(p.w[0]->TiedEmbeddingHash(), p.w[1]->TiedEmbeddingHash());
}

}  // namespace
}  // namespace aqswarm::pipeline
