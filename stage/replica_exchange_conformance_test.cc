// One conformance suite for every pipeline::ReplicaExchange backend: the
// in-process reference (pipeline::testing::HubExchange), gRPC over loopback
// (GrpcReplicaExchange), the round protocol over an in-process fabric
// (RoundReplicaExchange + testing::FabricTransport) and over NCCL (only where
// there is a GPU per replica). Each runs with D = 2 and 3 replicas and must
// keep the contract pipeline/dp_allreduce.h relies on:
//   (a) AllReduceMean gives every replica the same bits: the mean summed in
//       rank order, as the reference exchange computes it;
//   (b) Receive matches chunks by (step, round, phase, bucket, chunk), not by
//       arrival order;
//   (c) a Receive for a chunk nobody sends fails with DeadlineExceeded after
//       the exchange's timeout;
//   (d) a replica that vanished makes the others' step fail, not hang.
// Backend-specific behaviour (shaping, TLS, group refusal, the round table)
// stays in each backend's own test.
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "stage/gradient_exchange.h"
#include "stage/nccl_transport.h"
#include "stage/round_exchange.h"
#include "stage/round_fabric_test_util.h"
#include "pipeline/dp_allreduce.h"
#include "pipeline/dp_test_util.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm::stage {
namespace {

using ::aqswarm::testing::IsOk;
using ::aqswarm::testing::StatusIs;
using pipeline::ReplicaExchange;
using pipeline::testing::RandomFloats;

constexpr char kGroup[] = "job/stage-0";

// D connected exchanges of one backend, ranks 0..D-1.
class ExchangeGroup {
 public:
  virtual ~ExchangeGroup() = default;
  virtual ReplicaExchange& at(int rank) = 0;
  // Replica `rank` vanishes as a crashed process would; at(rank) is not used
  // afterwards.
  virtual void Vanish(int rank) = 0;
};

class HubGroup final : public ExchangeGroup {
 public:
  HubGroup(int d, absl::Duration timeout) : hub_(timeout) {
    for (int r = 0; r < d; ++r) ex_.push_back(std::make_unique<pipeline::testing::HubExchange>(&hub_, r, d));
  }
  ReplicaExchange& at(int rank) override { return *ex_[rank]; }
  void Vanish(int rank) override { hub_.Kill(rank); }

 private:
  pipeline::testing::Hub hub_;
  std::vector<std::unique_ptr<pipeline::testing::HubExchange>> ex_;
};

class GrpcGroup final : public ExchangeGroup {
 public:
  static absl::StatusOr<std::unique_ptr<ExchangeGroup>> Make(int d, absl::Duration timeout) {
    auto g = std::make_unique<GrpcGroup>();
    std::vector<std::string> addresses;
    for (int r = 0; r < d; ++r) {
      ReplicaExchangeOptions o;
      o.group = kGroup;
      o.rank = r;
      o.size = d;
      o.timeout = timeout;
      absl::StatusOr<std::unique_ptr<GrpcReplicaExchange>> ex = GrpcReplicaExchange::Start(o);
      if (!ex.ok()) return ex.status();
      addresses.push_back(absl::StrCat("127.0.0.1:", (*ex)->port()));
      g->ex_.push_back(*std::move(ex));
    }
    for (auto& e : g->ex_) {
      if (absl::Status s = e->Connect(addresses); !s.ok()) return s;
    }
    return g;
  }
  ReplicaExchange& at(int rank) override { return *ex_[rank]; }
  void Vanish(int rank) override { ex_[rank].reset(); }  // its server and senders are gone

 private:
  std::vector<std::unique_ptr<GrpcReplicaExchange>> ex_;
};

// RoundReplicaExchanges on one transport per rank; the round exchanges of a
// group are closed together before any is destroyed (round_exchange.h).
class RoundGroup : public ExchangeGroup {
 public:
  ~RoundGroup() override {
    for (auto& e : ex_) {
      if (e != nullptr) e->Close();
    }
    ex_.clear();
  }
  ReplicaExchange& at(int rank) override { return *ex_[rank]; }

