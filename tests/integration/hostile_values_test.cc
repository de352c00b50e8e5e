// Poisoned values on a live pipeline: real `aqswarm
// stage` processes on 127.0.0.1, their StageLink relayed through a proxy in
// this test that plays a hostile (or broken) upstream: it forwards the real
// stage 0's frames to stage 1 and rewrites one of them. What must hold:
//   - stage 1 refuses the poisoned frame with a clear error (the step, the
//     micro-batch, the sample, "non-finite") before anything is stored;
//   - its RocksDB message store holds no NaN/Inf afterwards;
//   - the honest stages, restarted on the same stores without the proxy,
//     finish the run: the loss falls and both ends of the link end with
//     bit-identical m(xi) rows (the refused row is repaired by a FULL
//     resend, nothing is lost).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/subprocess.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/event_json.h"
#include "proto/link.grpc.pb.h"
#include "storage/rocksdb_message_store.h"
#include "tests/integration/small_corpus.h"
#include "tests/testing/stage_launch_file.h"

namespace aqswarm {
namespace {

namespace fs = std::filesystem;

const char* kBinary = AQSWARM_BINARY;
const char* kDataDir = AQSWARM_DATA_DIR;
constexpr int kSeq = 32, kModel = 32;

// A StageLink relay: each stream from the upstream stage is forwarded to
// `target` and back; `rewrite` may change a frame on its way down (returns
// whether it did).
class LinkProxy final : public v1::StageLink::Service {
 public:
  LinkProxy(std::string target, std::function<bool(v1::LinkFrame*)> rewrite,
            std::function<bool(v1::LinkFrame*)> rewrite_up = [](v1::LinkFrame*) { return false; })
      : target_(std::move(target)), rewrite_(std::move(rewrite)), rewrite_up_(std::move(rewrite_up)) {}

