// The Coordinator service over real gRPC on 127.0.0.1:0, driven by an rpc::FakeClock.
#include "coordinator/coordinator_service.h"

#include <limits>

#include "common/certs.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_testing.h"
#include "rpc/channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::coordinator {
namespace {

using ::aqswarm::testing::ScratchDir;
using ::aqswarm::coordinator::testing::TestOptions;
using ::aqswarm::coordinator::testing::TokenFor;
using ::testing::HasSubstr;

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto coord = SwarmCoordinator::Create(TestOptions(&clock_, dir_.Sub("state"), 2, 1));
    ASSERT_TRUE(coord.ok()) << coord.status();
    CoordinatorServerOptions so;
    so.expiry_interval = absl::Milliseconds(5);
    so.watch_poll = absl::Milliseconds(50);
    auto server = CoordinatorServer::Start(*std::move(coord), so);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
  }

  v1::JoinRequest JoinRequestFor(const std::string& name, int port = 5000) {
    v1::JoinRequest r;
    r.set_peer_name(name);
    r.set_join_token(TokenFor(clock_, name));
    r.set_stage_link_address(absl::StrCat("127.0.0.1:", port));
    r.set_gradient_exchange_address(absl::StrCat("127.0.0.1:", port + 1));
    r.set_seconds_per_layer(0.01);
    r.set_memory_bytes(uint64_t{4} << 30);
    return r;
  }
  grpc::Status Join(const v1::JoinRequest& req, v1::JoinResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub_->Join(&ctx, req, resp);
  }
  v1::JoinResponse MustJoin(const std::string& name, int port = 5000) {
    v1::JoinResponse resp;
    grpc::Status s = Join(JoinRequestFor(name, port), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }
  grpc::Status Heartbeat(uint64_t id, const std::string& session, v1::HeartbeatResponse* resp = nullptr) {
    v1::HeartbeatRequest req;
    req.set_peer_id(id);
    req.set_session_token(session);
    v1::HeartbeatResponse ignored;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub_->Heartbeat(&ctx, req, resp != nullptr ? resp : &ignored);
  }

  rpc::FakeClock clock_;
  ScratchDir dir_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(CoordinatorServiceTest, JoinReturnsIdSessionLeaseAndJob) {
  v1::JoinResponse r = MustJoin("a");
  EXPECT_GT(r.peer_id(), 0u);
  EXPECT_EQ(r.session_token().size(), 32u);
  EXPECT_EQ(r.lease_seconds(), 10);
  EXPECT_EQ(r.lease_expiry_unix_ms(), absl::ToUnixMillis(clock_.Now() + absl::Seconds(10)));
  EXPECT_EQ(r.job().name(), "test-job");
  EXPECT_EQ(r.job().stages(), 2u);
  EXPECT_EQ(r.assignment_version(), 1u);
}

TEST_F(CoordinatorServiceTest, WrongOrExpiredTokenIsUnauthenticated) {
  v1::JoinResponse resp;
  v1::JoinRequest req = JoinRequestFor("a");
  req.set_join_token(TokenFor(clock_, "a", std::string(32, 'q')));
  grpc::Status s = Join(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("signature"));
  req.set_join_token(TokenFor(clock_, "a", testing::TestSecret(), testing::kTestSwarm, 1));
  clock_.Advance(absl::Seconds(2));
  s = Join(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  req.set_join_token("not-a-token");
  EXPECT_EQ(Join(req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  req.set_join_token(TokenFor(clock_, "someone-else"));
  EXPECT_EQ(Join(req, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(CoordinatorServiceTest, MalformedRequestsAreInvalidArgument) {
  v1::JoinResponse resp;
  auto expect_invalid = [&](v1::JoinRequest req, const std::string& field) {
    grpc::Status s = Join(req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(field));
  };
  v1::JoinRequest r = JoinRequestFor("a");
  r.set_peer_name("");
  expect_invalid(r, "peer_name");
  r = JoinRequestFor("a");
  r.set_stage_link_address("127.0.0.1");
  expect_invalid(r, "stage_link_address");
  r = JoinRequestFor("a");
  r.set_gradient_exchange_address("host:99999");
  expect_invalid(r, "gradient_exchange_address");
  r = JoinRequestFor("a");
  r.set_seconds_per_layer(std::numeric_limits<double>::quiet_NaN());
  expect_invalid(r, "seconds_per_layer");
  r = JoinRequestFor("a");
  r.set_memory_bytes(~uint64_t{0});
  expect_invalid(r, "memory_bytes");
  r = JoinRequestFor("a");
  r.add_held()->set_stage(0);
  r.add_held()->set_stage(0);
  expect_invalid(r, "held");

  EXPECT_EQ(Heartbeat(0, "x").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::JoinResponse a = MustJoin("a");
  v1::HeartbeatRequest hb;
  hb.set_peer_id(a.peer_id());
  hb.set_session_token(a.session_token());
  hb.mutable_progress()->set_loss(-1);
  v1::HeartbeatResponse hr;
  grpc::ClientContext ctx;
  grpc::Status s = stub_->Heartbeat(&ctx, hb, &hr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("loss"));

  v1::LinkProbeReport probe;
  probe.set_peer_id(a.peer_id());
  probe.set_session_token(a.session_token());
  v1::ReportResponse rr;
  grpc::ClientContext ctx2;
  EXPECT_EQ(stub_->ReportLinkProbe(&ctx2, probe, &rr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::ProgressReport pr;
  pr.set_peer_id(a.peer_id());
  pr.set_session_token(a.session_token());
  grpc::ClientContext ctx3;
  EXPECT_EQ(stub_->ReportProgress(&ctx3, pr, &rr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  pr.mutable_progress()->set_step(3);
  pr.set_has_held(true);
  v1::StageCheckpoints* h = pr.add_held();
  h->set_stage(0);
  for (int i = 0; i < 65; ++i) h->add_states()->set_step(i);
  grpc::ClientContext ctx4;
  s = stub_->ReportProgress(&ctx4, pr, &rr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("at most 64"));
  // An older peer's parallel lists: one hash per step, and not both forms.
  h->clear_states();
  h->add_legacy_steps(1);
  h->add_legacy_steps(2);
  h->add_legacy_sha256(std::string(64, 'a'));
  grpc::ClientContext ctx5;
  s = stub_->ReportProgress(&ctx5, pr, &rr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("2 steps but 1 sha256"));
  h->add_legacy_sha256(std::string(64, 'b'));
  h->add_states()->set_step(1);
  grpc::ClientContext ctx6;
  s = stub_->ReportProgress(&ctx6, pr, &rr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("twice"));
}

TEST_F(CoordinatorServiceTest, UnknownPeerHeartbeatIsNotFoundAndWrongSessionUnauthenticated) {
  grpc::Status s = Heartbeat(12345, "whatever");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  v1::JoinResponse a = MustJoin("a");
  EXPECT_EQ(Heartbeat(a.peer_id(), "wrong").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  v1::HeartbeatResponse hr;
  clock_.Advance(absl::Seconds(3));
  ASSERT_TRUE(Heartbeat(a.peer_id(), a.session_token(), &hr).ok());
  EXPECT_EQ(hr.lease_expiry_unix_ms(), absl::ToUnixMillis(clock_.Now() + absl::Seconds(10)));
  EXPECT_EQ(hr.assignment_version(), 1u);
}

TEST_F(CoordinatorServiceTest, WatchAssignmentDeliversNewVersionsAfterMembershipChanges) {
  v1::JoinResponse a = MustJoin("a", 5000);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::WatchAssignmentRequest req;
  req.set_peer_id(a.peer_id());
  req.set_session_token(a.session_token());
  auto reader = stub_->WatchAssignment(&ctx, req);
  v1::Assignment got;
  ASSERT_TRUE(reader->Read(&got));
  EXPECT_EQ(got.version(), 1u);
  EXPECT_FALSE(got.grid_complete());

  // Other RPCs are served while the stream waits.
  v1::JoinResponse b = MustJoin("b", 6000);
  ASSERT_TRUE(reader->Read(&got));
  EXPECT_EQ(got.version(), 2u);
  EXPECT_TRUE(got.grid_complete());
  const v1::Neighbor& other = got.stage() == 0 ? got.next() : got.previous();
  EXPECT_EQ(other.peer_id(), b.peer_id());
  EXPECT_EQ(other.stage_link_address(), "127.0.0.1:6000");
  EXPECT_GT(other.link_generation(), 0u);
  const uint64_t generation = other.link_generation();

  // A standby joins (version 3), then b's lease runs out on the fake clock:
  // the background sweep removes it and the standby takes its stage with a new generation.
  v1::JoinResponse s = MustJoin("s", 7000);
  ASSERT_TRUE(reader->Read(&got));
  EXPECT_EQ(got.version(), 3u);
  clock_.Advance(absl::Seconds(6));
  ASSERT_TRUE(Heartbeat(a.peer_id(), a.session_token()).ok());
  ASSERT_TRUE(Heartbeat(s.peer_id(), s.session_token()).ok());
  clock_.Advance(absl::Seconds(5));
  ASSERT_TRUE(reader->Read(&got));  // bounded by the context deadline
  EXPECT_EQ(got.version(), 4u);
  const v1::Neighbor& replaced = got.stage() == 0 ? got.next() : got.previous();
  EXPECT_EQ(replaced.peer_id(), s.peer_id());
  EXPECT_EQ(replaced.stage_link_address(), "127.0.0.1:7000");
  EXPECT_NE(replaced.link_generation(), generation);
  EXPECT_EQ(Heartbeat(b.peer_id(), b.session_token()).error_code(), grpc::StatusCode::NOT_FOUND);

  // Leaving ends the peer's own stream with NOT_FOUND.
  v1::LeaveRequest leave;
  leave.set_peer_id(a.peer_id());
  leave.set_session_token(a.session_token());
  v1::LeaveResponse lr;
  grpc::ClientContext lctx;
  ASSERT_TRUE(stub_->Leave(&lctx, leave, &lr).ok());
  EXPECT_EQ(lr.assignment_version(), 5u);
  while (reader->Read(&got)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(CoordinatorServiceTest, ASecondWatchOfTheSamePeerEndsTheFirst) {
  v1::JoinResponse a = MustJoin("a");
  v1::WatchAssignmentRequest req;
  req.set_peer_id(a.peer_id());
  req.set_session_token(a.session_token());
  grpc::ClientContext first_ctx, second_ctx;
  first_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  second_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto first = stub_->WatchAssignment(&first_ctx, req);
  v1::Assignment got;
  ASSERT_TRUE(first->Read(&got));
  const double superseded = RefusalCount(Refusal::kWatchSuperseded);
  auto second = stub_->WatchAssignment(&second_ctx, req);
  ASSERT_TRUE(second->Read(&got));
  // The first stream ends (long before its deadline); the second lives on.
  while (first->Read(&got)) {
  }
  EXPECT_EQ(first->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(RefusalCount(Refusal::kWatchSuperseded), superseded + 1);
  MustJoin("b", 6000);
  ASSERT_TRUE(second->Read(&got));
  EXPECT_EQ(got.version(), 2u);
  // A forged session cannot end the peer's watch.
  req.set_session_token("forged");
  grpc::ClientContext forged_ctx;
  auto forged = stub_->WatchAssignment(&forged_ctx, req);
  EXPECT_FALSE(forged->Read(&got));
  EXPECT_EQ(forged->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  MustJoin("s", 7000);
  ASSERT_TRUE(second->Read(&got));
  EXPECT_EQ(got.version(), 3u);
  second_ctx.TryCancel();
}

// Under TLS the join's certificate must name the peer; only an admin
// certificate sees Status details.
TEST(CoordinatorTlsTest, TheCertificateMustNameThePeerAndOnlyAdminsSeeStatusDetails) {
  rpc::FakeClock clock;
  ScratchDir dir;
  const std::string tls_dir = dir.Sub("tls");
  ASSERT_TRUE(InitCaDir(tls_dir, {}).ok());
  for (const char* n : {"coordinator", "a", "mallory", "admin"}) {
    LeafOptions leaf;
    leaf.name = n;
    leaf.ip_addresses = {"127.0.0.1"};
    ASSERT_TRUE(IssueCertInDir(tls_dir, leaf).ok()) << n;
  }
  auto coord = SwarmCoordinator::Create(TestOptions(&clock, dir.Sub("state"), 2, 1));
  ASSERT_TRUE(coord.ok()) << coord.status();
  CoordinatorServerOptions so;
  so.tls = {tls_dir, "coordinator"};
  auto server = CoordinatorServer::Start(*std::move(coord), so);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub_as = [&](const std::string& name) {
    auto channel = rpc::MakeChannel(absl::StrCat("127.0.0.1:", (*server)->port()), {tls_dir, name},
                                    rpc::ControlChannel());
    EXPECT_TRUE(channel.ok()) << channel.status();
    return v1::Coordinator::NewStub(*channel);
  };
  auto join = [&](v1::Coordinator::Stub& stub, const std::string& name, v1::JoinResponse* resp) {
    v1::JoinRequest r;
    r.set_peer_name(name);
    r.set_join_token(TokenFor(clock, name));
    r.set_stage_link_address("127.0.0.1:5000");
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub.Join(&ctx, r, resp);
  };
  auto mallory = stub_as("mallory");
  auto a = stub_as("a");
  v1::JoinResponse resp;
  const double before = RefusalCount(Refusal::kJoinCertificateName);
  grpc::Status s = join(*mallory, "a", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("'a'"));
  EXPECT_THAT(s.error_message(), HasSubstr("mallory"));
  EXPECT_EQ(RefusalCount(Refusal::kJoinCertificateName), before + 1);
  s = join(*a, "a", &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // Mallory cannot take the name over; a (same certificate) rejoins with a fresh token.
  EXPECT_EQ(join(*mallory, "a", &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  v1::JoinResponse again;
  s = join(*a, "a", &again);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_NE(again.peer_id(), resp.peer_id());

  auto status_as = [&](v1::Coordinator::Stub& stub) {
    v1::StatusResponse st;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    EXPECT_TRUE(stub.Status(&ctx, v1::StatusRequest(), &st).ok());
    return st;
  };
  auto admin = stub_as("admin");
  const v1::StatusResponse full = status_as(*admin), summary = status_as(*mallory);
  ASSERT_EQ(full.peers_size(), 1);
  EXPECT_EQ(full.peers(0).peer_name(), "a");
  ASSERT_EQ(summary.peers_size(), 1);
  EXPECT_EQ(summary.peers(0).peer_name(), "");
  EXPECT_EQ(summary.job_name(), full.job_name());
}

TEST_F(CoordinatorServiceTest, WatchWithAWrongSessionIsRefused) {
  v1::JoinResponse a = MustJoin("a");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::WatchAssignmentRequest req;
  req.set_peer_id(a.peer_id());
  req.set_session_token("forged");
  auto reader = stub_->WatchAssignment(&ctx, req);
  v1::Assignment got;
  EXPECT_FALSE(reader->Read(&got));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(CoordinatorServiceTest, StatusListsThePeersWithOnlyTheirStateAddresses) {
  v1::JoinRequest with_state = JoinRequestFor("a", 5000);
  with_state.set_state_transfer_address("10.9.8.7:7003");
  v1::StageCheckpoints* held = with_state.add_held();
  held->set_stage(1);
  held->add_legacy_steps(4);  // as a peer before HeldState sends it
  held->add_legacy_sha256(std::string(64, '4'));
  with_state.set_held_job_name("test-job");
  v1::JoinResponse a;
  ASSERT_TRUE(Join(with_state, &a).ok());
  v1::JoinResponse b = MustJoin("b", 6000);
  v1::JoinResponse s = MustJoin("s", 7000);
  v1::LinkProbeReport probe;
  probe.set_peer_id(a.peer_id());
  probe.set_session_token(a.session_token());
  probe.set_to_peer_id(b.peer_id());
  probe.set_bandwidth_bytes_per_second(12.5e6);
  probe.set_rtt_seconds(0.02);
  v1::ReportResponse rr;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->ReportLinkProbe(&ctx, probe, &rr).ok());
  }
  v1::ProgressReport pr;
  pr.mutable_progress()->set_step(12);
  pr.mutable_progress()->set_loss(4.5);
  pr.set_checkpoint_step(10);
  for (const v1::JoinResponse* p : {&a, &b}) {  // both stages: one alone is not backed
    pr.set_peer_id(p->peer_id());
    pr.set_session_token(p->session_token());
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->ReportProgress(&ctx, pr, &rr).ok());
  }
  grpc::ClientContext ctx;
  v1::StatusResponse st;
  ASSERT_TRUE(stub_->Status(&ctx, v1::StatusRequest(), &st).ok());
  EXPECT_EQ(st.job_name(), "test-job");
  EXPECT_EQ(st.assignment_version(), 3u);
  EXPECT_TRUE(st.grid_complete());
  EXPECT_EQ(st.step(), 12);
  EXPECT_EQ(st.loss(), 4.5);
  EXPECT_EQ(st.checkpoint_step(), 10);
  ASSERT_EQ(st.peers_size(), 3);
  EXPECT_EQ(st.peers(0).peer_name(), "a");
  EXPECT_EQ(st.peers(2).peer_name(), "s");
  EXPECT_EQ(st.peers(2).state(), v1::PeerStatus::STANDBY);
  EXPECT_EQ(st.peers(2).stage(), -1);
  ASSERT_EQ(st.peers(0).links_size(), 1);
  EXPECT_EQ(st.peers(0).links(0).rtt_seconds(), 0.02);
  EXPECT_EQ(st.DebugString().find("127.0.0.1"), std::string::npos) << "Status must not reveal link addresses";
  EXPECT_EQ(st.peers(0).state_transfer_address(), "10.9.8.7:7003");
  ASSERT_EQ(st.peers(0).held_size(), 1);
  EXPECT_EQ(st.peers(0).held(0).stage(), 1u);
  ASSERT_EQ(st.peers(0).held(0).states_size(), 1);  // reported as records
  EXPECT_EQ(st.peers(0).held(0).states(0).step(), 4);
  EXPECT_EQ(st.peers(0).held(0).states(0).sha256(), std::string(64, '4'));
  EXPECT_EQ(st.peers(0).held(0).legacy_steps_size(), 0);
  EXPECT_EQ(st.job().name(), "test-job");
  EXPECT_EQ(st.job().stages(), 2u);
}

TEST_F(CoordinatorServiceTest, JoinWithMalformedOrDifferentDataHashesIsRefused) {
  v1::JoinRequest bad = JoinRequestFor("a");
  bad.set_dataset_hash("zz");
  v1::JoinResponse resp;
  grpc::Status s = Join(bad, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("dataset_hash"));

  v1::JoinRequest first = JoinRequestFor("a");
  first.set_dataset_hash("0123456789abcdef");
  first.set_tokenizer_hash("fedcba9876543210");
  ASSERT_TRUE(Join(first, &resp).ok());
  v1::JoinRequest second = JoinRequestFor("b", 6000);
  second.set_dataset_hash("0123456789abcdee");
  second.set_tokenizer_hash("fedcba9876543210");
  s = Join(second, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("dataset hash 0123456789abcdee differs from the job's 0123456789abcdef"));
}

}  // namespace
}  // namespace aqswarm::coordinator
