// Hostile peers on the StageLink and the GradientExchange: real
// `aqswarm stage` processes on 127.0.0.1 under mutual TLS, attacked through
// raw gRPC clients holding certificates of the same swarm CA.
// What must hold:
//   - a link is opened only by the upstream the stage was told about
//     (previous.peerName): another certificate is refused (PERMISSION_DENIED);
//     a silent connection, a wrong hello and a hello of a newer plan are
//     answered in a few words and dropped while the stage keeps waiting, and
//     the real upstream then trains with a falling loss;
//   - an upstream that floods frames or sends frames of far-future steps gets
//     RESOURCE_EXHAUSTED and the stage says which bound it hit;
//   - a GradientExchange chunk that claims a rank its certificate does not
//     hold, a duplicate of a chunk already delivered and a chunk of a step far
//     ahead are refused, and the replicas train on with a falling loss.
// Each refusal is counted in aqswarm_peer_rejected_messages_total{reason}.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/certs.h"
#include "common/file_util.h"
#include "common/metrics.h"
#include "common/subprocess.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/event_json.h"
#include "proto/exchange.grpc.pb.h"
#include "proto/link.grpc.pb.h"
#include "tests/testing/ports.h"
#include "tests/testing/stage_launch_file.h"
#include "tests/integration/small_corpus.h"