 protected:
  std::vector<std::unique_ptr<RoundReplicaExchange>> ex_;
};

class FabricGroup final : public RoundGroup {
 public:
  FabricGroup(int d, absl::Duration timeout) : fabric_(std::make_unique<testing::Fabric>(d, timeout)) {}
  ~FabricGroup() override {
    for (auto& e : ex_) e->Close();
    ex_.clear();  // before the fabric they run on
  }
  static absl::StatusOr<std::unique_ptr<ExchangeGroup>> Make(int d, absl::Duration timeout) {
    auto g = std::make_unique<FabricGroup>(d, timeout);
    for (int r = 0; r < d; ++r) {
      RoundExchangeOptions o;
      o.group = kGroup;
      o.timeout = timeout;
      auto ex = RoundReplicaExchange::Start(o, std::make_unique<testing::FabricTransport>(g->fabric_.get(), r, d));
      if (!ex.ok()) return ex.status();
      g->ex_.push_back(*std::move(ex));
    }
    return g;
  }
  // The fabric's way: the rank's transport calls fail, so its rounds end, and
  // the others' next collective times out waiting for it.
  void Vanish(int rank) override { fabric_->Kill(rank); }

 private:
  std::unique_ptr<testing::Fabric> fabric_;
};

// NCCL, bootstrapped over the reference exchange: needs a GPU per replica.
class NcclGroup final : public RoundGroup {
 public:
  static std::string Unavailable(int d) {
    if (!NewNcclUniqueId().ok()) return "built without NCCL";
    if (CudaDeviceCount() < d) return absl::StrCat("needs ", d, " GPUs (NCCL puts one rank on each)");
    return "";
  }
  static absl::StatusOr<std::unique_ptr<ExchangeGroup>> Make(int d, absl::Duration timeout) {
    auto g = std::make_unique<NcclGroup>();
    pipeline::testing::Hub hub(absl::Seconds(60));
    std::vector<absl::StatusOr<std::unique_ptr<RoundReplicaExchange>>> started(d);
    std::vector<std::thread> threads;
    for (int r = 0; r < d; ++r) {
      threads.emplace_back([&, r] {
        pipeline::testing::HubExchange bootstrap(&hub, r, d);
        RoundExchangeOptions o;
        o.group = kGroup;
        o.timeout = timeout;
        started[r] = StartNcclReplicaExchange(bootstrap, o);
      });
    }
    for (auto& t : threads) t.join();
    for (auto& s : started) {
      if (!s.ok()) return s.status();
      g->ex_.push_back(*std::move(s));
    }
    return g;
  }
  // In one process a rank cannot die alone: it closes, stops sending, and
  // aborts the communicator when the others do not close within the timeout.
  void Vanish(int rank) override { ex_[rank]->Close(); }
};

struct Backend {
  std::string name;
  // Builds D connected exchanges whose Receive (and delivery of a chunk) is
  // bounded by `timeout`.
  std::function<absl::StatusOr<std::unique_ptr<ExchangeGroup>>(int d, absl::Duration timeout)> make;
  // Why it cannot run here with D replicas; empty when it can.
  std::function<std::string(int d)> unavailable = [](int) { return std::string(); };
};

void PrintTo(const Backend& b, std::ostream* os) { *os << b.name; }

std::vector<Backend> Backends() {
  return {
      {"Hub",
       [](int d, absl::Duration timeout) -> absl::StatusOr<std::unique_ptr<ExchangeGroup>> {
         return std::make_unique<HubGroup>(d, timeout);
       }},
      {"Grpc", &GrpcGroup::Make},
      {"RoundFabric", &FabricGroup::Make},
      {"RoundNccl", &NcclGroup::Make, &NcclGroup::Unavailable},
  };
}

// Runs fn(rank) for every rank in `ranks` on its own thread; their statuses.
std::vector<absl::Status> OnEachRank(const std::vector<int>& ranks, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> st(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) threads.emplace_back([&, i] { st[i] = fn(ranks[i]); });
  for (auto& t : threads) t.join();
  return st;
}

std::vector<int> Ranks(int d) {
  std::vector<int> r(d);
  for (int i = 0; i < d; ++i) r[i] = i;
  return r;
}

v1::ExchangeChunk Chunk(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase, uint32_t bucket,
                        uint32_t chunk, const std::string& tag) {
  v1::ExchangeChunk c;
  c.set_from_rank(from);
  c.set_step(step);
  c.set_round(round);
  c.set_phase(phase);
  c.set_bucket(bucket);
  c.set_chunk(chunk);
  c.mutable_tensor()->set_payload(tag);
  return c;
}

class ReplicaExchangeConformanceTest : public ::testing::TestWithParam<std::tuple<Backend, int>> {
 protected:
  void SetUp() override {
    const std::string why = backend().unavailable(d());
    if (!why.empty()) GTEST_SKIP() << backend().name << ": " << why;
  }
  const Backend& backend() const { return std::get<0>(GetParam()); }
  int d() const { return std::get<1>(GetParam()); }

