// End-to-end mutual TLS over StageLink on loopback: the happy path, and the
// ways a connection must be refused (plaintext client, foreign CA, no client
// certificate). Certificates are made by the test with common/certs.h.
#include "rpc/tls.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/certs.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "common/metrics.h"
#include "stage/gradient_exchange.h"
#include "stage/stage_metrics_testing.h"
#include "stage/link_handshake.h"
#include "rpc/channel.h"
#include "stage/link_transport.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm::stage {
namespace {

using ::aqswarm::testing::IsOk;
using ::testing::HasSubstr;

constexpr absl::Duration kDialTimeout = absl::Seconds(2);

v1::LinkFrame Commit(uint64_t step) {
  v1::LinkFrame f;
  f.mutable_commit()->set_step(step);
  return f;
}

// A swarm CA dir with certificates "server", "client" and "intruder" for 127.0.0.1, and a
// second, unrelated swarm ("other") with its own CA and "client" cert.
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new ::aqswarm::testing::ScratchDir();
    root_ = &scratch_->path();
    for (const char* swarm : {"swarm", "other"}) {
      const std::string dir = *root_ + "/" + std::string(swarm);
      ASSERT_THAT(InitCaDir(dir, {}), IsOk());
      for (const char* name : {"server", "client", "intruder"}) {
        LeafOptions leaf;
        leaf.name = name;
        leaf.ip_addresses = {"127.0.0.1"};
        auto issued = IssueCertInDir(dir, leaf);
        ASSERT_TRUE(issued.ok()) << issued.status();
      }
    }
  }
  static void TearDownTestSuite() {
    delete scratch_;
    scratch_ = nullptr;
    root_ = nullptr;
  }

  static rpc::TlsOptions Swarm(const std::string& name) { return {*root_ + "/swarm", name, ""}; }
  static rpc::TlsOptions Other(const std::string& name) { return {*root_ + "/other", name, ""}; }
  static std::string Read(const std::string& path) { return *ReadSmallFile(path); }

  std::unique_ptr<StageLinkServer> StartTlsServer() {
    auto server = StageLinkServer::Start("127.0.0.1:0", {}, Swarm("server"));
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }

  // Opens a raw StageLink stream with hand-made credentials (ones that
  // rpc::MakeChannelCredentials would refuse to build) and reports how it ended.
  static absl::Status RawExchange(int port, std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), creds);
    auto stub = v1::StageLink::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(kDialTimeout));
    auto stream = stub->Connect(&ctx);
    stream->Write(Commit(1));
    v1::LinkFrame f;
    if (stream->Read(&f)) return absl::OkStatus();  // the server answered: not rejected
    grpc::Status s = stream->Finish();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }

  static ::aqswarm::testing::ScratchDir* scratch_;
  static const std::string* root_;  // scratch_->path()
};

::aqswarm::testing::ScratchDir* TlsTest::scratch_ = nullptr;
const std::string* TlsTest::root_ = nullptr;

TEST_F(TlsTest, MutualTlsLinkExchangesFrames) {
  auto server = StartTlsServer();
  ASSERT_NE(server, nullptr);
  auto client = LinkConnection::Dial(absl::StrCat("127.0.0.1:", server->port()), {}, absl::Seconds(10),
                                     Swarm("client"));
  ASSERT_TRUE(client.ok()) << client.status();
  auto server_end = server->Accept(absl::Seconds(10));
  ASSERT_TRUE(server_end.ok()) << server_end.status();

  ASSERT_TRUE((*client)->Send(Commit(7)).ok());
  auto f = (*server_end)->Receive([](auto&) { return true; }, absl::Seconds(10));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->commit().step(), 7u);
  ASSERT_TRUE((*server_end)->Send(Commit(8)).ok());
  auto back = (*client)->Receive([](auto&) { return true; }, absl::Seconds(10));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->commit().step(), 8u);

  (*server_end)->CloseSend();
  client->reset();
  server.reset();
}

