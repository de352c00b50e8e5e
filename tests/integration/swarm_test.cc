// End-to-end churn: a real `aqswarm coordinator` and real `aqswarm peer`
// daemons (each running its stage as a child process) train a 2-stage x
// 2-pipeline GPT on 127.0.0.1. A peer is SIGKILLed and the standby takes its
// place; the coordinator is SIGKILLed and restarted on its state dir. Under
// mutual TLS, a 2 x 1 grid (no replicas) loses a stage's only peer and the
// standby resumes it from a mirror's copy; peers probe each other's links.
// Every wait polls the coordinator's Status with a deadline.
#include "absl/strings/match.h"
#include "tests/integration/swarm_fixture.h"

namespace aqswarm {
namespace {

// Every step's tied-embedding copies, as the peers' step events report
// them: in each pipeline the first and the last stage agree at every step
// both reported (at least 20 such steps and pipelines).
void ExpectTiedCopiesIdentical(const std::vector<std::string>& peer_outputs) {
  // (step, pipeline) -> stage -> the tied hashes its copies reported (a step
  // replayed after the re-plan may report again).
  std::map<std::pair<int64_t, int>, std::map<int, std::set<std::string>>> hashes;
  for (const std::string& out : peer_outputs) {
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
      if (!e.ok() || !e->stage().has_step()) continue;
      const v1::StepEvent& st = e->stage().step();
      ASSERT_FALSE(st.tied_hash().empty()) << line;
      hashes[{st.step(), static_cast<int>(st.pipeline())}][st.stage()].insert(st.tied_hash());
    }
  }
  int compared = 0;
  for (const auto& [step, by_stage] : hashes) {
    if (by_stage.size() < 2) continue;
    const auto& a = by_stage.at(0);
    const auto& b = by_stage.at(1);
    bool common = false;
    for (const auto& h : a) common |= b.count(h) > 0;
    EXPECT_TRUE(common) << "step " << step.first << ", pipeline " << step.second
                        << ": the first and last stage's tied copies differ";
    ++compared;
  }
  EXPECT_GE(compared, 20);
}

// Five peers on a 2x2 grid (one standby); one active peer is killed, the
// standby takes its place with the state it pulls from a live replica, and
// training goes on with a falling loss. With tied embeddings, the copies
// stay identical throughout.
void SwarmTest::KillAPeerAndExpectTheStandbyToCarryOn() {
  StartCoordinator();
  const std::string token = Token();
  for (const char* n : {"p1", "p2", "p3", "p4", "p5"}) StartPeer(n, token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.peers_size() == 5 && st.step() >= 5; },
                      absl::Seconds(180)))
      << "the swarm did not train 5 steps" << Logs();
  const int64_t killed_at = status_.step();
  const double loss_at_kill = status_.loss();
  const v1::PeerStatus* victim = At(status_, 1, 1);
  ASSERT_NE(victim, nullptr);
  const std::string victim_name = victim->peer_name();
  std::string standby;
  for (const auto& p : status_.peers()) {
    if (p.state() == v1::PeerStatus::STANDBY) standby = p.peer_name();
  }
  ASSERT_FALSE(standby.empty());
  peers_.at(victim_name)->Signal(SIGKILL);  // its stage dies with it (--die_with_parent)

  // Within the lease (3 s) plus a re-plan, the standby is placed. (Usually
  // in the killed peer's slot; with probed links the planner may move a
  // survivor there and seat the standby in the survivor's slot instead.)
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        bool seated = false;
        for (const auto& p : st.peers()) seated |= p.peer_name() == standby && p.state() == v1::PeerStatus::ACTIVE;
        return st.peers_size() == 4 && st.grid_complete() && seated;
      },
      absl::Seconds(20)))
      << "the standby did not take the killed peer's place" << Logs();
  // Training goes on from where the survivors were, and the loss keeps falling.
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= killed_at + 15; }, absl::Seconds(180)))
      << "training did not resume after the kill (step " << status_.step() << ")" << Logs();
  EXPECT_LT(status_.loss(), loss_at_kill - 0.05) << "loss " << status_.loss() << " vs " << loss_at_kill;
  std::ifstream fetched(dir_ / (standby + ".out"));
  const std::string out(std::istreambuf_iterator<char>(fetched), {});
  EXPECT_TRUE(HasEvent(out, [](const v1::PeerEvent& e) { return e.has_state_fetched(); }))
      << "the standby should have pulled its stage's state from a live replica";

  // SIGTERM: every daemon leaves and exits, bounded.
  TerminatePeersExcept(victim_name);
  EXPECT_TRUE(WaitFor([](const auto& st) { return st.peers_size() == 0; }, absl::Seconds(10)))
      << "peers did not leave";
  if (absl::StrContains(model_extra_, "tieEmbeddings")) {
    std::vector<std::string> outputs;
    for (const auto& [name, p] : peers_) outputs.push_back(Out(name));
    ExpectTiedCopiesIdentical(outputs);
  }
}