  grpc::Status Connect(grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* down) override {
    auto stub = v1::StageLink::NewStub(grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext cctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> up = stub->Connect(&cctx);
    std::thread back([&] {
      v1::LinkFrame f;
      while (up->Read(&f)) {
        if (rewrite_up_(&f)) ++rewritten_;
        if (!down->Write(f)) break;
      }
      ctx->TryCancel();  // the downstream stage is gone: end the upstream's stream too
    });
    v1::LinkFrame f;
    while (down->Read(&f)) {
      if (rewrite_(&f)) ++rewritten_;
      if (!up->Write(f)) break;
    }
    up->WritesDone();
    back.join();
    cctx.TryCancel();
    up->Finish().IgnoreError();
    return grpc::Status::OK;
  }
  int rewritten() const { return rewritten_.load(); }

 private:
  const std::string target_;
  const std::function<bool(v1::LinkFrame*)> rewrite_;
  const std::function<bool(v1::LinkFrame*)> rewrite_up_;  // frames on their way up (gradients)
  std::atomic<int> rewritten_{0};
};

class HostileValuesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(fs::path(kDataDir) / "sotu") || !fs::exists(fs::path(kDataDir) / "gpt2/encoder.json")) {
      GTEST_SKIP() << "no corpus or tokenizer in " << kDataDir << ": run scripts/fetch_data.sh";
    }
    ASSERT_NO_FATAL_FAILURE(testing::MakeSmallCorpusDir("aqswarm_hostile_values_", kDataDir, 6000, &dir_));
    // Two stages, AQ-SGD with m(xi) in RocksDB; epoch 1 sends DELTA rows.
    job_ = (dir_ / "job.json").string();
    std::ofstream(job_) << absl::StrCat(R"({"name":"hostile-values","seed":5,
      "model":{"seqLen":)", kSeq, R"(,"dModel":)", kModel, R"(,"nLayer":2,"nHead":2},
      "data":{"corpus":")", (dir_ / "corpus").string(), R"(","tokenizer":")", kDataDir, R"(/gpt2",
              "cacheDir":")", (dir_ / "cache").string(), R"("},
      "optimizer":{"lr":0.003,"warmupSteps":2,"gradClip":1.0},
      "microBatchSize":4,"microBatchesPerStep":2,"epochs":3,
      "compression":{"mode":"aqsgd","fwBits":3,"bwBits":6,"warmupEpochs":0,"store":"rocksdb"},
      "stages":2,"evalEverySteps":0,"evalBatches":1,"device":"cpu"})");
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) RemoveTree(dir_).IgnoreError();
  }

  std::unique_ptr<Subprocess> StartStage(int stage, const std::string& next, const std::string& log) {
    nlohmann::json fields = {
        {"stage", stage}, {"storeDir", (dir_ / absl::StrCat("store-", stage)).string()}, {"linkTimeout", "30s"}};
    if (stage > 0) fields["listen"] = "127.0.0.1:0";
    if (!next.empty()) fields["next"] = {{"stageLinkAddress", next}};
    const std::string launch = testing::WriteStageLaunchFile(
        (dir_ / absl::StrCat("launch-", stage, "-", ++started_, ".json")).string(), job_, std::move(fields));
    auto p = Subprocess::Spawn({kBinary, "stage", "--launch=" + launch},
                               {.capture_stdout = true, .stderr_path = (dir_ / log).string()});
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  // The StageLink port from a stage's listening event (its first line).
  int ListeningPort(Subprocess& p) {
    std::string line;
    while (p.ReadLine(&line, absl::Seconds(120)).ok()) {
      absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
      if (e.ok() && e->has_listening()) return static_cast<int>(e->listening().port());
    }
    return 0;
  }

  // Reads a stage's output to its end; returns its exit code and appends its
  // lines to `*out`.
  int Finish(Subprocess& p, std::string* out, absl::Duration timeout = absl::Seconds(120)) {
    std::string line;
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline && p.ReadLine(&line, deadline - absl::Now()).ok()) *out += line + "\n";
    absl::StatusOr<int> code = p.Wait(std::max(absl::Seconds(1), deadline - absl::Now()));
    EXPECT_TRUE(code.ok()) << code.status();
    return code.ok() ? *code : -1;
  }

  std::string ReadFile(const std::string& name) {
    std::ifstream in(dir_ / name);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  // Every m(xi) row the link's store `stage` holds (samples 0..999), by sample.
  std::map<uint64_t, std::vector<float>> StoredRows(int stage) {
    std::map<uint64_t, std::vector<float>> rows;
    auto store = storage::RocksDbMessageStore::Open({.path = (dir_ / absl::StrCat("store-", stage)).string()});
    EXPECT_TRUE(store.ok()) << store.status();
    if (!store.ok()) return rows;
    storage::LinkSpec spec;
    spec.link = {0, 0};
    spec.generation = 1;
    spec.rows = kSeq;
    spec.cols = kModel;
    spec.precision = RowPrecision::kFloat16;
    for (uint64_t id = 0; id < 1000; ++id) {
      std::vector<float> r(kSeq * kModel);
      std::vector<absl::Span<float>> out = {absl::MakeSpan(r)};
      std::vector<storage::RowRead> reads(1);
      const uint64_t ids[] = {id};
      EXPECT_TRUE((*store)->GetBatch(spec, ids, out, absl::MakeSpan(reads)).ok());
      if (reads[0].status.ok()) rows[id] = std::move(r);
    }
    return rows;
  }

  // Losses stage 0 reported, in step order.
  static std::vector<double> Losses(const std::string& out) {
    std::vector<double> losses;
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
      if (e.ok() && e->has_step()) losses.push_back(e->step().loss());
    }
    return losses;
  }

  fs::path dir_;
  std::string job_;
  int started_ = 0;  // stages started (their launch files' names)
};

