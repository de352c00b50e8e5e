#include "stage/gradient_exchange.h"

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "common/metrics.h"
#include "gtest/gtest.h"
#include "stage/stage_metrics_testing.h"
#include "pipeline/dp_test_util.h"

namespace aqswarm::stage {
namespace {

struct Group {
  Group(int d, absl::Duration timeout = absl::Seconds(20), rpc::ShapingOptions shaping = {},
        std::vector<double> schedule = {}) {
    std::vector<std::string> addrs;
    for (int r = 0; r < d; ++r) {
      ReplicaExchangeOptions o;
      o.group = "job/stage-0";
      o.rank = r;
      o.size = d;
      o.timeout = timeout;
      o.shaping = shaping;
      o.bandwidth_schedule_mbps = schedule;
      ex.push_back(*GrpcReplicaExchange::Start(o));
      addrs.push_back(absl::StrCat("127.0.0.1:", ex.back()->port()));
    }
    for (auto& e : ex) EXPECT_TRUE(e->Connect(addrs).ok());
  }
  std::vector<std::unique_ptr<GrpcReplicaExchange>> ex;
};

using pipeline::testing::RandomFloats;

TEST(GrpcReplicaExchangeTest, CompressedAllReduceOverLoopbackGivesIdenticalMeans) {
  const int d = 3;
  const int64_t n = 30000;
  Group g(d);
  pipeline::AllReduceOptions o;
  o.codec.codec = v1::CODEC_MINMAX;
  o.codec.bits = 4;
  o.codec.bucket_size = 512;
  o.bucket_elements = 12000;
  std::vector<std::vector<float>> in(d), out(d, std::vector<float>(n)), we(d), se(d);
  std::vector<absl::Status> st(d);
  std::vector<std::thread> t;
  for (int r = 0; r < d; ++r) in[r] = RandomFloats(n, r);
  for (int r = 0; r < d; ++r) {
    t.emplace_back([&, r] { st[r] = pipeline::AllReduceMean(*g.ex[r], o, 1, 0, in[r], absl::MakeSpan(out[r]), &we[r], &se[r]); });
  }
  for (auto& th : t) th.join();
  for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
  for (int r = 1; r < d; ++r) EXPECT_EQ(0, std::memcmp(out[0].data(), out[r].data(), n * 4));
  double err = 0;
  for (int64_t i = 0; i < n; ++i) err = std::max(err, std::fabs(out[0][i] - (in[0][i] + in[1][i] + in[2][i]) / 3.0));
  EXPECT_LT(err, 0.1);
  EXPECT_GT(g.ex[0]->bytes_sent(), 0u);
}

// The exchange's sender is shaped by the same FIFO wire as the links: an
// all-reduce never moves a replica's bytes faster than its link rate, here
// each step's rate in a benchmark's bandwidth schedule.
TEST(GrpcReplicaExchangeTest, ShapedExchangeNeverBeatsItsBandwidth) {
  const int d = 2;
  const int64_t n = 50000;  // raw float32: ~100 kB from each replica
  const std::vector<double> schedule = {8.0, 4.0};
  Group g(d, absl::Seconds(20), rpc::ShapingOptions{8.0, 0}, schedule);
  for (int step : {0, 1}) {
    const double mbps = schedule[step];
    std::vector<std::vector<float>> out(d, std::vector<float>(n));
    std::vector<absl::Status> st(d);
    const uint64_t before = g.ex[0]->bytes_sent();
    const absl::Time start = absl::Now();
    std::vector<std::thread> t;
    for (int r = 0; r < d; ++r) {
      t.emplace_back([&, r] {
        const std::vector<float> in = RandomFloats(n, r);
        st[r] = pipeline::AllReduceMean(*g.ex[r], {}, step, 0, in, absl::MakeSpan(out[r]), nullptr, nullptr);
      });
    }
    for (auto& th : t) th.join();
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    const double wire = (g.ex[0]->bytes_sent() - before) * 8.0 / (mbps * 1e6);
    EXPECT_GT(wire, 0.05);  // enough bytes that shaping shows
    EXPECT_GE(secs, wire * 0.99) << mbps << " Mbit/s, bytes " << g.ex[0]->bytes_sent() - before;
  }
}

// With a bandwidth schedule, a chunk goes out at its own step's rate, not the
// configured one (here unshaped): a delayed update sends step s while step
// s+1 runs.
TEST(GrpcReplicaExchangeTest, ScheduledExchangeShapesEachChunkAtItsStepsRate) {
  const int d = 2;
  const int64_t n = 50000;
  Group g(d, absl::Seconds(20), rpc::ShapingOptions{}, {0, 4.0});
  std::vector<std::vector<float>> out(d, std::vector<float>(n));
  std::vector<absl::Status> st(d);
  const absl::Time start = absl::Now();
  std::vector<std::thread> t;
  for (int r = 0; r < d; ++r) {
    t.emplace_back([&, r] {
      const std::vector<float> in = RandomFloats(n, r);
      st[r] = pipeline::AllReduceMean(*g.ex[r], {}, /*step=*/3, 0, in, absl::MakeSpan(out[r]), nullptr, nullptr);
    });
  }
  for (auto& th : t) th.join();
  for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  const double wire = g.ex[0]->bytes_sent() * 8.0 / 4e6;  // step 3: schedule[1] = 4 Mbit/s
  EXPECT_GT(wire, 0.05);
  EXPECT_GE(secs, wire * 0.99) << "bytes " << g.ex[0]->bytes_sent();
}

TEST(GrpcReplicaExchangeTest, VanishedReplicaFailsTheStepWithAClearStatusQuickly) {
  Group g(3, absl::Seconds(3));
  g.ex[2].reset();  // replica 2 is gone
  std::vector<float> in = RandomFloats(5000, 1), out0(5000), out1(5000);
  absl::Status s0, s1;
  const absl::Time start = absl::Now();
  std::thread a([&] { s0 = pipeline::AllReduceMean(*g.ex[0], {}, 0, 0, in, absl::MakeSpan(out0), nullptr, nullptr); });
  std::thread b([&] { s1 = pipeline::AllReduceMean(*g.ex[1], {}, 0, 0, in, absl::MakeSpan(out1), nullptr, nullptr); });
  a.join();
  b.join();
  for (const auto& s : {s0, s1}) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("replica 2"), std::string::npos) << s;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// A pipeline's replica replaced while the others train on (fault domains):
// replica 2 is gone, its successor listens elsewhere, the others retarget
// rank 2 there and the same all-reduce completes, bit-identical everywhere,
// with the chunks that were queued for the vanished one delivered to the
// new one.
TEST(GrpcReplicaExchangeTest, ARetargetedReplicaTakesTheVanishedOnesPlaceInTheRunningGroup) {
  const int d = 3;
  const int64_t n = 5000;
  Group g(d, absl::Seconds(20));
  g.ex[2].reset();
  std::vector<std::vector<float>> in(d), out(d, std::vector<float>(n));
  for (int r = 0; r < d; ++r) in[r] = RandomFloats(n, r);
  std::vector<absl::Status> st(d);
  std::vector<std::thread> t;
  for (int r = 0; r < 2; ++r) {
    t.emplace_back([&, r] {
      st[r] = pipeline::AllReduceMean(*g.ex[r], {}, 4, 0, in[r], absl::MakeSpan(out[r]), nullptr, nullptr);
    });
  }
  ReplicaExchangeOptions o;
  o.group = "job/stage-0";
  o.rank = 2;
  o.size = d;
  o.timeout = absl::Seconds(20);
  auto successor = GrpcReplicaExchange::Start(o);
  ASSERT_TRUE(successor.ok()) << successor.status();
  const std::string at = absl::StrCat("127.0.0.1:", (*successor)->port());
  std::vector<std::string> addrs;
  for (int r = 0; r < 2; ++r) addrs.push_back(absl::StrCat("127.0.0.1:", g.ex[r]->port()));
  addrs.push_back(at);
  ASSERT_TRUE((*successor)->Connect(addrs).ok());
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(g.ex[r]->Retarget(2, at, "").ok());
  EXPECT_FALSE(g.ex[0]->Retarget(0, at, "").ok()) << "a replica cannot retarget itself";
  st[2] = pipeline::AllReduceMean(**successor, {}, 4, 0, in[2], absl::MakeSpan(out[2]), nullptr, nullptr);
  for (auto& th : t) th.join();
  for (const auto& s : st) ASSERT_TRUE(s.ok()) << s;
  for (int r = 1; r < d; ++r) EXPECT_EQ(0, std::memcmp(out[0].data(), out[r].data(), n * 4));
  EXPECT_NEAR(out[0][7], (in[0][7] + in[1][7] + in[2][7]) / 3, 1e-5);
}

// With keep_delivered, a successor gets again what its predecessor had
// already taken of the newest step (it vanished mid-round), and a chunk
// its receiver holds already counts as delivered.
TEST(GrpcReplicaExchangeTest, ASuccessorGetsTheChunksOfTheNewestStepItsPredecessorTook) {
  auto start = [](int rank, bool keep) {
    ReplicaExchangeOptions o;
    o.group = "job/stage-0";
    o.rank = rank;
    o.size = 2;
    o.timeout = absl::Seconds(20);
    o.keep_delivered = keep;
    auto ex = GrpcReplicaExchange::Start(o);
    EXPECT_TRUE(ex.ok()) << ex.status();
    return ex.ok() ? *std::move(ex) : nullptr;
  };
  auto sender = start(0, true), first = start(1, false);
  const std::string at0 = absl::StrCat("127.0.0.1:", sender->port());
  ASSERT_TRUE(sender->Connect({at0, absl::StrCat("127.0.0.1:", first->port())}).ok());
  ASSERT_TRUE(first->Connect({at0, absl::StrCat("127.0.0.1:", first->port())}).ok());
  v1::ExchangeChunk c;
  c.set_from_rank(0);
  c.set_step(7);
  c.set_round(5);
  c.set_phase(v1::ExchangeChunk::SCATTER);
  ASSERT_TRUE(sender->Send(1, c).ok());
  auto got = first->Receive(0, 7, 5, v1::ExchangeChunk::SCATTER, 0, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  first.reset();  // vanished after taking it

  auto successor = start(1, false);
  const std::string at1 = absl::StrCat("127.0.0.1:", successor->port());
  ASSERT_TRUE(successor->Connect({at0, at1}).ok());
  ASSERT_TRUE(sender->Retarget(1, at1, "").ok());
  auto again = successor->Receive(0, 7, 5, v1::ExchangeChunk::SCATTER, 0, 0);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(sender->Send(1, c).ok()) << "a duplicate is no failure";
  c.set_step(8);
  ASSERT_TRUE(sender->Send(1, c).ok());
  EXPECT_TRUE(successor->Receive(0, 8, 5, v1::ExchangeChunk::SCATTER, 0, 0).ok()) << "the sender goes on";
}

TEST(GrpcReplicaExchangeTest, ChunksFromAnotherGroupOrImpossibleRanksAreRefused) {
  Group g(2);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", g.ex[0]->port()), grpc::InsecureChannelCredentials());
  auto stub = v1::GradientExchange::NewStub(channel);
  auto push = [&](v1::ExchangeChunk c) {
    grpc::ClientContext ctx;
    v1::ExchangeAck ack;
    return stub->Push(&ctx, c, &ack);
  };
  v1::ExchangeChunk c;
  c.set_group("other/stage-0");
  c.set_phase(v1::ExchangeChunk::SCATTER);
  c.set_from_rank(1);
  EXPECT_EQ(push(c).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  c.set_group("job/stage-0");
  c.set_from_rank(7);
  EXPECT_EQ(push(c).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  c.set_from_rank(1);
  c.set_phase(v1::ExchangeChunk::PHASE_UNSPECIFIED);
  EXPECT_EQ(push(c).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(GrpcReplicaExchangeTest, TheFirstChunkWinsAndChunksOutsideTheStepWindowAreRefused) {
  Group g(2);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", g.ex[0]->port()), grpc::InsecureChannelCredentials());
  auto stub = v1::GradientExchange::NewStub(channel);
  auto push = [&](const v1::ExchangeChunk& c) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ExchangeAck ack;
    return stub->Push(&ctx, c, &ack);
  };
  const double dup0 = Rejected("dp_duplicate_chunk"), window0 = Rejected("dp_step_out_of_window");
  v1::ExchangeChunk first;
  first.set_group("job/stage-0");
  first.set_phase(v1::ExchangeChunk::SCATTER);
  first.set_from_rank(1);
  first.set_step(5);
  first.mutable_tensor()->set_num_elements(1);
  v1::ExchangeChunk second = first;
  second.mutable_tensor()->set_num_elements(2);  // a later, different chunk under the same key
  ASSERT_TRUE(push(first).ok());
  const grpc::Status dup = push(second);
  EXPECT_EQ(dup.error_code(), grpc::StatusCode::ALREADY_EXISTS) << dup.error_message();
  EXPECT_EQ(Rejected("dp_duplicate_chunk"), dup0 + 1);
  auto got = g.ex[0]->Receive(1, 5, 0, v1::ExchangeChunk::SCATTER, 0, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->tensor().num_elements(), 1u);  // the first stands
  // Taken chunks stay refused too.
  EXPECT_EQ(push(second).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  // This replica now works on step 5: a chunk far ahead (or behind) is refused.
  v1::ExchangeChunk far = first;
  far.set_step(5 + ExchangeMailbox::kStepWindow + 1);
  EXPECT_EQ(push(far).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  far.set_step(1'000'000'000);
  EXPECT_EQ(push(far).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(Rejected("dp_step_out_of_window"), window0 + 2);
  v1::ExchangeChunk next = first;
  next.set_step(6);
  EXPECT_TRUE(push(next).ok());  // the next step is fine
}

TEST(GrpcReplicaExchangeTest, TheNcclBootstrapStepDoesNotMoveTheWindow) {
  Group g(2);
  v1::ExchangeChunk id;
  id.set_step(ExchangeMailbox::kUnanchoredStep);
  id.set_phase(v1::ExchangeChunk::GATHER);
  id.set_chunk(0);
  ASSERT_TRUE(g.ex[0]->Send(1, id).ok());
  ASSERT_TRUE(g.ex[1]->Receive(0, ExchangeMailbox::kUnanchoredStep, 0, v1::ExchangeChunk::GATHER, 0, 0).ok());
  // Training chunks of step 0 still flow after it.
  v1::ExchangeChunk c;
  c.set_step(0);
  c.set_phase(v1::ExchangeChunk::SCATTER);
  c.set_chunk(1);
  ASSERT_TRUE(g.ex[0]->Send(1, c).ok());
  EXPECT_TRUE(g.ex[1]->Receive(0, 0, 0, v1::ExchangeChunk::SCATTER, 0, 1).ok());
}

TEST(GrpcReplicaExchangeTest, LatencyShapingDoesNotWaitOnTheSendersClock) {
  rpc::ShapingOptions shaping;
  shaping.latency_ms = 20;
  Group g(2, absl::Seconds(20), shaping);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", g.ex[0]->port()), grpc::InsecureChannelCredentials());
  auto stub = v1::GradientExchange::NewStub(channel);
  v1::ExchangeChunk c;
  c.set_group("job/stage-0");
  c.set_phase(v1::ExchangeChunk::SCATTER);
  c.set_from_rank(1);
  // Stamped a minute in the future: the handler must not sleep on it.
  c.set_sent_unix_micros(absl::ToUnixMicros(absl::Now() + absl::Seconds(60)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ExchangeAck ack;
  const absl::Time start = absl::Now();
  const grpc::Status s = stub->Push(&ctx, c, &ack);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

}  // namespace
}  // namespace aqswarm::stage