TEST_F(SwarmTest, AKilledPeerIsReplacedByTheStandbyAndTrainingGoesOn) { KillAPeerAndExpectTheStandbyToCarryOn(); }

// The same with delayed DP updates: the states the standby pulls hold the
// update in flight (delayed/params), and the group goes on from them.
TEST_F(SwarmTest, WithDelayedUpdatesAKilledPeerIsReplacedAndTrainingGoesOn) {
  WriteJob(3, R"("dataParallel":2,"dp":{"optimizer":"quantized_adam","warmupSteps":3,"bits":4,"bucketSize":512,)"
              R"("delayedUpdate":true})");
  KillAPeerAndExpectTheStandbyToCarryOn();
}

// Tied embeddings across each pipeline's two stages: the four copies of the
// matrix (two stages x two replicas) stay identical through training, the
// kill and the standby that replaces the last stage with a fetched state.
TEST_F(SwarmTest, WithTiedEmbeddingsAKilledPeerIsReplacedAndTheCopiesStayIdentical) {
  model_extra_ = R"(,"tieEmbeddings":true)";
  WriteJob(3, R"("dataParallel":2,"dp":{"optimizer":"quantized_adam","warmupSteps":3,"bits":4,"bucketSize":512})");
  KillAPeerAndExpectTheStandbyToCarryOn();
}

// DiLoCo (4 inner steps, tied embeddings): the standby pulls the outer state
// (anchor, outer momentum, error buffers) through StateTransfer, training
// goes on, and the tied copies stay identical (both ends restart the tied
// copy from its anchor when they load a state).
TEST_F(SwarmTest, WithDiLoCoAKilledPeerIsReplacedAndTrainingGoesOn) {
  model_extra_ = R"(,"tieEmbeddings":true)";
  WriteJob(3, R"("dataParallel":2,"dp":{"optimizer":"diloco","innerSteps":4,"bits":4,"bucketSize":512})");
  KillAPeerAndExpectTheStandbyToCarryOn();
}

