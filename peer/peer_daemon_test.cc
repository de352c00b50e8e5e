// The peer daemon against a fake coordinator and a fake stage launcher: how
// it follows assignments (start, keep, restart on a new plan, stop on
// standby), passes its stage's progress on, waits after a failed stage, ends
// with a finished job, and joins again when the coordinator forgot it. No
// gRPC to a coordinator, no stage processes.
#include "peer/peer_daemon.h"

#include <algorithm>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "peer/fake_coordinator.h"
#include "peer/stage_child.h"
#include "tests/testing/ports.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::peer {
namespace {

// Children the daemon launched; the test makes them print events and exit.
class FakeLauncher final : public StageLauncher {
 public:
  struct Record {
    v1::StageLaunch launch;
    StageChildCallbacks callbacks;
    bool exited = false;
    bool stopped = false;
  };

  absl::StatusOr<std::unique_ptr<StageChild>> Launch(const v1::StageLaunch& launch,
                                                     StageChildCallbacks callbacks) override {
    auto r = std::make_shared<Record>(Record{launch, std::move(callbacks)});
    absl::MutexLock l(&mu_);
    records_.push_back(r);
    return std::unique_ptr<StageChild>(new Child(this, r));
  }

  bool WaitForLaunches(size_t n) {
    absl::MutexLock l(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return records_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(30));
  }
  size_t launches() {
    absl::MutexLock l(&mu_);
    return records_.size();
  }
  v1::StageLaunch launch(size_t i) {
    absl::MutexLock l(&mu_);
    return records_.at(i)->launch;
  }
  bool stopped(size_t i) {
    absl::MutexLock l(&mu_);
    return records_.at(i)->stopped;
  }
  // Child i prints `e` / exits with `code` (as its reader thread would).
  void Emit(size_t i, const v1::StageEvent& e) { At(i)->callbacks.on_event(e); }
  void Exit(size_t i, int code) {
    std::shared_ptr<Record> r = At(i);
    {
      absl::MutexLock l(&mu_);
      if (r->exited) return;
      r->exited = true;
    }
    r->callbacks.on_exit(code);
  }

 private:
  class Child final : public StageChild {
   public:
    Child(FakeLauncher* launcher, std::shared_ptr<Record> r) : launcher_(launcher), r_(std::move(r)) {}
    int64_t pid() const override { return 4242; }
    bool Stop(absl::Duration) override {
      bool exit = false;
      {
        absl::MutexLock l(&launcher_->mu_);
        r_->stopped = true;
        exit = !r_->exited;
        r_->exited = true;
      }
      if (exit) r_->callbacks.on_exit(143);  // SIGTERM
      return true;
    }

   private:
    FakeLauncher* launcher_;
    std::shared_ptr<Record> r_;
  };

  std::shared_ptr<Record> At(size_t i) {
    absl::MutexLock l(&mu_);
    return records_.at(i);
  }

  absl::Mutex mu_;
  std::vector<std::shared_ptr<Record>> records_ ABSL_GUARDED_BY(mu_);
};

v1::JobSpec Job() {
  v1::JobSpec job;
  job.set_name("daemon-test");
  job.set_stages(2);
  job.set_data_parallel(1);
  job.set_checkpoint_every_steps(1);
  return job;
}

// A daemon "p1" on loopback ports in <dir>/work, driven by `coordinator`
// and `launcher`, that never probes and reports fixed data hashes.
PeerDaemonOptions TestOptions(const testing::ScratchDir& dir, std::shared_ptr<FakeCoordinator> coordinator,
                              std::shared_ptr<StageLauncher> launcher) {
  PeerDaemonOptions o;
  o.coordinator = "fake-coordinator:7000";
  o.join_token = "token";
  o.name = "p1";
  o.listen = absl::StrCat("127.0.0.1:", testing::UniqueLoopbackPort());
  o.exchange_listen = absl::StrCat("127.0.0.1:", testing::UniqueLoopbackPort());
  o.work_dir = dir.Sub("work");
  o.probe_bytes = 0;
  o.coordinator_client = std::move(coordinator);
  o.launcher = std::move(launcher);
  o.identify_data = [](const v1::DataSpec&) { return DataIdentity{"00000000000000d1", "00000000000000d2"}; };
  return o;
}

class PeerDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    coordinator_ = std::make_shared<FakeCoordinator>(Job());
    launcher_ = std::make_shared<FakeLauncher>();
    PeerDaemonOptions o = TestOptions(dir_, coordinator_, launcher_);
    o.replan_wait = absl::Seconds(60);
    o.report = [this](const v1::PeerEvent& e) {
      absl::MutexLock l(&mu_);
      events_.push_back(e);
    };
    auto d = PeerDaemon::Create(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    runner_ = std::thread([this] { run_status_ = daemon_->Run(); });
  }

