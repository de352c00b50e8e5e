// Hostile peers against stage states, on a live swarm (a real coordinator
// and `aqswarm peer` daemons on 127.0.0.1, tests/integration/swarm_fixture.h):
//   - a StateTransfer client flood: a peer serves at most two fetches at
//     once and refuses the rest with RESOURCE_EXHAUSTED, while the swarm
//     keeps training; once the flood ends an honest fetch gets the state the
//     peer reported (its SHA-256);
//   - a rollback (a stage's only peer lost, the re-plan resumes at a step
//     behind the survivors): the survivors' later states are moved to their
//     quarantine, not deleted, the stage child stops on SIGTERM without the
//     SIGKILL grace, and training goes on with a falling loss.
//   - a lying state source (bytes whose SHA-256 differs from the one it
//     reported): refused by digest, nothing kept (the same with a second,
//     honest source, which is then used: peer/state_keeper_test.cc
//     StateKeeperTest.AStateWhoseSha256DiffersFromTheReportedOneIsRefusedAndAnotherSourceUsed).
#include <fcntl.h>
#include <sys/stat.h>

#include <set>

#include "common/metrics.h"
#include "common/sha256.h"
#include "proto/state.grpc.pb.h"
#include "tests/integration/swarm_fixture.h"

namespace aqswarm {
namespace {

class HostileStateTest : public SwarmTest {
 protected:
  // A 2-stage x 1-pipeline grid (no data parallelism) of `peers` peers,
  // each daemon serving its own metrics (metrics_port_[name]).
  void StartGrid(const std::vector<std::string>& peers) {
    WriteJob(3, R"("dataParallel":1)");
    StartCoordinator();
    const std::string token = Token();
    for (const std::string& n : peers) {
      metrics_port_[n] = testing::UniqueLoopbackPort();
      peer_flags_ = absl::StrCat(" --daemon_metrics_listen=127.0.0.1:", metrics_port_[n]);
      StartPeer(n, token);
    }
    peer_flags_.clear();
  }

  std::map<std::string, int> metrics_port_;

