#include "stage/link_transport.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/metrics.h"
#include "stage/link_handshake.h"
#include "stage/stage_metrics_testing.h"
#include "proto/job.pb.h"
#include "rpc/clock.h"

namespace aqswarm::stage {
namespace {

v1::LinkFrame Commit(uint64_t step, size_t pad = 0) {
  v1::LinkFrame f;
  f.mutable_commit()->set_step(step);
  if (pad) f.mutable_hello()->set_job_name(std::string(pad, 'x'));  // oneof: replaces commit
  return f;
}

auto StepIs(uint64_t step) {
  return [step](const v1::LinkFrame& f) { return f.has_commit() && f.commit().step() == step; };
}

struct Pair {
  explicit Pair(rpc::ShapingOptions shaping = {}) {
    server = *StageLinkServer::Start("127.0.0.1:0", shaping);
    client = *LinkConnection::Dial(absl::StrCat("127.0.0.1:", server->port()), shaping, absl::Seconds(10));
    server_end = *server->Accept(absl::Seconds(10));
  }
  ~Pair() {
    // Orderly close, as the stage runners do: both sides stop sending.
    server_end->CloseSend();
    client.reset();
    server.reset();
  }
  std::unique_ptr<StageLinkServer> server;
  std::unique_ptr<LinkConnection> client;
  LinkConnection* server_end;
};

TEST(LinkTransportTest, FramesFlowBothWaysAndUnmatchedFramesWait) {
  Pair p;
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(p.client->Send(Commit(i)).ok());
  // Take them out of order: later frames wait in arrival order.
  auto f3 = p.server_end->Receive(StepIs(3), absl::Seconds(10));
  ASSERT_TRUE(f3.ok()) << f3.status();
  for (uint64_t i : {0, 1, 2, 4}) {
    auto f = p.server_end->Receive([](auto&) { return true; }, absl::Seconds(10));
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->commit().step(), i);
  }
  ASSERT_TRUE(p.server_end->Send(Commit(42)).ok());
  auto back = p.client->Receive(StepIs(42), absl::Seconds(10));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_GT(p.client->bytes_sent(), 0u);
  EXPECT_EQ(p.client->bytes_sent(), p.server_end->bytes_received());
}

TEST(LinkTransportTest, APortAlreadyServedIsRefusedNotShared) {
  // Two servers on one port would split the upstream's connections between
  // them (SO_REUSEPORT): the second must fail to start instead.
  auto first = StageLinkServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = StageLinkServer::Start(absl::StrCat("127.0.0.1:", (*first)->port()), {});
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
}

TEST(LinkTransportTest, ReceiveTimesOutWithDeadlineExceeded) {
  Pair p;
  auto f = p.server_end->Receive(StepIs(1), absl::Milliseconds(50));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(LinkTransportTest, ShapedLinkNeverBeatsItsBandwidthOrLatency) {
  // 8 Mbit/s: 10 frames of ~50 kB (0.4 Mbit each) need >= 0.5 s on the wire,
  // plus 30 ms one-way latency for the last one.
  Pair p(rpc::ShapingOptions{8.0, 30.0});
  const absl::Time start = absl::Now();
  for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(p.client->Send(Commit(i, 50000)).ok());
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(p.server_end->Receive([](auto&) { return true; }, absl::Seconds(30)).ok());
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  const double wire = p.client->bytes_sent() * 8.0 / 8e6;
  EXPECT_GE(secs, wire + 0.03 - 0.01) << "bytes " << p.client->bytes_sent();
}

TEST(LinkTransportTest, ShapedLinkKeepsItsBandwidthWithManySmallFrames) {
  // 400 frames of ~2.5 kB queued at once on an 80 Mbit/s link, on a fake
  // clock that stands still: the writer thread's wake-up and write latencies
  // are not wire time, so a FIFO wire sends them back to back. Each frame's
  // departure (sent_unix_micros: when its last byte left the emulated wire)
  // is one frame's wire time after the one before it, and none is usable
  // before the clock reaches its departure.
  rpc::FakeClock clock;
  FrameArrivals arrivals;
  Pair p(rpc::ShapingOptions{80.0, 0, &clock});
  p.server_end->NotifyArrivals(&arrivals);
  const absl::Time start = clock.Now();
  for (uint64_t i = 0; i < 400; ++i) ASSERT_TRUE(p.client->Send(Commit(i, 2500)).ok());
  ASSERT_TRUE(arrivals.WaitFor(400, absl::Now() + absl::Seconds(30)));
  EXPECT_FALSE(*p.server_end->Has(StepIs(0))) << "held until the clock moves";
  const double wire = p.client->bytes_sent() * 8.0 / 80e6;
  clock.Advance(absl::Seconds(wire * 1.01));
  std::vector<int64_t> sent;
  for (int i = 0; i < 400; ++i) {
    auto f = p.server_end->Receive([](auto&) { return true; }, absl::Seconds(30));
    ASSERT_TRUE(f.ok()) << f.status();
    sent.push_back(f->sent_unix_micros());
  }
  const double frame_us = wire / 400 * 1e6;
  EXPECT_NEAR(sent[0] - absl::ToUnixMicros(start), frame_us, frame_us * 0.02);
  for (size_t i = 1; i < sent.size(); ++i) {
    ASSERT_NEAR(sent[i] - sent[i - 1], frame_us, frame_us * 0.02) << "frame " << i << " left late or early";
  }
}

TEST(LinkTransportTest, AShapedFrameArrivesAtOnceAndIsHeldUntilItsWireTimeEnds) {
  // 1 Mbit/s: 5 frames of ~50 kB are ~2 s of wire. The sender writes each at
  // once (no thread sleeps per frame): all five arrive while the fake clock
  // stands still. The receiving end holds each until its last byte would
  // have left the wire: Has and Receive see it then, and NextDue says when
  // the next held frame comes due.
  auto big = [](uint64_t i) {
    v1::LinkFrame f;
    f.mutable_hello()->set_job_name(absl::StrCat(i, ":", std::string(50000, 'x')));
    return f;
  };
  auto is = [](uint64_t i) {
    return [i](const v1::LinkFrame& f) { return absl::StartsWith(f.hello().job_name(), absl::StrCat(i, ":")); };
  };
  rpc::FakeClock clock;
  FrameArrivals arrivals;
  Pair p(rpc::ShapingOptions{1.0, 0, &clock});
  p.server_end->NotifyArrivals(&arrivals);
  EXPECT_EQ(p.server_end->NextDue(clock.Now()), absl::InfiniteFuture());
  const absl::Time start = clock.Now();
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(p.client->Send(big(i)).ok());
  ASSERT_TRUE(arrivals.WaitFor(5, absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(clock.Now(), start) << "all five arrived with no wire time passing";
  const double wire = p.client->bytes_sent() * 8.0 / 1e6;
  for (uint64_t i = 0; i < 5; ++i) EXPECT_FALSE(*p.server_end->Has(is(i))) << "arrived but held: its wire time runs";
  const absl::Time first_due = p.server_end->NextDue(clock.Now());
  EXPECT_NEAR(absl::ToDoubleSeconds(first_due - start), wire / 5, wire / 5 * 0.02);
  clock.Set(first_due);
  EXPECT_TRUE(*p.server_end->Has(is(0)));
  EXPECT_FALSE(*p.server_end->Has(is(1)));
  clock.Set(start + absl::Seconds(wire * 1.001));
  auto last = p.server_end->Receive(is(4), absl::Seconds(30));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_GT(last->hold_micros(), 0);
  EXPECT_NEAR(last->hold_micros() * 1e-6, wire, wire * 0.02);
  // The four before it came due first: nothing is held any more.
  EXPECT_EQ(p.server_end->NextDue(clock.Now()), absl::InfiniteFuture());
  for (uint64_t i = 0; i < 4; ++i) EXPECT_TRUE(*p.server_end->Has(is(i)));
}

TEST(LinkTransportTest, NextDueReportsAFrameThatCameDueSinceTheWaitersCheck) {
  // The adaptive schedule checks Has, then bounds its wait by NextDue. A
  // frame coming due between the two must still be reported (its due time,
  // already past, so the wait ends at once): counted as never held, the
  // wait would last until the next arrival, and after the step's last frame
  // there is none (a pipeline hung for its 2 min link timeout this way).
  auto is_hello = [](const v1::LinkFrame& f) { return f.has_hello(); };
  v1::LinkFrame big;
  big.mutable_hello()->set_job_name(std::string(50000, 'x'));  // ~0.4 s at 1 Mbit/s
  rpc::FakeClock clock;
  FrameArrivals arrivals;
  Pair p(rpc::ShapingOptions{1.0, 0, &clock});
  p.server_end->NotifyArrivals(&arrivals);
  ASSERT_TRUE(p.client->Send(big).ok());
  while (arrivals.count() < 1) ASSERT_TRUE(arrivals.WaitPast(0, absl::Now() + absl::Seconds(10)));
  const absl::Time checked = clock.Now();
  ASSERT_FALSE(*p.server_end->Has(is_hello)) << "held: its wire time runs";
  const absl::Time due = p.server_end->NextDue(checked);
  ASSERT_GT(due, checked);
  ASSERT_LT(due, checked + absl::Seconds(1));
  clock.Set(due + absl::Microseconds(1));  // it comes due after the check
  EXPECT_EQ(p.server_end->NextDue(checked), due) << "came due after the check: still reported";
  EXPECT_EQ(p.server_end->NextDue(clock.Now()), absl::InfiniteFuture()) << "due now: nothing held";
  EXPECT_TRUE(*p.server_end->Has(is_hello));
}

TEST(LinkTransportTest, AHoldFromThePeerIsBoundedNeverNegativeOrForEver) {
  // hold_micros comes off the network: a negative one means no hold, and a
  // huge one parks the frame at most 60 s (as the latency emulation does),
  // without overflowing the due time.
  rpc::FakeClock clock;
  auto server = StageLinkServer::Start("127.0.0.1:0", rpc::ShapingOptions{0, 0, &clock});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::StageLink::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->Connect(&ctx);
  auto end = (*server)->Accept(absl::Seconds(10));
  ASSERT_TRUE(end.ok()) << end.status();
  FrameArrivals arrivals;
  (*end)->NotifyArrivals(&arrivals);
  v1::LinkFrame negative = Commit(1), huge = Commit(2);
  negative.set_hold_micros(-5'000'000);
  huge.set_hold_micros(std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(stream->Write(negative));
  ASSERT_TRUE(stream->Write(huge));
  ASSERT_TRUE(arrivals.WaitFor(2, absl::Now() + absl::Seconds(10)));
  EXPECT_TRUE(*(*end)->Has(StepIs(1))) << "a negative hold is no hold";
  EXPECT_FALSE(*(*end)->Has(StepIs(2)));
  EXPECT_EQ((*end)->NextDue(clock.Now()), clock.Now() + absl::Seconds(60));
  stream->WritesDone();
  (*end)->CloseSend();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(LinkTransportTest, SetBandwidthShapesTheFramesQueuedAfterIt) {
  // 5 frames of ~50 kB at 8 Mbit/s, then the rate drops to 2 Mbit/s for 5
  // more: a frame keeps the rate it was queued under, so the first five leave
  // the wire at the fast rate and the rest at the slow one (their
  // departures, on a fake clock that stands still while they are sent). Then
  // unshaped: 20 more frames are usable at once.
  rpc::FakeClock clock;
  FrameArrivals arrivals;
  Pair p(rpc::ShapingOptions{8.0, 0, &clock});
  p.server_end->NotifyArrivals(&arrivals);
  const absl::Time start = clock.Now();
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(p.client->Send(Commit(i, 50000)).ok());
  p.client->SetBandwidth(2.0);
  for (uint64_t i = 5; i < 10; ++i) ASSERT_TRUE(p.client->Send(Commit(i, 50000)).ok());
  ASSERT_TRUE(arrivals.WaitFor(10, absl::Now() + absl::Seconds(30)));
  const double half = p.client->bytes_sent() / 2 * 8.0;  // bits of each five
  clock.Advance(absl::Seconds(half / 8e6 + half / 2e6 + 1));
  std::vector<double> left;  // seconds after start
  for (int i = 0; i < 10; ++i) {
    auto f = p.server_end->Receive([](auto&) { return true; }, absl::Seconds(30));
    ASSERT_TRUE(f.ok()) << f.status();
    left.push_back(absl::ToDoubleSeconds(absl::FromUnixMicros(f->sent_unix_micros()) - start));
  }
  EXPECT_NEAR(left[4], half / 8e6, half / 8e6 * 0.01) << "the first five went at 8 Mbit/s";
  EXPECT_NEAR(left[9], half / 8e6 + half / 2e6, half / 2e6 * 0.01) << "the next five at 2 Mbit/s";
  p.client->SetBandwidth(0);
  for (uint64_t i = 100; i < 120; ++i) ASSERT_TRUE(p.client->Send(Commit(i)).ok());
  ASSERT_TRUE(arrivals.WaitFor(30, absl::Now() + absl::Seconds(30)));
  for (uint64_t i = 100; i < 120; ++i) EXPECT_TRUE(*p.server_end->Has(StepIs(i))) << "unshaped frames are not held";
}

TEST(LinkTransportTest, PassiveMeasurementOfBusyTimeFindsTheShapedBandwidth) {
  // Large frames on an 8 Mbit/s link (a fake clock: the busy time is the
  // emulated wire's): the busy-time rate is the wire's; a small frame is not
  // counted.
  rpc::FakeClock clock;
  FrameArrivals arrivals;
  Pair p(rpc::ShapingOptions{8.0, 0, &clock});
  p.server_end->NotifyArrivals(&arrivals);
  for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(p.client->Send(Commit(i, 50000)).ok());
  ASSERT_TRUE(p.client->Send(Commit(99)).ok());  // small: not counted
  ASSERT_TRUE(arrivals.WaitFor(11, absl::Now() + absl::Seconds(30)));
  EXPECT_GE(p.client->busy_bytes(), 10u * 50000);
  EXPECT_LT(p.client->busy_bytes(), p.client->bytes_sent() + 200);
  const double mbit = p.client->busy_bytes() * 8 / p.client->busy_seconds() / 1e6;
  EXPECT_NEAR(mbit, 8.0, 0.01);
  EXPECT_EQ(p.server_end->busy_bytes(), 0u) << "the other direction sent nothing";
}

TEST(LinkTransportTest, VanishedPeerFailsPendingReceiveQuickly) {
  Pair p;
  const absl::Time start = absl::Now();
  p.server->Shutdown(absl::ZeroDuration());  // the downstream stage goes away at once
  auto f = p.client->Receive(StepIs(7), absl::Seconds(30));
  EXPECT_FALSE(f.ok());
  EXPECT_NE(f.status().code(), absl::StatusCode::kDeadlineExceeded) << f.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_FALSE(p.client->Send(Commit(1)).ok() && p.client->Send(Commit(2)).ok() &&
               p.client->Receive(StepIs(9), absl::Seconds(5)).ok());
}

// Has() peeks without taking; FrameArrivals wakes a waiter for a frame on
// either of two links, and for a link's end.
TEST(LinkTransportTest, ArrivalsOnTwoLinksWakeOneWaiter) {
  FrameArrivals arrivals;  // outlives the links that notify it
  Pair a, b;
  a.server_end->NotifyArrivals(&arrivals);
  b.client->NotifyArrivals(&arrivals);
  EXPECT_FALSE(*a.server_end->Has(StepIs(1)));
  uint64_t seen = arrivals.count();
  EXPECT_FALSE(arrivals.WaitPast(seen, absl::Now() + absl::Milliseconds(20))) << "nothing arrived";
  ASSERT_TRUE(b.server_end->Send(Commit(2)).ok());  // towards b.client
  ASSERT_TRUE(arrivals.WaitPast(seen, absl::Now() + absl::Seconds(10)));
  EXPECT_TRUE(*b.client->Has(StepIs(2)));
  EXPECT_TRUE(*b.client->Has(StepIs(2))) << "Has does not take the frame";
  EXPECT_FALSE(*b.client->Has(StepIs(3)));
  ASSERT_TRUE(b.client->Receive(StepIs(2), absl::Seconds(1)).ok());
  EXPECT_FALSE(*b.client->Has(StepIs(2)));
  seen = arrivals.count();
  ASSERT_TRUE(a.client->Send(Commit(1)).ok());  // towards a.server_end
  ASSERT_TRUE(arrivals.WaitPast(seen, absl::Now() + absl::Seconds(10)));
  EXPECT_TRUE(*a.server_end->Has(StepIs(1)));
  // The peer goes away: the waiter wakes, and Has fails like Receive.
  seen = arrivals.count();
  a.server->Shutdown(absl::ZeroDuration());
  ASSERT_TRUE(arrivals.WaitPast(seen, absl::Now() + absl::Seconds(30)));
  EXPECT_TRUE(*a.server_end->Has(StepIs(1))) << "what arrived before the end stays";
  EXPECT_FALSE(a.server_end->Has(StepIs(5)).ok());
}

// The step protocol owns its arrival counter and detaches it from the links
// before it is destroyed, while their readers still run: once
// NotifyArrivals(nullptr) returns, the old counter is never touched again.
TEST(LinkTransportTest, AReplacedArrivalCounterIsNotNotifiedAnyMore) {
  Pair p;
  auto counter = std::make_unique<FrameArrivals>();
  p.server_end->NotifyArrivals(counter.get());
  ASSERT_TRUE(p.client->Send(Commit(1)).ok());
  ASSERT_TRUE(counter->WaitPast(0, absl::Now() + absl::Seconds(10)));
  p.server_end->NotifyArrivals(nullptr);
  const uint64_t seen = counter->count();
  ASSERT_TRUE(p.client->Send(Commit(2)).ok());
  ASSERT_TRUE(p.server_end->Receive(StepIs(2), absl::Seconds(10)).ok()) << "the next frame arrived";
  EXPECT_EQ(counter->count(), seen);
}

TEST(LinkTransportTest, SecondUpstreamIsRefused) {
  Pair p;
  auto intruder = LinkConnection::Dial(absl::StrCat("127.0.0.1:", p.server->port()), {}, absl::Seconds(10));
  ASSERT_TRUE(intruder.ok());
  auto f = (*intruder)->Receive([](auto&) { return true; }, absl::Seconds(10));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAlreadyExists) << f.status();
}

TEST(LinkTransportTest, DialingNobodyFailsWithinTheTimeout) {
  auto c = LinkConnection::Dial("127.0.0.1:1", {}, absl::Milliseconds(300));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
}

v1::JobSpec SmallJob() {
  v1::JobSpec job;
  job.set_name("squat");
  job.mutable_model()->set_seq_len(8);
  job.mutable_model()->set_d_model(16);
  job.mutable_model()->set_vocab_size(64);
  job.set_micro_batch_size(2);
  job.set_micro_batches_per_step(2);
  return job;
}

// A stage-1 StageLinkServer that expects stage 0's hello of plan 3, with a
// short hello deadline.
struct Upstream {
  explicit Upstream(absl::Duration hello_timeout = absl::Seconds(5), LinkLimits limits = {}) {
    want = LinkHelloFor(SmallJob(), 0, 0, 1, 3);
    LinkServerOptions o = UpstreamServerOptions(want, "", {}, {}, limits);
    o.hello_timeout = hello_timeout;
    server = *StageLinkServer::StartWith("127.0.0.1:0", o);
    address = absl::StrCat("127.0.0.1:", server->port());
  }
  v1::LinkHello want;
  std::unique_ptr<StageLinkServer> server;
  std::string address;
};

// Sends `hello` on a raw connection and returns the answer (or how the
// stream ended).
absl::StatusOr<v1::LinkHelloAck> Hello(const std::string& address, const v1::LinkHello& hello) {
  auto c = LinkConnection::Dial(address, {}, absl::Seconds(10));
  if (!c.ok()) return c.status();
  v1::LinkFrame f;
  *f.mutable_hello() = hello;
  if (absl::Status s = (*c)->Send(f); !s.ok()) return s;
  auto ack = (*c)->Receive([](const v1::LinkFrame& x) { return x.has_hello_ack(); }, absl::Seconds(10));
  if (!ack.ok()) return ack.status();
  (*c)->CloseSend();
  return ack->hello_ack();
}

TEST(LinkHandshakeTest, ASilentSquatterIsDroppedAndTheRealUpstreamStillGetsTheLink) {
  Upstream u(absl::Milliseconds(300));
  const double silent0 = Rejected("link_hello_silent");
  auto squatter = LinkConnection::Dial(u.address, {}, absl::Seconds(10));  // connects first, says nothing
  ASSERT_TRUE(squatter.ok()) << squatter.status();
  // Dropped after the hello deadline: its stream ends.
  auto end = (*squatter)->Receive([](const v1::LinkFrame&) { return true; }, absl::Seconds(10));
  EXPECT_FALSE(end.ok());
  EXPECT_NE(end.status().code(), absl::StatusCode::kDeadlineExceeded) << end.status();
  EXPECT_EQ(Rejected("link_hello_silent"), silent0 + 1);
  // The stage kept waiting: the real upstream gets the link.
  auto real = DialNext(u.address, u.want, {}, {}, absl::Seconds(10));
  ASSERT_TRUE(real.ok()) << real.status();
  auto up = AcceptPrevious(*u.server, absl::Seconds(10));
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_TRUE((*real)->Send(Commit(1)).ok());
  EXPECT_TRUE((*up)->Receive(StepIs(1), absl::Seconds(10)).ok());
  (*up)->CloseSend();
}

TEST(LinkHandshakeTest, AWrongHelloIsRefusedInAFewWordsAndTheStageKeepsWaiting) {
  Upstream u;
  const double mismatch0 = Rejected("link_hello_mismatch");
  v1::LinkHello wrong = u.want;
  wrong.set_d_model(17);
  wrong.set_job_name("other-job");
  auto ack = Hello(u.address, wrong);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_FALSE(ack->accepted());
  EXPECT_FALSE(ack->retry());
  EXPECT_THAT(ack->reason(), ::testing::HasSubstr("differ"));
  EXPECT_THAT(ack->reason(), ::testing::HasSubstr("d_model"));  // which field, not its value
  // Nothing of the expected hello is sent back.
  EXPECT_FALSE(absl::StrContains(ack->reason(), "squat")) << ack->reason();
  EXPECT_FALSE(absl::StrContains(ack->reason(), "16")) << ack->reason();
  EXPECT_LE(ack->reason().size(), 64u);
  // This end keeps the detail: its wait's timeout error names the values.
  auto waited = AcceptPrevious(*u.server, absl::Milliseconds(10));
  EXPECT_THAT(waited.status().message(), ::testing::HasSubstr("d_model 17, expected 16"));
  EXPECT_EQ(Rejected("link_hello_mismatch"), mismatch0 + 1);
  // A first frame that is no hello is refused too.
  auto raw = LinkConnection::Dial(u.address, {}, absl::Seconds(10));
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE((*raw)->Send(Commit(1)).ok());
  auto end = (*raw)->Receive([](const v1::LinkFrame&) { return true; }, absl::Seconds(10));
  EXPECT_EQ(end.status().code(), absl::StatusCode::kInvalidArgument) << end.status();
  // Still waiting for the real upstream.
  auto real = DialNext(u.address, u.want, {}, {}, absl::Seconds(10));
  ASSERT_TRUE(real.ok()) << real.status();
  auto up = AcceptPrevious(*u.server, absl::Seconds(10));
  ASSERT_TRUE(up.ok()) << up.status();
  (*up)->CloseSend();
}

// A middle stage whose downstream cannot accept connections serves both
// slots on one port: its upstream dials StageLink, its downstream dials
// StageLinkReverse (DialPrevious) with the hello the middle stage would have
// sent. Each connection becomes the right link and frames flow both ways; a
// wrong hello on the downstream slot is refused there, and a server without
// that slot answers a reversed dial with UNIMPLEMENTED.
TEST(LinkHandshakeTest, AReversedLinkIsTakenOnTheDownstreamSlotBesideTheUpstreamOne) {
  const v1::LinkHello from_up = LinkHelloFor(SmallJob(), 0, 0, 1, 3);    // link 0 -> 1
  const v1::LinkHello to_down = LinkHelloFor(SmallJob(), 0, 1, 2, 3);    // link 1 -> 2
  auto server = StageLinkServer::StartSlots("127.0.0.1:0", UpstreamServerOptions(from_up, "", {}, {}, {}),
                                            UpstreamServerOptions(to_down, "", {}, {}, {}));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*server)->port());
  v1::LinkHello wrong = to_down;
  wrong.set_generation(9);
  auto refused = DialPrevious(address, wrong, {}, {}, absl::Seconds(10));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("generation"));
  // Dialed the other way round first, then the usual way: each lands on its slot.
  auto downstream = DialPrevious(address, to_down, {}, {}, absl::Seconds(10));
  ASSERT_TRUE(downstream.ok()) << downstream.status();
  auto upstream = DialNext(address, from_up, {}, {}, absl::Seconds(10));
  ASSERT_TRUE(upstream.ok()) << upstream.status();
  auto up = AcceptPrevious(**server, absl::Seconds(10));
  auto down = AcceptNext(**server, absl::Seconds(10));
  ASSERT_TRUE(up.ok() && down.ok()) << up.status() << " " << down.status();
  ASSERT_NE(*up, *down);
  ASSERT_TRUE((*upstream)->Send(Commit(1)).ok());
  EXPECT_TRUE((*up)->Receive(StepIs(1), absl::Seconds(10)).ok());
  ASSERT_TRUE((*down)->Send(Commit(2)).ok());   // activations go down the reversed link
  EXPECT_TRUE((*downstream)->Receive(StepIs(2), absl::Seconds(10)).ok());
  ASSERT_TRUE((*downstream)->Send(Commit(3)).ok());  // gradients come back up it
  EXPECT_TRUE((*down)->Receive(StepIs(3), absl::Seconds(10)).ok());
  // A second downstream is refused.
  auto second = DialPrevious(address, to_down, {}, {}, absl::Milliseconds(500));
  EXPECT_FALSE(second.ok());
  (*up)->CloseSend();
  (*down)->CloseSend();
  // A server with the upstream slot only: a reversed dial is not served.
  Upstream only;
  auto none = DialPrevious(only.address, only.want, {}, {}, absl::Seconds(10));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnimplemented) << none.status();
}

TEST(LinkHandshakeTest, ANewerPlanHelloIsRefusedWithRetryAndDoesNotEndTheStage) {
  Upstream u;
  const double newer0 = Rejected("link_plan_newer"), older0 = Rejected("link_plan_older");
  v1::LinkHello newer = u.want;
  newer.set_plan(u.want.plan() + 1);
  auto ack = Hello(u.address, newer);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_FALSE(ack->accepted());
  EXPECT_TRUE(ack->retry());  // the dialer waits for this stage's next incarnation
  EXPECT_EQ(Rejected("link_plan_newer"), newer0 + 1);
  v1::LinkHello older = u.want;
  older.set_plan(u.want.plan() - 1);
  ack = Hello(u.address, older);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_FALSE(ack->accepted());
  EXPECT_FALSE(ack->retry());
  EXPECT_EQ(Rejected("link_plan_older"), older0 + 1);
  // The stage did not end: its upstream of the same plan connects.
  auto real = DialNext(u.address, u.want, {}, {}, absl::Seconds(10));
  ASSERT_TRUE(real.ok()) << real.status();
  auto up = AcceptPrevious(*u.server, absl::Seconds(10));
  ASSERT_TRUE(up.ok()) << up.status();
  (*up)->CloseSend();
}

TEST(LinkHandshakeTest, FramesOverTheQueueCapEndTheStreamWithResourceExhausted) {
  LinkLimits limits;
  limits.max_queued_frames = 8;
  Upstream u(absl::Seconds(5), limits);
  const double over0 = Rejected("link_frames_over_cap");
  auto real = DialNext(u.address, u.want, {}, {}, absl::Seconds(10));
  ASSERT_TRUE(real.ok()) << real.status();
  auto up = AcceptPrevious(*u.server, absl::Seconds(10));
  ASSERT_TRUE(up.ok());
  for (int i = 0; i < 64; ++i) {
    if (!(*real)->Send(Commit(0)).ok()) break;
  }
  absl::Status end = (*real)->WaitClosed(absl::Seconds(10));
  EXPECT_EQ(end.code(), absl::StatusCode::kResourceExhausted) << end;
  EXPECT_THAT(std::string(end.message()), ::testing::HasSubstr("frames queued"));
  EXPECT_EQ(Rejected("link_frames_over_cap"), over0 + 1);
  // This end holds at most the cap and then reports the refusal.
  int held = 0;
  while ((*up)->Receive(StepIs(0), absl::Seconds(1)).ok()) ++held;
  EXPECT_LE(held, 8);
  EXPECT_EQ((*up)->Has(StepIs(0)).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(LinkHandshakeTest, FramesTooFarAheadOrTooLargeAreRefused) {
  const LinkLimits job_limits = LinkLimitsFor(SmallJob(), 10);
  // Sized from the job: 2 x 8 x 16 x 4 bytes of activations and headroom, not 512 MiB.
  EXPECT_LT(job_limits.max_frame_bytes, 2 << 20);
  EXPECT_GE(job_limits.max_frame_bytes, 2 * 8 * 16 * 4);
  EXPECT_EQ(job_limits.first_step, 10u);
  // With tied embeddings the head's gradient travels too: dense over the vocabulary.
  v1::JobSpec tied = SmallJob();
  tied.mutable_model()->set_vocab_size(50000);
  tied.mutable_model()->set_tie_embeddings(true);
  EXPECT_GE(LinkLimitsFor(tied, 0).max_frame_bytes, 50000 * 17 * 4 + 1024);
  Upstream u(absl::Seconds(5), job_limits);
  const double window0 = Rejected("link_step_out_of_window");
  {
    auto real = DialNext(u.address, u.want, {}, {}, absl::Seconds(10));
    ASSERT_TRUE(real.ok()) << real.status();
    auto up = AcceptPrevious(*u.server, absl::Seconds(10));
    ASSERT_TRUE(up.ok());
    ASSERT_TRUE((*real)->Send(Commit(10 + kLinkStepWindow)).ok());  // within the window
    EXPECT_TRUE((*up)->Receive(StepIs(10 + kLinkStepWindow), absl::Seconds(10)).ok());
    ASSERT_TRUE((*real)->Send(Commit(1'000'000)).ok());  // far ahead
    absl::Status end = (*real)->WaitClosed(absl::Seconds(10));
    EXPECT_EQ(end.code(), absl::StatusCode::kResourceExhausted) << end;
    EXPECT_EQ(Rejected("link_step_out_of_window"), window0 + 1);
  }
  // A frame larger than the job's frames: gRPC refuses it.
  Upstream big(absl::Seconds(5), job_limits);
  auto real = DialNext(big.address, big.want, {}, {}, absl::Seconds(10));
  ASSERT_TRUE(real.ok()) << real.status();
  auto up = AcceptPrevious(*big.server, absl::Seconds(10));
  ASSERT_TRUE(up.ok());
  v1::LinkFrame huge;
  huge.mutable_activations()->set_step(10);
  huge.mutable_activations()->add_rows()->mutable_tensor()->mutable_scales()->assign(job_limits.max_frame_bytes + 1, 'x');
  ASSERT_TRUE((*real)->Send(huge).ok());
  absl::Status end = (*real)->WaitClosed(absl::Seconds(10));
  EXPECT_EQ(end.code(), absl::StatusCode::kResourceExhausted) << end;
  EXPECT_FALSE((*up)->Receive([](const v1::LinkFrame&) { return true; }, absl::Seconds(5)).ok());
}

TEST(LinkHandshakeTest, AReleasedConnectionIsNoLongerRead) {
  auto server = *StageLinkServer::Start("127.0.0.1:0", rpc::ShapingOptions{});
  auto client = *LinkConnection::Dial(absl::StrCat("127.0.0.1:", server->port()), {}, absl::Seconds(10));
  LinkConnection* end = *server->Accept(absl::Seconds(10));
  server->Release(end);
  // The stream ends for the dialer at once instead of being read on.
  absl::Status closed = client->WaitClosed(absl::Seconds(5));
  EXPECT_FALSE(absl::IsDeadlineExceeded(closed)) << closed;
}

}  // namespace
}  // namespace aqswarm::stage