namespace aqswarm {
namespace {

namespace fs = std::filesystem;

const char* kBinary = AQSWARM_BINARY;
const char* kDataDir = AQSWARM_DATA_DIR;
constexpr int kSeq = 32, kModel = 32;

// The value of aqswarm_peer_rejected_messages_total{reason="<reason>"} in a
// Prometheus text page (0 when absent).
double Rejected(const std::string& page, const std::string& reason) {
  const std::string key = absl::StrCat("aqswarm_peer_rejected_messages_total{reason=\"", reason, "\"}");
  for (absl::string_view line : absl::StrSplit(page, '\n')) {
    if (!absl::StartsWith(line, key)) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return 0;
}

class HostileLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(fs::path(kDataDir) / "sotu") || !fs::exists(fs::path(kDataDir) / "gpt2/encoder.json")) {
      GTEST_SKIP() << "no corpus or tokenizer in " << kDataDir << ": run scripts/fetch_data.sh";
    }
    ASSERT_NO_FATAL_FAILURE(testing::MakeSmallCorpusDir("aqswarm_hostile_link_", kDataDir, 8000, &dir_));
    tls_ = (dir_ / "tls").string();
    ASSERT_TRUE(InitCaDir(tls_, {}).ok());
    for (const char* name : {"stage-a", "stage-b", "rep-0", "rep-1", "intruder"}) {
      LeafOptions leaf;
      leaf.name = name;
      leaf.ip_addresses = {"127.0.0.1"};
      ASSERT_TRUE(IssueCertInDir(tls_, leaf).ok()) << name;
    }
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) RemoveTree(dir_).IgnoreError();
  }

  // A small GPT on the corpus; `grid` sets stages, data parallelism, steps.
  std::string WriteJob(const std::string& grid) {
    const std::string job = (dir_ / "job.json").string();
    std::ofstream(job) << absl::StrCat(R"({"name":"hostile-link","seed":5,
      "model":{"seqLen":)", kSeq, R"(,"dModel":)", kModel, R"(,"nLayer":2,"nHead":2},
      "data":{"corpus":")", (dir_ / "corpus").string(), R"(","tokenizer":")", kDataDir, R"(/gpt2",
              "cacheDir":")", (dir_ / "cache").string(), R"("},
      "optimizer":{"lr":0.003,"warmupSteps":2,"gradClip":1.0},
      "microBatchSize":4,"microBatchesPerStep":2,"epochs":6,
      "compression":{"mode":"aqsgd","fwBits":3,"bwBits":6,"warmupEpochs":0,"store":"rocksdb"},
      "evalEverySteps":0,"evalBatches":1,"device":"cpu",)", grid, "}");
    return job;
  }

  // `aqswarm stage` under mTLS as `name` from <dir>/<name>-<n>.launch.json
  // (`fields` and the common ones), its stderr in <dir>/<name>-<n>.err.
  std::unique_ptr<Subprocess> StartStage(const std::string& job, const std::string& name, nlohmann::json fields) {
    fields["tls"] = {{"dir", tls_}, {"name", name}};
    fields["linkTimeout"] = "60s";
    fields["metricsListen"] = "127.0.0.1:0";
    fields["storeDir"] = (dir_ / absl::StrCat("store-", name, "-", ++started_)).string();
    const std::string launch = testing::WriteStageLaunchFile(
        (dir_ / absl::StrCat(name, "-", started_, ".launch.json")).string(), job, std::move(fields));
    auto p = Subprocess::Spawn({kBinary, "stage", "--launch=" + launch},
                               {.capture_stdout = true,
                                .stderr_path = (dir_ / absl::StrCat(name, "-", started_, ".err")).string()});
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  // The stage's listening event (its first line).
  v1::ListeningEvent Listening(Subprocess& p) {
    std::string line;
    while (p.ReadLine(&line, absl::Seconds(120)).ok()) {
      absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
      if (e.ok() && e->has_listening()) return e->listening();
    }
    ADD_FAILURE() << "no listening event";
    return {};
  }

  // Reads a stage's output to its end; returns its exit code and appends its
  // lines to `*out`.
  int Finish(Subprocess& p, std::string* out, absl::Duration timeout = absl::Seconds(150)) {
    std::string line;
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline && p.ReadLine(&line, deadline - absl::Now()).ok()) *out += line + "\n";
    absl::StatusOr<int> code = p.Wait(std::max(absl::Seconds(1), deadline - absl::Now()));
    EXPECT_TRUE(code.ok()) << code.status();
    return code.ok() ? *code : -1;
  }

  // The losses of the step events in `out`, in order.
  static std::vector<double> Losses(const std::string& out) {
    std::vector<double> losses;
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
      if (e.ok() && e->has_step()) losses.push_back(e->step().loss());
    }
    return losses;
  }
  static void ExpectLossFalls(const std::vector<double>& losses) {
    ASSERT_GE(losses.size(), 12u);
    double head = 0, tail = 0;
    for (size_t i = 0; i < 4; ++i) head += losses[i] / 4;
    for (size_t i = losses.size() - 4; i < losses.size(); ++i) tail += losses[i] / 4;
    EXPECT_LT(tail, head - 0.3) << "loss did not fall: " << head << " -> " << tail;
  }

  std::shared_ptr<grpc::Channel> Channel(int port, const std::string& as) {
    auto files = LoadTlsFiles(tls_, as);
    EXPECT_TRUE(files.ok()) << files.status();
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                               grpc::SslCredentials({files->ca_cert_pem, files->key_pem, files->cert_pem}));
  }

  // The hello stage 0 sends for this job (plan 0).
  static v1::LinkHello Hello() {
    v1::LinkHello h;
    h.set_job_name("hostile-link");
    h.set_generation(1);
    h.set_seq_len(kSeq);
    h.set_d_model(kModel);
    h.set_micro_batch_size(4);
    h.set_micro_batches_per_step(2);
    h.set_mode("aqsgd");
    h.set_fw_bits(3);
    h.set_bw_bits(6);
    h.set_m_precision("fp16");
    h.set_link_protocol(2);
    return h;
  }

  // One raw StageLink stream as `as`: sends `first` (unless empty), then
  // returns the answer (if any) and how the stream ended.
  struct Outcome {
    bool answered = false;
    v1::LinkHelloAck ack;
    grpc::Status status;
  };
  Outcome Try(int port, const std::string& as, const std::optional<v1::LinkFrame>& first) {
    auto stub = v1::StageLink::NewStub(Channel(port, as));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto stream = stub->Connect(&ctx);
    Outcome o;
    if (first.has_value()) stream->Write(*first);
    v1::LinkFrame f;
    if (stream->Read(&f) && f.has_hello_ack()) {
      o.answered = true;
      o.ack = f.hello_ack();
    }
    stream->WritesDone();
    while (stream->Read(&f)) {
    }
    o.status = stream->Finish();
    return o;
  }

  std::string Scrape(int metrics_port) {
    auto page = HttpGet(absl::StrCat("127.0.0.1:", metrics_port), "/metrics");
    EXPECT_TRUE(page.ok()) << page.status();
    return page.ok() ? *page : "";
  }

  fs::path dir_;
  std::string tls_;
  int started_ = 0;
};

v1::LinkFrame HelloFrame(const v1::LinkHello& h) {
  v1::LinkFrame f;
  *f.mutable_hello() = h;
  return f;
}