  std::string Err(const std::string& peer) {
    std::ifstream in(dir_ / (peer + ".err"));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  static std::vector<int64_t> StepsOnDisk(const fs::path& dir) {
    std::vector<int64_t> steps;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      int64_t n = 0;
      if (absl::StartsWith(name, "state-") && absl::EndsWith(name, ".ckpt") &&
          absl::SimpleAtoi(name.substr(6, name.size() - 11), &n)) {
        steps.push_back(n);
      }
    }
    std::sort(steps.begin(), steps.end());
    return steps;
  }
};

// One fetch stream that reads at most one chunk, so the server stays busy
// sending it (HTTP/2 flow control) until it is cancelled.
struct HeldFetch {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::StateTransfer::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::StateChunk>> reader;
  bool finished = false;
};

TEST_F(HostileStateTest, AStateTransferFloodIsBoundedAndAnHonestFetchStillWorks) {
  StartGrid({"h1", "h2"});
  const v1::PeerStatus* holder = nullptr;
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        if (!st.grid_complete() || st.step() < 3) return false;
        for (const auto& p : st.peers()) {
          if (!p.state_transfer_address().empty() && !p.held().empty()) return true;
        }
        return false;
      },
      absl::Seconds(120)))
      << "the swarm did not train 3 steps" << Logs();
  for (const auto& p : status_.peers()) {
    if (!p.state_transfer_address().empty() && !p.held().empty()) holder = &p;
  }
  ASSERT_NE(holder, nullptr);
  const std::string target = holder->state_transfer_address();
  const int holder_metrics = metrics_port_.at(holder->peer_name());
  const uint32_t stage = holder->held(0).stage();
  const int64_t step_before = status_.step();
  const double loss_before = status_.loss();

  // The flood: 12 fetches at once, none read beyond its first chunk.
  v1::StateRequest req;
  req.set_job_name("swarm-it");
  req.set_stage(stage);  // step 0: the newest
  constexpr int kFlood = 12;
  std::vector<std::unique_ptr<HeldFetch>> flood;
  for (int i = 0; i < kFlood; ++i) {
    auto f = std::make_unique<HeldFetch>();
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    f->channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    f->stub = v1::StateTransfer::NewStub(f->channel);
    f->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    f->reader = f->stub->Fetch(&f->ctx, req);
    flood.push_back(std::move(f));
  }
  int served = 0, refused = 0;
  std::string refusal;
  for (auto& f : flood) {
    v1::StateChunk c;
    if (f->reader->Read(&c)) {
      ++served;  // admitted: left unread, the server stays on it
      continue;
    }
    const grpc::Status s = f->reader->Finish();
    f->finished = true;
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      refusal = s.error_message();
    } else {
      ADD_FAILURE() << "fetch ended with " << s.error_code() << ": " << s.error_message();
    }
  }
  EXPECT_EQ(served, 2) << "a peer serves at most two state fetches at once";
  EXPECT_EQ(refused, kFlood - 2);
  EXPECT_THAT(refusal, ::testing::HasSubstr("at most 2"));
  // Counted where it was refused: the holder daemon's metrics.
  absl::StatusOr<std::string> scraped = HttpGet(absl::StrCat("127.0.0.1:", holder_metrics), "/metrics");
  ASSERT_TRUE(scraped.ok()) << scraped.status();
  EXPECT_THAT(*scraped, ::testing::HasSubstr(absl::StrCat(
                            "aqswarm_peer_state_transfer_refused_total{reason=\"busy\"} ", kFlood - 2)));

  // The swarm trains on while the flood holds the server.
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= step_before + 3; }, absl::Seconds(90)))
      << "training stalled under the flood" << Logs();
  for (auto& f : flood) f->ctx.TryCancel();
  for (auto& f : flood) {
    if (f->finished) continue;
    v1::StateChunk c;
    while (f->reader->Read(&c)) {
    }
    f->reader->Finish();
  }
  flood.clear();

  // An honest fetch now gets the whole state, and it is the one reported.
  auto stub = v1::StateTransfer::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  std::string bytes;
  int64_t fetched_step = -1;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  grpc::Status last;
  while (absl::Now() < deadline) {  // bounded retries: a slot frees once the server sees the cancellations
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = stub->Fetch(&ctx, req);
    v1::StateChunk c;
    bytes.clear();
    while (reader->Read(&c)) {
      bytes += c.data();
      fetched_step = static_cast<int64_t>(c.step());
    }
    last = reader->Finish();
    if (last.ok()) break;
    ASSERT_EQ(last.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << last.error_message();
    absl::SleepFor(absl::Milliseconds(200));  // polling interval of a bounded wait
  }
  ASSERT_TRUE(last.ok()) << last.error_message();
  ASSERT_GT(bytes.size(), 1000u);
  const std::string digest = Sha256Hex(bytes);
  bool compared = false;
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        for (const auto& p : st.peers()) {
          if (p.state_transfer_address() != target) continue;
          for (const auto& h : p.held()) {
            if (h.stage() != stage) continue;
            for (const v1::HeldState& state : h.states()) {
              if (state.step() == fetched_step) {
                EXPECT_EQ(state.sha256(), digest) << "step " << fetched_step;
                compared = true;
              }
            }
          }
        }
        return compared;
      },
      absl::Seconds(10)))
      << "the peer never reported the digest of step " << fetched_step;
  EXPECT_LT(status_.loss(), loss_before) << "the loss did not fall";
}

