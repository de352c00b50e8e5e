// The step protocol without gRPC or a model: stages run as threads joined by
// InProcessStageLink, each computing with a small arithmetic fake; where a
// test needs a neighbour that misbehaves, the test plays that neighbour.
#include "stage/step_protocol.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "compression/codec.h"
#include "stage/blame.h"
#include "stage/in_process_stage_link.h"

namespace aqswarm::stage {
namespace {

v1::LinkCompression Fp32Links() {
  v1::LinkCompression c;
  c.set_mode(v1::LinkCompression::fp32);
  return c;
}

constexpr int kStages = 3, kM = 4;
constexpr int64_t kB = 2, kT = 3, kD = 4;

// Stage 0 emits (sample id + position) / 100; every later stage doubles its
// input; the last stage's loss is the mean of its input. Backward: the last
// stage starts from ones, every stage passes 0.5 x its gradient up. The
// squared gradient norm of stage j is j + 1.
class FakeCompute final : public StageCompute {
 public:
  explicit FakeCompute(int stage) : stage_(stage) {}
  absl::Status Forward(int mb, absl::Span<const int64_t> ids, absl::Span<const float> in, std::vector<float>* out,
                       double* loss) override {
    forwards.push_back(mb);
    if (stage_ == 0) {
      out->resize(kB * kT * kD);
      for (size_t i = 0; i < out->size(); ++i) (*out)[i] = (ids[i / (kT * kD)] + i % (kT * kD)) / 100.0f;
      return absl::OkStatus();
    }
    if (in.size() != static_cast<size_t>(kB * kT * kD)) return absl::InvalidArgumentError("input of a wrong size");
    if (stage_ + 1 == kStages) {
      double sum = 0;
      for (float v : in) sum += v;
      *loss = sum / in.size();
      return absl::OkStatus();
    }
    out->assign(in.begin(), in.end());
    for (float& v : *out) v *= 2;
    return absl::OkStatus();
  }
  absl::Status Backward(int mb, absl::Span<const float> grad_out, std::vector<float>* grad_in) override {
    backwards.push_back(mb);
    if (grad_in == nullptr) return absl::OkStatus();
    if (grad_out.empty()) {
      grad_in->assign(kB * kT * kD, 1.0f);
    } else {
      grad_in->assign(grad_out.begin(), grad_out.end());
      for (float& v : *grad_in) v *= 0.5f;
    }
    return absl::OkStatus();
  }
  double GradSquaredNorm() const override { return own_sq_override ? *own_sq_override : stage_ + 1 + tied_added; }
  // Tied embeddings (a 3 x kD matrix): stage 0 contributes rows {0, 2}, the
  // last stage a dense matrix; what each end adds is recorded, and counts in
  // its norm from then on.
  absl::Status TiedGradient(std::vector<uint32_t>* rows, std::vector<float>* values) override {
    if (stage_ == 0) {
      *rows = {0, 2};
      values->assign(2 * kD, 0.5f);
    } else {
      rows->clear();
      values->assign(3 * kD, 0.25f);
    }
    return absl::OkStatus();
  }
  absl::Status AddTiedGradient(absl::Span<const uint32_t> rows, absl::Span<const float> values) override {
    added_rows.assign(rows.begin(), rows.end());
    added_values.assign(values.begin(), values.end());
    tied_added = 10;
    return absl::OkStatus();
  }
  absl::Status Eval(absl::Span<const int64_t> ids, absl::Span<const float> in, std::vector<float>* out,
                    double* loss) override {
    return Forward(-1, ids, in, out, loss);
  }
  std::vector<int> forwards, backwards;
  std::vector<uint32_t> added_rows;
  std::vector<float> added_values;
  double tied_added = 0;
  std::optional<double> own_sq_override;  // a diverged stage's norm

