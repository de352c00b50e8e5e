#include "stage/round_exchange.h"

#include <cstring>
#include <thread>

#include "gtest/gtest.h"
#include "stage/round_fabric_test_util.h"
#include "pipeline/dp_test_util.h"

namespace aqswarm::stage {
namespace {

using testing::Fabric;
using testing::FabricTransport;

std::unique_ptr<RoundReplicaExchange> StartRank(Fabric* f, int rank, int size, absl::Duration timeout,
                                                FabricTransport** transport = nullptr) {
  auto t = std::make_unique<FabricTransport>(f, rank, size);
  if (transport != nullptr) *transport = t.get();
  RoundExchangeOptions o;
  o.group = "job/stage-0";
  o.timeout = timeout;
  auto ex = RoundReplicaExchange::Start(o, std::move(t));
  EXPECT_TRUE(ex.ok()) << ex.status();
  return std::move(*ex);
}

using pipeline::testing::RandomFloats;

// The same compressed all-reduce with error feedback over three steps through
// the round protocol and through the in-process reference exchange: every
// replica's output and error buffers must match the reference bit for bit.
TEST(RoundReplicaExchangeTest, CompressedAllReduceMatchesTheReferenceExchangeBitForBit) {
  for (int d : {2, 3}) {
    const int64_t n = 30000;
    pipeline::AllReduceOptions o;
    o.codec.codec = v1::CODEC_MINMAX;
    o.codec.bits = 4;
    o.codec.bucket_size = 512;
    o.bucket_elements = 12000;
    auto run = [&](std::vector<pipeline::ReplicaExchange*> ex, std::vector<std::vector<float>>* out,
                   std::vector<std::vector<float>>* we, std::vector<std::vector<float>>* se) {
      out->assign(d, std::vector<float>(n));
      we->assign(d, {});
      se->assign(d, {});
      for (uint64_t step = 0; step < 3; ++step) {
        std::vector<absl::Status> st(d);
        std::vector<std::thread> t;
        for (int r = 0; r < d; ++r) {
          t.emplace_back([&, r] {
            std::vector<float> in = RandomFloats(n, 100 * step + r);
            st[r] = pipeline::AllReduceMean(*ex[r], o, step, 0, in, absl::MakeSpan((*out)[r]), &(*we)[r], &(*se)[r]);
          });
        }
        for (auto& th : t) th.join();
        for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
      }
    };
    Fabric fabric(d, absl::Seconds(20));
    std::vector<std::unique_ptr<RoundReplicaExchange>> rounds;
    for (int r = 0; r < d; ++r) rounds.push_back(StartRank(&fabric, r, d, absl::Seconds(20)));
    pipeline::testing::Hub hub;
    std::vector<std::unique_ptr<pipeline::testing::HubExchange>> hubs;
    for (int r = 0; r < d; ++r) hubs.push_back(std::make_unique<pipeline::testing::HubExchange>(&hub, r, d));
    std::vector<pipeline::ReplicaExchange*> a, b;
    for (int r = 0; r < d; ++r) {
      a.push_back(rounds[r].get());
      b.push_back(hubs[r].get());
    }
    std::vector<std::vector<float>> out_a, we_a, se_a, out_b, we_b, se_b;
    run(a, &out_a, &we_a, &se_a);
    run(b, &out_b, &we_b, &se_b);
    for (int r = 0; r < d; ++r) {
      EXPECT_EQ(0, std::memcmp(out_a[r].data(), out_b[r].data(), n * 4)) << "d=" << d << " rank " << r;
      EXPECT_EQ(we_a[r], we_b[r]);
      EXPECT_EQ(se_a[r], se_b[r]);
      EXPECT_EQ(0, std::memcmp(out_a[0].data(), out_a[r].data(), n * 4));
      EXPECT_GT(rounds[r]->bytes_sent(), 0u);
    }
    for (auto& e : rounds) e->Close();
  }
}

TEST(RoundReplicaExchangeTest, AllReplicasLeaveTogetherAndFinishCleanly) {
  Fabric fabric(2, absl::Seconds(20));
  bool clean0 = false, clean1 = false;
  FabricTransport *t0, *t1;
  auto a = StartRank(&fabric, 0, 2, absl::Seconds(20), &t0);
  auto b = StartRank(&fabric, 1, 2, absl::Seconds(20), &t1);
  t0->finished_clean_ = &clean0;
  t1->finished_clean_ = &clean1;
  v1::ExchangeChunk c;
  c.set_from_rank(0);
  c.set_phase(v1::ExchangeChunk::SCATTER);
  c.set_chunk(1);
  ASSERT_TRUE(a->Send(1, c).ok());
  a->Close();  // closes while its chunk may still be queued: it is still delivered
  auto got = b->Receive(0, 0, 0, v1::ExchangeChunk::SCATTER, 0, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->group(), "job/stage-0");
  b.reset();  // the last to close: both leave in the same round
  a.reset();
  EXPECT_TRUE(clean0);
  EXPECT_TRUE(clean1);
}

TEST(RoundReplicaExchangeTest, VanishedReplicaFailsTheStepWithAClearStatusQuickly) {
  Fabric fabric(3, absl::Milliseconds(500));
  bool clean0 = true;
  FabricTransport* t0;
  auto a = StartRank(&fabric, 0, 3, absl::Seconds(5), &t0);
  auto b = StartRank(&fabric, 1, 3, absl::Seconds(5));
  t0->finished_clean_ = &clean0;
  // Replica 2 never joins the rounds.
  std::vector<float> in = RandomFloats(5000, 1), out0(5000), out1(5000);
  absl::Status s0, s1;
  const absl::Time start = absl::Now();
  std::thread x([&] { s0 = pipeline::AllReduceMean(*a, {}, 0, 0, in, absl::MakeSpan(out0), nullptr, nullptr); });
  std::thread y([&] { s1 = pipeline::AllReduceMean(*b, {}, 0, 0, in, absl::MakeSpan(out1), nullptr, nullptr); });
  x.join();
  y.join();
  for (const auto& s : {s0, s1}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("did not join"), std::string::npos) << s;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));  // the transport's 0.5 s, not the 5 s Receive timeout
  a.reset();
  EXPECT_FALSE(clean0);  // the transport was aborted
  EXPECT_FALSE(b->Send(0, v1::ExchangeChunk()).ok());  // sticky
}