// The first DELTA activation batch: its first row's tensor becomes raw
// float32 values with a NaN (a valid message otherwise).
bool PoisonFirstDelta(v1::LinkFrame* f, std::atomic<bool>* done, uint64_t* step, uint32_t* mb, uint64_t* sample) {
  if (done->load() || !f->has_activations() || f->activations().eval() || f->activations().resend()) return false;
  v1::AqsgdRow* row = f->mutable_activations()->mutable_rows(0);
  if (row->kind() != v1::AqsgdRow::KIND_DELTA) return false;
  v1::EncodedTensor& t = *row->mutable_tensor();
  const uint64_t n = t.num_elements();
  t.set_codec(v1::CODEC_RAW_F32);
  t.set_bits(32);
  t.clear_scales();
  t.clear_checksum();
  t.clear_bucket_size();
  std::vector<float> values(n, 0.01f);
  values[5] = std::nanf("");
  t.set_payload(std::string(reinterpret_cast<const char*>(values.data()), 4 * n));
  *step = f->activations().step();
  *mb = f->activations().micro_batch();
  *sample = row->sample_id();
  done->store(true);
  return true;
}

TEST_F(HostileValuesTest, NaNActivationsFromAHostileUpstreamAreRefusedAndNothingPoisonedIsStored) {
  // 1. Stage 1 behind the proxy; stage 0 dials the proxy.
  std::unique_ptr<Subprocess> s1 = StartStage(1, "", "stage-1.err");
  ASSERT_NE(s1, nullptr);
  const int port1 = ListeningPort(*s1);
  ASSERT_GT(port1, 0);
  std::atomic<bool> poisoned{false};
  uint64_t step = 0, sample = 0;
  uint32_t mb = 0;
  LinkProxy proxy(absl::StrCat("127.0.0.1:", port1),
                  [&](v1::LinkFrame* f) { return PoisonFirstDelta(f, &poisoned, &step, &mb, &sample); });
  int proxy_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &proxy_port);
  builder.RegisterService(&proxy);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_GT(proxy_port, 0);
  std::unique_ptr<Subprocess> s0 = StartStage(0, absl::StrCat("127.0.0.1:", proxy_port), "stage-0.err");
  ASSERT_NE(s0, nullptr);
  std::string out0, out1;
  const int code1 = Finish(*s1, &out1);
  const int code0 = Finish(*s0, &out0);
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  ASSERT_EQ(proxy.rewritten(), 1) << "no DELTA batch went through the proxy\n" << out0;
  // 2. Stage 1 refused it, naming the step, the micro-batch, the sample and why.
  EXPECT_NE(code1, 0);
  const std::string err1 = out1 + ReadFile("stage-1.err");
  EXPECT_TRUE(absl::StrContains(err1, absl::StrCat("step ", step, " micro-batch ", mb, " activations"))) << err1;
  EXPECT_TRUE(absl::StrContains(err1, absl::StrCat("sample ", sample))) << err1;
  EXPECT_TRUE(absl::StrContains(err1, "non-finite")) << err1;
  EXPECT_NE(code0, 0) << "stage 0 lost its downstream: it fails too";
  // 3. Nothing NaN reached stage 1's store.
  const std::map<uint64_t, std::vector<float>> rows = StoredRows(1);
  ASSERT_FALSE(rows.empty());
  for (const auto& [id, r] : rows) {
    for (float v : r) ASSERT_TRUE(std::isfinite(v)) << "sample " << id << " holds a non-finite value";
  }
  // 4. The honest stages, restarted on the same stores, train to the end:
  // the refused row's DELTA no longer matches, is resent FULL, and both ends
  // agree again.
  s1 = StartStage(1, "", "stage-1b.err");
  ASSERT_NE(s1, nullptr);
  const int port1b = ListeningPort(*s1);
  ASSERT_GT(port1b, 0);
  s0 = StartStage(0, absl::StrCat("127.0.0.1:", port1b), "stage-0b.err");
  ASSERT_NE(s0, nullptr);
  std::string again0, again1;
  EXPECT_EQ(Finish(*s1, &again1), 0) << again1 << ReadFile("stage-1b.err");
  EXPECT_EQ(Finish(*s0, &again0), 0) << again0 << ReadFile("stage-0b.err");
  const std::vector<double> loss = Losses(again0);
  ASSERT_GE(loss.size(), 4u) << again0;
  for (double l : loss) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(loss.back(), loss.front()) << again0;
  const std::map<uint64_t, std::vector<float>> sent = StoredRows(0), got = StoredRows(1);
  ASSERT_EQ(sent.size(), got.size());
  for (const auto& [id, r] : sent) {
    ASSERT_TRUE(got.count(id)) << "sample " << id;
    EXPECT_EQ(0, std::memcmp(r.data(), got.at(id).data(), r.size() * 4)) << "sample " << id;
  }
}