 private:
  const int stage_;
};

v1::JobSpec Job() {
  v1::JobSpec job;
  job.set_name("protocol-test");
  job.mutable_model()->set_seq_len(kT);
  job.mutable_model()->set_d_model(kD);
  job.set_micro_batch_size(kB);
  job.set_micro_batches_per_step(kM);
  job.mutable_compression()->set_mode(v1::LinkCompression::fp32);
  job.mutable_compression()->set_m_precision(v1::LinkCompression::MPrecision::fp32);
  job.mutable_compression()->set_fw_bits(8);
  job.mutable_compression()->set_bw_bits(8);
  return job;
}

// The sample ids of micro-batch mb of step s: 100 s + kB mb + i.
std::vector<int64_t> SampleIds(int64_t step) {
  std::vector<int64_t> ids(kM * kB);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = 100 * step + static_cast<int64_t>(i);
  return ids;
}

// One stage: its links' ends, endpoints, compute and protocol.
struct Stage {
  Stage(int stage, pipeline::StepSchedule::Kind kind, StageLink* up, StageLink* down,
        absl::Duration timeout = absl::Seconds(10), bool tie = false)
      : compute(stage) {
    const v1::JobSpec job = Job();
    if (down != nullptr) sender = *pipeline::ActivationSender::Create(nullptr, *pipeline::LinkOptionsFromJob(job, 0, stage, 1));
    if (up != nullptr) receiver = *pipeline::ActivationReceiver::Create(nullptr, *pipeline::LinkOptionsFromJob(job, 0, stage - 1, 1));
    StepProtocolOptions o;
    o.stage = stage;
    o.num_stages = kStages;
    o.micro_batches = kM;
    o.micro_batch_size = kB;
    o.seq_len = kT;
    o.d_model = kD;
    o.schedule = {kind, kStages, kM, 0};
    o.link_timeout = timeout;
    o.tie_embeddings = tie;
    o.tied_elements = 3 * kD;
    o.rejected = [this](RejectReason r) { rejected.emplace_back(RejectReasonName(r)); };
    std::vector<uint64_t> order;  // the epoch: steps 0 and 1
    for (int64_t step = 0; step < 2; ++step) {
      for (int64_t id : SampleIds(step)) order.push_back(id);
    }
    if (sender != nullptr) {
      EXPECT_TRUE(sender->StartEpoch(order).ok());
    }
    if (receiver != nullptr) {
      EXPECT_TRUE(receiver->StartEpoch(order).ok());
    }
    protocol = std::make_unique<StepProtocol>(o, &compute, StepLinks{up, down, sender.get(), receiver.get()});
  }
  absl::StatusOr<StepOutcome> Step(int64_t step, const std::vector<int64_t>& ids) {
    return protocol->RunStep({step, 0, [&](int mb) { return absl::MakeConstSpan(ids).subspan(mb * kB, kB); }});
  }
  FakeCompute compute;
  std::unique_ptr<pipeline::ActivationSender> sender;
  std::unique_ptr<pipeline::ActivationReceiver> receiver;
  std::unique_ptr<StepProtocol> protocol;
  std::vector<std::string> rejected;
};

class StepProtocolTest : public ::testing::TestWithParam<pipeline::StepSchedule::Kind> {};

TEST_P(StepProtocolTest, ThreeStagesAgreeOnTheLossAndTheCommittedNorm) {
  auto [l0a, l0b] = InProcessStageLink::Pair("link 0");
  auto [l1a, l1b] = InProcessStageLink::Pair("link 1");
  Stage s0(0, GetParam(), nullptr, l0a.get()), s1(1, GetParam(), l0b.get(), l1a.get()), s2(2, GetParam(), l1b.get(), nullptr);
  for (int64_t step = 0; step < 2; ++step) {
    const std::vector<int64_t> ids = SampleIds(step);
    absl::StatusOr<StepOutcome> out[kStages];
    std::thread t1([&] { out[1] = s1.Step(step, ids); });
    std::thread t2([&] { out[2] = s2.Step(step, ids); });
    out[0] = s0.Step(step, ids);
    t1.join();
    t2.join();
    // The last stage's input is 2 x stage 0's output: its loss is known.
    double expect = 0;
    for (int64_t id : ids) {
      for (int i = 0; i < kT * kD; ++i) expect += 2 * (id + i) / 100.0f;
    }
    expect /= ids.size() * kT * kD;
    for (int s = 0; s < kStages; ++s) {
      ASSERT_TRUE(out[s].ok()) << "stage " << s << ": " << out[s].status();
      EXPECT_NEAR(out[s]->loss, expect, 1e-5) << "stage " << s;
      EXPECT_EQ(out[s]->total_grad_sq, 1 + 2 + 3) << "stage " << s;  // the commit reached every stage
    }
  }
  // Backwards always run in increasing micro-batch order.
  EXPECT_THAT(s0.compute.backwards, ::testing::ElementsAre(0, 1, 2, 3, 0, 1, 2, 3));
  EXPECT_THAT(s1.compute.backwards, ::testing::ElementsAre(0, 1, 2, 3, 0, 1, 2, 3));
  EXPECT_TRUE(s0.rejected.empty() && s1.rejected.empty() && s2.rejected.empty());
}

TEST_P(StepProtocolTest, EvaluationReturnsTheLastStagesLossEverywhere) {
  auto [l0a, l0b] = InProcessStageLink::Pair("link 0");
  auto [l1a, l1b] = InProcessStageLink::Pair("link 1");
  Stage s0(0, GetParam(), nullptr, l0a.get()), s1(1, GetParam(), l0b.get(), l1a.get()), s2(2, GetParam(), l1b.get(), nullptr);
  const std::vector<int64_t> val = {7, 8, 9, 10};
  const std::vector<absl::Span<const int64_t>> batches = {absl::MakeConstSpan(val).subspan(0, 2),
                                                          absl::MakeConstSpan(val).subspan(2, 2)};
  absl::StatusOr<double> loss[kStages];
  std::thread t1([&] { loss[1] = s1.protocol->RunEval(5, batches); });
  std::thread t2([&] { loss[2] = s2.protocol->RunEval(5, batches); });
  loss[0] = s0.protocol->RunEval(5, batches);
  t1.join();
  t2.join();
  ASSERT_TRUE(loss[2].ok()) << loss[2].status();
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(loss[s].ok()) << loss[s].status();
    EXPECT_EQ(*loss[s], *loss[2]);
  }
}

TEST_P(StepProtocolTest, TiedGradientsCrossThePipelineBothWays) {
  auto [l0a, l0b] = InProcessStageLink::Pair("link 0");
  auto [l1a, l1b] = InProcessStageLink::Pair("link 1");
  const absl::Duration t = absl::Seconds(10);
  Stage s0(0, GetParam(), nullptr, l0a.get(), t, true), s1(1, GetParam(), l0b.get(), l1a.get(), t, true),
      s2(2, GetParam(), l1b.get(), nullptr, t, true);
  const std::vector<int64_t> ids = SampleIds(0);
  absl::StatusOr<StepOutcome> out[kStages];
  std::thread t1([&] { out[1] = s1.Step(0, ids); });
  std::thread t2([&] { out[2] = s2.Step(0, ids); });
  out[0] = s0.Step(0, ids);
  t1.join();
  t2.join();
  for (int s = 0; s < kStages; ++s) ASSERT_TRUE(out[s].ok()) << "stage " << s << ": " << out[s].status();
  // Stage 0 got the head's dense gradient, the last stage stage 0's rows; the
  // middle stage relayed both and added nothing.
  EXPECT_TRUE(s0.compute.added_rows.empty());
  EXPECT_THAT(s0.compute.added_values, ::testing::Each(0.25f));
  EXPECT_EQ(s0.compute.added_values.size(), 3u * kD);
  EXPECT_THAT(s2.compute.added_rows, ::testing::ElementsAre(0, 2));
  EXPECT_THAT(s2.compute.added_values, ::testing::Each(0.5f));
  EXPECT_EQ(s1.compute.tied_added, 0);
  // Stage 0 completes the norm after adding: every stage clips by it.
  for (int s = 0; s < kStages; ++s) EXPECT_EQ(out[s]->total_grad_sq, 1 + 10 + 2 + 3) << "stage " << s;
}

INSTANTIATE_TEST_SUITE_P(Schedules, StepProtocolTest,
                         ::testing::Values(pipeline::StepSchedule::kAdaptive, pipeline::StepSchedule::k1F1B,
                                           pipeline::StepSchedule::kGpipe));

// The test plays stage 1 against a real stage 0 (of 3).
class StageZeroTest : public ::testing::Test {
 protected:
  StageZeroTest() : links_(InProcessStageLink::Pair("link 0")) {}
  StageLink& down_end() { return *links_.second; }
  absl::StatusOr<v1::LinkFrame> Next(const StageLink::Match& m) { return down_end().Receive(m, absl::Seconds(10)); }
  std::pair<std::unique_ptr<InProcessStageLink>, std::unique_ptr<InProcessStageLink>> links_;
};

TEST_F(StageZeroTest, AResendRequestIsAnsweredWithTheRowsAgain) {
  Stage s0(0, pipeline::StepSchedule::kGpipe, nullptr, links_.first.get());
  const std::vector<int64_t> ids = SampleIds(0);
  absl::StatusOr<StepOutcome> out;
  std::thread t([&] { out = s0.Step(0, ids); });
  absl::StatusOr<v1::LinkFrame> first = Next([](const v1::LinkFrame& f) { return f.has_activations(); });
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->activations().micro_batch(), 0u);
  v1::LinkFrame req;
  req.mutable_resend()->set_step(0);
  req.mutable_resend()->set_micro_batch(0);
  req.mutable_resend()->add_sample_ids(ids[1]);
  ASSERT_TRUE(down_end().Send(req, absl::Seconds(1)).ok());
  absl::StatusOr<v1::LinkFrame> again =
      Next([](const v1::LinkFrame& f) { return f.has_activations() && f.activations().resend(); });
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->activations().micro_batch(), 0u);
  // Then the gradients, M-1 carrying the norm below and the loss.
  pipeline::GradientCodec codec(Fp32Links(), kT, kD);
  for (int mb = 0; mb < kM; ++mb) {
    v1::LinkFrame g;
    g.mutable_gradients()->set_step(0);
    g.mutable_gradients()->set_micro_batch(mb);
    ASSERT_TRUE(codec.Encode(std::vector<float>(kB * kT * kD, 0.25f), kB, 1, g.mutable_gradients()->mutable_grad()).ok());
    if (mb + 1 == kM) {
      g.mutable_gradients()->set_partial_grad_sq_norm(5);
      g.mutable_gradients()->set_loss(2.5);
    }
    ASSERT_TRUE(down_end().Send(g, absl::Seconds(1)).ok());
  }
  absl::StatusOr<v1::LinkFrame> commit = Next([](const v1::LinkFrame& f) { return f.has_commit(); });
  t.join();
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(commit.ok()) << commit.status();
  EXPECT_EQ(commit->commit().total_grad_sq_norm(), 5 + 1);
  EXPECT_EQ(out->total_grad_sq, 6);
  EXPECT_EQ(out->loss, 2.5);
}

