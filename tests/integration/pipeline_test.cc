// End-to-end: the real `aqswarm` binary, real processes, real gRPC over
// loopback, real RocksDB stores.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "proto/event_json.h"
#include "nlohmann/json.hpp"
#include "storage/rocksdb_message_store.h"
#include "tests/integration/test_device.h"
#include "tests/testing/stage_launch_file.h"

namespace aqswarm {
namespace {

namespace fs = std::filesystem;
using ::aqswarm::testing::WriteStageLaunchFile;

const char* kBinary = AQSWARM_BINARY;

// The StageLink port of a stage's first line (its listening event); 0 if it is not one.
int ListeningPort(const std::string& line) {
  absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
  EXPECT_TRUE(e.ok() && e->has_listening()) << line;
  return e.ok() ? static_cast<int>(e->listening().port()) : 0;
}
const char* kDataDir = AQSWARM_DATA_DIR;

class PipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("aqswarm_it_", ::getpid(), "_",
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    aqswarm::RemoveTree(dir_).IgnoreError();
    fs::create_directories(dir_ / "corpus");
    ASSERT_TRUE(fs::exists(fs::path(kDataDir) / "gpt2/encoder.json"))
        << "GPT-2 tokenizer files missing: run scripts/fetch_data.sh";
    // A small real corpus: the first 9 kB of the first State of the Union.
    std::vector<fs::path> files;
    for (auto& e : fs::directory_iterator(fs::path(kDataDir) / "sotu")) files.push_back(e.path());
    ASSERT_FALSE(files.empty());
    std::sort(files.begin(), files.end());
    std::ifstream in(files[0]);
    std::string text(9000, '\0');
    in.read(text.data(), text.size());
    text.resize(in.gcount());
    std::ofstream(dir_ / "corpus" / "small.txt") << text;
  }
  void TearDown() override { aqswarm::RemoveTree(dir_).IgnoreError(); }