TEST_F(HostileStateTest, ARollbackQuarantinesTheAbandonedStatesInsteadOfDeletingThem) {
  StartGrid({"r1", "r2", "r3"});
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.peers_size() == 3 && st.step() >= 4; },
                      absl::Seconds(120)))
      << "the swarm did not train 4 steps" << Logs();
  const v1::PeerStatus* s0 = At(status_, 0, 0);
  const v1::PeerStatus* s1 = At(status_, 1, 0);
  ASSERT_NE(s0, nullptr);
  ASSERT_NE(s1, nullptr);
  const std::string first = s0->peer_name(), lost = s1->peer_name();
  std::string standby;
  for (const auto& p : status_.peers()) {
    if (p.state() == v1::PeerStatus::STANDBY) standby = p.peer_name();
  }
  ASSERT_FALSE(standby.empty());
  const fs::path stage0 = dir_ / first / "checkpoints" / "stage-0";
  const std::vector<int64_t> before = StepsOnDisk(stage0);
  ASSERT_FALSE(before.empty());
  ASSERT_GT(before.back(), 0);

  // Stage 1's only state holder goes: the re-plan resumes where every stage
  // has a state, behind the steps the first stage's peer holds.
  peers_.at(lost)->Signal(SIGKILL);
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        bool seated = false;
        for (const auto& p : st.peers()) seated |= p.peer_name() == standby && p.state() == v1::PeerStatus::ACTIVE;
        return st.peers_size() == 2 && st.grid_complete() && seated;
      },
      absl::Seconds(30)))
      << "the standby did not take the lost peer's place" << Logs();
  int64_t resume = -1;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (resume < 0 && absl::Now() < deadline) {
    uint64_t newest_plan = 0;
    for (absl::string_view line : absl::StrSplit(Out(first), '\n')) {
      absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
      if (e.ok() && e->has_assignment() && e->assignment().role() == "stage" && e->assignment().plan() > newest_plan) {
        newest_plan = e->assignment().plan();
        if (newest_plan > 1) resume = e->assignment().resume_step();
      }
    }
    if (resume < 0) absl::SleepFor(absl::Milliseconds(200));  // polling interval of a bounded wait
  }
  ASSERT_GE(resume, 0) << "no new plan reached " << first << Logs();
  ASSERT_LT(resume, before.back()) << "no rollback to check";

  // Every state past the resume step was moved aside, none deleted (the
  // assignment event comes out just before the daemon applies the plan).
  const auto list_quarantine = [&] {
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(stage0 / "quarantine", ec)) names.push_back(e.path().filename().string());
    return names;
  };
  std::vector<std::string> quarantined = list_quarantine();
  for (const absl::Time until = absl::Now() + absl::Seconds(10); quarantined.empty() && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(100));  // polling interval of a bounded wait
    quarantined = list_quarantine();
  }
  ASSERT_FALSE(quarantined.empty()) << "nothing quarantined in " << stage0;
  int kept_from_before = 0;
  for (const std::string& name : quarantined) {
    int64_t step = 0;
    ASSERT_TRUE(absl::SimpleAtoi(name.substr(6, name.find("-at-") - 6), &step)) << name;
    EXPECT_GT(step, resume) << name;
    EXPECT_GT(fs::file_size(stage0 / "quarantine" / name), 1000u) << name;
    kept_from_before += std::count(before.begin(), before.end(), step) > 0;
  }
  EXPECT_GE(kept_from_before, 1) << "none of the states held before the rollback is in the quarantine";

  // Training goes on from the resume step, and the loss falls.
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= resume + 2 && st.loss() > 0; }, absl::Seconds(60)))
      << Logs();
  const double loss_early = status_.loss();
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= resume + 10; }, absl::Seconds(90))) << Logs();
  EXPECT_LT(status_.loss(), loss_early) << "the loss did not fall after the rollback";

  // SIGTERM: each daemon stops its stage child, which exits on SIGTERM well
  // within the daemon's 10 s SIGKILL grace (a child that inherited the
  // daemon's blocked SIGTERM waited it out), then leaves.
  for (const std::string& name : {first, standby}) {
    const absl::Time start = absl::Now();
    peers_.at(name)->Signal(SIGTERM);
    absl::StatusOr<int> code = peers_.at(name)->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << name << " did not exit after SIGTERM";
    EXPECT_EQ(*code, 0) << name;
    EXPECT_LT(absl::Now() - start, absl::Seconds(8)) << name << " took the SIGKILL grace to stop its stage";
    EXPECT_THAT(Err(name), ::testing::Not(::testing::HasSubstr("did not stop within"))) << name;
  }
}

