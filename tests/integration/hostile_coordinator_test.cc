// Hostile callers against a live coordinator under mutual TLS while two real
// `aqswarm peer` daemons train a 2-stage GPT on 127.0.0.1: a join under a
// name the certificate does not carry, a join under a live name with another
// certificate of that name, a replayed join token, a flood of forged joins
// and of rejoins, progress reported backwards, held states claimed for
// stages that are not the caller's, and a flood of reports. Each is refused
// with its status code and counted in aqswarm_coordinator_refusals_total
// (scraped from the coordinator's /metrics); the honest peers keep their
// memberships (same ids: no lease lost, nobody evicted; h's own lease, which
// it never renews, does run out) and keep training with a falling loss.
#include "common/metrics.h"
#include "rpc/channel.h"
#include "tests/integration/swarm_fixture.h"

namespace aqswarm {
namespace {

class HostileCoordinatorTest : public SwarmTest {
 protected:
  // A join token admitting `name` only.
  std::string TokenFor(const std::string& name) {
    auto secret = LoadJoinSecret((fs::path(tls_dir_) / kJoinSecretFile).string());
    EXPECT_TRUE(secret.ok()) << secret.status();
    auto token = IssueJoinToken(*secret, "swarm-it", name, absl::ToUnixSeconds(absl::Now()) + 3600);
    EXPECT_TRUE(token.ok()) << token.status();
    return token.ok() ? *token : "";
  }

  // A client of the coordinator presenting certificate `name` from `dir`.
  std::unique_ptr<v1::Coordinator::Stub> StubAs(const std::string& dir, const std::string& name) {
    auto channel = rpc::MakeChannel(absl::StrCat("127.0.0.1:", coordinator_port_), {dir, name},
                                    rpc::ControlChannel());
    EXPECT_TRUE(channel.ok()) << channel.status();
    return v1::Coordinator::NewStub(*channel);
  }

  // A join with the job's data identity (a real peer's would be checked).
  grpc::Status Join(v1::Coordinator::Stub& stub, const std::string& name, const std::string& token,
                    v1::JoinResponse* resp) {
    v1::JoinRequest r;
    r.set_peer_name(name);
    r.set_join_token(token);
    r.set_dataset_hash(status_.job().data().dataset_hash());
    r.set_tokenizer_hash(status_.job().data().tokenizer_hash());
    r.set_stage_link_address("127.0.0.1:9");
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub.Join(&ctx, r, resp);
  }

  static grpc::Status Report(v1::Coordinator::Stub& stub, const v1::JoinResponse& who, int64_t step,
                             const std::vector<uint32_t>& held_stages = {}) {
    v1::ProgressReport r;
    r.set_peer_id(who.peer_id());
    r.set_session_token(who.session_token());
    r.mutable_progress()->set_step(step);
    r.mutable_progress()->set_loss(5);
    if (!held_stages.empty()) {
      r.set_has_held(true);
      for (uint32_t s : held_stages) {
        v1::StageCheckpoints* h = r.add_held();
        h->set_stage(s);
        h->add_states()->set_step(step);
      }
    }
    v1::ReportResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub.ReportProgress(&ctx, r, &resp);
  }

  // The value of `series` (name{labels}) on the coordinator's /metrics.
  double Metric(const std::string& series) {
    auto body = HttpGet(absl::StrCat("127.0.0.1:", metrics_port_), "/metrics", absl::Seconds(5));
    EXPECT_TRUE(body.ok()) << body.status();
    if (!body.ok()) return -1;
    for (absl::string_view line : absl::StrSplit(*body, '\n')) {
      if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ")) {
        double v = 0;
        if (absl::SimpleAtod(line, &v)) return v;
      }
    }
    ADD_FAILURE() << "no " << series << " on /metrics";
    return -1;
  }
  double Refusals(const std::string& cause) {
    return Metric(absl::StrCat("aqswarm_coordinator_refusals_total{cause=\"", cause, "\"}"));
  }