  std::string WriteJob(const std::string& name, const std::string& mode, int stages, int max_steps, int epochs,
                       int fw_bits = 3, const std::string& extra = "", const std::string& store = "rocksdb",
                       const std::string& compression_extra = "") {
    const std::string json = absl::StrCat(R"({"name":")", name, R"(","seed":5,
      "model":{"seqLen":32,"dModel":32,"nLayer":3,"nHead":2},
      "data":{"corpus":")", (dir_ / "corpus").string(), R"(","tokenizer":")", kDataDir, R"(/gpt2",
              "cacheDir":")", (dir_ / "cache").string(), R"("},
      "optimizer":{"lr":0.003,"warmupSteps":2,"gradClip":1.0},
      "microBatchSize":4,"microBatchesPerStep":2,"epochs":)", epochs, R"(,"maxSteps":)", max_steps, R"(,
      "compression":{"mode":")", mode, R"(","fwBits":)", fw_bits, R"(,"bwBits":6,"warmupEpochs":0,"store":")", store, "\"", compression_extra, R"(},
      "stages":)", stages, R"(,"evalEverySteps":0,"evalBatches":1,"device":")", TestDevice(), "\"", extra, "}");
    const std::string path = (dir_ / absl::StrCat(name, "-", mode, "-", stages, "-", fw_bits, ".json")).string();
    std::ofstream(path) << json;
    return path;
  }

  // Runs `aqswarm pipeline` to completion; returns its exit code.
  int RunPipeline(const std::string& job, const std::string& out, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {kBinary, "pipeline", "--job=" + job, "--out_dir=" + out};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = Subprocess::Spawn(argv, {.capture_stdout = true, .stderr_path = (dir_ / "launcher.err").string()});
    EXPECT_TRUE(p.ok());
    std::string line;
    while ((*p)->ReadLine(&line, absl::Seconds(240)).ok()) output_ += line + "\n";
    auto code = (*p)->Wait(absl::Seconds(60));
    EXPECT_TRUE(code.ok());
    return code.ok() ? *code : -1;
  }

  // Loss column of a run's metrics.csv.
  std::vector<double> Losses(const std::string& out) {
    std::ifstream in(fs::path(out) / "metrics.csv");
    std::string line;
    std::getline(in, line);  // header
    std::vector<double> losses;
    while (std::getline(in, line)) {
      std::vector<std::string> cols = absl::StrSplit(line, ',');
      losses.push_back(std::stod(cols[2]));
    }
    return losses;
  }

  // The DELTA rows each sending stage of pipeline 0 had sent by its last
  // step (the step events' cumulative sender.delta_rows in events.jsonl),
  // by stage.
  std::map<uint32_t, uint64_t> DeltaRowsSent(const std::string& out) {
    std::map<uint32_t, uint64_t> rows;
    std::ifstream in(fs::path(out) / "events.jsonl");
    for (std::string l; std::getline(in, l);) {
      absl::StatusOr<v1::StageEvent> ev = events::ParseStageEvent(l);
      EXPECT_TRUE(ev.ok()) << ev.status();
      if (!ev.ok() || !ev->has_step() || !ev->step().has_sender() || ev->step().pipeline() != 0) continue;
      uint64_t& r = rows[ev->step().stage()];
      r = std::max<uint64_t>(r, ev->step().sender().delta_rows());
    }
    return rows;
  }

  // Epoch 1 sent DELTA rows on every forward link of a `stages`-stage run.
  void ExpectDeltaRowsOnEveryLink(const std::string& out, uint32_t stages) {
    const std::map<uint32_t, uint64_t> rows = DeltaRowsSent(out);
    for (uint32_t s = 0; s + 1 < stages; ++s) {
      ASSERT_TRUE(rows.count(s)) << "no step event of stage " << s << " with sender rows";
      EXPECT_GT(rows.at(s), 0u) << "stage " << s << " never sent a DELTA row";
    }
  }

  // Runs a 3-stage AQ-SGD `job` for its 2 epochs, keeping the stores: the
  // loss falls, epoch 1 sent deltas, and both ends of each forward link hold
  // bit-identical m(xi) for every sample.
  void ExpectStoresBitIdentical(const std::string& job) {
    const std::string out = (dir_ / "run").string();
    ASSERT_EQ(RunPipeline(job, out, {"--keep_stores"}), 0) << output_;
    std::vector<double> loss = Losses(out);
    ASSERT_GE(loss.size(), 8u) << output_;
    EXPECT_LT(loss.back(), loss.front());
    // Epoch 1 sent deltas on both forward links.
    ExpectDeltaRowsOnEveryLink(out, 3);
    for (uint32_t boundary = 0; boundary < 2; ++boundary) {
      std::unique_ptr<storage::RocksDbMessageStore> a, b;
      {
        auto sa = storage::RocksDbMessageStore::Open({.path = absl::StrCat(out, "/store-p0-s", boundary)});
        auto sb = storage::RocksDbMessageStore::Open({.path = absl::StrCat(out, "/store-p0-s", boundary + 1)});
        ASSERT_TRUE(sa.ok() && sb.ok()) << sa.status() << sb.status();
        a = std::move(*sa);
        b = std::move(*sb);
      }
      storage::LinkSpec spec;
      spec.link = {0, boundary};
      spec.generation = 1;
      spec.rows = 32;
      spec.cols = 32;
      spec.precision = RowPrecision::kFloat16;
      int found = 0;
      for (uint64_t id = 0; id < 80; ++id) {
        std::vector<float> ra(32 * 32), rb(32 * 32);
        std::vector<absl::Span<float>> oa = {absl::MakeSpan(ra)}, ob = {absl::MakeSpan(rb)};
        std::vector<storage::RowRead> reads_a(1), reads_b(1);
        const uint64_t ids[] = {id};
        ASSERT_TRUE(a->GetBatch(spec, ids, oa, absl::MakeSpan(reads_a)).ok());
        ASSERT_TRUE(b->GetBatch(spec, ids, ob, absl::MakeSpan(reads_b)).ok());
        ASSERT_EQ(reads_a[0].status.ok(), reads_b[0].status.ok()) << "sample " << id << " boundary " << boundary;
        if (!reads_a[0].status.ok()) continue;
        ++found;
        EXPECT_EQ(0, std::memcmp(ra.data(), rb.data(), ra.size() * 4)) << "sample " << id;
        EXPECT_EQ(reads_a[0].payload_checksum, reads_b[0].payload_checksum);
      }
      EXPECT_GE(found, 32) << "boundary " << boundary;
    }
  }

  // A 2 stages x 2 replicas AQ-SGD job with job.dp = {dp} trains 8 steps:
  // the loss falls and the launcher, which compares every stage's parameter
  // hash across replicas after every step (and fails the run on a
  // mismatch), reports them identical at every step.
  void ExpectGridTrains(const std::string& name, const std::string& dp, size_t steps = 8) {
    const std::string out = (dir_ / name).string();
    const std::string job = WriteJob(name, "aqsgd", 2, static_cast<int>(steps), 10, 3,
                                     absl::StrCat(R"(,"dataParallel":2,"dp":{)", dp, "}"));
    ASSERT_EQ(RunPipeline(job, out), 0) << output_;
    size_t identical = 0;
    for (size_t pos = 0; (pos = output_.find("replicas identical", pos)) != std::string::npos; ++pos) ++identical;
    EXPECT_EQ(identical, steps) << output_;
    std::vector<double> loss = Losses(out);
    ASSERT_EQ(loss.size(), steps);
    EXPECT_LT(loss.back(), loss.front() - 0.1) << output_;
  }

  fs::path dir_;
  std::string output_;
};

TEST_F(PipelineTest, AqsgdStoresOnBothEndsOfEveryLinkAreBitIdenticalAfterTwoEpochs) {
  ExpectStoresBitIdentical(WriteJob("aq", "aqsgd", 3, 0, 2));
}

// Tiled first visits (3 bits, tiles of 16 tokens of a channel, every whole
// tile rotated) with zstd-coded codes in both directions: m(xi) starts from
// the decoded first visit on both ends and stays bit-identical through the
// deltas.
TEST_F(PipelineTest, AqsgdWithTiledFirstVisitsAndEntropyCodingKeepsBothEndsBitIdentical) {
  ExpectStoresBitIdentical(
      WriteJob("aqtiled", "aqsgd", 3, 0, 2, 3, "", "rocksdb",
               R"(,"firstVisit":"tiled","tileSize":16,"rotation":"all","tileAlong":"tokens","entropyCoding":true)"));
}

// A per-token first-visit reference on the midtread grid: both stages of
// every link build the same table from what they hold, so m(xi) stays
// bit-identical through first visits and deltas.
TEST_F(PipelineTest, AqsgdWithAFirstVisitReferenceKeepsBothEndsBitIdentical) {
  ExpectStoresBitIdentical(WriteJob("aqref", "aqsgd", 3, 0, 2, 3, "", "rocksdb",
                                    R"(,"firstVisit":"tiled","tileGrid":"midtread","firstVisitReference":true)"));
}

// First visits in the deltas' per-channel fixed point (4 bits) with a
// per-token reference and zstd: m(xi) stays bit-identical.
TEST_F(PipelineTest, AqsgdWithFixedPointFirstVisitsAndAReferenceKeepsBothEndsBitIdentical) {
  ExpectStoresBitIdentical(
      WriteJob("aqfixed", "aqsgd", 3, 0, 2, 3, "", "rocksdb",
               R"(,"firstVisit":"fixed_point","firstVisitBits":4,"firstVisitReference":true,"entropyCoding":true)"));
}

// compression.mode tiled: the tiled codec both ways (fw 2 bits), no state.
TEST_F(PipelineTest, TiledLinksWithEntropyCodingTrainAndTheLossFalls) {
  const std::string out = (dir_ / "run").string();
  ASSERT_EQ(RunPipeline(WriteJob("tiled", "tiled", 2, 0, 2, 2, "", "rocksdb", R"(,"entropyCoding":true)"), out), 0)
      << output_;
  std::vector<double> loss = Losses(out);
  ASSERT_GE(loss.size(), 8u) << output_;
  EXPECT_LT(loss.back(), loss.front());
  EXPECT_FALSE(fs::exists(fs::path(out) / "store-p0-s0" / "CURRENT"));
}

// compression.store = memory: m(xi) in RAM instead of RocksDB trains to the
// very same losses (the store holds what the codec computed, bit for bit),
// and no store directory is written.
TEST_F(PipelineTest, AqsgdWithItsStoreInRamTrainsExactlyAsWithRocksDb) {
  const std::string disk = (dir_ / "disk").string(), ram = (dir_ / "ram").string();
  ASSERT_EQ(RunPipeline(WriteJob("disk", "aqsgd", 3, 0, 2), disk), 0) << output_;
  output_.clear();
  ASSERT_EQ(RunPipeline(WriteJob("ram", "aqsgd", 3, 0, 2, 3, "", "memory"), ram, {"--keep_stores"}), 0) << output_;
  ExpectDeltaRowsOnEveryLink(ram, 3);  // epoch 1 sent deltas
  std::vector<double> a = Losses(disk), b = Losses(ram);
  ASSERT_GE(a.size(), 8u);
  EXPECT_EQ(a, b);
  EXPECT_FALSE(fs::exists(fs::path(ram) / "store-p0-s0" / "CURRENT"));
}

TEST_F(PipelineTest, ThreeStageFp32PipelineTrainsLikeOneStage) {
  const std::string one = (dir_ / "one").string(), three = (dir_ / "three").string();
  ASSERT_EQ(RunPipeline(WriteJob("s1", "fp32", 1, 4, 1), one), 0) << output_;
  ASSERT_EQ(RunPipeline(WriteJob("s3", "fp32", 3, 4, 1), three), 0) << output_;
  std::vector<double> a = Losses(one), b = Losses(three);
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-4) << "step " << i;
}

// shaping.bandwidthScheduleMbps (the slownet bench's sweeps): step g runs at
// schedule[g % 2], every stage reports it, a shaped step cannot beat its
// link's bytes / rate, and shaping changes nothing of what is trained.
TEST_F(PipelineTest, BandwidthScheduleShapesEachStepAtItsOwnRate) {
  const std::string plain = (dir_ / "plain").string(), swept = (dir_ / "swept").string();
  ASSERT_EQ(RunPipeline(WriteJob("plain", "fp32", 2, 4, 1), plain), 0) << output_;
  ASSERT_EQ(RunPipeline(WriteJob("swept", "fp32", 2, 4, 1, 3, R"(,"shaping":{"bandwidthScheduleMbps":[0,2]})"), swept),
            0)
      << output_;
  EXPECT_EQ(Losses(plain), Losses(swept));
  // fp32 links send DIRECT rows only: what ExpectDeltaRowsOnEveryLink counts is real.
  const std::map<uint32_t, uint64_t> deltas = DeltaRowsSent(swept);
  ASSERT_EQ(deltas.size(), 1u);
  EXPECT_EQ(deltas.begin()->second, 0u);
  std::ifstream event_lines(fs::path(swept) / "events.jsonl");
  int lines = 0;
  for (std::string l; std::getline(event_lines, l);) {
    absl::StatusOr<v1::StageEvent> ev = events::ParseStageEvent(l);
    ASSERT_TRUE(ev.ok()) << ev.status();
    if (!ev->has_step()) continue;
    const v1::StepEvent& e = ev->step();
    ++lines;
    ASSERT_EQ(e.bandwidth_mbps(), e.step() % 2 == 0 ? 0.0 : 2.0) << l;
    // The step's resource use (getrusage deltas): kernel CPU within all CPU.
    EXPECT_GT(e.cpu_seconds(), 0) << l;
    EXPECT_GE(e.sys_seconds(), 0) << l;
    EXPECT_LE(e.sys_seconds(), e.cpu_seconds()) << l;
    EXPECT_FALSE(e.loss_not_finite()) << l;
    if (e.step() % 2 == 1 && e.stage() == 0) {
      const double wire = e.fw_bytes() * 8 / 2e6;
      EXPECT_GT(wire, 0.05) << l;
      EXPECT_GE(e.step_seconds(), wire) << l;
      EXPECT_GT(e.ctx_switches(), 0u) << l;  // its threads waited on the slow wire
    }
  }
  EXPECT_EQ(lines, 8);
}

// examples/tiny_dp.json for 30 steps (maxSteps and optimizer.totalSteps 30)
// with dp.warmupSteps 0 ends within 3% of the same job under AdamW: the
// warm-up runs at least two steps (a variance frozen from none or one
// gradient makes the compressed steps m / eps or m / |g|).
TEST_F(PipelineTest, QuantizedAdamWithWarmupZeroEndsWithinThreePercentOfAdamW) {
  std::ifstream in(fs::path(kDataDir) / ".." / "examples" / "tiny_dp.json");
  ASSERT_TRUE(in.good());
  nlohmann::json base = nlohmann::json::parse(in);
  base["maxSteps"] = 30;
  base["optimizer"]["totalSteps"] = 30;
  base["data"]["corpus"] = (fs::path(kDataDir) / "sotu").string();
  base["data"]["tokenizer"] = (fs::path(kDataDir) / "gpt2").string();
  base["data"]["cacheDir"] = (dir_ / "cache").string();
  base["device"] = TestDevice();
  std::map<std::string, double> final_loss;
  for (const std::string optimizer : {"quantized_adam", "adamw"}) {
    nlohmann::json job = base;
    job["dp"] = {{"optimizer", optimizer}, {"bits", 4}, {"bucketSize", 512}};
    if (optimizer == "quantized_adam") job["dp"]["warmupSteps"] = 0;
    const std::string path = (dir_ / (optimizer + ".json")).string();
    std::ofstream(path) << job.dump();
    output_.clear();
    ASSERT_EQ(RunPipeline(path, (dir_ / optimizer).string()), 0) << output_;
    const size_t at = output_.find("final val_loss ");
    ASSERT_NE(at, std::string::npos) << output_;
    final_loss[optimizer] = std::stod(output_.substr(at + 15));
  }
  std::printf("tiny_dp 30 steps: quantized_adam (warm-up 0) %.4f, adamw %.4f\n", final_loss["quantized_adam"],
              final_loss["adamw"]);
  EXPECT_LT(final_loss["quantized_adam"], final_loss["adamw"] * 1.03);
}

TEST_F(PipelineTest, TwoByTwoGridWithQuantizedAdamTrainsAndKeepsReplicasBitIdentical) {
  ExpectGridTrains("grid", R"("optimizer":"quantized_adam","warmupSteps":3,"bits":4)");
}

// dp.delayed_update: each step's exchange runs behind the next step's
// compute; the replicas still match after every step and the job trains.
TEST_F(PipelineTest, TwoByTwoGridWithDelayedUpdatesTrainsAndKeepsReplicasBitIdentical) {
  ExpectGridTrains("delayed", R"("optimizer":"quantized_adam","warmupSteps":3,"bits":4,"delayedUpdate":true)");
}

// dp.optimizer diloco, 2 inner steps, 2 fragments synced on alternate steps:
// the launcher compares the anchors (ParameterHash under diloco) after every
// step; the job trains.
TEST_F(PipelineTest, TwoByTwoGridWithDiLoCoTrainsAndKeepsAnchorsBitIdentical) {
  ExpectGridTrains("diloco", R"("optimizer":"diloco","innerSteps":2,"fragments":2,"bits":4)");
}

// Outer steps farther apart than the exchange's default step window (8): the
// replicas' mailboxes accept the next outer step's chunks (the window grows
// with dp.innerSteps), whichever replica gets there first.
TEST_F(PipelineTest, DiLoCoOuterStepsFartherApartThanTheDefaultStepWindowGoThrough) {
  ExpectGridTrains("diloco-h10", R"("optimizer":"diloco","innerSteps":10,"bits":4)", 20);
}

// dp.transport nccl on a machine without a GPU (CI), with one GPU (both
// replicas on it) or a build without NCCL: the stages fail at their first DP
// step with a status that says why, and the launcher exits non-zero instead of
// hanging. With two GPUs the grid trains.
TEST_F(PipelineTest, GridOverNcclFailsClearlyWithoutGpusOrTrainsWithThem) {
  const std::string out = (dir_ / "nccl").string();
  const std::string job = WriteJob("nccl", "fp32", 1, 3, 10, 3, R"(,"dataParallel":2,"dp":{"transport":"nccl"})");
  const absl::Time start = absl::Now();
  const int code = RunPipeline(job, out, {"--link_timeout_s=20"});
  std::ifstream in(dir_ / "launcher.err");
  std::stringstream err;
  err << in.rdbuf();
  if (code == 0) {  // a machine with two GPUs and a CUDA build
    EXPECT_EQ(Losses(out).size(), 3u) << output_;
    return;
  }
  EXPECT_EQ(code, 1);
  // One GPU: NCCL refuses two ranks on one device, and says so.
  EXPECT_TRUE(err.str().find("no CUDA device for the NCCL exchange") != std::string::npos ||
              err.str().find("built without NCCL") != std::string::npos ||
              err.str().find("Duplicate GPU detected") != std::string::npos)
      << err.str();
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
}

// Runs `aqswarm ARGS...` to completion; returns its exit code.
int RunAqswarm(std::vector<std::string> args) {
  args.insert(args.begin(), kBinary);
  auto p = Subprocess::Spawn(args, {.capture_stdout = true});
  if (!p.ok()) return -1;
  std::string line;
  while ((*p)->ReadLine(&line, absl::Seconds(60)).ok()) {
  }
  auto code = (*p)->Wait(absl::Seconds(60));
  return code.ok() ? *code : -1;
}

TEST_F(PipelineTest, GridRunsOverMutualTlsAndAPlaintextNeighbourIsRejected) {
  const std::string tls = (dir_ / "tls").string();
  ASSERT_EQ(RunAqswarm({"certs", "init", "--tls_dir=" + tls}), 0);
  ASSERT_EQ(RunAqswarm({"certs", "issue", "--tls_dir=" + tls, "--name=local", "--ip=127.0.0.1"}), 0);
  const std::string job = WriteJob("tlsgrid", "aqsgd", 2, 3, 10, 3,
                                   R"(,"dataParallel":2,"dp":{"optimizer":"quantized_adam","warmupSteps":1,"bits":4})");
  ASSERT_EQ(RunPipeline(job, (dir_ / "tlsrun").string(), {"--tls_dir=" + tls, "--name=local"}), 0) << output_;
  EXPECT_NE(output_.find("replicas identical"), std::string::npos);

  // A TLS stage 1, and a stage 0 that dials it in plaintext: refused.
  const std::string job2 = WriteJob("tlsmix", "aqsgd", 2, 3, 1);
  const std::string down_launch = WriteStageLaunchFile(
      (dir_ / "m1.launch.json").string(), job2,
      {{"stage", 1}, {"storeDir", (dir_ / "m1").string()}, {"tls", {{"dir", tls}, {"name", "local"}}}});
  auto down = Subprocess::Spawn({kBinary, "stage", "--launch=" + down_launch},
                                {.capture_stdout = true, .stderr_path = (dir_ / "m1.err").string()});
  ASSERT_TRUE(down.ok());
  std::string line;
  ASSERT_TRUE((*down)->ReadLine(&line, absl::Seconds(120)).ok());
  const int port = ListeningPort(line);
  const std::string up_launch = WriteStageLaunchFile(
      (dir_ / "m0.launch.json").string(), job2,
      {{"stage", 0},
       {"storeDir", (dir_ / "m0").string()},
       {"next", {{"stageLinkAddress", absl::StrCat("127.0.0.1:", port)}}},
       {"linkTimeout", "5s"}});
  auto up = Subprocess::Spawn({kBinary, "stage", "--launch=" + up_launch},
                              {.capture_stdout = true, .stderr_path = (dir_ / "m0.err").string()});
  ASSERT_TRUE(up.ok());
  auto cu = (*up)->Wait(absl::Seconds(60));
  ASSERT_TRUE(cu.ok());
  EXPECT_EQ(*cu, 1);
  std::ifstream in(dir_ / "m0.err");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find("plaintext"), std::string::npos) << ss.str();
}