TEST_F(StageZeroTest, AResendForAMicroBatchNotInFlightFailsTheStepAndIsCounted) {
  Stage s0(0, pipeline::StepSchedule::kAdaptive, nullptr, links_.first.get());
  const std::vector<int64_t> ids = SampleIds(0);
  v1::LinkFrame req;
  req.mutable_resend()->set_step(0);
  req.mutable_resend()->set_micro_batch(kM + 3);
  ASSERT_TRUE(down_end().Send(req, absl::Seconds(1)).ok());
  absl::StatusOr<StepOutcome> out = s0.Step(0, ids);
  EXPECT_TRUE(absl::IsInvalidArgument(out.status())) << out.status();
  EXPECT_THAT(out.status().message(), ::testing::HasSubstr("not in flight"));
  EXPECT_THAT(s0.rejected, ::testing::ElementsAre("resend_invalid"));
}

TEST_F(StageZeroTest, ASilentNeighbourTimesOutNamingWhatIsMissing) {
  for (auto kind : {pipeline::StepSchedule::kAdaptive, pipeline::StepSchedule::kGpipe}) {
    auto links = InProcessStageLink::Pair("link 0");
    Stage s0(0, kind, nullptr, links.first.get(), absl::Milliseconds(300));
    absl::StatusOr<StepOutcome> out = s0.Step(0, SampleIds(0));
    EXPECT_TRUE(absl::IsDeadlineExceeded(out.status())) << out.status();
    if (kind == pipeline::StepSchedule::kAdaptive) {
      EXPECT_THAT(out.status().message(), ::testing::HasSubstr("the gradient of micro-batch 0"));
    }
    // Stage 0 waits on its one neighbour: the silent one is named.
    std::optional<v1::Blame> blame = BlameOf(out.status());
    ASSERT_TRUE(blame.has_value()) << out.status();
    EXPECT_EQ(blame->kind(), v1::Blame::SILENT);
    EXPECT_EQ(blame->link(), v1::Blame::DOWNSTREAM);
    EXPECT_EQ(blame->step(), 0);
  }
}