  // A group of d() replicas of the backend under test, bounded by `timeout`.
  std::unique_ptr<ExchangeGroup> Make(absl::Duration timeout) {
    absl::StatusOr<std::unique_ptr<ExchangeGroup>> g = backend().make(d(), timeout);
    EXPECT_THAT(g, IsOk());
    return g.ok() ? *std::move(g) : nullptr;
  }
};

// (a) Raw float32 all-reduce, uneven buckets and chunks, two steps and two
// rounds: every replica gets the bits of the rank-order mean, which is what
// the reference exchange gives too.
TEST_P(ReplicaExchangeConformanceTest, AllReduceMeanIsBitIdenticalOnEveryReplicaAndEqualsTheRankOrderMean) {
  const int d = this->d();
  const int64_t n = 2500;
  pipeline::AllReduceOptions o;  // raw f32
  o.bucket_elements = 1001;      // three buckets, chunk sizes differing by one
  auto group = Make(absl::Seconds(30));
  ASSERT_NE(group, nullptr);
  HubGroup reference(d, absl::Seconds(30));
  for (uint64_t step = 0; step < 2; ++step) {
    for (uint32_t round = 0; round < 2; ++round) {
      std::vector<std::vector<float>> in(d), out(d, std::vector<float>(n)), ref(d, std::vector<float>(n));
      for (int r = 0; r < d; ++r) in[r] = RandomFloats(n, 1000 * step + 10 * round + r);
      auto run = [&](ExchangeGroup& g, std::vector<std::vector<float>>* result) {
        return OnEachRank(Ranks(d), [&](int r) {
          return pipeline::AllReduceMean(g.at(r), o, step, round, in[r], absl::MakeSpan((*result)[r]), nullptr,
                                         nullptr);
        });
      };
      for (const absl::Status& s : run(*group, &out)) ASSERT_THAT(s, IsOk());
      for (const absl::Status& s : run(reference, &ref)) ASSERT_THAT(s, IsOk());
      // The mean as the banner of dp_allreduce.h defines it: summed in rank
      // order 0..D-1, then multiplied by 1/D.
      std::vector<float> direct(n);
      for (int64_t i = 0; i < n; ++i) {
        float sum = 0.0f;
        for (int r = 0; r < d; ++r) sum += in[r][i];
        direct[i] = sum * (1.0f / static_cast<float>(d));
      }
      for (int r = 0; r < d; ++r) {
        SCOPED_TRACE(absl::StrCat("step ", step, " round ", round, " rank ", r));
        EXPECT_EQ(0, std::memcmp(out[r].data(), ref[r].data(), n * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(out[r].data(), direct.data(), n * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(out[r].data(), out[0].data(), n * sizeof(float)));
      }
    }
  }
}

// (b) Chunks that differ in one key field each, sent in reverse order and
// taken in forward order: each Receive gets its own chunk.
TEST_P(ReplicaExchangeConformanceTest, ChunksAreMatchedByTheirKeyNotByArrivalOrder) {
  const int d = this->d();
  auto group = Make(absl::Seconds(30));
  ASSERT_NE(group, nullptr);
  const int from = d - 1, to = 0;
  using P = v1::ExchangeChunk;
  const std::vector<v1::ExchangeChunk> chunks = {
      Chunk(from, 7, 1, P::SCATTER, 2, 1, "base"),   Chunk(from, 7, 1, P::SCATTER, 2, 0, "chunk 0"),
      Chunk(from, 7, 1, P::SCATTER, 3, 1, "bucket 3"), Chunk(from, 7, 1, P::GATHER, 2, 1, "gather"),
      Chunk(from, 7, 2, P::SCATTER, 2, 1, "round 2"), Chunk(from, 8, 1, P::SCATTER, 2, 1, "step 8"),
  };
  std::vector<absl::Status> st = OnEachRank({from, to}, [&](int r) -> absl::Status {
    if (r == from) {
      for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
        if (absl::Status s = group->at(from).Send(to, *it); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
    for (const v1::ExchangeChunk& want : chunks) {
      absl::StatusOr<v1::ExchangeChunk> got =
          group->at(to).Receive(from, want.step(), want.round(), want.phase(), want.bucket(), want.chunk());
      if (!got.ok()) return got.status();
      EXPECT_EQ(got->tensor().payload(), want.tensor().payload());
      EXPECT_EQ(got->from_rank(), static_cast<uint32_t>(from));
    }
    return absl::OkStatus();
  });
  for (const absl::Status& s : st) EXPECT_THAT(s, IsOk());
}

// (c) Nobody sends this chunk: the Receive gives up after the exchange's
// timeout (not at once, not never), and the exchange still works afterwards.
TEST_P(ReplicaExchangeConformanceTest, AReceiveNobodyAnswersFailsWithDeadlineExceededAfterTheTimeout) {
  const int d = this->d();
  const absl::Duration timeout = absl::Milliseconds(300);
  auto group = Make(timeout);
  ASSERT_NE(group, nullptr);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ExchangeChunk> got = group->at(0).Receive(d - 1, 99, 0, v1::ExchangeChunk::SCATTER, 0, 0);
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(got, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_GE(took, timeout / 2);
  EXPECT_LT(took, timeout * 10);
}

// (d) The last replica vanishes before a step: every other replica's
// all-reduce fails with a status, well within ten timeouts.
TEST_P(ReplicaExchangeConformanceTest, AVanishedReplicaFailsTheOthersStepInsteadOfHanging) {
  const int d = this->d();
  const absl::Duration timeout = absl::Seconds(1);
  auto group = Make(timeout);
  ASSERT_NE(group, nullptr);
  group->Vanish(d - 1);
  const int64_t n = 3000;
  std::vector<int> live = Ranks(d - 1);
  std::vector<std::vector<float>> out(d, std::vector<float>(n));
  const absl::Time start = absl::Now();
  std::vector<absl::Status> st = OnEachRank(live, [&](int r) {
    const std::vector<float> in = RandomFloats(n, r);
    return pipeline::AllReduceMean(group->at(r), {}, 0, 0, in, absl::MakeSpan(out[r]), nullptr, nullptr);
  });
  EXPECT_LT(absl::Now() - start, timeout * 10);
  for (size_t i = 0; i < st.size(); ++i) EXPECT_FALSE(st[i].ok()) << "rank " << live[i];
}

INSTANTIATE_TEST_SUITE_P(Backends, ReplicaExchangeConformanceTest,
                         ::testing::Combine(::testing::ValuesIn(Backends()), ::testing::Values(2, 3)),
                         [](const ::testing::TestParamInfo<std::tuple<Backend, int>>& info) {
                           return absl::StrCat(std::get<0>(info.param).name, "_D", std::get<1>(info.param));
                         });

}  // namespace
}  // namespace aqswarm::stage