// A lying state source: the only holder of stage 1's state (the stage-0
// peer's mirror copy, --mirror_checkpoints) serves bytes that are not the
// state whose SHA-256 it reported (its copies changed on disk after it
// hashed them, size and times kept). The peer that takes over stage 1
// refuses them with a status naming both digests and keeps nothing.
TEST_F(HostileStateTest, AStateSourceWhoseBytesDifferFromItsReportedSha256IsRefused) {
  WriteJob(5, R"("dataParallel":1,"checkpointEverySteps":2)");
  StartCoordinator({"--mirror_checkpoints"});
  const std::string token = Token();
  for (const char* n : {"m1", "m2", "m3"}) StartPeer(n, token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.peers_size() == 3 && st.step() >= 4; },
                      absl::Seconds(120)))
      << "the swarm did not train 4 steps" << Logs();
  const v1::PeerStatus* first = At(status_, 0, 0);
  const v1::PeerStatus* victim = At(status_, 1, 0);
  ASSERT_TRUE(first != nullptr && victim != nullptr);
  const std::string first_name = first->peer_name(), victim_name = victim->peer_name();
  const fs::path copies = dir_ / first_name / "checkpoints" / "stage-1";
  const fs::path own = dir_ / first_name / "checkpoints" / "stage-0";
  // The newest stage-1 copy the holder has reported to the coordinator
  // (reported: hashed, with its own states of the same or earlier steps).
  const auto reported_copy = [&] {
    int64_t newest = -1;
    for (absl::string_view line : absl::StrSplit(Out(first_name), '\n')) {
      absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
      if (e.ok() && e->has_mirrored() && e->mirrored().stage() == 1 && e->mirrored().reported()) {
        newest = std::max<int64_t>(newest, e->mirrored().step());
      }
    }
    return newest;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (reported_copy() < 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));  // polling interval of a bounded wait
  }
  ASSERT_GE(reported_copy(), 0) << Out(first_name);
  peers_.at(victim_name)->Signal(SIGKILL);
  // The holder's states change under it: same size, same times, other bytes.
  // Both stages' (its mirror copies and its own): the re-plan may seat the
  // standby at either stage, and either way it fetches from this holder. A
  // copy still on its way when the victim died lands after the kill: each
  // copy is forged once the holder has reported it, until a peer refuses
  // one (the re-plan waits out the victim's 3 s lease).
  std::set<fs::path> forged;
  std::string forged_paths;
  const auto forge = [&](const fs::path& path) {
    if (forged.count(path) > 0) return;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return;  // pruned meanwhile
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(st.st_size / 2);
      f << std::string(64, '\x5a');
    }
    const struct timespec times[2] = {st.st_atim, st.st_mtim};
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path;
    forged.insert(path);
    absl::StrAppend(&forged_paths, " ", path.parent_path().filename().string(), "/", path.filename().string());
  };
  const auto forge_reported = [&] {
    const int64_t newest = reported_copy();
    for (const fs::path& dir : {copies, own}) {
      for (int64_t step : StepsOnDisk(dir)) {
        if (step <= newest) forge(dir / absl::StrCat("state-", step, ".ckpt"));
      }
    }
  };
  forge_reported();
  ASSERT_FALSE(forged.empty()) << "no mirror copy of stage 1 in " << copies;

  // The peer seated at stage 1 refuses what the holder serves, by digest.
  std::string taker, error;
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (error.empty() && absl::Now() < until) {
    for (const auto& [name, p] : peers_) {
      if (name == victim_name || name == first_name) continue;
      for (absl::string_view line : absl::StrSplit(Out(name), '\n')) {
        absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
        if (e.ok() && e->has_assignment_failed() &&
            absl::StrContains(e->assignment_failed().error(), "SHA-256")) {
          taker = name;
          error = e->assignment_failed().error();
        }
      }
    }
    if (!error.empty()) break;
    forge_reported();
    absl::SleepFor(absl::Milliseconds(20));  // polling interval of a bounded wait
  }
  ASSERT_FALSE(error.empty()) << "no peer refused the forged state; forged:" << forged_paths << Logs();
  EXPECT_THAT(error, ::testing::HasSubstr("its holders reported"));
  EXPECT_THAT(error, ::testing::HasSubstr(first_name));
  EXPECT_FALSE(HasEvent(Out(taker), [](const v1::PeerEvent& e) { return e.has_state_fetched(); }))
      << "the forged state was taken";
  EXPECT_TRUE(StepsOnDisk(dir_ / taker / "checkpoints" / "stage-0").empty()) << "the forged state was kept";
  EXPECT_TRUE(StepsOnDisk(dir_ / taker / "checkpoints" / "stage-1").empty()) << "the forged state was kept";
}

}  // namespace
}  // namespace aqswarm