TEST_F(StageZeroTest, AVanishedNeighbourIsUnavailableNamingTheLink) {
  Stage s0(0, pipeline::StepSchedule::kAdaptive, nullptr, links_.first.get());
  absl::StatusOr<StepOutcome> out;
  std::thread t([&] { out = s0.Step(0, SampleIds(0)); });
  ASSERT_TRUE(Next([](const v1::LinkFrame& f) { return f.has_activations(); }).ok());
  links_.second->Close();  // stage 1 dies after the first micro-batch
  t.join();
  EXPECT_TRUE(absl::IsUnavailable(out.status())) << out.status();
  EXPECT_THAT(out.status().message(), ::testing::HasSubstr("link 0"));
  // A lost link is a consequence, not evidence against the neighbour.
  ASSERT_TRUE(BlameOf(out.status()).has_value());
  EXPECT_EQ(BlameOf(out.status())->kind(), v1::Blame::LINK_LOST);
}

TEST_F(StageZeroTest, AGradientOfTheWrongShapeIsRefusedAndCounted) {
  Stage s0(0, pipeline::StepSchedule::kGpipe, nullptr, links_.first.get());
  v1::LinkFrame g;
  g.mutable_gradients()->set_step(0);
  g.mutable_gradients()->set_micro_batch(0);
  pipeline::GradientCodec small(Fp32Links(), kT, kD - 1);
  ASSERT_TRUE(small.Encode(std::vector<float>(kB * kT * (kD - 1), 1.0f), kB, 1, g.mutable_gradients()->mutable_grad()).ok());
  ASSERT_TRUE(down_end().Send(g, absl::Seconds(1)).ok());
  absl::StatusOr<StepOutcome> out = s0.Step(0, SampleIds(0));
  EXPECT_FALSE(out.ok());
  EXPECT_THAT(s0.rejected, ::testing::ElementsAre("gradient_invalid"));
  ASSERT_TRUE(BlameOf(out.status()).has_value()) << out.status();
  EXPECT_EQ(BlameOf(out.status())->link(), v1::Blame::DOWNSTREAM);
  EXPECT_EQ(BlameOf(out.status())->kind(), v1::Blame::REFUSED);
}

