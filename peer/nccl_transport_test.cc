// Built with -DAQSWARM_WITH_CUDA=ON only. Without a GPU (CI) the argument
// and no-device paths run; the all-reduce needs two GPUs.
#include "peer/nccl_transport.h"

#include <cuda_runtime.h>

#include <cstring>
#include <thread>

#include "gtest/gtest.h"
#include "pipeline/dp_test_util.h"

namespace aqswarm::peer {
namespace {

int Devices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

TEST(NcclTransportTest, BadOptionsAreRefusedBeforeAnyCudaCall) {
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

TEST(NcclTransportTest, WithoutAGpuStartFailsWithAClearStatus) {
  if (Devices() > 0) GTEST_SKIP() << "this machine has a GPU";
  NcclTransportOptions o;
  o.size = 2;
  o.unique_id.assign(128, '\0');
  auto t = StartNcclTransport(o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_NE(t.status().message().find("no CUDA device"), std::string::npos) << t.status();
}

// Two ranks on two GPUs: the compressed all-reduce with error feedback over
// NCCL matches the in-process reference bit for bit.
TEST(NcclTransportTest, CompressedAllReduceOnTwoGpusMatchesTheReference) {
  if (Devices() < 2) GTEST_SKIP() << "needs 2 GPUs (NCCL refuses two ranks on one device)";
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
  pipeline::AllReduceOptions o;
  o.codec.codec = v1::CODEC_MINMAX;
  o.codec.bits = 4;
  o.bucket_elements = 40000;
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
}  // namespace aqswarm::peer