  void TearDown() override {
    if (daemon_ != nullptr) daemon_->Stop();
    if (runner_.joinable()) runner_.join();
  }

  // Waits (bounded) until the daemon reported `n` events that `pred` accepts.
  bool SawEvents(const std::function<bool(const v1::PeerEvent&)>& pred, int n) {
    absl::MutexLock l(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::count_if(events_.begin(), events_.end(), pred) >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(30));
  }
  bool SawEvent(const std::function<bool(const v1::PeerEvent&)>& pred) { return SawEvents(pred, 1); }
  bool Applied(uint64_t version) {
    return SawEvent([version](const v1::PeerEvent& e) { return e.assignment().version() == version; });
  }

  static v1::Assignment Stage0(uint64_t version, uint64_t plan) {
    v1::Assignment a;
    a.set_version(version);
    a.set_plan_version(plan);
    a.set_peer_id(7);
    a.set_role(v1::Assignment::STAGE);
    a.set_stage(0);
    a.set_num_stages(2);
    a.set_num_pipelines(1);
    a.set_grid_complete(true);
    a.mutable_next()->set_stage_link_address("127.0.0.1:9");
    a.mutable_next()->set_link_generation(plan);
    return a;
  }
  static v1::StageEvent Step(uint32_t step) {
    v1::StageEvent e;
    e.mutable_step()->set_step(step);
    e.mutable_step()->set_loss(5.5);
    e.mutable_step()->set_tokens(1000);
    e.mutable_step()->set_step_seconds(0.5);
    return e;
  }

  testing::ScratchDir dir_;
  std::shared_ptr<FakeCoordinator> coordinator_;
  std::shared_ptr<FakeLauncher> launcher_;
  std::unique_ptr<PeerDaemon> daemon_;
  std::thread runner_;
  absl::Status run_status_;
  absl::Mutex mu_;
  std::vector<v1::PeerEvent> events_ ABSL_GUARDED_BY(mu_);
};