TEST_F(TlsTest, PlaintextClientAgainstTlsServerIsUnavailableQuickly) {
  auto server = StartTlsServer();
  ASSERT_NE(server, nullptr);
  const absl::Time start = absl::Now();
  auto client = LinkConnection::Dial(absl::StrCat("127.0.0.1:", server->port()), {}, kDialTimeout);
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable) << client.status();
  EXPECT_THAT(client.status().message(), HasSubstr("over plaintext (is it up, without TLS?)"));
  EXPECT_LT(took, kDialTimeout + absl::Seconds(3));
  EXPECT_EQ(server->Accept(absl::Milliseconds(100)).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(TlsTest, TlsClientAgainstPlaintextServerIsUnavailable) {
  auto server = StageLinkServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(server.ok());
  auto client = LinkConnection::Dial(absl::StrCat("127.0.0.1:", (*server)->port()), {}, kDialTimeout,
                                     Swarm("client"));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable) << client.status();
  EXPECT_THAT(client.status().message(), HasSubstr("over mTLS"));
}

TEST_F(TlsTest, PeerOfAnotherSwarmIsRejected) {
  // Both ends consistent, but different CAs: neither trusts the other.
  auto server = StartTlsServer();
  ASSERT_NE(server, nullptr);
  auto client = LinkConnection::Dial(absl::StrCat("127.0.0.1:", server->port()), {}, kDialTimeout,
                                     Other("client"));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable) << client.status();
  EXPECT_EQ(server->Accept(absl::Milliseconds(100)).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(TlsTest, ClientCertificateFromAnotherCaIsRejectedByTheServer) {
  // The client trusts the swarm CA (so it would accept the server) but
  // presents a certificate from another CA: only the server's check stops it.
  auto server = StartTlsServer();
  ASSERT_NE(server, nullptr);
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = Read(*root_ + "/swarm/ca.pem");
  o.pem_private_key = Read(*root_ + "/other/client.key");
  o.pem_cert_chain = Read(*root_ + "/other/client.pem");
  const absl::Time start = absl::Now();
  absl::Status s = RawExchange(server->port(), grpc::SslCredentials(o));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(absl::Now() - start, kDialTimeout + absl::Seconds(3));
  EXPECT_EQ(server->Accept(absl::Milliseconds(100)).status().code(), absl::StatusCode::kDeadlineExceeded);

  // Our own loader refuses to build such a mix in the first place.
  const std::string mixed = *root_ + "/mixed";
  std::filesystem::create_directories(mixed);
  std::filesystem::copy_file(*root_ + "/swarm/ca.pem", mixed + "/ca.pem");
  std::filesystem::copy_file(*root_ + "/other/client.pem", mixed + "/client.pem");
  std::filesystem::copy_file(*root_ + "/other/client.key", mixed + "/client.key");
  auto creds = rpc::MakeChannelCredentials({mixed, "client", ""});
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kUnauthenticated) << creds.status();
  EXPECT_THAT(creds.status().message(), HasSubstr("is not signed by the swarm CA"));
}