  // Two honest peers (q1, q2) training a 2 x 1 grid under mTLS; certificates
  // for "h" (the attacker) and "admin" (this test's Status calls).
  void StartHonestSwarm() {
  WriteJob(5, R"("dataParallel":1)");
  MakeTlsDir({"q1", "q2", "h"});
  metrics_port_ = testing::UniqueLoopbackPort();
  StartCoordinator({absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port_)});
  // Per-peer tokens (the default of `aqswarm certs token`).
  StartPeer("q1", TokenFor("q1"));
  StartPeer("q2", TokenFor("q2"));
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.step() >= 3; }, absl::Seconds(180)))
      << "the swarm did not train 3 steps" << Logs();
  for (const auto& p : status_.peers()) honest_[p.peer_name()] = p.peer_id();
  ASSERT_EQ(honest_.size(), 2u);
  loss_before_ = status_.loss();
  step_before_ = status_.step();

  }

  // The honest peers were never evicted and keep training, loss falling;
  // then they leave.
  void ExpectHonestPeersTrainOn() {
  // The honest peers were never evicted and keep training, loss falling.
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.step() >= step_before_ + 12; }, absl::Seconds(180)))
      << "training stalled under attack (step " << status_.step() << ")" << Logs();
  EXPECT_LT(status_.loss(), loss_before_) << "loss did not fall";
  for (const auto& p : status_.peers()) {
    if (honest_.count(p.peer_name())) {
      EXPECT_EQ(p.peer_id(), honest_[p.peer_name()]) << p.peer_name() << " lost its membership";
      EXPECT_EQ(p.state(), v1::PeerStatus::ACTIVE) << p.peer_name();
    }
  }
  TerminatePeersExcept("");
  }

  // A second CA-signed certificate for each of `names` (same CA, other keys).
  std::string OtherCertificates(const std::vector<std::string>& names) {
    const std::string evil = (dir_ / "evil-tls").string();
    fs::create_directories(evil);
    fs::copy_file(fs::path(tls_dir_) / kCaCertFile, fs::path(evil) / kCaCertFile);
    fs::copy_file(fs::path(tls_dir_) / kCaKeyFile, fs::path(evil) / kCaKeyFile);
    for (const std::string& n : names) {
      LeafOptions leaf;
      leaf.name = n;
      leaf.ip_addresses = {"127.0.0.1"};
      EXPECT_TRUE(IssueCertInDir(evil, leaf).ok()) << n;
    }
    return evil;
  }

  std::map<std::string, uint64_t> honest_;  // name -> peer id
  double loss_before_ = 0;
  int64_t step_before_ = 0;
  int metrics_port_ = 0;
};

// status_ holds the last Status WaitFor accepted (the job's data identity in it).

TEST_F(HostileCoordinatorTest, ForeignNamesLiveNamesAndReplayedTokensAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartHonestSwarm());
  // Another machine's certificate of the same CA: "h", the attacker.
  auto h = StubAs(tls_dir_, "h");
  v1::JoinResponse resp;

  // 1. A join under a name the certificate does not carry.
  double before = Refusals("join_certificate_name");
  grpc::Status s = Join(*h, "q1", TokenFor("q1"), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("not a name of the client certificate"));
  EXPECT_EQ(Refusals("join_certificate_name"), before + 1);

  // 2. A second certificate named q1 (a stolen CA key, a careless operator)
  // with a fresh q1 token: q1's lease is live, so nothing is taken.
  const std::string evil = OtherCertificates({"q1", "h"});
  auto evil_q1 = StubAs(evil, "q1");
  before = Refusals("join_name_held");
  s = Join(*evil_q1, "q1", TokenFor("q1"), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("previous_session_token"));
  EXPECT_EQ(Refusals("join_name_held"), before + 1);

  // 3. A replayed token: h joins (a standby), leaves, and its token is
  // replayed with another certificate of that name: refused. h itself
  // (same certificate) comes back with the same token.
  const std::string h_token = TokenFor("h");
  v1::JoinResponse hj;
  s = Join(*h, "h", h_token, &hj);
  ASSERT_TRUE(s.ok()) << s.error_message();
  {
    v1::LeaveRequest leave;
    leave.set_peer_id(hj.peer_id());
    leave.set_session_token(hj.session_token());
    v1::LeaveResponse lr;
    grpc::ClientContext ctx;
    ASSERT_TRUE(h->Leave(&ctx, leave, &lr).ok());
  }
  auto evil_h = StubAs(evil, "h");
  before = Refusals("join_token_replayed");
  s = Join(*evil_h, "h", h_token, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("already used"));
  EXPECT_EQ(Refusals("join_token_replayed"), before + 1);
  s = Join(*h, "h", h_token, &hj);
  ASSERT_TRUE(s.ok()) << s.error_message();

  ASSERT_NO_FATAL_FAILURE(ExpectHonestPeersTrainOn());
}

TEST_F(HostileCoordinatorTest, BackwardProgressForeignClaimsAndReportFloodsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartHonestSwarm());
  auto h = StubAs(tls_dir_, "h");
  const std::string h_token = TokenFor("h");
  v1::JoinResponse hj;
  grpc::Status s = Join(*h, "h", h_token, &hj);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // 4. Progress backwards: h says it is where the swarm is, then at step 0.
  const int64_t now_step = Status().step();
  ASSERT_TRUE(Report(*h, hj, now_step).ok());
  double before = Refusals("progress_backward");
  s = Report(*h, hj, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("only moves forward"));
  EXPECT_EQ(Refusals("progress_backward"), before + 1);

  // 5. Held states of both stages from a standby that holds neither: dropped.
  before = Refusals("held_foreign_stage");
  ASSERT_TRUE(Report(*h, hj, now_step, {0, 1}).ok());
  EXPECT_EQ(Refusals("held_foreign_stage"), before + 2);
  const v1::StatusResponse after_claims = Status();
  for (const auto& p : after_claims.peers()) {
    if (p.peer_name() == "h") EXPECT_EQ(p.held_size(), 0) << "h's foreign claims were kept";
  }

  // 6. A report flood: beyond the per-peer budget, RESOURCE_EXHAUSTED.
  before = Refusals("report_rate");
  int exhausted = 0;
  for (int i = 0; i < 400; ++i) {
    exhausted += Report(*h, hj, now_step).error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }
  EXPECT_GT(exhausted, 100);
  EXPECT_EQ(Refusals("report_rate"), before + exhausted);

  ASSERT_NO_FATAL_FAILURE(ExpectHonestPeersTrainOn());
}