TEST_F(PeerDaemonTest, FollowsItsAssignmentsAndPassesItsStagesProgressOn) {
  coordinator_->Push(Stage0(1, 1));
  ASSERT_TRUE(launcher_->WaitForLaunches(1));
  const v1::StageLaunch c = launcher_->launch(0);
  EXPECT_EQ(c.stage(), 0u);
  EXPECT_EQ(c.plan(), 1u);
  EXPECT_EQ(c.start_step(), 0);
  EXPECT_EQ(c.next().stage_link_address(), "127.0.0.1:9");
  EXPECT_TRUE(c.die_with_parent());
  EXPECT_THAT(c.checkpoint_dir(), ::testing::EndsWith("work/checkpoints/stage-0"));

  // A step event becomes a progress report (steps completed, under its plan)
  // and is passed on as the daemon's own event.
  launcher_->Emit(0, Step(4));
  ASSERT_TRUE(coordinator_->WaitFor([](const FakeCoordinator& f) {
    return !f.progress().empty() && f.progress().back().progress().step() == 5;
  }));
  EXPECT_EQ(coordinator_->progress().back().progress().plan_version(), 1u);
  EXPECT_DOUBLE_EQ(coordinator_->progress().back().progress().tokens_per_second(), 2000);
  EXPECT_TRUE(SawEvent([](const v1::PeerEvent& e) { return e.stage().step().step() == 4; }));

  // A new version of the same plan (a standby came): the child trains on;
  // a new plan restarts it under that plan (the second launch is plan 2's,
  // not a restart for version 2).
  coordinator_->Push(Stage0(2, 1));
  ASSERT_TRUE(Applied(2));
  coordinator_->Push(Stage0(3, 2));
  ASSERT_TRUE(launcher_->WaitForLaunches(2));
  EXPECT_TRUE(launcher_->stopped(0));
  EXPECT_EQ(launcher_->launch(1).plan(), 2u);
  EXPECT_EQ(launcher_->launch(1).next().link_generation(), 2u);

  // Standby: no child.
  v1::Assignment standby = Stage0(4, 3);
  standby.set_role(v1::Assignment::STANDBY);
  coordinator_->Push(standby);
  ASSERT_TRUE(Applied(4));
  ASSERT_TRUE(SawEvents([](const v1::PeerEvent& e) { return e.has_stage_stopped(); }, 2));
  EXPECT_TRUE(launcher_->stopped(1));
  EXPECT_EQ(launcher_->launches(), 2u);

  daemon_->Stop();
  runner_.join();
  EXPECT_TRUE(run_status_.ok()) << run_status_;
  EXPECT_EQ(coordinator_->leaves(), 1);
}

TEST_F(PeerDaemonTest, AnAssignmentThatDoesNotFitTheJobIsIgnored) {
  v1::Assignment wrong = Stage0(1, 1);
  wrong.set_num_stages(3);
  coordinator_->Push(wrong);
  coordinator_->Push(Stage0(2, 1));
  ASSERT_TRUE(launcher_->WaitForLaunches(1));
  absl::MutexLock l(&mu_);
  for (const auto& e : events_) EXPECT_NE(e.assignment().version(), 1u) << "the 3-stage assignment was applied";
}

TEST_F(PeerDaemonTest, AFailedStageWaitsForTheNextPlanAndRestartsUnderIt) {
  coordinator_->Push(Stage0(1, 1));
  ASSERT_TRUE(launcher_->WaitForLaunches(1));
  launcher_->Exit(0 /*child*/, 1);
  ASSERT_TRUE(SawEvent([](const v1::PeerEvent& e) { return e.child_exit().code() == 1; }));
  coordinator_->Push(Stage0(2, 1));  // the same plan: no restart
  ASSERT_TRUE(Applied(2));
  EXPECT_EQ(launcher_->launches(), 1u);
  coordinator_->Push(Stage0(3, 2));  // the coordinator's next plan
  ASSERT_TRUE(launcher_->WaitForLaunches(2));
  EXPECT_EQ(launcher_->launch(1).plan(), 2u);
}

TEST_F(PeerDaemonTest, AStageEndingWithABlameIsReportedToTheCoordinatorAndTheDaemonStays) {
  coordinator_->Push(Stage0(1, 1));
  ASSERT_TRUE(launcher_->WaitForLaunches(1));
  v1::StageEvent error;
  error.mutable_error()->set_code("INVALID_ARGUMENT");
  v1::Blame& b = *error.mutable_error()->mutable_blame();
  b.set_kind(v1::Blame::REFUSED);
  b.set_link(v1::Blame::DOWNSTREAM);
  b.set_reason("gradient_invalid");
  b.set_peer_id(7);
  b.set_plan(1);
  launcher_->Emit(0, error);
  launcher_->Exit(0, 1);
  ASSERT_TRUE(coordinator_->WaitFor([](const FakeCoordinator& f) { return !f.blames().empty(); }));
  const v1::BlameReport r = coordinator_->blames().front();
  EXPECT_EQ(r.blame().peer_id(), 7u);
  EXPECT_EQ(r.blame().reason(), "gradient_invalid");
  EXPECT_FALSE(r.session_token().empty());
  ASSERT_TRUE(SawEvent([](const v1::PeerEvent& e) { return e.blame_reported().outcome() == "RECORDED"; }));
  // It keeps its slot: the coordinator's restart is what starts it again.
  coordinator_->Push(Stage0(2, 2));
  ASSERT_TRUE(launcher_->WaitForLaunches(2));
  EXPECT_EQ(coordinator_->leaves(), 0);
}