struct Stage {
  std::unique_ptr<Subprocess> proc;
  std::string err;
};

TEST_F(PipelineTest, KilledStageMakesItsNeighboursFailWithAClearErrorQuickly) {
  const std::string job = WriteJob("kill", "aqsgd", 3, 100000, 1000);
  std::vector<Stage> st(3);
  std::string next;
  for (int s = 2; s >= 0; --s) {
    st[s].err = (dir_ / absl::StrCat("stage", s, ".err")).string();
    nlohmann::json fields = {
        {"stage", s}, {"storeDir", (dir_ / absl::StrCat("store", s)).string()}, {"linkTimeout", "60s"}};
    if (!next.empty()) fields["next"] = {{"stageLinkAddress", next}};
    const std::string launch =
        WriteStageLaunchFile((dir_ / absl::StrCat("stage", s, ".launch.json")).string(), job, std::move(fields));
    auto p = Subprocess::Spawn({kBinary, "stage", "--launch=" + launch},
                               {.capture_stdout = true, .stderr_path = st[s].err});
    ASSERT_TRUE(p.ok());
    st[s].proc = std::move(*p);
    std::string line;
    ASSERT_TRUE(st[s].proc->ReadLine(&line, absl::Seconds(120)).ok());
    next = absl::StrCat("127.0.0.1:", ListeningPort(line));
  }
  // Wait until training is under way (stage 0 reported a step), then kill the middle.
  std::string line;
  bool stepped = false;
  while (!stepped && st[0].proc->ReadLine(&line, absl::Seconds(120)).ok()) {
    absl::StatusOr<v1::StageEvent> e = events::ParseStageEvent(line);
    stepped = e.ok() && e->has_step();
  }
  ASSERT_TRUE(stepped);
  st[1].proc->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  for (int s : {0, 2}) {
    auto code = st[s].proc->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << "stage " << s << " hung after its neighbour died";
    EXPECT_EQ(*code, 1) << "stage " << s;
    std::ifstream in(st[s].err);
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_NE(ss.str().find("link"), std::string::npos) << "stage " << s << " said: " << ss.str();
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(30));
}

