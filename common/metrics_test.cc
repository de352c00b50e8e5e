#include "common/metrics.h"

#include <pthread.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace aqswarm {
namespace {

TEST(MetricsTest, CatalogListsDeclaredMetricsOnce) {
  DeclareCounter("aqswarm_test_things_total", "Things.", {"kind"});
  DeclareCounter("aqswarm_test_things_total", "Things.", {"kind"});  // same family again
  DeclareGauge("aqswarm_test_level_bytes", "Level.");
  int found = 0;
  for (const MetricInfo& m : MetricCatalog()) {
    if (m.name == "aqswarm_test_things_total") {
      ++found;
      EXPECT_EQ(m.type, "counter");
      EXPECT_EQ(m.labels, std::vector<std::string>{"kind"});
    }
  }
  EXPECT_EQ(found, 1);
}

TEST(MetricsTest, ServerServesRegistryAndRunsSamplersBeforeEachScrape) {
  auto& level = DeclareGauge("aqswarm_test_sampled_bytes", "Sampled level.").Add({});
  int calls = 0;
  auto sampler = std::make_unique<MetricsSampler>([&] { level.Set(++calls * 100); });
  DeclareCounter("aqswarm_test_events_total", "Events.", {"kind"}).Add({{"kind", "a"}}).Increment(3);
  auto server = MetricsServer::Start("127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  auto body = HttpGet(absl::StrCat("127.0.0.1:", (*server)->port()), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_NE(body->find("aqswarm_test_events_total{kind=\"a\"} 3"), std::string::npos) << *body;
  EXPECT_NE(body->find("aqswarm_test_sampled_bytes 100"), std::string::npos) << *body;
  sampler.reset();  // no longer called
  body = HttpGet(absl::StrCat("127.0.0.1:", (*server)->port()), "/metrics");
  ASSERT_TRUE(body.ok());
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(HttpGet(absl::StrCat("127.0.0.1:", (*server)->port()), "/nothing").ok());
}

TEST(MetricsTest, BusyPortIsAnError) {
  auto a = MetricsServer::Start("127.0.0.1:0");
  ASSERT_TRUE(a.ok());
  auto b = MetricsServer::Start(absl::StrCat("127.0.0.1:", (*a)->port()));
  EXPECT_FALSE(b.ok());
}

TEST(MetricsTest, ThreadsNeverGetLessThanOneMebibyteOfStack) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 100 << 10), 0);
  size_t size = 0;
  pthread_attr_getstacksize(&attr, &size);
  EXPECT_GE(size, kMinThreadStackBytes);
  pthread_attr_destroy(&attr);
}

}  // namespace
}  // namespace aqswarm
