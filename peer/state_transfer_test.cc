#include "peer/state_transfer.h"

#include <fstream>
#include <sstream>

#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/sha256.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pipeline/job_spec.h"
#include "pipeline/stage_worker.h"
#include "stage/link_transport.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::peer {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(StateTransferTest, JoinerFetchesALiveReplicasCheckpointAndMatchesItExactly) {
  auto job = pipeline::ParseJobSpec(R"({"seed":3,"model":{"vocabSize":61,"seqLen":8,"dModel":16,"nLayer":2,"nHead":2},
      "microBatchSize":2,"microBatchesPerStep":1,"stages":2})");
  ASSERT_TRUE(job.ok());
  auto live = *pipeline::StageWorker::Create(*job, 1);
  std::vector<float> in(2 * 8 * 16, 0.1f);
  double loss;
  ASSERT_TRUE(live->ForwardLoss(0, in, {}, std::vector<int32_t>(16, 5), 2, &loss).ok());
  ASSERT_TRUE(live->Backward(0, {}, nullptr).ok());
  ASSERT_TRUE(live->Step(0, live->GradSquaredNorm()).ok());
  const aqswarm::testing::ScratchDir scratch;
  const std::string dir = scratch.path();
  auto server = StateTransferServer::Start("127.0.0.1:0", [&](const v1::StateRequest& r) -> absl::StatusOr<StateSnapshot> {
    if (r.stage() != 1) return absl::NotFoundError("this peer serves stage 1");
    const std::string path = absl::StrCat(dir, "/live.ckpt");
    absl::Status s = live->SaveCheckpoint(path);
    if (!s.ok()) return s;
    return StateSnapshot{ReadFile(path), static_cast<uint64_t>(live->optimizer_step())};
  }, /*chunk_bytes=*/4096);
  ASSERT_TRUE(server.ok());
  v1::StateRequest req;
  req.set_stage(1);
  auto snap = FetchState(absl::StrCat("127.0.0.1:", (*server)->port()), req);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step, 1u);
  const std::string got = absl::StrCat(dir, "/joiner.ckpt");
  std::ofstream(got, std::ios::binary) << snap->bytes;
  auto joiner = *pipeline::StageWorker::Create(*job, 1);
  EXPECT_NE(joiner->ParameterHash(), live->ParameterHash());  // it trained a step; the joiner did not
  ASSERT_TRUE(joiner->LoadCheckpoint(got).ok());
  EXPECT_EQ(joiner->ParameterHash(), live->ParameterHash());
  EXPECT_EQ(joiner->optimizer_step(), 1);

  req.set_stage(0);
  EXPECT_EQ(FetchState(absl::StrCat("127.0.0.1:", (*server)->port()), req).status().code(), absl::StatusCode::kNotFound);
}

// A hostile or broken server: every malformed stream is a DataLoss (or the
// limit), never a crash or a huge allocation.
class RogueService final : public v1::StateTransfer::Service {
 public:
  explicit RogueService(int mode) : mode_(mode) {}
  grpc::Status Fetch(grpc::ServerContext*, const v1::StateRequest*, grpc::ServerWriter<v1::StateChunk>* w) override {
    v1::StateChunk c;
    if (mode_ == 5 || mode_ == 6) {  // a first chunk of 4 of 10 bytes, then the total (5) or the step (6) changes
      c.set_total_bytes(10);
      c.set_data("xxxx");
      w->Write(c);
      c.set_offset(4);
      c.set_data("xxxxxx");
      if (mode_ == 5) c.set_total_bytes(12);
      if (mode_ == 6) c.set_step(9);
      w->Write(c);
      return grpc::Status::OK;
    }
    c.set_total_bytes(mode_ == 0 ? (1ull << 62) : 10);
    c.set_offset(mode_ == 1 ? 3 : 0);
    c.set_data(mode_ == 3 ? std::string(20, 'x') : std::string(mode_ == 4 ? 4 : 10, 'x'));
    c.set_checksum(mode_ == 2 ? 42 : 0);
    w->Write(c);
    return grpc::Status::OK;
  }
  grpc::Status Probe(grpc::ServerContext*, const v1::ProbeRequest*, v1::ProbeResponse* resp) override {
    resp->set_received_bytes(mode_);  // not what was sent
    return grpc::Status::OK;
  }

 private:
  int mode_;
};

TEST(StateTransferTest, APortAlreadyServedIsRefusedNotShared) {
  // A StateTransfer server on a StageLink server's port would split the
  // connections between them (SO_REUSEPORT): it must fail to start instead.
  auto link = stage::StageLinkServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(link.ok()) << link.status();
  auto state = StateTransferServer::Start(absl::StrCat("127.0.0.1:", (*link)->port()),
                                          [](const v1::StateRequest&) -> absl::StatusOr<StateSnapshot> {
                                            return absl::NotFoundError("none");
                                          });
  EXPECT_TRUE(absl::IsUnavailable(state.status())) << state.status();
}

TEST(StateTransferTest, MalformedStreamsAreRejected) {
  for (int mode = 0; mode < 7; ++mode) {
    RogueService svc(mode);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&svc);
    auto server = b.BuildAndStart();
    auto r = FetchState(absl::StrCat("127.0.0.1:", port), v1::StateRequest(), {.max_bytes = 1 << 20});
    EXPECT_FALSE(r.ok()) << "mode " << mode;
    EXPECT_TRUE(absl::IsDataLoss(r.status()) || absl::IsResourceExhausted(r.status())) << mode << " " << r.status();
    server->Shutdown();
  }
}