// Fine-tuning end to end: pre-train a small tied GPT on the early speeches
// (`aqswarm pipeline`, one stage), export it (`aqswarm export`), then
// fine-tune it through a swarm (coordinator + 4 peers: AQ-SGD links,
// QuantizedAdam, tied embeddings across the 2 stages) on modern speeches it
// has not seen. The fine-tune starts near the pre-trained loss, far below a
// model from scratch (ln 50257 = 10.8), and improves. While it trains, the
// live swarm is exported (`aqswarm export --coordinator`).
TEST_F(SwarmTest, AnExportedModelIsFineTunedThroughTheSwarmOnAnotherText) {
  const fs::path pre_corpus = dir_ / "pre-corpus", ft_corpus = dir_ / "ft-corpus";
  fs::create_directories(pre_corpus);
  fs::create_directories(ft_corpus);
  std::vector<fs::path> speeches;
  for (const auto& e : fs::directory_iterator(fs::path(kData) / "sotu")) speeches.push_back(e.path());
  std::sort(speeches.begin(), speeches.end());
  int pre = 0, ft = 0;
  for (const fs::path& f : speeches) {
    const int year = std::atoi(f.filename().string().substr(0, 4).c_str());
    if (year < 1830 && pre < 30) fs::copy_file(f, pre_corpus / f.filename()), ++pre;
    if (year >= 1990 && ft < 8) fs::copy_file(f, ft_corpus / f.filename()), ++ft;
  }
  ASSERT_EQ(pre, 30);
  ASSERT_EQ(ft, 8);
  const std::string pre_job = (dir_ / "pretrain.json").string();
  std::ofstream(pre_job) << R"({"name":"pretrain","seed":4,
      "model":{"seqLen":32,"dModel":32,"nLayer":2,"nHead":2,"tieEmbeddings":true},
      "data":{"corpus":")" << pre_corpus.string() << R"(","tokenizer":")" << kData << R"(/gpt2"},
      "optimizer":{"lr":0.01,"minLr":0.002,"warmupSteps":5,"totalSteps":150,"gradClip":1.0},
      "microBatchSize":8,"microBatchesPerStep":2,"epochs":1,"maxSteps":150,"stages":1,"threads":1})";
  RunToCompletion(dir_, "pretrain.log", {"pipeline", "--job=" + pre_job, "--out_dir=" + (dir_ / "pre").string()});
  // The pre-trained loss: the mean of its last 10 steps.
  std::vector<double> pre_losses;
  {
    std::ifstream in(dir_ / "pre" / "events.jsonl");
    for (std::string line; std::getline(in, line);) {
      absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
      if (e.ok() && e->has_step()) pre_losses.push_back(e->step().loss());
    }
  }
  ASSERT_GE(pre_losses.size(), 150u);
  double pre_loss = 0;
  for (size_t i = pre_losses.size() - 10; i < pre_losses.size(); ++i) pre_loss += pre_losses[i] / 10;
  const fs::path model = dir_ / "pretrained";
  RunToCompletion(dir_, "export.log", {"export", "--run=" + (dir_ / "pre").string(), "--out=" + model.string()});

  corpus_ = ft_corpus.string();
  model_extra_ = absl::StrCat(R"(,"tieEmbeddings":true,"initFrom":")", model.string(), R"(")");
  WriteJob(9, R"("dataParallel":2,"dp":{"optimizer":"quantized_adam","warmupSteps":3,"bits":4,"bucketSize":512})");
  StartCoordinator();
  const std::string token = Token();
  peer_flags_ = " --keep_checkpoints=1000";  // so the exported step's files can be compared below
  for (const char* n : {"p1", "p2", "p3", "p4"}) StartPeer(n, token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.step() >= 30; }, absl::Seconds(240)))
      << "the swarm did not fine-tune 30 steps" << Logs();

  // Export the live swarm while it trains: the newest step every stage has
  // a state of, fetched from the peers over StateTransfer. It must equal the
  // export of those same states from the peers' disks, and generate text.
  const fs::path live = dir_ / "live-export";
  RunToCompletion(dir_, "export-live.log", {"export", absl::StrCat("--coordinator=127.0.0.1:", coordinator_port_),
                                            "--out=" + live.string()});
  std::string said;
  {
    std::ifstream in(dir_ / "export-live.log");
    said.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = said.find(" stage(s) after ");
  ASSERT_NE(at, std::string::npos) << said;
  const int64_t live_step = std::atoll(said.c_str() + at + 16);
  ASSERT_GE(live_step, 30) << said;
  const fs::path run = dir_ / "live-run";
  fs::create_directories(run);
  fs::copy_file(job_, run / "job.json");
  for (int k = 0; k < 2; ++k) {
    const std::string name = absl::StrCat("stage-", k);
    const std::string file = absl::StrCat("state-", live_step, ".ckpt");
    fs::create_directories(run / "checkpoints" / name);
    bool found = false;
    for (const char* p : {"p1", "p2", "p3", "p4"}) {
      const fs::path held = dir_ / p / "checkpoints" / name / file;
      if (!found && fs::exists(held)) fs::copy_file(held, run / "checkpoints" / name / file), found = true;
    }
    ASSERT_TRUE(found) << "no peer holds " << name << "/" << file;
  }
  RunToCompletion(dir_, "export-run.log", {"export", "--run=" + run.string(), "--out=" + (dir_ / "disk-export").string()});
  auto bytes = [](const fs::path& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes(live / "model.safetensors"), bytes(dir_ / "disk-export" / "model.safetensors"))
      << "the live export differs from the states of step " << live_step << " on the peers' disks";
  EXPECT_FALSE(fs::exists(live / ".stage-states")) << "fetched states are removed after the export";
  RunToCompletion(dir_, "generate-live.log",
                  {"generate", "--model=" + live.string(), "--prompt=Congress", "--max_tokens=8", "--seed=1"});
  // step -> the training loss the stages reported (pipelines averaged).
  std::map<int64_t, std::vector<double>> by_step;
  for (const auto& [name, p] : peers_) {
    for (absl::string_view line : absl::StrSplit(Out(name), '\n')) {
      absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
      if (e.ok() && e->stage().has_step() && e->stage().step().stage() == 1) {
        by_step[e->stage().step().step()].push_back(e->stage().step().loss());
      }
    }
  }
  auto mean_of = [&](int64_t from, int64_t to) {
    double sum = 0;
    int n = 0;
    for (int64_t s = from; s < to; ++s) {
      for (double l : by_step[s]) sum += l, ++n;
    }
    return n > 0 ? sum / n : std::nan("");
  };
  const double first = mean_of(0, 5), later = mean_of(25, 30);
  const double scratch = std::log(50257.0);
  EXPECT_LT(first, (pre_loss + scratch) / 2) << "the fine-tune starts far from the pre-trained loss " << pre_loss
                                             << " (from scratch: " << scratch << ")";
  EXPECT_LT(later, first - 0.1) << "the fine-tune did not improve (first 5 steps " << first << ")";
  std::cout << "pre-trained loss " << pre_loss << ", fine-tune steps 0-4 " << first << ", steps 25-29 " << later
            << "\n";
  TerminatePeersExcept("");
}