TEST_F(StageZeroTest, ATiedGradientLargerThanTheMatrixIsRefusedAndCounted) {
  Stage s0(0, pipeline::StepSchedule::kGpipe, nullptr, links_.first.get(), absl::Seconds(10), /*tie=*/true);
  pipeline::GradientCodec codec(Fp32Links(), kT, kD);
  for (int mb = 0; mb < kM; ++mb) {
    v1::LinkFrame g;
    g.mutable_gradients()->set_step(0);
    g.mutable_gradients()->set_micro_batch(mb);
    ASSERT_TRUE(codec.Encode(std::vector<float>(kB * kT * kD, 1.0f), kB, 1, g.mutable_gradients()->mutable_grad()).ok());
    if (mb + 1 == kM) {  // the head's gradient: one row more than the 3 x kD matrix
      compression::CodecOptions raw;
      raw.codec = v1::CODEC_RAW_F32;
      const std::vector<float> values(4 * kD, 0.5f);
      const int64_t shape[] = {4 * kD};
      ASSERT_TRUE(compression::Encode(raw, values, shape, 0, g.mutable_gradients()->mutable_tied()->mutable_values()).ok());
    }
    ASSERT_TRUE(down_end().Send(g, absl::Seconds(1)).ok());
  }
  absl::StatusOr<StepOutcome> out = s0.Step(0, SampleIds(0));
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), ::testing::HasSubstr("tied gradient"));
  EXPECT_THAT(s0.rejected, ::testing::ElementsAre("gradient_invalid"));
  EXPECT_TRUE(s0.compute.added_values.empty());  // nothing was added
}

