#include "pipeline/layerwise_plan.h"

#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "pipeline/dp_test_util.h"

namespace aqswarm::pipeline {
namespace {

using testing::Hub;
using testing::HubExchange;
using testing::RandomFloats;

constexpr int kReplicas = 3;

// Tensors of different dynamic range: uniform noise in [-0.5, 0.5) (even
// indices) and in [-5, 5) (odd: ten times the bucket ranges, a hundred times
// the min-max error at any width).
std::vector<float> Mix(const std::vector<int64_t>& sizes, uint64_t seed) {
  std::vector<float> x;
  for (size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> v = RandomFloats(sizes[t], seed + t);
    if (t % 2 == 1) {
      for (float& f : v) f *= 10;
    }
    x.insert(x.end(), v.begin(), v.end());
  }
  return x;
}

LayerwisePlanOptions Options() {
  LayerwisePlanOptions o;
  o.codec.bucket_size = 64;
  o.codec.min_compress_elements = 16;
  o.min_bits = 2;
  o.max_bits = 8;
  o.uniform_bits = 4;
  o.replicas = kReplicas;
  return o;
}

const std::vector<int64_t> kSizes = {4096, 4096, 2048, 6000, 3000, 5000};

TEST(LayerwisePlanTest, NeverCostsMoreThanUniformAtNoMoreError) {
  const std::vector<float> x = Mix(kSizes, 1);
  absl::StatusOr<LayerwisePlan> plan = ChooseLayerwiseBits(x, kSizes, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->bits.size(), kSizes.size());
  EXPECT_LE(plan->error, plan->uniform_error);
  EXPECT_LT(plan->cost_bytes, plan->uniform_cost_bytes) << "the mix should leave room for a cheaper plan";
  EXPECT_NE(plan->bits, std::vector<int>(kSizes.size(), 4));
}

// The squared error of the wide tensors (odd indices) falls most per added
// bit: they get the bits the narrow ones give up.
TEST(LayerwisePlanTest, TensorsWithALargerDynamicRangeGetMoreBits) {
  const std::vector<float> x = Mix(kSizes, 2);
  absl::StatusOr<LayerwisePlan> plan = ChooseLayerwiseBits(x, kSizes, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (size_t t = 1; t < kSizes.size(); t += 2) {
    for (size_t u = 0; u < kSizes.size(); u += 2) {
      EXPECT_GE(plan->bits[t], plan->bits[u]) << "wide tensor " << t << " vs narrow tensor " << u;
    }
  }
}

TEST(LayerwisePlanTest, BadSizesAndWidthsAreRefused) {
  const std::vector<float> x = Mix(kSizes, 3);
  std::vector<int64_t> short_sizes = kSizes;
  short_sizes.back() -= 1;
  EXPECT_EQ(ChooseLayerwiseBits(x, short_sizes, Options()).status().code(), absl::StatusCode::kInvalidArgument);
  LayerwisePlanOptions o = Options();
  o.uniform_bits = 9;
  EXPECT_EQ(ChooseLayerwiseBits(x, kSizes, o).status().code(), absl::StatusCode::kInvalidArgument);
  Hub hub;
  HubExchange ex(&hub, 0, 1);
  std::vector<float> out(x.size());
  AllReduceOptions ao;
  ao.codec.codec = v1::CODEC_MINMAX;
  const std::vector<int> bad_bits(kSizes.size() - 1, 4);
  EXPECT_EQ(AllReduceMeanLayerwise(ex, ao, kSizes, bad_bits, 0, 16, x, absl::MakeSpan(out), nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> ew(3);
  const std::vector<int> bits(kSizes.size(), 4);
  const absl::Status s = AllReduceMeanLayerwise(ex, ao, kSizes, bits, 0, 16, x, absl::MakeSpan(out), &ew, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("worker error"), std::string::npos) << s;
  EXPECT_EQ(ex.sent(), 0) << "a refused exchange sends nothing";
}

// D = 3 replicas measure the same (exchanged) mean: the same plan; then
// exchange with it, several steps with error feedback: bit-identical means,
// and fewer bytes than the uniform 4-bit exchange of the same inputs.
TEST(LayerwisePlanTest, ReplicasChooseTheSamePlanStayIdenticalAndSendFewerBytes) {
  const AllReduceOptions ao = testing::MinMaxAllReduce(4, 64, 16, 8192);
  const int64_t n = Mix(kSizes, 0).size();
  // Step 0 (uniform) gives the mean every replica then plans on.
  std::vector<std::vector<float>> mean(kReplicas, std::vector<float>(n));
  std::vector<LayerwisePlan> plans(kReplicas);
  std::vector<std::vector<float>> ew(kReplicas), es(kReplicas);
  std::vector<AllReduceStats> uniform_stats(kReplicas), layer_stats(kReplicas);
  auto run = [&](auto body) {
    std::vector<absl::Status> st(kReplicas);
    std::vector<std::thread> th;
    for (int r = 0; r < kReplicas; ++r) th.emplace_back([&, r] { st[r] = body(r); });
    for (auto& t : th) t.join();
    for (const auto& s : st) ASSERT_TRUE(s.ok()) << s;
  };
  {
    Hub hub;
    run([&](int r) -> absl::Status {
      HubExchange ex(&hub, r, kReplicas);
      AQSWARM_RETURN_IF_ERROR(AllReduceMean(ex, ao, 0, 0, Mix(kSizes, 10 + r), absl::MakeSpan(mean[r]), nullptr,
                                            nullptr, &uniform_stats[r]));
      LayerwisePlanOptions o = Options();
      AQSWARM_ASSIGN_OR_RETURN(plans[r], ChooseLayerwiseBits(mean[r], kSizes, o));
      return absl::OkStatus();
    });
  }
  for (int r = 1; r < kReplicas; ++r) {
    EXPECT_EQ(plans[r].bits, plans[0].bits) << "replica " << r;
    EXPECT_EQ(plans[r].cost_bytes, plans[0].cost_bytes);
  }
  ASSERT_LT(plans[0].cost_bytes, plans[0].uniform_cost_bytes);
  for (uint64_t step = 1; step <= 3; ++step) {
    Hub hub;
    run([&](int r) -> absl::Status {
      HubExchange ex(&hub, r, kReplicas);
      return AllReduceMeanLayerwise(ex, ao, kSizes, plans[r].bits, step, 16, Mix(kSizes, 100 * step + r),
                                    absl::MakeSpan(mean[r]), &ew[r], &es[r], &layer_stats[r]);
    });
    for (int r = 1; r < kReplicas; ++r) {
      EXPECT_EQ(0, std::memcmp(mean[r].data(), mean[0].data(), n * sizeof(float))) << "step " << step;
    }
  }
  // The mean is close to the true one (error feedback keeps it unbiased over steps).
  std::vector<float> truth(n, 0.0f);
  for (int r = 0; r < kReplicas; ++r) {
    const std::vector<float> x = Mix(kSizes, 300 + r);
    for (int64_t i = 0; i < n; ++i) truth[i] += x[i] / kReplicas;
  }
  double err = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    err += (mean[0][i] - truth[i]) * (mean[0][i] - truth[i]);
    norm += truth[i] * truth[i];
  }
  EXPECT_LT(err, 0.05 * norm);
  EXPECT_EQ(static_cast<int64_t>(es[0].size()),
            LayerwiseOwnedElements(kSizes, plans[0].bits, 0, kReplicas, ao.bucket_elements));
  const double per_step = static_cast<double>(layer_stats[0].bytes_sent) / 3;
  std::printf("bytes per exchange (rank 0): uniform 4-bit %llu, layer-wise %.0f, bits",
              static_cast<unsigned long long>(uniform_stats[0].bytes_sent), per_step);
  for (int b : plans[0].bits) std::printf(" %d", b);
  std::printf("\n");
  EXPECT_LT(per_step, static_cast<double>(uniform_stats[0].bytes_sent));
}

}  // namespace
}  // namespace aqswarm::pipeline