TEST_F(HostileCoordinatorTest, JoinFloodsAreRefusedCheaplyAndStatusIsASummaryForNonAdmins) {
  ASSERT_NO_FATAL_FAILURE(StartHonestSwarm());
  // Another machine's certificate of the same CA: "h", the attacker.
  auto h = StubAs(tls_dir_, "h");
  v1::JoinResponse resp;

  grpc::Status s;
  // 7. A join flood: forged tokens under made-up names (refused before any
  // budget or lock is spent), then rejoins as h faster than its budget.
  const double unauthenticated = Metric("aqswarm_coordinator_rejected_requests_total{reason=\"unauthenticated\"}");
  const std::string forged = IssueJoinToken(std::string(32, 'x'), "swarm-it", "*", absl::ToUnixSeconds(absl::Now()) + 60)
                                 .value_or("");
  for (int i = 0; i < 200; ++i) {
    s = Join(*h, "h", forged, &resp);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
  EXPECT_EQ(Metric("aqswarm_coordinator_rejected_requests_total{reason=\"unauthenticated\"}"), unauthenticated + 200);
  double before = Refusals("join_rate");
  int limited = 0;
  for (int i = 0; i < 20; ++i) {
    s = Join(*h, "h", TokenFor("h"), &resp);
    limited += s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }
  EXPECT_GE(limited, 15);
  EXPECT_EQ(Refusals("join_rate"), before + limited);

  // 8. h sees the summary only; the test's "admin" certificate sees all.
  {
    v1::StatusResponse st;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ASSERT_TRUE(h->Status(&ctx, v1::StatusRequest(), &st).ok());
    EXPECT_EQ(st.DebugString().find("q1"), std::string::npos) << "the summary names peers";
    EXPECT_GE(st.peers_size(), 2);
  }

  ASSERT_NO_FATAL_FAILURE(ExpectHonestPeersTrainOn());
}

// The other side of single-use tokens: an honest peer whose daemon crashed
// comes back with the same token (plaintext, so no certificate proves it:
// the session it saved in its work dir does), within its old lease or after.
TEST_F(HostileCoordinatorTest, AnHonestPeerRestartedAfterACrashRejoinsWithItsToken) {
  WriteJob(5, R"("dataParallel":1)");
  StartCoordinator();
  auto token_for = [&](const std::string& name) {
    auto secret = LoadJoinSecret((dir_ / "coord" / kJoinSecretFile).string());
    EXPECT_TRUE(secret.ok()) << secret.status();
    return IssueJoinToken(*secret, "swarm-it", name, absl::ToUnixSeconds(absl::Now()) + 3600).value_or("");
  };
  const std::string q2_token = token_for("q2");
  StartPeer("q1", token_for("q1"));
  StartPeer("q2", q2_token);
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.step() >= 3; }, absl::Seconds(180)))
      << "the swarm did not train 3 steps" << Logs();
  uint64_t old_id = 0;
  for (const auto& p : status_.peers()) {
    if (p.peer_name() == "q2") old_id = p.peer_id();
  }
  ASSERT_NE(old_id, 0u);
  const int64_t step_before = status_.step();
  peers_.at("q2")->Signal(SIGKILL);
  ASSERT_TRUE(peers_.at("q2")->Wait(absl::Seconds(30)).ok());
  StartPeer("q2", q2_token);  // the same token, at once (its old lease is live)
  ASSERT_TRUE(WaitFor(
      [&](const auto& st) {
        for (const auto& p : st.peers()) {
          if (p.peer_name() == "q2" && p.peer_id() != old_id && p.state() == v1::PeerStatus::ACTIVE) return true;
        }
        return false;
      },
      absl::Seconds(60)))
      << "the restarted q2 did not rejoin" << Logs();
  ASSERT_TRUE(WaitFor([&](const auto& st) { return st.grid_complete() && st.step() >= step_before + 5; },
                      absl::Seconds(180)))
      << "training did not go on after the restart" << Logs();
  TerminatePeersExcept("");
}

}  // namespace
}  // namespace aqswarm