// Norms from a hostile neighbour: a NaN committed total (from upstream) and
// a negative partial norm (from downstream) would turn gradient clipping
// off; each is refused by the stage that receives it, naming the field.
TEST_F(HostileValuesTest, NaNOrNegativeGradientNormsAreRefused) {
  struct Case {
    const char* field;
    int refusing_stage;
    std::function<bool(v1::LinkFrame*)> down, up;
  };
  auto never = [](v1::LinkFrame*) { return false; };
  std::atomic<bool> once{false};
  const Case cases[] = {
      {"committed total_grad_sq_norm", 1,
       [&](v1::LinkFrame* f) {
         if (!f->has_commit() || once.exchange(true)) return false;
         f->mutable_commit()->set_total_grad_sq_norm(std::nan(""));
         return true;
       },
       never},
      {"partial_grad_sq_norm from downstream", 0, never,
       [&](v1::LinkFrame* f) {
         if (!f->has_gradients() || f->gradients().partial_grad_sq_norm() == 0 || once.exchange(true)) return false;
         f->mutable_gradients()->set_partial_grad_sq_norm(-5);
         return true;
       }},
  };
  for (const Case& c : cases) {
    once = false;
    std::unique_ptr<Subprocess> s1 = StartStage(1, "", "stage-1.err");
    ASSERT_NE(s1, nullptr);
    const int port1 = ListeningPort(*s1);
    ASSERT_GT(port1, 0);
    LinkProxy proxy(absl::StrCat("127.0.0.1:", port1), c.down, c.up);
    int proxy_port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &proxy_port);
    builder.RegisterService(&proxy);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    ASSERT_GT(proxy_port, 0);
    std::unique_ptr<Subprocess> s0 = StartStage(0, absl::StrCat("127.0.0.1:", proxy_port), "stage-0.err");
    ASSERT_NE(s0, nullptr);
    std::string out[2];
    const int code1 = Finish(*s1, &out[1]);
    const int code0 = Finish(*s0, &out[0]);
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    ASSERT_EQ(proxy.rewritten(), 1) << c.field;
    EXPECT_NE(c.refusing_stage == 0 ? code0 : code1, 0) << c.field;
    const std::string err = out[c.refusing_stage] + ReadFile(absl::StrCat("stage-", c.refusing_stage, ".err"));
    EXPECT_TRUE(absl::StrContains(err, c.field)) << err;
    EXPECT_TRUE(absl::StrContains(err, "refused")) << err;
  }
}