TEST_F(HostileLinkTest, SquattersAreRefusedWhileTheStageWaitsForItsUpstreamWhichThenTrains) {
  const std::string job = WriteJob(R"("stages":2,"maxSteps":24)");
  auto b = StartStage(job, "stage-b",
                      {{"stage", 1}, {"listen", "127.0.0.1:0"}, {"previous", {{"peerName", "stage-a"}}}});
  ASSERT_NE(b, nullptr);
  const v1::ListeningEvent lb = Listening(*b);
  ASSERT_GT(lb.port(), 0u);
  const int port = static_cast<int>(lb.port());

  // Another member of the swarm, with the right hello: refused by name.
  Outcome intruder = Try(port, "intruder", HelloFrame(Hello()));
  EXPECT_FALSE(intruder.answered);
  EXPECT_EQ(intruder.status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << intruder.status.error_message();
  // Connections that present the upstream's certificate but behave wrongly
  // (a stale or broken incarnation): silent, a wrong hello, a newer plan.
  const absl::Time silent_from = absl::Now();
  Outcome silent = Try(port, "stage-a", std::nullopt);
  EXPECT_FALSE(silent.answered);
  EXPECT_FALSE(silent.status.ok());
  EXPECT_LT(absl::Now() - silent_from, absl::Seconds(20));  // dropped after the hello deadline, not link_timeout
  v1::LinkHello wrong = Hello();
  wrong.set_d_model(kModel + 1);
  Outcome mismatch = Try(port, "stage-a", HelloFrame(wrong));
  ASSERT_TRUE(mismatch.answered);
  EXPECT_FALSE(mismatch.ack.accepted());
  EXPECT_FALSE(absl::StrContains(mismatch.ack.reason(), "hostile-link")) << mismatch.ack.reason();
  EXPECT_FALSE(absl::StrContains(mismatch.ack.reason(), absl::StrCat(kModel))) << mismatch.ack.reason();
  EXPECT_EQ(mismatch.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  v1::LinkHello newer = Hello();
  newer.set_plan(7);
  Outcome replan = Try(port, "stage-a", HelloFrame(newer));
  ASSERT_TRUE(replan.answered);
  EXPECT_FALSE(replan.ack.accepted());
  EXPECT_TRUE(replan.ack.retry());
  v1::LinkFrame not_hello;
  not_hello.mutable_commit()->set_step(0);
  EXPECT_EQ(Try(port, "stage-a", not_hello).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Each refusal is counted, and the stage is still up and waiting.
  const std::string page = Scrape(static_cast<int>(lb.metrics_port()));
  EXPECT_GE(Rejected(page, "link_wrong_peer"), 1);
  EXPECT_GE(Rejected(page, "link_hello_silent"), 1);
  EXPECT_GE(Rejected(page, "link_hello_mismatch"), 1);
  EXPECT_GE(Rejected(page, "link_plan_newer"), 1);
  EXPECT_GE(Rejected(page, "link_not_hello"), 1);

  // The real upstream connects and both stages train to the end.
  auto a = StartStage(
      job, "stage-a",
      {{"stage", 0},
       {"next", {{"stageLinkAddress", absl::StrCat("127.0.0.1:", port)}, {"peerName", "stage-b"}}}});
  ASSERT_NE(a, nullptr);
  std::string out_a, out_b;
  std::thread finish_a([&] { EXPECT_EQ(Finish(*a, &out_a), 0) << out_a; });
  EXPECT_EQ(Finish(*b, &out_b), 0) << out_b;
  finish_a.join();
  ExpectLossFalls(Losses(out_b));
}

TEST_F(HostileLinkTest, AnUpstreamThatFloodsOrRunsFarAheadIsCutOffWithTheBoundNamed) {
  const std::string job = WriteJob(R"("stages":2,"maxSteps":24)");
  for (const bool flood : {true, false}) {
    SCOPED_TRACE(flood ? "flood" : "far ahead");
    auto b = StartStage(job, "stage-b",
                        {{"stage", 1}, {"listen", "127.0.0.1:0"}, {"previous", {{"peerName", "stage-a"}}}});
    ASSERT_NE(b, nullptr);
    const int port = static_cast<int>(Listening(*b).port());
    auto stub = v1::StageLink::NewStub(Channel(port, "stage-a"));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto stream = stub->Connect(&ctx);
    ASSERT_TRUE(stream->Write(HelloFrame(Hello())));
    v1::LinkFrame f;
    ASSERT_TRUE(stream->Read(&f));
    ASSERT_TRUE(f.hello_ack().accepted()) << f.hello_ack().reason();
    v1::LinkFrame bad;
    if (flood) {
      bad.mutable_commit()->set_step(0);
      for (int i = 0; i < 10'000 && stream->Write(bad); ++i) {
      }
    } else {
      bad.mutable_commit()->set_step(1'000'000);
      stream->Write(bad);
    }
    stream->WritesDone();
    while (stream->Read(&f)) {
    }
    const grpc::Status end = stream->Finish();
    EXPECT_EQ(end.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << end.error_message();
    EXPECT_TRUE(absl::StrContains(end.error_message(), flood ? "frames queued" : "steps ahead"))
        << end.error_message();
    // The stage ends with the refusal named (this upstream is the one its
    // assignment names: nobody else can take its place).
    std::string out;
    EXPECT_NE(Finish(*b, &out), 0);
    EXPECT_TRUE(absl::StrContains(out, flood ? "frames queued" : "steps ahead")) << out;
  }
}

TEST_F(HostileLinkTest, SpoofedDuplicateAndFarFutureExchangeChunksAreRefusedAndTheReplicasTrainOn) {
  const std::string job =
      WriteJob(R"("stages":1,"dataParallel":2,"maxSteps":30,
                  "dp":{"optimizer":"quantized_adam","warmupSteps":3,"bits":4,"bucketSize":512})");
  const int p0 = testing::UniqueLoopbackPort(), p1 = testing::UniqueLoopbackPort();
  const nlohmann::json replicas = {
      {{"pipeline", 0}, {"gradientExchangeAddress", absl::StrCat("127.0.0.1:", p0)}, {"peerName", "rep-0"}},
      {{"pipeline", 1}, {"gradientExchangeAddress", absl::StrCat("127.0.0.1:", p1)}, {"peerName", "rep-1"}}};
  auto r0 = StartStage(job, "rep-0",
                       {{"stage", 0},
                        {"pipeline", 0},
                        {"exchangeListen", absl::StrCat("127.0.0.1:", p0)},
                        {"replicas", replicas}});
  auto r1 = StartStage(job, "rep-1",
                       {{"stage", 0},
                        {"pipeline", 1},
                        {"exchangeListen", absl::StrCat("127.0.0.1:", p1)},
                        {"replicas", replicas}});
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  const v1::ListeningEvent l0 = Listening(*r0);
  Listening(*r1);
  // Wait until replica 0 has finished a step: its chunks of that step from
  // replica 1 have been delivered.
  std::string out0;
  uint64_t done_step = 0;
  bool stepped = false;
  std::string line;
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (!stepped && absl::Now() < deadline && r0->ReadLine(&line, deadline - absl::Now()).ok()) {
    out0 += line + "\n";
    absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
    if (e.ok() && e->has_step()) {
      stepped = true;
      done_step = e->step().step();
    }
  }
  ASSERT_TRUE(stepped) << out0;

  auto push = [&](const std::string& as, uint64_t step) {
    auto stub = v1::GradientExchange::NewStub(Channel(p0, as));
    v1::ExchangeChunk c;
    c.set_group("hostile-link/stage-0/gen-0/plan-0");
    c.set_step(step);
    c.set_phase(v1::ExchangeChunk::SCATTER);
    c.set_from_rank(1);
    c.mutable_tensor()->set_num_elements(1);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ExchangeAck ack;
    return stub->Push(&ctx, c, &ack);
  };
  // A member of the swarm that is not replica 1 claims its rank.
  const grpc::Status spoofed = push("intruder", done_step + 1);
  EXPECT_EQ(spoofed.error_code(), grpc::StatusCode::PERMISSION_DENIED) << spoofed.error_message();
  // Replica 1's certificate (a buggy replica): a second copy of a chunk it
  // already delivered, and a chunk of a step far ahead.
  const grpc::Status dup = push("rep-1", done_step);
  EXPECT_EQ(dup.error_code(), grpc::StatusCode::ALREADY_EXISTS) << dup.error_message();
  const grpc::Status far = push("rep-1", done_step + 1'000'000);
  EXPECT_EQ(far.error_code(), grpc::StatusCode::OUT_OF_RANGE) << far.error_message();
  const std::string page = Scrape(static_cast<int>(l0.metrics_port()));
  EXPECT_GE(Rejected(page, "dp_wrong_peer"), 1);
  EXPECT_GE(Rejected(page, "dp_duplicate_chunk"), 1);
  EXPECT_GE(Rejected(page, "dp_step_out_of_window"), 1);

  // Both replicas train on to the end, the loss falling.
  std::string out1;
  std::thread finish1([&] { EXPECT_EQ(Finish(*r1, &out1), 0) << out1; });
  EXPECT_EQ(Finish(*r0, &out0), 0) << out0;
  finish1.join();
  ExpectLossFalls(Losses(out0));
}

}  // namespace
}  // namespace aqswarm