TEST_F(SwarmTest, ARestartedCoordinatorResumesTheSameJobAndPeersCarryOn) {
  StartCoordinator();
  const std::string token = Token();
  for (const char* n : {"a", "b", "c", "d"}) StartPeer(n, token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.step() >= 3; }, absl::Seconds(180)))
      << Logs();
  const uint64_t version = status_.assignment_version();
  coordinator_->Signal(SIGKILL);
  ASSERT_TRUE(coordinator_->Wait(absl::Seconds(10)).ok());
  StartCoordinator();  // same port, same state dir
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.grid_complete() && st.step() >= 3; }, absl::Seconds(30)));
  const int64_t resumed_at = status_.step();
  EXPECT_EQ(status_.assignment_version(), version) << "the restart re-planned; peers should have reconnected";
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= resumed_at + 5 && st.peers_size() == 4; },
                      absl::Seconds(120)))
      << "training did not go on under the restarted coordinator" << Logs();
  EXPECT_EQ(status_.assignment_version(), version);

  // A peer with a bad token is refused with a clear error and exits.
  auto bad = Subprocess::Spawn({kBinary, "peer", absl::StrCat("--coordinator=127.0.0.1:", coordinator_port_),
                                "--join_token=aqj1.bogus.token", "--name=intruder", "--listen=127.0.0.1:1",
                                "--exchange_listen=127.0.0.1:2", "--work_dir=" + (dir_ / "intruder").string()},
                               {.capture_stdout = true, .stderr_path = (dir_ / "intruder.err").string()});
  ASSERT_TRUE(bad.ok());
  auto code = (*bad)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 1);
  std::ifstream err(dir_ / "intruder.err");
  const std::string msg(std::istreambuf_iterator<char>(err), {});
  EXPECT_NE(msg.find("token"), std::string::npos) << msg;
}