TEST_F(PeerDaemonTest, AStageThatFinishesTheJobEndsTheRunAndLeaves) {
  coordinator_->Push(Stage0(1, 1));
  ASSERT_TRUE(launcher_->WaitForLaunches(1));
  v1::StageEvent done;
  done.mutable_done();
  launcher_->Emit(0, done);
  launcher_->Exit(0, 0);
  runner_.join();
  EXPECT_TRUE(run_status_.ok()) << run_status_;
  EXPECT_TRUE(SawEvent([](const v1::PeerEvent& e) { return e.has_job_done(); }));
  EXPECT_EQ(coordinator_->leaves(), 1);
}

TEST_F(PeerDaemonTest, APeerTheCoordinatorForgotJoinsAgain) {
  ASSERT_TRUE(coordinator_->WaitFor([](const FakeCoordinator& f) { return f.joins() == 1; }));
  coordinator_->ForgetPeer();
  ASSERT_TRUE(coordinator_->WaitFor([](const FakeCoordinator& f) { return f.joins() == 2; }));
  coordinator_->Push(Stage0(1, 1));
  ASSERT_TRUE(launcher_->WaitForLaunches(1));
}

// A coordinator that says "join later" (a re-plan hold of up to minutes, a
// join rate limit) for longer than the join timeout is waited for; one that
// cannot be reached is given up on after the join timeout.
TEST(PeerDaemonJoinTest, ACoordinatorSayingJoinLaterIsWaitedForPastTheJoinTimeout) {
  testing::ScratchDir dir;
  auto coordinator = std::make_shared<FakeCoordinator>(Job());
  const absl::Time until = absl::Now() + absl::Seconds(2);
  coordinator->RefuseJoinsUntil(until, absl::ResourceExhaustedError("peer p1 re-planned the swarm: held back 2 s"));
  PeerDaemonOptions o = TestOptions(dir, coordinator, std::make_shared<FakeLauncher>());
  o.join_timeout = absl::Milliseconds(500);
  auto daemon = PeerDaemon::Create(o);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  absl::Status run;
  std::thread runner([&] { run = (*daemon)->Run(); });
  const bool joined = coordinator->WaitFor([](const FakeCoordinator& f) { return f.joins() == 1; });
  (*daemon)->Stop();
  runner.join();
  EXPECT_TRUE(joined) << run;
  EXPECT_GE(absl::Now(), until);
  EXPECT_GT(coordinator->refused_joins(), 1);
  EXPECT_TRUE(run.ok()) << run;
}

TEST(PeerDaemonJoinTest, AnUnreachableCoordinatorIsGivenUpOnAfterTheJoinTimeout) {
  testing::ScratchDir dir;
  auto coordinator = std::make_shared<FakeCoordinator>(Job());
  coordinator->RefuseJoinsUntil(absl::InfiniteFuture(), absl::UnavailableError("connection refused"));
  PeerDaemonOptions o = TestOptions(dir, coordinator, std::make_shared<FakeLauncher>());
  o.join_timeout = absl::Milliseconds(500);
  auto daemon = PeerDaemon::Create(o);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const absl::Status run = (*daemon)->Run();
  EXPECT_EQ(run.code(), absl::StatusCode::kUnavailable) << run;
  EXPECT_EQ(coordinator->joins(), 0);
  EXPECT_GT(coordinator->refused_joins(), 0);
}