TEST(RoundReplicaExchangeTest, AnImpossibleRoundTableFailsTheExchangeWithoutAllocatingIt) {
  Fabric fabric(2, absl::Seconds(5));
  FabricTransport* t1;
  auto a = StartRank(&fabric, 0, 2, absl::Seconds(5));
  auto b = StartRank(&fabric, 1, 2, absl::Seconds(5), &t1);
  t1->corrupt_row_ = true;
  auto got = a->Receive(1, 0, 0, v1::ExchangeChunk::SCATTER, 0, 0);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_NE(got.status().message().find("announced a chunk of 1099511627776 bytes"), std::string::npos) << got.status();
}

TEST(RoundReplicaExchangeTest, BadArgumentsAreRefused) {
  Fabric fabric(2, absl::Seconds(5));
  EXPECT_FALSE(RoundReplicaExchange::Start({}, nullptr).ok());
  EXPECT_EQ(RoundReplicaExchange::Start({}, std::make_unique<FabricTransport>(&fabric, 2, 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  RoundExchangeOptions o;
  o.max_idle = absl::ZeroDuration();
  EXPECT_FALSE(RoundReplicaExchange::Start(o, std::make_unique<FabricTransport>(&fabric, 0, 2)).ok());
  auto a = StartRank(&fabric, 0, 2, absl::Seconds(5));
  auto b = StartRank(&fabric, 1, 2, absl::Seconds(5));
  EXPECT_EQ(a->Send(0, v1::ExchangeChunk()).code(), absl::StatusCode::kInvalidArgument);  // to itself
  EXPECT_EQ(a->Send(5, v1::ExchangeChunk()).code(), absl::StatusCode::kInvalidArgument);
  a->Close();
  b->Close();
}

}  // namespace
}  // namespace aqswarm::stage