TEST_F(PipelineTest, NeighbourWithDifferentLinkSettingsIsRefused) {
  const std::string job_a = WriteJob("same", "aqsgd", 2, 2, 1, 3), job_b = WriteJob("same", "aqsgd", 2, 2, 1, 4);
  // The downstream drops the mismatched hello and waits for its real upstream
  // until its link timeout.
  const std::string down_launch = WriteStageLaunchFile(
      (dir_ / "down.launch.json").string(), job_a,
      {{"stage", 1}, {"storeDir", (dir_ / "s1").string()}, {"linkTimeout", "15s"}});
  auto down = Subprocess::Spawn({kBinary, "stage", "--launch=" + down_launch},
                                {.capture_stdout = true, .stderr_path = (dir_ / "down.err").string()});
  ASSERT_TRUE(down.ok());
  std::string line;
  ASSERT_TRUE((*down)->ReadLine(&line, absl::Seconds(120)).ok());
  const int port = ListeningPort(line);
  const std::string up_launch = WriteStageLaunchFile(
      (dir_ / "up.launch.json").string(), job_b,
      {{"stage", 0},
       {"storeDir", (dir_ / "s0").string()},
       {"next", {{"stageLinkAddress", absl::StrCat("127.0.0.1:", port)}}}});
  auto up = Subprocess::Spawn({kBinary, "stage", "--launch=" + up_launch},
                              {.capture_stdout = true, .stderr_path = (dir_ / "up.err").string()});
  ASSERT_TRUE(up.ok());
  auto cu = (*up)->Wait(absl::Seconds(120));
  auto cd = (*down)->Wait(absl::Seconds(120));
  ASSERT_TRUE(cu.ok() && cd.ok());
  EXPECT_EQ(*cu, 1);
  EXPECT_EQ(*cd, 1);
  std::ifstream in(dir_ / "up.err");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find("refused the link"), std::string::npos) << ss.str();
  EXPECT_NE(ss.str().find("fw_bits"), std::string::npos) << ss.str();
  // The downstream's own error says why it refused, with the values.
  std::ifstream down_in(dir_ / "down.err");
  std::stringstream down_err;
  down_err << down_in.rdbuf();
  EXPECT_NE(down_err.str().find("fw_bits 4, expected 3"), std::string::npos) << down_err.str();
}