TEST_F(TlsTest, ClientWithoutCertificateIsRejected) {
  auto server = StartTlsServer();
  ASSERT_NE(server, nullptr);
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = Read(*root_ + "/swarm/ca.pem");  // trusts the server, presents nothing
  absl::Status s = RawExchange(server->port(), grpc::SslCredentials(o));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(server->Accept(absl::Milliseconds(100)).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(TlsTest, MisconfiguredTlsFailsAtStartWithTheFileName) {
  auto missing = StageLinkServer::Start("127.0.0.1:0", {}, Swarm("nobody"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("nobody.pem does not exist"));
  auto no_name = LinkConnection::Dial("127.0.0.1:1", {}, kDialTimeout, {*root_ + "/swarm", "", ""});
  EXPECT_EQ(no_name.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_name.status().message(), HasSubstr("no certificate name"));
  EXPECT_EQ(rpc::DescribeTls({}), "plaintext");
}

TEST_F(TlsTest, OnlyTheUpstreamTheAssignmentNamesGetsTheLink) {
  v1::JobSpec job;
  job.set_name("tls-job");
  const v1::LinkHello want = LinkHelloFor(job, 0, 0, 1, 1);
  auto server = StageLinkServer::StartWith("127.0.0.1:0", UpstreamServerOptions(want, "client", {}, Swarm("server"), {}));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*server)->port());
  const double wrong0 = Rejected("link_wrong_peer");
  // Another member of the swarm, with the right hello: refused by name.
  auto intruder = DialNext(address, want, {}, Swarm("intruder"), absl::Seconds(10));
  EXPECT_EQ(intruder.status().code(), absl::StatusCode::kPermissionDenied) << intruder.status();
  EXPECT_THAT(intruder.status().message(), HasSubstr("not the upstream"));
  // At least one refusal: the dialer may redial once when its hello write
  // races the server's close, and that connection is refused too.
  EXPECT_GE(Rejected("link_wrong_peer"), wrong0 + 1);
  // The named upstream gets the link.
  auto real = DialNext(address, want, {}, Swarm("client"), absl::Seconds(10));
  ASSERT_TRUE(real.ok()) << real.status();
  auto up = AcceptPrevious(**server, absl::Seconds(10));
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_TRUE((*real)->Send(Commit(3)).ok());
  EXPECT_TRUE((*up)->Receive([](auto& f) { return f.has_commit(); }, absl::Seconds(10)).ok());
  (*up)->CloseSend();
}

TEST_F(TlsTest, TheDialerReachesOnlyTheDownstreamTheAssignmentNames) {
  v1::JobSpec job;
  job.set_name("tls-job");
  const v1::LinkHello want = LinkHelloFor(job, 0, 0, 1, 1);
  auto server = StageLinkServer::StartWith("127.0.0.1:0", UpstreamServerOptions(want, "client", {}, Swarm("server"), {}));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*server)->port());
  // The stage listening there is "server", not the "intruder" the dialer expects.
  auto wrong = DialNext(address, want, {}, Swarm("client"), absl::Seconds(2), "intruder");
  EXPECT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(), HasSubstr("intruder"));
  auto right = DialNext(address, want, {}, Swarm("client"), absl::Seconds(10), "server");
  ASSERT_TRUE(right.ok()) << right.status();
  auto up = AcceptPrevious(**server, absl::Seconds(10));
  ASSERT_TRUE(up.ok()) << up.status();
  (*up)->CloseSend();
}

TEST_F(TlsTest, AnExchangeChunkIsTakenOnlyFromTheReplicaOfItsRank) {
  ReplicaExchangeOptions o;
  o.group = "job/stage-0";
  o.rank = 0;
  o.size = 2;
  o.tls = Swarm("server");
  o.peer_names = {"server", "client"};
  auto ex = GrpcReplicaExchange::Start(o);
  ASSERT_TRUE(ex.ok()) << ex.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*ex)->port());
  auto push = [&](const std::string& as, uint64_t step) {
    auto channel = rpc::MakeChannel(address, Swarm(as), rpc::LinkChannel());
    EXPECT_TRUE(channel.ok());
    auto stub = v1::GradientExchange::NewStub(*channel);
    v1::ExchangeChunk c;
    c.set_group(o.group);
    c.set_phase(v1::ExchangeChunk::SCATTER);
    c.set_from_rank(1);
    c.set_step(step);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ExchangeAck ack;
    return stub->Push(&ctx, c, &ack);
  };
  const double spoofed0 = Rejected("dp_wrong_peer");
  // "intruder" is a member of the swarm but not replica 1.
  const grpc::Status spoofed = push("intruder", 3);
  EXPECT_EQ(spoofed.error_code(), grpc::StatusCode::PERMISSION_DENIED) << spoofed.error_message();
  EXPECT_EQ(Rejected("dp_wrong_peer"), spoofed0 + 1);
  // Replica 1 itself is heard, and its chunk (not the spoofer's) is the one taken.
  const grpc::Status real = push("client", 3);
  EXPECT_TRUE(real.ok()) << real.error_message();
  EXPECT_TRUE((*ex)->Receive(1, 3, 0, v1::ExchangeChunk::SCATTER, 0, 0).ok());
}

}  // namespace
}  // namespace aqswarm::stage