TEST_F(SwarmTest, UnderMutualTlsAStageWithNoReplicaResumesFromAMirrorsCopyAndLinksGetProbed) {
  WriteJob(5, R"("dataParallel":1,"checkpointEverySteps":2)");
  MakeTlsDir({"q1", "q2", "q3"});
  StartCoordinator({"--mirror_checkpoints"});
  const std::string token = Token();
  for (const char* n : {"q1", "q2", "q3"}) StartPeer(n, token);
  // Train, and wait until some placed peer measured a link (heartbeat answers
  // ask for probes; the result shows in Status).
  ASSERT_TRUE(WaitFor(
      [](const auto& st) {
        int links = 0;
        for (const auto& p : st.peers()) links += p.links_size();
        return st.grid_complete() && st.peers_size() == 3 && st.step() >= 6 && links >= 2;
      },
      absl::Seconds(180)))
      << "the swarm did not train 6 steps with probed links" << Logs();
  for (const auto& p : status_.peers()) {
    for (const auto& l : p.links()) {
      EXPECT_GT(l.bandwidth_bytes_per_second(), 1e6) << p.peer_name() << " -> " << l.to_peer_id() << " on loopback";
    }
  }
  const v1::PeerStatus* first = At(status_, 0, 0);
  const v1::PeerStatus* victim = At(status_, 1, 0);
  ASSERT_TRUE(first != nullptr && victim != nullptr);
  const std::string first_name = first->peer_name(), victim_name = victim->peer_name();
  // The stage-0 peer copies stage 1's state after its checkpoints and tells
  // the coordinator. The kill waits until it has reported a copy of some
  // step whose own stage-0 state it keeps: a re-plan resumes only at a step
  // held for every stage. (The daemon pins its own state of the newest
  // copied step; before it did, a copy that lagged under load could land
  // after that state was pruned, and the re-plan restarted at step 0.)
  const auto mirrored = [&] {
    for (absl::string_view line : absl::StrSplit(Out(first_name), '\n')) {
      absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
      if (!e.ok() || !e->has_mirrored() || e->mirrored().stage() != 1 || !e->mirrored().reported()) continue;
      const int64_t step = e->mirrored().step();
      // stage/stage_checkpoints.h StageCheckpointPath: <work dir>/checkpoints/stage-<j>/state-<step>.ckpt
      if (fs::exists(dir_ / first_name / "checkpoints" / "stage-0" / absl::StrCat("state-", step, ".ckpt"))) return true;
    }
    return false;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!mirrored() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));  // polling interval of a bounded wait
  }
  ASSERT_TRUE(mirrored()) << Out(first_name);
  // The step at the kill (training went on while the copy landed).
  const v1::StatusResponse at_kill = Status();
  ASSERT_TRUE(last_status_.ok()) << last_status_.error_message();
  const int64_t killed_at = at_kill.step();
  peers_.at(victim_name)->Signal(SIGKILL);

  // Stage 1 had no replica: the standby takes it over from the mirror's copy.
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        const v1::PeerStatus* p = At(st, 1, 0);
        return st.peers_size() == 2 && st.grid_complete() && p != nullptr && p->peer_name() != victim_name;
      },
      absl::Seconds(20)))
      << "the standby did not take the killed peer's place" << Logs();
  const std::string standby = At(status_, 1, 0)->peer_name();
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= killed_at + 6; }, absl::Seconds(120)))
      << "training did not resume after the kill (step " << status_.step() << ")" << Logs();
  const std::string out = Out(standby);
  std::ifstream coordinator_err(dir_ / "coordinator.err");
  EXPECT_TRUE(HasEvent(out, [](const v1::PeerEvent& e) { return e.has_state_fetched() && e.state_fetched().stage() == 1; }))
      << out << "\n--- " << first_name << ":\n"
      << Out(first_name) << "\n--- coordinator:\n"
      << std::string(std::istreambuf_iterator<char>(coordinator_err), {});
  EXPECT_NE(out.find(absl::StrCat(R"("from":")", first_name, R"(")")), std::string::npos)
      << "the state should come from the stage-0 peer's mirror copy: " << out;

  TerminatePeersExcept(victim_name);
}

// Re-planning on measurements: the swarm forms with a peer whose
// uplink is slow (emulated: its stage sends and its link probes go at
// 0.2 Mbit/s); nothing is lost, so only the measured links can move it.
// Its probes and its forward link's send rate show the slow uplink, the
// coordinator predicts a much faster step with the standby in its place,
// re-plans once, and training goes on. With a 1 s check interval and a 3 s
// hold it then keeps the plan (no thrashing on loopback noise).
TEST_F(SwarmTest, APeerWhoseUplinkTurnsOutSlowIsReplannedOutOnceAndTrainingGoesOn) {
  WriteJob(7, R"("dataParallel":1,"checkpointEverySteps":2)");
  StartCoordinator({"--replan_interval_s=1", "--replan_hold_s=3"});
  const std::string token = Token();
  const std::string common = " --seconds_per_layer=0.01 --probe_bytes=65536";
  peer_flags_ = common + " --emulate_uplink_mbps=0.2";
  StartPeer("slow", token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.peers_size() == 1; }, absl::Seconds(60))) << Logs();
  peer_flags_ = common;
  StartPeer("fast1", token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.peers_size() == 2; }, absl::Seconds(60)))
      << Logs();
  StartPeer("fast2", token);
  auto placed = [](const v1::StatusResponse& st, const std::string& name) {
    for (const auto& p : st.peers()) {
      if (p.peer_name() == name) return p.stage() >= 0;
    }
    return false;
  };
  ASSERT_TRUE(placed(Status(), "slow")) << "the first two peers fill the grid";
  const auto coordinator_log = [&] {
    std::ifstream in(dir_ / "coordinator.err");
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const auto replans = [&] {
    const std::string log = coordinator_log();
    int n = 0;
    for (size_t at = log.find("re-planning on measurements"); at != std::string::npos;
         at = log.find("re-planning on measurements", at + 1)) {
      ++n;
    }
    return n;
  };
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        return st.grid_complete() && st.peers_size() == 3 && !placed(st, "slow") && placed(st, "fast1") &&
               placed(st, "fast2");
      },
      absl::Seconds(150)))
      << "the slow peer was not re-planned out\n--- coordinator:\n" << coordinator_log() << Logs();
  EXPECT_EQ(replans(), 1) << coordinator_log();
  EXPECT_EQ(coordinator_log().find("lease of peer"), std::string::npos) << "nobody was lost";
  // Training goes on under the new plan; a dozen hold periods later the plan stands.
  const int64_t at_replan = status_.step();
  const uint64_t plan = Status().assignment_version();
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= at_replan + 20; }, absl::Seconds(120)))
      << "training did not go on after the re-plan (step " << status_.step() << ")" << Logs();
  const absl::Time hold_until = absl::Now() + absl::Seconds(8);
  ASSERT_TRUE(WaitFor([&](const auto&) { return absl::Now() >= hold_until; }, absl::Seconds(20)));
  EXPECT_EQ(replans(), 1) << "the plan changed again:\n" << coordinator_log();
  EXPECT_FALSE(placed(status_, "slow"));
  EXPECT_GE(status_.assignment_version(), plan);
  TerminatePeersExcept("");
}