// The data hashes a peer reports at join come from its own copy of the
// job's data (hashed once per job); a peer that cannot read the data does
// not join and says why.
// Plaintext servers (StageLink, GradientExchange, StateTransfer) only on
// loopback unless --insecure (rpc::CheckListenSecurity).
TEST(PeerDaemonListenTest, PlaintextOffLoopbackIsRefusedUnlessInsecure) {
  testing::ScratchDir dir;
  for (const bool exchange : {false, true}) {
    PeerDaemonOptions o = TestOptions(dir, std::make_shared<FakeCoordinator>(Job()), std::make_shared<FakeLauncher>());
    const int port = testing::UniqueLoopbackPort();
    (exchange ? o.exchange_listen : o.listen) = absl::StrCat("0.0.0.0:", port);
    (exchange ? o.exchange_advertise : o.advertise) = absl::StrCat("127.0.0.1:", port);
    auto refused = PeerDaemon::Create(o);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("--insecure"));
    EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("0.0.0.0"));
    o.insecure = true;
    auto allowed = PeerDaemon::Create(o);
    EXPECT_TRUE(allowed.ok()) << allowed.status();
  }
}

class PeerDaemonDataTest : public ::testing::Test {
 protected:
  absl::Status RunUntil(std::function<absl::StatusOr<DataIdentity>(const v1::DataSpec&)> identify,
                        const std::function<bool(const FakeCoordinator&)>& joined) {
    v1::JobSpec job = Job();
    job.mutable_data()->set_corpus("their/corpus");
    job.mutable_data()->set_tokenizer("their/tokenizer.json");
    coordinator_ = std::make_shared<FakeCoordinator>(job);
    PeerDaemonOptions o = TestOptions(dir_, coordinator_, std::make_shared<FakeLauncher>());
    o.identify_data = std::move(identify);
    auto d = PeerDaemon::Create(o);
    if (!d.ok()) return d.status();
    absl::Status status;
    std::thread runner([&] { status = (*d)->Run(); });
    const bool ok = coordinator_->WaitFor(joined);
    (*d)->Stop();
    runner.join();
    EXPECT_TRUE(ok) << "the join the test waited for did not happen";
    return status;
  }

  testing::ScratchDir dir_;
  std::shared_ptr<FakeCoordinator> coordinator_;
};

TEST_F(PeerDaemonDataTest, ReportsTheHashesOfItsCopyOfTheJobsData) {
  std::vector<v1::DataSpec> asked;
  absl::Status s = RunUntil(
      [&](const v1::DataSpec& d) {
        asked.push_back(d);
        return DataIdentity{"00000000000000d1", "00000000000000d2"};
      },
      [](const FakeCoordinator& f) { return f.joins() >= 1; });
  EXPECT_TRUE(s.ok()) << s;
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].corpus(), "their/corpus");
  EXPECT_EQ(coordinator_->last_join().dataset_hash(), "00000000000000d1");
  EXPECT_EQ(coordinator_->last_join().tokenizer_hash(), "00000000000000d2");
}

TEST_F(PeerDaemonDataTest, APeerThatCannotReadTheDataDoesNotJoinAndSaysWhy) {
  absl::Status s = RunUntil([](const v1::DataSpec&) -> absl::StatusOr<DataIdentity> {
    return absl::NotFoundError("their/corpus: no such file or directory");
  }, [](const FakeCoordinator& f) { return f.status_calls() >= 1; });
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), ::testing::HasSubstr("data.corpus 'their/corpus'"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("no such file"));
  EXPECT_EQ(coordinator_->joins(), 0);
}

}  // namespace
}  // namespace aqswarm::peer