// Every process whose command line mentions `needle` (e.g. a test's own job file).
std::vector<int> ProcessesMentioning(const std::string& needle) {
  std::vector<int> pids;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.find(needle) != std::string::npos) pids.push_back(std::stoi(pid));
  }
  return pids;
}

TEST_F(PipelineTest, StageThatFailsToStartIsNamedAndTheOthersAreStopped) {
  // Stage p0-s1's metrics port is taken, so it fails while the other stages,
  // started in parallel with it, come up and wait for their neighbours.
  const int busy = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(busy, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(busy, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(busy, 1), 0);
  ASSERT_EQ(::getsockname(busy, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  const std::string job = WriteJob("nostart", "fp32", 3, 4, 1);
  const absl::Time start = absl::Now();
  EXPECT_EQ(RunPipeline(job, (dir_ / "run").string(),
                        {absl::StrCat("--metrics_port_base=", port - 1), "--link_timeout_s=100"}),
            1);
  ::close(busy);
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));  // not the link timeout
  std::ifstream in(dir_ / "launcher.err");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find("stage p0-s1 did not start"), std::string::npos) << ss.str();
  EXPECT_NE(ss.str().find(absl::StrCat(port)), std::string::npos) << ss.str();  // the stage's own error
  // The stages run from <out_dir>/launch-<p>-<s>.json.
  EXPECT_EQ(ProcessesMentioning((dir_ / "run" / "launch-").string()), std::vector<int>{}) << "stages left running";
}

