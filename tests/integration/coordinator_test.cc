// End-to-end: the real `aqswarm coordinator` process, simulated peers over
// gRPC from this test, a SIGKILL and a restart on the same state dir.
#include <signal.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/certs.h"
#include "common/file_util.h"
#include "common/join_token.h"
#include "common/subprocess.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/coordinator.grpc.pb.h"
#include "tests/testing/ports.h"

namespace aqswarm {
namespace {

namespace fs = std::filesystem;

const char* kBinary = AQSWARM_BINARY;

std::chrono::system_clock::time_point Deadline(int seconds = 10) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

class CoordinatorProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("aqswarm_coord_it_", ::getpid());
    aqswarm::RemoveTree(dir_).IgnoreError();
    fs::create_directories(dir_);
    job_ = (dir_ / "job.json").string();
    std::ofstream(job_) << R"({"name":"coord-it","model":{"seqLen":32,"dModel":32,"nLayer":4,"nHead":2},
      "data":{"syntheticTokens":10000},"stages":2,"dataParallel":1})";
  }
  void TearDown() override {
    coordinator_.reset();  // kills a still-running child
    aqswarm::RemoveTree(dir_).IgnoreError();
  }

  // Starts `aqswarm coordinator` and connects a stub to the port it prints.
  void StartCoordinator() {
    auto p = Subprocess::Spawn({kBinary, "coordinator", "--job=" + job_, "--listen=127.0.0.1:0",
                                "--state_dir=" + (dir_ / "state").string(), "--lease_s=30"},
                               {.capture_stdout = true, .stderr_path = (dir_ / "coordinator.err").string()});
    ASSERT_TRUE(p.ok()) << p.status();
    coordinator_ = *std::move(p);
    absl::StatusOr<int> port = aqswarm::testing::ListeningPort(*coordinator_, absl::Seconds(60));
    ASSERT_TRUE(port.ok()) << port.status() << "; see " << (dir_ / "coordinator.err");
    ASSERT_GT(*port, 0);
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", *port), grpc::InsecureChannelCredentials()));
  }

  v1::JoinResponse Join(const std::string& name, int port) {
    auto secret = LoadJoinSecret((dir_ / "state" / kJoinSecretFile).string());
    EXPECT_TRUE(secret.ok()) << secret.status();
    auto token = IssueJoinToken(*secret, "coord-it", name, absl::ToUnixSeconds(absl::Now()) + 600);
    EXPECT_TRUE(token.ok()) << token.status();
    v1::JoinRequest req;
    req.set_peer_name(name);
    req.set_join_token(*token);
    req.set_stage_link_address(absl::StrCat("127.0.0.1:", port));
    v1::JoinResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    grpc::Status s = stub_->Join(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  grpc::Status Heartbeat(const v1::JoinResponse& peer, v1::HeartbeatResponse* resp) {
    v1::HeartbeatRequest req;
    req.set_peer_id(peer.peer_id());
    req.set_session_token(peer.session_token());
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    return stub_->Heartbeat(&ctx, req, resp);
  }

  v1::StatusResponse Status() {
    v1::StatusResponse st;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    grpc::Status s = stub_->Status(&ctx, v1::StatusRequest(), &st);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return st;
  }

  fs::path dir_;
  std::string job_;
  std::unique_ptr<Subprocess> coordinator_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

// Plaintext on an address other machines reach is refused at start, naming
// --insecure; with --insecure it serves.
TEST_F(CoordinatorProcessTest, PlaintextOffLoopbackNeedsInsecure) {
  const std::string err = (dir_ / "refused.err").string();
  auto p = Subprocess::Spawn({kBinary, "coordinator", "--job=" + job_, "--listen=0.0.0.0:0",
                              "--state_dir=" + (dir_ / "state").string()},
                             {.capture_stdout = true, .stderr_path = err});
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<int> code = (*p)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_NE(*code, 0);
  std::ifstream in(err);
  const std::string text(std::istreambuf_iterator<char>(in), {});
  EXPECT_NE(text.find("--insecure"), std::string::npos) << text;
  EXPECT_NE(text.find("0.0.0.0:0"), std::string::npos) << text;

  auto q = Subprocess::Spawn({kBinary, "coordinator", "--job=" + job_, "--listen=0.0.0.0:0", "--insecure",
                              "--state_dir=" + (dir_ / "state").string()},
                             {.capture_stdout = true, .stderr_path = (dir_ / "insecure.err").string()});
  ASSERT_TRUE(q.ok()) << q.status();
  absl::StatusOr<int> port = aqswarm::testing::ListeningPort(**q, absl::Seconds(60));
  EXPECT_TRUE(port.ok()) << port.status();
}

TEST_F(CoordinatorProcessTest, SurvivesSigkillWithMembersVersionAndHeartbeats) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator());
  std::vector<v1::JoinResponse> peers;
  for (auto [name, port] : std::vector<std::pair<std::string, int>>{{"a", 5000}, {"b", 6000}, {"s", 7000}}) {
    peers.push_back(Join(name, port));
  }
  v1::HeartbeatResponse hb;
  for (const auto& p : peers) ASSERT_TRUE(Heartbeat(p, &hb).ok());
  EXPECT_EQ(hb.assignment_version(), 3u);
  v1::ProgressReport pr;
  pr.mutable_progress()->set_step(17);
  pr.mutable_progress()->set_loss(5.25);
  for (int i : {1, 0}) {  // both stages of the pipeline: one alone is not backed
    pr.set_peer_id(peers[i].peer_id());
    pr.set_session_token(peers[i].session_token());
    v1::ReportResponse rr;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    ASSERT_TRUE(stub_->ReportProgress(&ctx, pr, &rr).ok());
  }
  const v1::StatusResponse before = Status();
  ASSERT_EQ(before.peers_size(), 3);
  ASSERT_TRUE(before.grid_complete());

  coordinator_->Signal(SIGKILL);
  auto code = coordinator_->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 128 + SIGKILL);

  ASSERT_NO_FATAL_FAILURE(StartCoordinator());
  const v1::StatusResponse after = Status();
  EXPECT_EQ(after.assignment_version(), 3u);
  EXPECT_EQ(after.step(), 17);
  EXPECT_EQ(after.loss(), 5.25);
  ASSERT_EQ(after.peers_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(after.peers(i).peer_id(), before.peers(i).peer_id());
    EXPECT_EQ(after.peers(i).peer_name(), before.peers(i).peer_name());
    EXPECT_EQ(after.peers(i).state(), before.peers(i).state());
    EXPECT_EQ(after.peers(i).stage(), before.peers(i).stage());
    EXPECT_EQ(after.peers(i).pipeline(), before.peers(i).pipeline());
  }
  // The same peer ids and session tokens heartbeat again.
  for (const auto& p : peers) {
    grpc::Status s = Heartbeat(p, &hb);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(hb.assignment_version(), 3u);
  }
  // Their assignments come back with the neighbours' addresses.
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::WatchAssignmentRequest wr;
  wr.set_peer_id(peers[0].peer_id());
  wr.set_session_token(peers[0].session_token());
  auto reader = stub_->WatchAssignment(&ctx, wr);
  v1::Assignment a;
  ASSERT_TRUE(reader->Read(&a));
  EXPECT_EQ(a.version(), 3u);
  EXPECT_TRUE(a.grid_complete());
  ctx.TryCancel();
  while (reader->Read(&a)) {
  }
  EXPECT_FALSE(reader->Finish().ok());  // cancelled
  // A new peer gets a fresh id and the next version.
  v1::JoinResponse d = Join("d", 8000);
  EXPECT_GT(d.peer_id(), peers.back().peer_id());
  EXPECT_EQ(d.assignment_version(), 4u);

  coordinator_->Signal(SIGTERM);
  code = coordinator_->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
}

}  // namespace
}  // namespace aqswarm
