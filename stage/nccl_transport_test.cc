// Without CUDA (a build without it, or a machine without a GPU: CI) the
// argument, bootstrap and no-device paths run; the all-reduce needs two GPUs.
#include "stage/nccl_transport.h"

#include <cstring>
#include <iostream>
#include <thread>

#include "gtest/gtest.h"
#include "pipeline/dp_test_util.h"

namespace aqswarm::stage {
namespace {

// The compressed all-reduce the GPU tests run: 4-bit min-max, 40000-element buckets.
pipeline::AllReduceOptions TestAllReduceOptions() {
  pipeline::AllReduceOptions o;
  o.codec.codec = v1::CODEC_MINMAX;
  o.codec.bits = 4;
  o.bucket_elements = 40000;
  return o;
}

TEST(NcclTransportTest, BadOptionsAreRefusedBeforeAnyCudaCall) {
  if (!NewNcclUniqueId().ok()) GTEST_SKIP() << "built without NCCL";
  NcclTransportOptions o;
  o.size = 2;
  o.unique_id = "short";
  auto t = StartNcclTransport(o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("128 bytes, got 5"), std::string::npos) << t.status();
  o.unique_id.assign(128, '\0');
  o.rank = 2;
  EXPECT_EQ(StartNcclTransport(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.rank = 0;
  o.timeout = absl::ZeroDuration();
  EXPECT_EQ(StartNcclTransport(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Every replica of a grid whose job asks for NCCL, on a machine (or build)
// without it: the id goes round over the bootstrap exchange and every rank
// fails with a status that says why.
TEST(NcclTransportTest, WithoutAGpuEveryReplicaFailsWithAClearStatus) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a GPU";
  const int d = 3;
  const bool built = NewNcclUniqueId().ok();
  pipeline::testing::Hub hub(built ? absl::Seconds(20) : absl::Milliseconds(100));
  std::vector<absl::Status> st(d);
  std::vector<std::thread> t;
  for (int r = 0; r < d; ++r) {
    t.emplace_back([&, r] {
      pipeline::testing::HubExchange bootstrap(&hub, r, d);
      RoundExchangeOptions o;
      o.group = "job/stage-0";
      st[r] = StartNcclReplicaExchange(bootstrap, o).status();
    });
  }
  for (auto& th : t) th.join();
  for (int r = 0; r < d; ++r) {
    EXPECT_EQ(st[r].code(), absl::StatusCode::kFailedPrecondition) << st[r];
    // With NCCL built, ranks 1.. got rank 0's id and failed on the device, not on the bootstrap.
    const char* why = built ? "no CUDA device" : "built without NCCL";
    EXPECT_NE(st[r].message().find(why), std::string::npos) << r << ": " << st[r];
    if (!built) break;  // rank 0 fails before sending: the others wait out the hub
  }
}

// One rank on a real GPU: the device staging of every collective (host ->
// device -> NCCL -> host, buffers grown as chunks grow), and the compressed
// all-reduce over it matches the in-process reference bit for bit.
TEST(NcclTransportTest, OneRankOnAGpuStagesEveryCollectiveThroughTheDevice) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  auto id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  NcclTransportOptions to;
  to.unique_id = *id;
  to.timeout = absl::Seconds(60);
  auto t = StartNcclTransport(to);
  ASSERT_TRUE(t.ok()) << t.status();
  const std::vector<int64_t> row = {7, -1, int64_t{1} << 40};
  std::vector<int64_t> table(row.size());
  ASSERT_TRUE((*t)->AllGather(row, absl::MakeSpan(table)).ok());
  EXPECT_EQ(table, row);
  for (size_t n : {size_t{1}, size_t{1000}, size_t{3} << 20}) {  // the staging buffers grow
    std::string bytes(n, '\0');
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>(i * 131 + n);
    std::vector<std::string> received(1);
    const int64_t want[] = {static_cast<int64_t>(n)};
    ASSERT_TRUE((*t)->Exchange({bytes}, want, &received).ok()) << n;
    EXPECT_EQ(received[0], bytes) << n;
  }
  RoundExchangeOptions eo;
  eo.group = "job/stage-0";
  auto ex = RoundReplicaExchange::Start(eo, std::move(*t));
  ASSERT_TRUE(ex.ok()) << ex.status();
  const int64_t n = 100000;
  const pipeline::AllReduceOptions o = TestAllReduceOptions();
  const std::vector<float> in = pipeline::testing::RandomFloats(n, 3);
  std::vector<float> out(n), ref(n), we, se, we_ref, se_ref;
  ASSERT_TRUE(pipeline::AllReduceMean(**ex, o, 0, 0, in, absl::MakeSpan(out), &we, &se).ok());
  pipeline::testing::Hub hub;
  pipeline::testing::HubExchange h(&hub, 0, 1);
  ASSERT_TRUE(pipeline::AllReduceMean(h, o, 0, 0, in, absl::MakeSpan(ref), &we_ref, &se_ref).ok());
  EXPECT_EQ(0, std::memcmp(out.data(), ref.data(), n * sizeof(float)));
  EXPECT_EQ(we, we_ref);
  EXPECT_EQ(se, se_ref);
  (*ex)->Close();
}

// Two ranks on one GPU (NCCL refuses them): both fail with a status, neither hangs.
TEST(NcclTransportTest, TwoRanksOnOneGpuFailWithAStatus) {
  if (CudaDeviceCount() != 1) GTEST_SKIP() << "needs exactly 1 GPU";
  auto id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<absl::Status> st(2);
  std::vector<std::thread> t;
  const absl::Time start = absl::Now();
  for (int r = 0; r < 2; ++r) {
    t.emplace_back([&, r] {
      NcclTransportOptions o;
      o.rank = r;
      o.size = 2;
      o.unique_id = *id;
      o.timeout = absl::Seconds(30);
      st[r] = StartNcclTransport(o).status();
    });
  }
  for (auto& th : t) th.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(st[r].ok()) << r;
    std::cout << "rank " << r << ": " << st[r] << "\n";
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(45));
}

// Two ranks on two GPUs: the compressed all-reduce with error feedback over
// NCCL matches the in-process reference bit for bit.
TEST(NcclTransportTest, CompressedAllReduceOnTwoGpusMatchesTheReference) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 GPUs (NCCL refuses two ranks on one device)";
  const int d = 2;
  const int64_t n = 100000;
  auto id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<std::unique_ptr<RoundTransport>> transports(d);
  std::vector<absl::Status> st(d);
  {
    std::vector<std::thread> t;
    for (int r = 0; r < d; ++r) {
      t.emplace_back([&, r] {
        NcclTransportOptions o;
        o.rank = r;
        o.size = d;
        o.unique_id = *id;
        o.timeout = absl::Seconds(60);
        auto tr = StartNcclTransport(o);
        st[r] = tr.status();
        if (tr.ok()) transports[r] = std::move(*tr);
      });
    }
    for (auto& th : t) th.join();
  }
  for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
  std::vector<std::unique_ptr<RoundReplicaExchange>> ex;
  for (int r = 0; r < d; ++r) {
    RoundExchangeOptions o;
    o.group = "job/stage-0";
    ex.push_back(*RoundReplicaExchange::Start(o, std::move(transports[r])));
  }
  pipeline::testing::Hub hub;
  const pipeline::AllReduceOptions o = TestAllReduceOptions();
  std::vector<std::vector<float>> in(d), out(d, std::vector<float>(n)), ref(d, std::vector<float>(n)), we(d), se(d),
      we_ref(d), se_ref(d);
  for (int r = 0; r < d; ++r) in[r] = pipeline::testing::RandomFloats(n, r);
  std::vector<std::thread> t;
  for (int r = 0; r < d; ++r) {
    t.emplace_back([&, r] {
      st[r] = pipeline::AllReduceMean(*ex[r], o, 0, 0, in[r], absl::MakeSpan(out[r]), &we[r], &se[r]);
      pipeline::testing::HubExchange h(&hub, r, d);
      if (st[r].ok()) st[r] = pipeline::AllReduceMean(h, o, 0, 0, in[r], absl::MakeSpan(ref[r]), &we_ref[r], &se_ref[r]);
    });
  }
  for (auto& th : t) th.join();
  for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < d; ++r) {
    EXPECT_EQ(0, std::memcmp(out[r].data(), ref[r].data(), n * sizeof(float)));
    EXPECT_EQ(we[r], we_ref[r]);
    EXPECT_EQ(se[r], se_ref[r]);
  }
  for (auto& e : ex) e->Close();
}

}  // namespace
}  // namespace aqswarm::stage