// The last backward's partial norm from a hostile downstream: NaN,
// negative or infinite (without loss scaling) is refused and counted before
// stage 0 commits anything; +inf is an overflow's signal with loss scaling.
TEST_F(StageZeroTest, APartialNormThatIsNotFiniteOrNegativeIsRefusedAndCounted) {
  for (double bad : {std::nan(""), -1.0, HUGE_VAL}) {
    auto links = InProcessStageLink::Pair("link 0");
    Stage s0(0, pipeline::StepSchedule::kGpipe, nullptr, links.first.get());
    pipeline::GradientCodec codec(Fp32Links(), kT, kD);
    for (int mb = 0; mb < kM; ++mb) {
      v1::LinkFrame g;
      g.mutable_gradients()->set_step(0);
      g.mutable_gradients()->set_micro_batch(mb);
      ASSERT_TRUE(codec.Encode(std::vector<float>(kB * kT * kD, 0.25f), kB, 1, g.mutable_gradients()->mutable_grad()).ok());
      if (mb + 1 == kM) g.mutable_gradients()->set_partial_grad_sq_norm(bad);
      ASSERT_TRUE(links.second->Send(g, absl::Seconds(1)).ok());
    }
    absl::StatusOr<StepOutcome> out = s0.Step(0, SampleIds(0));
    EXPECT_TRUE(absl::IsInvalidArgument(out.status())) << bad << ": " << out.status();
    EXPECT_THAT(std::string(out.status().message()), ::testing::HasSubstr("partial_grad_sq_norm")) << bad;
    EXPECT_THAT(s0.rejected, ::testing::ElementsAre("norm_invalid")) << bad;
    // No commit went down.
    EXPECT_FALSE(*links.second->Has([](const v1::LinkFrame& f) { return f.has_commit(); }));
  }
}

// A NaN in a gradient from downstream (raw float32 on an fp32 link) fails
// the step naming the step and micro-batch, before the backward runs.
TEST_F(StageZeroTest, ANonFiniteGradientIsRefusedNamingTheMicroBatch) {
  Stage s0(0, pipeline::StepSchedule::kGpipe, nullptr, links_.first.get());
  pipeline::GradientCodec codec(Fp32Links(), kT, kD);
  v1::LinkFrame g;
  g.mutable_gradients()->set_step(0);
  g.mutable_gradients()->set_micro_batch(0);
  ASSERT_TRUE(codec.Encode(std::vector<float>(kB * kT * kD, 0.25f), kB, 1, g.mutable_gradients()->mutable_grad()).ok());
  const float nan = NAN;
  std::memcpy(g.mutable_gradients()->mutable_grad()->mutable_payload()->data() + 8, &nan, 4);
  ASSERT_TRUE(down_end().Send(g, absl::Seconds(1)).ok());
  absl::StatusOr<StepOutcome> out = s0.Step(0, SampleIds(0));
  EXPECT_TRUE(absl::IsDataLoss(out.status())) << out.status();
  EXPECT_THAT(std::string(out.status().message()), ::testing::HasSubstr("step 0 micro-batch 0 gradient"));
  EXPECT_THAT(s0.rejected, ::testing::ElementsAre("gradient_nonfinite"));
  EXPECT_TRUE(s0.compute.backwards.empty());
}

