#include <memory>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/state.grpc.pb.h"
#include "rpc/channel.h"
#include "rpc/clock.h"
#include "rpc/link_shaping.h"
#include "rpc/server.h"
#include "rpc/status.h"

namespace aqswarm::rpc {
namespace {

TEST(StatusTest, CodesAndMessagesCrossBothWays) {
  EXPECT_TRUE(FromGrpc(grpc::Status::OK, "x").ok());
  EXPECT_TRUE(ToGrpc(absl::OkStatus()).ok());
  const absl::Status s = FromGrpc(grpc::Status(grpc::StatusCode::NOT_FOUND, "no such peer"), "heartbeat");
  EXPECT_TRUE(absl::IsNotFound(s));
  EXPECT_EQ(s.message(), "heartbeat: no such peer");
  EXPECT_EQ(FromGrpc(grpc::Status(grpc::StatusCode::UNAVAILABLE, "down")).message(), "down");
  const grpc::Status g = ToGrpc(absl::ResourceExhaustedError("mailbox full"));
  EXPECT_EQ(g.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(g.error_message(), "mailbox full");
}

TEST(ListenSecurityTest, LoopbackAddressesAreRecognised) {
  for (const char* a : {"127.0.0.1:7000", "127.1.2.3:1", "localhost:80", "[::1]:7000", "[::ffff:127.0.0.1]:5",
                        "unix:/tmp/sock"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a : {"0.0.0.0:7000", "[::]:7000", ":7000", "10.0.0.1:7000", "example.org:1", "128.0.0.1:2",
                        "[::2]:3", "localhost.evil.org:1", ""}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

TEST(ListenSecurityTest, PlaintextOffLoopbackIsRefusedUnlessInsecure) {
  EXPECT_TRUE(CheckListenSecurity("127.0.0.1:0", /*tls=*/false, /*insecure=*/false).ok());
  EXPECT_TRUE(CheckListenSecurity("0.0.0.0:0", /*tls=*/true, /*insecure=*/false).ok());
  EXPECT_TRUE(CheckListenSecurity("0.0.0.0:0", /*tls=*/false, /*insecure=*/true).ok());
  const absl::Status s = CheckListenSecurity("0.0.0.0:7000", /*tls=*/false, /*insecure=*/false);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("--insecure"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("0.0.0.0:7000"), absl::string_view::npos) << s;
}

TEST(ChannelTest, EveryPresetKeepsItsConnectionAlive) {
  for (const ChannelPreset& p : {ControlChannel(), BulkChannel(), LinkChannel()}) {
    EXPECT_GT(p.keepalive_ms, 0);
    EXPECT_LE(p.keepalive_ms, 20000);
    EXPECT_GT(p.keepalive_timeout_ms, 0);
  }
}

class Echo final : public v1::StateTransfer::Service {
  grpc::Status Probe(grpc::ServerContext*, const v1::ProbeRequest* req, v1::ProbeResponse* resp) override {
    resp->set_received_bytes(req->payload().size());
    return grpc::Status::OK;
  }
};

TEST(ServerTest, StartsOnAFreePortAndServes) {
  Echo echo;
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  absl::StatusOr<StartedServer> s = StartServer(o, {&echo});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_GT(s->port, 0);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> ch =
      MakeChannel("127.0.0.1:" + std::to_string(s->port), {}, ControlChannel());
  ASSERT_TRUE(ch.ok()) << ch.status();
  auto stub = v1::StateTransfer::NewStub(*ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ProbeRequest req;
  req.set_payload("ping");
  v1::ProbeResponse resp;
  ASSERT_TRUE(FromGrpc(stub->Probe(&ctx, req, &resp), "probe").ok());
  EXPECT_EQ(resp.received_bytes(), 4u);
  s->server->Shutdown();
}

TEST(ServerTest, APortAlreadyServedIsRefusedNotShared) {
  Echo a, b;
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  absl::StatusOr<StartedServer> first = StartServer(o, {&a});
  ASSERT_TRUE(first.ok()) << first.status();
  o.listen = "127.0.0.1:" + std::to_string(first->port);
  absl::StatusOr<StartedServer> second = StartServer(o, {&b});
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
  EXPECT_THAT(second.status().message(), ::testing::HasSubstr("cannot listen on"));
  first->server->Shutdown();
}

TEST(ServerTest, ABadTlsDirFailsAtStartWithTheFile) {
  Echo echo;
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.tls = {.dir = "/nonexistent/tls", .name = "peer-a"};
  absl::StatusOr<StartedServer> s = StartServer(o, {&echo});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), ::testing::HasSubstr("/nonexistent/tls"));
  EXPECT_FALSE(MakeChannel("127.0.0.1:1", o.tls, LinkChannel()).ok());
}

TEST(EmulatedWireTest, AFifoWireAtTheLinkRateOnAFakeClock) {
  FakeClock clock(absl::FromUnixSeconds(1000));
  EmulatedWire wire(&clock);
  const absl::Time t0 = clock.Now();
  // 1 Mbit/s: 125,000 bytes take one second. Two frames queued together
  // leave one after the other.
  EXPECT_EQ(wire.Reserve(125000, t0, 1.0), t0 + absl::Seconds(1));
  EXPECT_EQ(wire.Reserve(125000, t0, 1.0), t0 + absl::Seconds(2));
  // A frame queued after the wire went idle starts when it was queued.
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(wire.Reserve(62500, clock.Now(), 1.0), t0 + absl::Seconds(5.5));
  // Unshaped: no time at all.
  EXPECT_EQ(wire.Reserve(1 << 20, clock.Now(), 0), clock.Now());
  // Transmit waits (on this clock) until the last byte has left: the wire
  // is still busy for 0.5 s with the frame before, then 1 s for this one.
  const absl::Time before = clock.Now();
  EXPECT_EQ(wire.Transmit(250000, before, 2.0), before + absl::Seconds(1.5));
  EXPECT_EQ(clock.Now(), before + absl::Seconds(1.5));
}

}  // namespace
}  // namespace aqswarm::rpc