TEST_F(PipelineTest, StageRejectsBadNeighbourAddressesOnStdin) {
  const std::string job = WriteJob("stdin", "fp32", 2, 1, 1);
  const std::string no_next_launch =
      WriteStageLaunchFile((dir_ / "none.launch.json").string(), job, {{"stage", 0}});
  auto no_next = Subprocess::Spawn({kBinary, "stage", "--launch=" + no_next_launch},
                                   {.capture_stdout = true, .stderr_path = (dir_ / "none.err").string()});
  ASSERT_TRUE(no_next.ok());
  auto code = (*no_next)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 1);
  std::ifstream none(dir_ / "none.err");
  std::stringstream ns;
  ns << none.rdbuf();
  EXPECT_NE(ns.str().find("needs next.stage_link_address"), std::string::npos) << ns.str();

  const std::string launch =
      WriteStageLaunchFile((dir_ / "stdin.launch.json").string(), job, {{"stage", 0}, {"neighborsOnStdin", true}});
  // Each bad patch line (empty: stdin closed) and what the stage says of it.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "stdin: not a StageLaunch patch"},
      {R"({"replicas":[]})", "no next.stage_link_address"},
      {R"({"next":5})", "stdin: not a StageLaunch patch"},
      {"", "no neighbour patch on stdin"}};
  for (const auto& [bad, want] : cases) {
    const std::string err = (dir_ / "bad.err").string();
    fs::remove(err);
    auto p = Subprocess::Spawn({kBinary, "stage", "--launch=" + launch},
                               {.capture_stdout = true, .stderr_path = err, .pipe_stdin = true});
    ASSERT_TRUE(p.ok());
    std::string line;
    ASSERT_TRUE((*p)->ReadLine(&line, absl::Seconds(120)).ok());
    EXPECT_NE(line.find("listening"), std::string::npos) << line;
    if (bad.empty()) {
      (*p)->CloseStdin();  // the launcher went away
    } else {
      ASSERT_TRUE((*p)->WriteStdin(bad + "\n").ok());
    }
    auto c = (*p)->Wait(absl::Seconds(60));
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(*c, 1) << bad;
    std::ifstream in(err);
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_NE(ss.str().find(want), std::string::npos) << bad << ": " << ss.str();
  }
}

}  // namespace
}  // namespace aqswarm
