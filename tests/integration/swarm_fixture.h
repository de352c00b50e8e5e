// The SwarmTest fixture: a real `aqswarm coordinator` and real `aqswarm peer`
// daemons (each running its stage as a child process) on 127.0.0.1, waited
// on by polling the coordinator's Status with a deadline.
#ifndef AQSWARM_TESTS_INTEGRATION_SWARM_FIXTURE_H_
#define AQSWARM_TESTS_INTEGRATION_SWARM_FIXTURE_H_

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/certs.h"
#include "common/file_util.h"
#include "common/join_token.h"
#include "common/subprocess.h"
#include "grpcpp/grpcpp.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/coordinator.grpc.pb.h"
#include "proto/event_json.h"
#include "tests/testing/ports.h"

namespace aqswarm {
namespace {

namespace fs = std::filesystem;

const char* kBinary = AQSWARM_BINARY;

// Whether a daemon's output (one event per line) holds an event that `pred` accepts.
bool HasEvent(const std::string& out, const std::function<bool(const v1::PeerEvent&)>& pred) {
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    absl::StatusOr<v1::PeerEvent> e = events::ParsePeerEvent(line);
    if (e.ok() && pred(*e)) return true;
  }
  return false;
}
const char* kData = AQSWARM_DATA_DIR;

class SwarmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(fs::path(kData) / "sotu")) GTEST_SKIP() << "no corpus in " << kData << ": run scripts/setup.sh";
    dir_ = fs::temp_directory_path() / absl::StrCat("aqswarm_swarm_it_", ::getpid());
    aqswarm::RemoveTree(dir_).IgnoreError();
    fs::create_directories(dir_);
    job_ = (dir_ / "job.json").string();
    WriteJob(3, R"("dataParallel":2,"dp":{"optimizer":"quantized_adam","warmupSteps":3,"bits":4,"bucketSize":512})");
  }

  // The test job: a small 2-stage GPT on the corpus with AQ-SGD links;
  // `grid` adds the data-parallel (and checkpoint) fields.
  void WriteJob(int seed, const std::string& grid) {
    std::ofstream(job_) << R"({"name":"swarm-it","seed":)" << seed << R"(,
      "model":{"seqLen":32,"dModel":32,"nLayer":)" << std::max(2, stages_) << R"(,"nHead":2)" << model_extra_ << R"(},
      "data":{"corpus":")" << corpus_ << R"(","tokenizer":")" << kData << R"(/gpt2"},
      "optimizer":{"lr":0.005,"minLr":0.001,"warmupSteps":2,"totalSteps":400,"weightDecay":0.0,"gradClip":1.0},
      "microBatchSize":2,"microBatchesPerStep":2,"epochs":1,"maxSteps":400,
      "compression":{"mode":"aqsgd","fwBits":3,"bwBits":6,"warmupEpochs":0,"mPrecision":"fp16"},
      "stages":)" << stages_ << R"(,"threads":1,"evalEverySteps":0,"evalBatches":1,)" << grid << "}";
  }

  void KillAPeerAndExpectTheStandbyToCarryOn();

  void TearDown() override {
    for (auto& [name, p] : peers_) p.reset();  // SIGKILL + reap whatever still runs
    coordinator_.reset();
    if (!HasFailure()) aqswarm::RemoveTree(dir_).IgnoreError();
  }

  // With tls_dir_ set, the coordinator, every peer and this test's Status
  // calls use mutual TLS with certificates from it.
  void StartCoordinator(std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {kBinary, "coordinator", "--job=" + job_,
                                     // First start: any port (it says which); a restart takes the same one.
                                     absl::StrCat("--listen=127.0.0.1:", coordinator_port_),
                                     "--state_dir=" + (dir_ / "coord").string(), "--lease_s=3"};
    if (!tls_dir_.empty()) {
      argv.push_back("--tls_dir=" + tls_dir_);
      argv.push_back("--name=coordinator");
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = Subprocess::Spawn(argv, {.capture_stdout = true, .stderr_path = (dir_ / "coordinator.err").string()});
    ASSERT_TRUE(p.ok()) << p.status();
    coordinator_ = *std::move(p);
    absl::StatusOr<int> port = testing::ListeningPort(*coordinator_, absl::Seconds(60));
    ASSERT_TRUE(port.ok()) << port.status() << "; see " << dir_ / "coordinator.err";
    ASSERT_TRUE(coordinator_port_ == 0 || coordinator_port_ == *port) << "restarted on another port";
    coordinator_port_ = *port;
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (!tls_dir_.empty()) {
      auto files = LoadTlsFiles(tls_dir_, "admin");
      ASSERT_TRUE(files.ok()) << files.status();
      creds = grpc::SslCredentials({files->ca_cert_pem, files->key_pem, files->cert_pem});
    }
    stub_ = v1::Coordinator::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", coordinator_port_), creds));
  }

  // A CA and certificates (IP 127.0.0.1) for the coordinator, `peers` and "admin".
  void MakeTlsDir(const std::vector<std::string>& peers) {
    tls_dir_ = (dir_ / "tls").string();
    ASSERT_TRUE(InitCaDir(tls_dir_, {}).ok());
    std::vector<std::string> names = peers;
    names.push_back("coordinator");
    names.push_back("admin");
    for (const std::string& n : names) {
      LeafOptions leaf;
      leaf.name = n;
      leaf.ip_addresses = {"127.0.0.1"};
      ASSERT_TRUE(IssueCertInDir(tls_dir_, leaf).ok()) << n;
    }
  }

  std::string Token() {
    auto secret = LoadJoinSecret(
        (tls_dir_.empty() ? dir_ / "coord" / kJoinSecretFile : fs::path(tls_dir_) / kJoinSecretFile).string());
    EXPECT_TRUE(secret.ok()) << secret.status();
    auto token = IssueJoinToken(*secret, "swarm-it", "*", absl::ToUnixSeconds(absl::Now()) + 3600);
    EXPECT_TRUE(token.ok()) << token.status();
    return token.ok() ? *token : "";
  }

  // `aqswarm peer` with its JSON lines in <dir>/<name>.out, run in `cwd`
  // (default: the test's), with `peer_flags_` added.
  // `env`: variables for it ("NAME=value", e.g. a test fault injection).
  void StartPeer(const std::string& name, const std::string& token, const std::string& cwd = "",
                 const std::string& env = "") {
    const fs::path work = dir_ / name;
    const std::string cmd = absl::StrCat(
        env.empty() ? "" : absl::StrCat("export ", env, " && "),
        cwd.empty() ? "" : absl::StrCat("cd ", cwd, " && "), "exec ", kBinary, " peer", peer_flags_,
        " --coordinator=127.0.0.1:", coordinator_port_, " --join_token=", token,
        " --name=", name, " --listen=127.0.0.1:", testing::UniqueLoopbackPort(),
        " --exchange_listen=127.0.0.1:", testing::UniqueLoopbackPort(),
        " --work_dir=", work.string(), " --link_timeout_s=", link_timeout_s_,
        tls_dir_.empty() ? "" : absl::StrCat(" --tls_dir=", tls_dir_, " --name=", name), " > ",
        (dir_ / (name + ".out")).string());
    auto p = Subprocess::Spawn({"/bin/sh", "-c", cmd},
                               {.capture_stdout = false, .stderr_path = (dir_ / (name + ".err")).string()});
    ASSERT_TRUE(p.ok()) << p.status();
    peers_[name] = *std::move(p);
  }

  v1::StatusResponse Status() {
    v1::StatusResponse st;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    last_status_ = stub_->Status(&ctx, v1::StatusRequest(), &st);
    return st;
  }

  // Polls Status until `done` holds (true) or `timeout` passes (false).
  bool WaitFor(const std::function<bool(const v1::StatusResponse&)>& done, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      v1::StatusResponse st = Status();
      if (last_status_.ok() && done(st)) {
        status_ = st;
        return true;
      }
      absl::SleepFor(absl::Milliseconds(200));  // polling interval of a bounded wait
    }
    return false;
  }

  static const v1::PeerStatus* At(const v1::StatusResponse& st, int stage, int pipeline) {
    for (const auto& p : st.peers()) {
      if (p.stage() == stage && p.pipeline() == pipeline) return &p;
    }
    return nullptr;
  }

  std::string Logs() {
    std::string all;
    for (const auto& [name, p] : peers_) {
      std::ifstream in(dir_ / name / "stage.log");
      all += absl::StrCat("\n--- ", name, " stage.log:\n", std::string(std::istreambuf_iterator<char>(in), {}));
    }
    return all;
  }

  // SIGTERM to every peer but `dead`; each must leave and exit 0, bounded.
  void TerminatePeersExcept(const std::string& dead) {
    for (auto& [name, p] : peers_) {
      if (name != dead) p->Signal(SIGTERM);
    }
    for (auto& [name, p] : peers_) {
      if (name == dead) continue;
      auto code = p->Wait(absl::Seconds(30));
      ASSERT_TRUE(code.ok()) << name << " did not exit after SIGTERM";
      EXPECT_EQ(*code, 0) << name;
    }
  }

  std::string Out(const std::string& peer) {
    std::ifstream in(dir_ / (peer + ".out"));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  fs::path dir_;
  std::string tls_dir_;  // empty: plaintext
  std::string job_;
  std::string model_extra_;  // more model fields for WriteJob (",\"tieEmbeddings\":true")
  int stages_ = 2;           // the job's stages (WriteJob)
  std::string peer_flags_;   // more `aqswarm peer` flags (" --keep_checkpoints=100")
  int link_timeout_s_ = 20;  // every peer's --link_timeout_s
  std::string corpus_ = std::string(kData) + "/sotu";
  int coordinator_port_ = 0;
  std::unique_ptr<Subprocess> coordinator_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::map<std::string, std::unique_ptr<Subprocess>> peers_;
  grpc::Status last_status_;
  v1::StatusResponse status_;
};

// Runs `aqswarm <args>` to completion (bounded); its output in <dir>/<log>.
void RunToCompletion(const fs::path& dir, const std::string& log, std::vector<std::string> args) {
  args.insert(args.begin(), kBinary);
  auto p = Subprocess::Spawn({"/bin/sh", "-c", absl::StrCat("exec ", absl::StrJoin(args, " "), " > ",
                                                            (dir / log).string(), " 2>&1")},
                             {.capture_stdout = false});
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<int> code = (*p)->Wait(absl::Seconds(240));
  ASSERT_TRUE(code.ok()) << code.status();
  std::ifstream in(dir / log);
  ASSERT_EQ(*code, 0) << std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace
}  // namespace aqswarm

#endif  // AQSWARM_TESTS_INTEGRATION_SWARM_FIXTURE_H_