// A stage whose own gradient diverged stops the step with an error naming
// it rather than sending a NaN norm up (which its neighbour would refuse).
TEST_F(StageZeroTest, AStageWhoseOwnGradientIsNotFiniteStopsTheStepWithoutCommitting) {
  Stage s0(0, pipeline::StepSchedule::kGpipe, nullptr, links_.first.get());
  s0.compute.own_sq_override = std::nan("");
  pipeline::GradientCodec codec(Fp32Links(), kT, kD);
  for (int mb = 0; mb < kM; ++mb) {
    v1::LinkFrame g;
    g.mutable_gradients()->set_step(0);
    g.mutable_gradients()->set_micro_batch(mb);
    ASSERT_TRUE(codec.Encode(std::vector<float>(kB * kT * kD, 0.25f), kB, 1, g.mutable_gradients()->mutable_grad()).ok());
    if (mb + 1 == kM) g.mutable_gradients()->set_partial_grad_sq_norm(5);
    ASSERT_TRUE(down_end().Send(g, absl::Seconds(1)).ok());
  }
  absl::StatusOr<StepOutcome> out = s0.Step(0, SampleIds(0));
  EXPECT_TRUE(absl::IsFailedPrecondition(out.status())) << out.status();
  EXPECT_THAT(std::string(out.status().message()), ::testing::HasSubstr("own gradient is not finite"));
  EXPECT_TRUE(s0.rejected.empty());
  EXPECT_FALSE(*down_end().Has([](const v1::LinkFrame& f) { return f.has_commit(); }));
}

// The test plays stage 1 against a real last stage (of 3).
class LastStageTest : public ::testing::Test {
 protected:
  LastStageTest() : links_(InProcessStageLink::Pair("link 1")) {}
  StageLink& up_end() { return *links_.first; }
  // Sends micro-batch mb's activations of step 0 as stage 1 would.
  void SendActivations(pipeline::ActivationSender& sender, int mb, float poison_at_9 = 0) {
    const std::vector<int64_t> ids = SampleIds(0);
    std::vector<uint64_t> s(ids.begin() + mb * kB, ids.begin() + (mb + 1) * kB);
    std::vector<float> acts(kB * kT * kD, 0.5f);
    v1::LinkFrame f;
    ASSERT_TRUE(sender.Encode(0, mb, 0, s, acts, f.mutable_activations()).ok());
    if (poison_at_9 != 0) {
      std::memcpy(f.mutable_activations()->mutable_rows(1)->mutable_tensor()->mutable_payload()->data() + 4 * 9,
                  &poison_at_9, 4);
    }
    ASSERT_TRUE(up_end().Send(f, absl::Seconds(1)).ok());
  }
  std::pair<std::unique_ptr<InProcessStageLink>, std::unique_ptr<InProcessStageLink>> links_;
};

TEST_F(LastStageTest, NonFiniteActivationsAreRefusedBeforeTheForward) {
  for (float bad : {NAN, INFINITY}) {
    auto links = InProcessStageLink::Pair("link 1");
    links_ = std::move(links);
    Stage s2(2, pipeline::StepSchedule::kGpipe, links_.second.get(), nullptr);
    auto sender = *pipeline::ActivationSender::Create(nullptr, *pipeline::LinkOptionsFromJob(Job(), 0, 1, 1));
    SendActivations(*sender, 0, bad);
    absl::StatusOr<StepOutcome> out = s2.Step(0, SampleIds(0));
    EXPECT_TRUE(absl::IsDataLoss(out.status())) << out.status();
    EXPECT_TRUE(compression::IsNonFiniteError(out.status())) << out.status();
    EXPECT_THAT(std::string(out.status().message()), ::testing::HasSubstr("step 0 micro-batch 0 activations"));
    EXPECT_THAT(s2.rejected, ::testing::ElementsAre("activation_nonfinite"));
    EXPECT_TRUE(s2.compute.forwards.empty()) << "the poisoned input reached the model";
    // The refusal blames the sender, with the reason it was counted under.
    std::optional<v1::Blame> blame = BlameOf(out.status());
    ASSERT_TRUE(blame.has_value()) << out.status();
    EXPECT_EQ(blame->kind(), v1::Blame::REFUSED);
    EXPECT_EQ(blame->link(), v1::Blame::UPSTREAM);
    EXPECT_EQ(blame->reason(), "activation_nonfinite");
    EXPECT_EQ(blame->step(), 0);
  }
}

