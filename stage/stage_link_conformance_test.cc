// One suite over every StageLink (stage/stage_link.h): the gRPC link
// (LinkConnection over a real StageLinkServer on 127.0.0.1) and the
// in-process pair the step protocol's tests use. What the step protocol
// relies on holds for both: frames in arrival order, taken by match, the
// others kept; Has peeks; waits are bounded; arrivals notify; a vanished far
// end fails every wait with Unavailable and keeps what had arrived.
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "stage/in_process_stage_link.h"
#include "stage/link_transport.h"
#include "stage/stage_link.h"

namespace aqswarm::stage {
namespace {

v1::LinkFrame Commit(uint64_t step) {
  v1::LinkFrame f;
  f.mutable_commit()->set_step(step);
  return f;
}

StageLink::Match StepIs(uint64_t step) {
  return [step](const v1::LinkFrame& f) { return f.has_commit() && f.commit().step() == step; };
}

// Waits until `link` holds a frame that matches. The count is read before
// each check, so a frame that arrives between the check and the wait wakes it.
bool AwaitFrame(StageLink& link, const FrameArrivals& arrivals, const StageLink::Match& match) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (uint64_t seen = arrivals.count(); !*link.Has(match); seen = arrivals.count()) {
    if (!arrivals.WaitPast(seen, deadline)) return false;
  }
  return true;
}

// Two connected ends: `up` (stage j) and `down` (stage j + 1).
class LinkPair {
 public:
  virtual ~LinkPair() = default;
  virtual StageLink* up() = 0;
  virtual StageLink* down() = 0;
  // The downstream end goes away at once, as a killed process would.
  virtual void VanishDown() = 0;
};

class GrpcPair final : public LinkPair {
 public:
  GrpcPair() {
    server_ = *StageLinkServer::Start("127.0.0.1:0", {});
    client_ = *LinkConnection::Dial(absl::StrCat("127.0.0.1:", server_->port()), {}, absl::Seconds(10));
    server_end_ = *server_->Accept(absl::Seconds(10));
  }
  ~GrpcPair() override {
    if (!vanished_) server_end_->CloseSend();
    client_.reset();
    server_.reset();
  }
  StageLink* up() override { return client_.get(); }
  StageLink* down() override { return server_end_; }
  void VanishDown() override {
    vanished_ = true;
    server_->Shutdown(absl::ZeroDuration());
  }

 private:
  std::unique_ptr<StageLinkServer> server_;
  std::unique_ptr<LinkConnection> client_;
  LinkConnection* server_end_ = nullptr;  // owned by server_
  bool vanished_ = false;
};

class InProcessPair final : public LinkPair {
 public:
  InProcessPair() { std::tie(up_, down_) = InProcessStageLink::Pair("link 0"); }
  StageLink* up() override { return up_.get(); }
  StageLink* down() override { return down_.get(); }
  void VanishDown() override { down_->Close(); }

 private:
  std::unique_ptr<InProcessStageLink> up_, down_;
};

struct Backend {
  std::string name;
  std::function<std::unique_ptr<LinkPair>()> make;
};

class StageLinkConformanceTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { pair_ = GetParam().make(); }
  std::unique_ptr<LinkPair> pair_;
};

TEST_P(StageLinkConformanceTest, FramesComeInArrivalOrderTakenByMatchTheOthersWait) {
  for (StageLink* from : {pair_->up(), pair_->down()}) {
    StageLink* to = from == pair_->up() ? pair_->down() : pair_->up();
    for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(from->Send(Commit(i), absl::Seconds(10)).ok());
    absl::StatusOr<v1::LinkFrame> f3 = to->Receive(StepIs(3), absl::Seconds(10));
    ASSERT_TRUE(f3.ok()) << f3.status();
    for (uint64_t i : {0, 1, 2, 4}) {
      absl::StatusOr<v1::LinkFrame> f = to->Receive([](const v1::LinkFrame&) { return true; }, absl::Seconds(10));
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_EQ(f->commit().step(), i);
    }
  }
}