// Peers others cannot dial are found: one says so (--no_inbound), the other
// advertises a StateTransfer address where nothing listens (what a peer
// behind NAT looks like from outside) and fails the coordinator's probe. With
// replicas they cannot be placed (a replica must accept the others'
// updates), so they stay standbys although they joined first, and the
// reachable peers that join after them are placed and train.
TEST_F(SwarmTest, WithReplicasPeersThatCannotBeDialedStayStandbysAndTheReachableOnesTrain) {
  StartCoordinator();
  const std::string token = Token();
  peer_flags_ = " --no_inbound";
  StartPeer("behind-nat", token);
  peer_flags_ = absl::StrCat(" --state_advertise=127.0.0.1:", testing::UniqueLoopbackPort());
  StartPeer("unreachable", token);
  auto reach = [](const v1::StatusResponse& st, const std::string& name) {
    for (const auto& p : st.peers()) {
      if (p.peer_name() == name) return p.reachability();
    }
    return v1::REACHABILITY_UNSPECIFIED;
  };
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        return reach(st, "behind-nat") == v1::NO_INBOUND && reach(st, "unreachable") == v1::UNREACHABLE;
      },
      absl::Seconds(60)))
      << "status: " << status_.DebugString() << Logs();
  peer_flags_ = "";
  for (const char* name : {"a", "b", "c", "d"}) StartPeer(name, token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.step() >= 5; }, absl::Seconds(180)))
      << "status: " << status_.DebugString() << Logs();
  for (const auto& p : status_.peers()) {
    const bool reachable = p.peer_name().size() == 1;
    EXPECT_EQ(p.stage() >= 0, reachable) << p.peer_name();
    if (reachable) {
      EXPECT_EQ(p.reachability(), v1::REACHABLE) << p.peer_name();
    }
  }
  TerminatePeersExcept("");
}

// Peers behind NAT serve stages of a single pipeline: two of them (one says
// --no_inbound, one fails the probe) and one reachable peer, 3 stages. Both
// advertise StageLink addresses where nothing listens, so every link that
// touches them must be opened by them: the only valid order puts the
// reachable peer in the middle, its upstream dials it as usual and its
// downstream dials it too (a reversed link). Training runs.
TEST_F(SwarmTest, PeersBehindNatServeTheEndsOfAPipelineAndTheirLinksAreOpenedFromTheirSide) {
  stages_ = 3;
  WriteJob(13, R"("dataParallel":1)");
  StartCoordinator();
  const std::string token = Token();
  peer_flags_ = absl::StrCat(" --no_inbound --advertise=127.0.0.1:", testing::UniqueLoopbackPort());
  StartPeer("nat1", token);
  peer_flags_ = absl::StrCat(" --advertise=127.0.0.1:", testing::UniqueLoopbackPort(),
                             " --state_advertise=127.0.0.1:", testing::UniqueLoopbackPort());
  StartPeer("nat2", token);
  peer_flags_ = "";
  StartPeer("open", token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.step() >= 5; }, absl::Seconds(180)))
      << "status: " << status_.DebugString() << Logs();
  for (const auto& p : status_.peers()) {
    if (p.peer_name() == "open") {
      EXPECT_EQ(p.stage(), 1);
      EXPECT_EQ(p.reachability(), v1::REACHABLE);
    } else {
      EXPECT_NE(p.stage(), 1) << p.peer_name();
      EXPECT_NE(p.reachability(), v1::REACHABLE) << p.peer_name();
    }
  }
  TerminatePeersExcept("");
}

}  // namespace
}  // namespace aqswarm