// The committed total from a hostile upstream: NaN, negative, or below the
// partial norm the last stage sent up (3) is refused; an honest one is used.
TEST_F(LastStageTest, ACommittedTotalBelowThePartialOrNotFiniteIsRefused) {
  for (double total : {std::nan(""), -4.0, 2.0, 9.0}) {
    links_ = InProcessStageLink::Pair("link 1");
    Stage s2(2, pipeline::StepSchedule::kGpipe, links_.second.get(), nullptr);
    auto sender = *pipeline::ActivationSender::Create(nullptr, *pipeline::LinkOptionsFromJob(Job(), 0, 1, 1));
    for (int mb = 0; mb < kM; ++mb) SendActivations(*sender, mb);
    v1::LinkFrame c;
    c.mutable_commit()->set_step(0);
    c.mutable_commit()->set_total_grad_sq_norm(total);
    ASSERT_TRUE(up_end().Send(c, absl::Seconds(1)).ok());
    absl::StatusOr<StepOutcome> out = s2.Step(0, SampleIds(0));
    if (total == 9.0) {
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(out->total_grad_sq, 9.0);
      EXPECT_TRUE(s2.rejected.empty());
      continue;
    }
    EXPECT_TRUE(absl::IsInvalidArgument(out.status())) << total << ": " << out.status();
    EXPECT_THAT(std::string(out.status().message()), ::testing::HasSubstr("total_grad_sq_norm")) << total;
    EXPECT_THAT(s2.rejected, ::testing::ElementsAre("norm_invalid")) << total;
  }
}

}  // namespace
}  // namespace aqswarm::stage

namespace aqswarm::stage {
namespace {

TEST(WaitHistoryTest, BoundsMidStepWaitsByTheRecentP99OnceEnoughWereSeen) {
  AdaptiveDeadlineOptions o;
  o.enabled = true;
  o.multiple = 8;
  o.floor = absl::Seconds(5);
  o.window = 32;
  o.min_samples = 16;
  WaitHistory h(o);
  for (int i = 0; i < 15; ++i) h.Record(absl::Milliseconds(100));
  EXPECT_FALSE(h.Bound().has_value()) << "too few samples for a bound";
  h.Record(absl::Milliseconds(100));
  ASSERT_TRUE(h.Bound().has_value());
  EXPECT_EQ(*h.Bound(), absl::Seconds(5)) << "8 x 100 ms is under the floor";
  for (int i = 0; i < 16; ++i) h.Record(absl::Seconds(1));  // the window: 16 x 100 ms, 16 x 1 s
  EXPECT_EQ(h.P99(), absl::Seconds(1));
  EXPECT_EQ(*h.Bound(), absl::Seconds(8));
  for (int i = 0; i < 32; ++i) h.Record(absl::Milliseconds(10));  // the 1 s waits leave the window
  EXPECT_EQ(h.P99(), absl::Milliseconds(10));
  EXPECT_EQ(*h.Bound(), absl::Seconds(5));
  WaitHistory off(AdaptiveDeadlineOptions{});
  for (int i = 0; i < 100; ++i) off.Record(absl::Milliseconds(1));
  EXPECT_FALSE(off.Bound().has_value()) << "off unless enabled";
}

}  // namespace
}  // namespace aqswarm::stage