// Data parallelism with a hostile replica: `aqswarm pipeline` runs one
// stage x 4 replicas; the replica of rank 3 corrupts every float32
// contribution it sends (the test-only fault injection of
// pipeline/dp_allreduce.cc, AQSWARM_TEST_FAULT_DP_SCATTER).
class HostileReplicaTest : public HostileValuesTest {
 protected:
  // Runs the job with dp = {dp} under `fault`; returns the exit code, the
  // launcher's output in output_ and the step losses.
  int RunGrid(const std::string& name, const std::string& dp, const std::string& fault, std::vector<double>* loss) {
    const std::string job = (dir_ / (name + ".json")).string();
    std::ifstream in(job_);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string stages = R"("stages":2,)";
    text.replace(text.find(stages), stages.size(),
                 absl::StrCat(R"("stages":1,"dataParallel":4,"maxSteps":10,"dp":{)", dp, "},"));
    const std::string epochs = R"("epochs":3,)";  // the small corpus is ~1 step an epoch with 4 replicas
    text.replace(text.find(epochs), epochs.size(), R"("epochs":20,)");
    std::ofstream(job) << text;
    const std::string out = (dir_ / name).string();
    ::setenv("AQSWARM_TEST_FAULT_DP_SCATTER", fault.c_str(), 1);
    auto p = Subprocess::Spawn({kBinary, "pipeline", "--job=" + job, "--out_dir=" + out},
                               {.capture_stdout = true, .stderr_path = (dir_ / (name + ".err")).string()});
    ::unsetenv("AQSWARM_TEST_FAULT_DP_SCATTER");
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return -1;
    output_.clear();
    const int code = Finish(**p, &output_, absl::Seconds(150));
    for (const auto& e : fs::directory_iterator(out)) {
      if (e.path().extension() == ".log") output_ += ReadFile(fs::relative(e.path(), dir_).string());
    }
    loss->clear();
    std::ifstream csv(fs::path(out) / "metrics.csv");
    std::string line;
    std::getline(csv, line);  // header
    std::string losses;
    while (std::getline(csv, line)) {
      std::vector<std::string> cols = absl::StrSplit(line, ',');
      if (cols.size() > 2) loss->push_back(std::stod(cols[2]));
      if (cols.size() > 2) absl::StrAppend(&losses, " ", cols[2]);
    }
    std::cout << name << " (dp " << dp << ", fault " << fault << "): exit " << code << ", losses" << losses << "\n";
    return code;
  }
  int Identical() const {
    int n = 0;
    for (size_t pos = 0; (pos = output_.find("replicas identical", pos)) != std::string::npos; ++pos) ++n;
    return n;
  }
  std::string output_;
};

// Contributions x(-1000): the plain mean follows the hostile replica (the
// loss does not fall); under dp.robust centered_clip the honest three win,
// the loss falls and the replicas stay bit-identical at every step.
TEST_F(HostileReplicaTest, AReplicaSendingScaledUpdatesIsClippedAndTrainingConverges) {
  std::vector<double> robust, plain;
  ASSERT_EQ(RunGrid("robust", R"("robust":"centered_clip")", "3:-1000", &robust), 0) << output_;
  EXPECT_TRUE(absl::StrContains(output_, "TEST FAULT INJECTION")) << output_;
  EXPECT_EQ(Identical(), 10) << output_;
  ASSERT_EQ(robust.size(), 10u) << output_;
  EXPECT_LT(robust.back(), robust.front() - 0.2) << output_;
  ASSERT_EQ(RunGrid("plain", "", "3:-1000", &plain), 0) << output_;
  ASSERT_EQ(plain.size(), 10u) << output_;
  EXPECT_GT(plain.back(), robust.back() + 0.2) << "without dp.robust the hostile replica should win\n" << output_;
}

// NaN contributions: without dp.robust every honest owner refuses them (the
// run fails naming the non-finite value); under dp.robust clip_norm they
// are dropped, training converges and no replica's parameters go NaN.
TEST_F(HostileReplicaTest, AReplicaSendingNaNIsRefusedOrDroppedNeverApplied) {
  std::vector<double> robust, plain;
  ASSERT_EQ(RunGrid("robust", R"("robust":"clip_norm")", "3:nan", &robust), 0) << output_;
  EXPECT_EQ(Identical(), 10) << output_;
  ASSERT_EQ(robust.size(), 10u) << output_;
  for (double l : robust) EXPECT_TRUE(std::isfinite(l)) << output_;
  EXPECT_LT(robust.back(), robust.front() - 0.2) << output_;
  EXPECT_NE(RunGrid("plain", "", "3:nan", &plain), 0) << output_;
  EXPECT_TRUE(absl::StrContains(output_, "non-finite")) << output_;
}

}  // namespace
}  // namespace aqswarm
