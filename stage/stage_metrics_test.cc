// Peer metrics end to end inside a torch-linked binary: the exposer must
// start with OpenBLAS loaded (docs/design/STACK.md trap 2) and serve what StageMetrics
// sampled from real links, a real AQ-SGD sender and a store.
#include "stage/stage_metrics.h"

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/metrics.h"
#include "gtest/gtest.h"
#include "stage/link_transport.h"
#include "pipeline/torch_info.h"
#include "storage/memory_message_store.h"

namespace aqswarm::stage {
namespace {

// Value of the first sample of `name` whose labels contain every `labels`
// entry (`key="value"`), or -1.
double Sample(const std::string& text, const std::string& name, const std::vector<std::string>& labels = {}) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, name) || line.size() <= name.size() ||
        (line[name.size()] != '{' && line[name.size()] != ' ')) {
      continue;
    }
    bool all = true;
    for (const auto& l : labels) all &= absl::StrContains(line, l);
    if (!all) continue;
    double v = -1;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return -1;
}

TEST(PeerMetricsTest, ExposerServesInsideATorchLinkedProcess) {
  // Make sure torch (and with it the system BLAS) is loaded and used.
  ASSERT_FALSE(pipeline::TorchInfo().empty());
  std::ifstream maps("/proc/self/maps");
  std::stringstream all;
  all << maps.rdbuf();
  if (all.str().find("blas") == std::string::npos) {
    GTEST_LOG_(WARNING) << "no BLAS library mapped: this run does not exercise the OpenBLAS stack trap";
  }
  auto server = MetricsServer::Start("127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string addr = absl::StrCat("127.0.0.1:", (*server)->port());

  // A middle stage (1 of 3): real links both ways, a real AQ-SGD sender.
  auto link_server = StageLinkServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(link_server.ok()) << link_server.status();
  auto down = LinkConnection::Dial(absl::StrCat("127.0.0.1:", (*link_server)->port()), {}, absl::Seconds(10));
  ASSERT_TRUE(down.ok()) << down.status();
  auto up = (*link_server)->Accept(absl::Seconds(10));
  ASSERT_TRUE(up.ok()) << up.status();
  auto store = storage::MemoryMessageStore::Create({});
  ASSERT_TRUE(store.ok());
  pipeline::LinkEndpointOptions lo;
  lo.link = {{0, 1}, 1, 4, 16, RowPrecision::kFloat16};
  lo.micro_batch = 2;
  lo.codec.quantizer.bits = 4;
  lo.codec.warmup_epochs = 0;
  auto sender = pipeline::ActivationSender::Create(store->get(), lo);
  ASSERT_TRUE(sender.ok()) << sender.status();
  ASSERT_TRUE((*sender)->StartEpoch({7, 8, 7, 8}).ok());

  v1::JobSpec job;
  job.set_name("metrics-test");
  StageMetrics metrics(job, 1, 0);
  metrics.SetSources({.down = down->get(), .up = *up, .sender = sender->get(), .store = store->get()});
  std::vector<float> acts(2 * 4 * 16);
  for (int step = 0; step < 2; ++step) {
    for (size_t i = 0; i < acts.size(); ++i) acts[i] = std::sin(0.1 * i + step);
    v1::LinkFrame f;
    ASSERT_TRUE((*sender)->Encode(step, 0, 0, {7, 8}, acts, f.mutable_activations()).ok());
    ASSERT_TRUE((*down)->Send(f).ok());
    ASSERT_TRUE((*up)->Receive([](const v1::LinkFrame& x) { return x.has_activations(); }, absl::Seconds(10)).ok());
    pipeline::GradientCodecStats g{.tensors = 1, .payload_bytes = 40, .raw_bytes = 400, .error_sq = 1, .signal_sq = 100};
    metrics.ObserveStep({.step = step, .has_loss = true, .loss = 2.5, .tokens = 128, .step_seconds = 0.5,
                         .compute_seconds = 0.3, .network_wait_seconds = 0.1, .dp_seconds = 0.1,
                         .dp_robust_dropped = static_cast<uint64_t>(step), .dp_robust_clipped = 3u * step},
                        g);
  }
  CountRejectedMessage(RejectReason::kActivationInvalid);

  auto body = HttpGet(addr, "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  const std::string& t = *body;
  const std::string fw = "link=\"p0:s1-s2\"", bw = "link=\"p0:s0-s1\"";
  EXPECT_GT(Sample(t, "aqswarm_link_bytes_total", {fw, "kind=\"activation\"", "direction=\"sent\""}), 0) << t;
  EXPECT_GT(Sample(t, "aqswarm_link_bytes_total", {bw, "kind=\"activation\"", "direction=\"received\""}), 0);
  EXPECT_GT(Sample(t, "aqswarm_link_raw_bytes_total", {fw, "kind=\"activation\""}), 0);
  EXPECT_GT(Sample(t, "aqswarm_link_compression_ratio", {fw, "kind=\"activation\""}), 0);
  const double err = Sample(t, "aqswarm_link_quantization_error_ratio", {fw, "kind=\"activation\""});
  EXPECT_GT(err, 0);
  EXPECT_LT(err, 0.5);
  EXPECT_DOUBLE_EQ(Sample(t, "aqswarm_link_quantization_error_ratio", {bw, "kind=\"gradient\""}), 0.1);
  EXPECT_EQ(Sample(t, "aqswarm_aqsgd_rows_sent_total", {fw, "type=\"full\""}), 2);   // step 0: unseen
  EXPECT_EQ(Sample(t, "aqswarm_aqsgd_rows_sent_total", {fw, "type=\"delta\""}), 2);  // step 1
  EXPECT_EQ(Sample(t, "aqswarm_aqsgd_resent_rows_total", {fw, "role=\"sender\""}), 0);
  EXPECT_GE(Sample(t, "aqswarm_store_hits_total"), 0);
  EXPECT_GE(Sample(t, "aqswarm_store_operations_total", {"op=\"get\""}), 0);
  EXPECT_DOUBLE_EQ(Sample(t, "aqswarm_step_phase_seconds_total", {"phase=\"network_wait\""}), 0.2);
  EXPECT_EQ(Sample(t, "aqswarm_step_duration_seconds_count"), 2);
  EXPECT_EQ(Sample(t, "aqswarm_steps_total"), 2);
  EXPECT_EQ(Sample(t, "aqswarm_train_loss"), 2.5);
  EXPECT_EQ(Sample(t, "aqswarm_train_tokens_per_second"), 256);
  EXPECT_EQ(Sample(t, "aqswarm_peer_info", {"job=\"metrics-test\"", "stage=\"1\""}), 1);
  EXPECT_EQ(Sample(t, "aqswarm_peer_rejected_messages_total", {"reason=\"activation_invalid\""}), 1);
  EXPECT_EQ(Sample(t, "aqswarm_peer_rejected_messages_total", {"reason=\"dp_mailbox_full\""}), 0);
  EXPECT_EQ(Sample(t, "aqswarm_peer_rejected_messages_total", {"reason=\"activation_nonfinite\""}), 0);
  EXPECT_EQ(Sample(t, "aqswarm_dp_robust_contributions_total", {"link=\"s1:dp\"", "action=\"dropped\""}), 1);
  EXPECT_EQ(Sample(t, "aqswarm_dp_robust_contributions_total", {"link=\"s1:dp\"", "action=\"clipped\""}), 3);

  ASSERT_TRUE((*sender)->Close().ok());
  (*down)->CloseSend();
  (*link_server)->Shutdown(absl::Seconds(1));
}

TEST(PeerMetricsTest, EveryPeerMetricIsInTheCatalogue) {
  DeclarePeerMetrics();
  std::set<std::string> names;
  for (const MetricInfo& m : MetricCatalog()) names.insert(m.name);
  for (const char* n : {"aqswarm_link_bytes_total", "aqswarm_link_compression_ratio",
                        "aqswarm_link_quantization_error_ratio", "aqswarm_aqsgd_rows_sent_total",
                        "aqswarm_store_evictions_total", "aqswarm_step_phase_seconds_total", "aqswarm_train_loss",
                        "aqswarm_peer_rejected_messages_total"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  for (const std::string& n : names) {
    EXPECT_TRUE(absl::StartsWith(n, "aqswarm_")) << n;
  }
}

}  // namespace
}  // namespace aqswarm::stage