TEST_P(StageLinkConformanceTest, HasPeeksWithoutTaking) {
  FrameArrivals arrivals;
  pair_->down()->NotifyArrivals(&arrivals);
  EXPECT_FALSE(*pair_->down()->Has(StepIs(1)));
  ASSERT_TRUE(pair_->up()->Send(Commit(1), absl::Seconds(10)).ok());
  ASSERT_TRUE(AwaitFrame(*pair_->down(), arrivals, StepIs(1)));
  EXPECT_TRUE(*pair_->down()->Has(StepIs(1))) << "Has does not take the frame";
  EXPECT_FALSE(*pair_->down()->Has(StepIs(2)));
  ASSERT_TRUE(pair_->down()->Receive(StepIs(1), absl::Seconds(1)).ok());
  EXPECT_FALSE(*pair_->down()->Has(StepIs(1)));
  pair_->down()->NotifyArrivals(nullptr);
}

TEST_P(StageLinkConformanceTest, AWaitForAFrameThatNeverComesIsBounded) {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::LinkFrame> f = pair_->down()->Receive(StepIs(7), absl::Milliseconds(50));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDeadlineExceeded) << f.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_P(StageLinkConformanceTest, ArrivalsNotifyTheCounterUntilItIsReplaced) {
  auto counter = std::make_unique<FrameArrivals>();
  pair_->down()->NotifyArrivals(counter.get());
  const uint64_t before = counter->count();
  ASSERT_TRUE(pair_->up()->Send(Commit(1), absl::Seconds(10)).ok());
  ASSERT_TRUE(counter->WaitPast(before, absl::Now() + absl::Seconds(10)));
  pair_->down()->NotifyArrivals(nullptr);
  const uint64_t seen = counter->count();
  ASSERT_TRUE(pair_->up()->Send(Commit(2), absl::Seconds(10)).ok());
  ASSERT_TRUE(pair_->down()->Receive(StepIs(2), absl::Seconds(10)).ok()) << "the next frame arrived";
  EXPECT_EQ(counter->count(), seen);
}

TEST_P(StageLinkConformanceTest, AVanishedFarEndFailsWaitsWithUnavailableAndKeepsWhatArrived) {
  FrameArrivals arrivals;
  pair_->up()->NotifyArrivals(&arrivals);
  ASSERT_TRUE(pair_->down()->Send(Commit(1), absl::Seconds(10)).ok());
  ASSERT_TRUE(AwaitFrame(*pair_->up(), arrivals, StepIs(1)));
  const absl::Time start = absl::Now();
  pair_->VanishDown();
  absl::StatusOr<v1::LinkFrame> missing = pair_->up()->Receive(StepIs(2), absl::Seconds(30));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnavailable) << missing.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "not the timeout";
  EXPECT_EQ(pair_->up()->Has(StepIs(2)).status().code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<v1::LinkFrame> kept = pair_->up()->Receive(StepIs(1), absl::Seconds(1));
  EXPECT_TRUE(kept.ok()) << "what arrived before the end stays: " << kept.status();
  EXPECT_FALSE(pair_->up()->Send(Commit(3), absl::Seconds(1)).ok()) << "the link is broken";
  pair_->up()->NotifyArrivals(nullptr);
}

TEST_P(StageLinkConformanceTest, BytesSentCountWhatWasSent) {
  EXPECT_EQ(pair_->up()->bytes_sent(), 0u);
  ASSERT_TRUE(pair_->up()->Send(Commit(1), absl::Seconds(10)).ok());
  ASSERT_TRUE(pair_->down()->Receive(StepIs(1), absl::Seconds(10)).ok());
  const uint64_t one = pair_->up()->bytes_sent();
  EXPECT_GT(one, 0u);
  ASSERT_TRUE(pair_->up()->Send(Commit(2), absl::Seconds(10)).ok());
  ASSERT_TRUE(pair_->down()->Receive(StepIs(2), absl::Seconds(10)).ok());
  EXPECT_GT(pair_->up()->bytes_sent(), one);
  EXPECT_EQ(pair_->down()->bytes_sent(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, StageLinkConformanceTest,
    ::testing::Values(Backend{"Grpc", [] { return std::unique_ptr<LinkPair>(new GrpcPair()); }},
                      Backend{"InProcess", [] { return std::unique_ptr<LinkPair>(new InProcessPair()); }}),
    [](const ::testing::TestParamInfo<Backend>& info) { return info.param.name; });

}  // namespace
}  // namespace aqswarm::stage