TEST(StateTransferTest, ProbeMeasuresALinkAndRejectsLiesAndBadOptions) {
  auto server = StateTransferServer::Start(
      "127.0.0.1:0", [](const v1::StateRequest&) -> absl::StatusOr<StateSnapshot> { return StateSnapshot{}; });
  ASSERT_TRUE(server.ok());
  const std::string target = absl::StrCat("127.0.0.1:", (*server)->port());
  auto p = ProbeLink(target, {.payload_bytes = 256 << 10, .rounds = 2});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(p->bandwidth_bytes_per_second, 1e6) << "loopback moves more than 1 MB/s";
  EXPECT_GT(p->rtt_seconds, 0);
  EXPECT_LT(p->rtt_seconds, 1);
  EXPECT_TRUE(absl::IsInvalidArgument(ProbeLink(target, {.payload_bytes = kMaxProbeBytes + 1}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ProbeLink(target, {.rounds = 0}).status()));

  RogueService rogue(7);
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&rogue);
  auto liar = b.BuildAndStart();
  EXPECT_TRUE(absl::IsDataLoss(ProbeLink(absl::StrCat("127.0.0.1:", port)).status()));
  liar->Shutdown();
  // Nobody listening: a bounded failure, not a hang.
  auto gone = ProbeLink(absl::StrCat("127.0.0.1:", port), {.timeout = absl::Seconds(2)});
  EXPECT_FALSE(gone.ok());
}

// The server streams a kept file; the fetcher writes it to disk as it
// arrives and checks the digest its holders reported.
TEST(StateTransferTest, AFileIsStreamedToAFileAndItsSha256Checked) {
  const aqswarm::testing::ScratchDir scratch;
  const std::string src = scratch.Sub("state-7.ckpt");
  std::string content(5 * 4096 + 123, '\0');
  for (size_t i = 0; i < content.size(); ++i) content[i] = static_cast<char>(i * 131 % 251);
  std::ofstream(src, std::ios::binary) << content;
  auto server = StateTransferServer::Start(
      "127.0.0.1:0",
      [&](const v1::StateRequest&) -> absl::StatusOr<StateSnapshot> { return StateSnapshot{.step = 7, .path = src}; },
      /*chunk_bytes=*/4096);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = absl::StrCat("127.0.0.1:", (*server)->port());
  const std::string digest = Sha256Hex(content);
  const std::string dst = scratch.Sub("got.ckpt");
  auto got = FetchStateToFile(target, v1::StateRequest(), dst, {.expected_sha256 = digest});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->step, 7u);
  EXPECT_EQ(got->bytes, content.size());
  EXPECT_EQ(got->sha256, digest);
  EXPECT_EQ(ReadFile(dst), content);

  // A digest that differs: DATA_LOSS naming both, nothing written.
  const std::string other = Sha256Hex("something else");
  const std::string dst2 = scratch.Sub("refused.ckpt");
  auto refused = FetchStateToFile(target, v1::StateRequest(), dst2, {.expected_sha256 = other});
  EXPECT_TRUE(absl::IsDataLoss(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find(digest), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find(other), std::string::npos) << refused.status();
  EXPECT_FALSE(std::filesystem::exists(dst2));
  // Over the fetcher's bound: refused before anything is kept.
  auto big = FetchStateToFile(target, v1::StateRequest(), dst2, {.max_bytes = 4096});
  EXPECT_TRUE(absl::IsResourceExhausted(big.status())) << big.status();
  for (const auto& e : std::filesystem::directory_iterator(scratch.path())) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "state-7.ckpt" || name == "got.ckpt") << "left behind: " << name;
  }
}

// At most max_concurrent_fetches at once: the next is RESOURCE_EXHAUSTED
// (and counted); once one finishes, fetches are served again.
TEST(StateTransferTest, FetchesBeyondTheConcurrencyLimitAreRefusedAndHonestOnesServedAfter) {
  absl::Mutex mu;
  int inside = 0;
  absl::Notification release;
  auto server = StateTransferServer::Start(
      "127.0.0.1:0",
      [&](const v1::StateRequest& r) -> absl::StatusOr<StateSnapshot> {
        if (r.step() == 1) {  // the slow ones
          {
            absl::MutexLock l(&mu);
            ++inside;
          }
          release.WaitForNotificationWithTimeout(absl::Seconds(30));
        }
        return StateSnapshot{.bytes = "state", .step = r.step()};
      },
      1 << 20, {}, /*max_concurrent_fetches=*/2);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = absl::StrCat("127.0.0.1:", (*server)->port());
  v1::StateRequest slow;
  slow.set_step(1);
  std::vector<absl::Status> slow_results(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] { slow_results[i] = FetchState(target, slow).status(); });
  }
  {
    absl::MutexLock l(&mu);
    auto both = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return inside == 2; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&both), absl::Seconds(20)));
  }
  v1::StateRequest quick;
  quick.set_step(2);
  auto third = FetchState(target, quick);
  EXPECT_TRUE(absl::IsResourceExhausted(third.status())) << third.status();
  EXPECT_NE(third.status().message().find("at most 2"), std::string::npos) << third.status();
  EXPECT_EQ((*server)->refused_busy(), 1u);
  release.Notify();
  for (auto& t : threads) t.join();
  for (const auto& st : slow_results) EXPECT_TRUE(st.ok()) << st;
  auto after = FetchState(target, quick);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->bytes, "state");
  EXPECT_TRUE(absl::IsInvalidArgument(
      StateTransferServer::Start("127.0.0.1:0", [](const v1::StateRequest&) -> absl::StatusOr<StateSnapshot> {
        return StateSnapshot{};
      }, 1 << 20, {}, 0).status()));
}

}  // namespace
}  // namespace aqswarm::peer
