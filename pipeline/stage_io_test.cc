#include "pipeline/stage_io.h"
#include "pipeline/gpt.h"

#include <signal.h>
#include <sys/resource.h>

#include <filesystem>

#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::pipeline {
namespace {

v1::ModelSpec Spec() {
  v1::ModelSpec s;
  s.set_vocab_size(50);
  s.set_seq_len(8);
  s.set_d_model(16);
  s.set_n_layer(2);
  s.set_n_head(2);
  s.set_tie_embeddings(true);
  return s;
}

// A GPT-2 style file as Hugging Face writes it: "transformer." prefix, an
// attention-mask buffer we must ignore, no lm_head (tied).
std::string Gpt2File(const GptStageImpl& src) {
  std::vector<torch::Tensor> keep;
  std::vector<StTensor> t;
  for (const auto& [name, p] : src.named_params()) {
    keep.push_back(p.detach().contiguous());
    t.push_back({"transformer." + name, std::vector<int64_t>(p.sizes().begin(), p.sizes().end()),
                 absl::MakeConstSpan(keep.back().data_ptr<float>(), keep.back().numel())});
  }
  std::vector<float> mask(64, 1.0f);
  t.push_back({"transformer.h.0.attn.bias", {1, 1, 8, 8}, mask});
  return SerializeSafetensors(t, {{"format", "pt"}});
}

TEST(StageIoTest, Gpt2WeightsLoadIntoSplitStagesAndReproduceTheModel) {
  const v1::ModelSpec spec = Spec();
  GptStage src(spec, StageRangeFor(spec, 0, 1), /*seed=*/11);
  auto file = SafetensorsFile::Parse(Gpt2File(*src));
  ASSERT_TRUE(file.ok()) << file.status();
  GptStage s0(spec, StageRangeFor(spec, 0, 2), /*seed=*/99), s1(spec, StageRangeFor(spec, 1, 2), 99);
  ASSERT_TRUE(LoadGpt2Weights(**file, *s0).ok());
  ASSERT_TRUE(LoadGpt2Weights(**file, *s1).ok());
  torch::NoGradGuard ng;
  torch::Tensor ids = torch::randint(0, 50, {2, 8}, torch::kLong);
  EXPECT_TRUE(torch::allclose(s1->forward(s0->forward(ids)), src->forward(ids), 1e-5, 1e-6));
}

TEST(StageIoTest, WrongShapeOrMissingTensorChangesNothing) {
  const v1::ModelSpec spec = Spec();
  GptStage src(spec, StageRangeFor(spec, 0, 1), 11);
  v1::ModelSpec bigger = spec;
  bigger.set_d_model(32);
  GptStage dst(bigger, StageRangeFor(bigger, 0, 1), 5);
  const torch::Tensor before = dst->named_params()[0].second.clone();
  auto file = SafetensorsFile::Parse(Gpt2File(*src));
  ASSERT_TRUE(file.ok());
  absl::Status s = LoadGpt2Weights(**file, *dst);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("shape"), std::string::npos);
  EXPECT_TRUE(torch::equal(before, dst->named_params()[0].second));

  v1::ModelSpec deeper = spec;
  deeper.set_n_layer(3);
  GptStage dst2(deeper, StageRangeFor(deeper, 0, 1), 5);
  EXPECT_EQ(LoadGpt2Weights(**file, *dst2).code(), absl::StatusCode::kNotFound);
}

std::string WithHeader(const std::string& json, size_t data_bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json + std::string(data_bytes, '\0');
}

TEST(SafetensorsTest, MalformedFilesAreRejectedWithDataLoss) {
  const std::string cases[] = {
      std::string("\x01\x02", 2),                                                  // shorter than 8 bytes
      std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}",                    // huge header length
      WithHeader("not json", 0),                                                   // bad JSON
      WithHeader(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),  // past the end
      WithHeader(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", 16), // size != shape
      WithHeader(R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", 16),
      WithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 16),  // overlap
      WithHeader(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", 16),
      WithHeader(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8),
  };
  for (const auto& c : cases) {
    auto f = SafetensorsFile::Parse(c);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << f.status();
  }
  auto f = SafetensorsFile::Parse(WithHeader(R"({"a":{"dtype":"X64","shape":[1],"data_offsets":[0,8]}})", 8));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnimplemented);
  // An empty tensor at the offset where the next one starts does not overlap
  // it, whatever order the header lists them in.
  for (const char* header : {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})",
                             R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                             R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})"}) {
    auto empty = SafetensorsFile::Parse(WithHeader(header, 8));
    ASSERT_TRUE(empty.ok()) << empty.status();
    ASSERT_NE((*empty)->Find("e"), nullptr);
    EXPECT_EQ((*empty)->Find("e")->end, (*empty)->Find("e")->begin);
  }
  // Known non-float dtypes open (a checkpoint may hold them); they are not floats.
  auto i64 = SafetensorsFile::Parse(WithHeader(R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8));
  ASSERT_TRUE(i64.ok()) << i64.status();
  EXPECT_FALSE((*i64)->entries()[0].is_float());
  EXPECT_EQ((*i64)->entries()[0].dtype_name, "I64");
  EXPECT_EQ(SafetensorsFile::Open("/nonexistent.safetensors").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, ReadsF16AndBf16) {
  const std::string json =
      R"({"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[1],"data_offsets":[4,6]}})";
  std::string bytes = WithHeader(json, 0);
  const unsigned char data[] = {0x00, 0x3c, 0x00, 0xc0, 0x80, 0x3f};  // 1.0h, -2.0h, 1.0bf16
  bytes.append(reinterpret_cast<const char*>(data), sizeof(data));
  auto f = SafetensorsFile::Parse(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->ToFloat32(*(*f)->Find("h")), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ((*f)->ToFloat32(*(*f)->Find("b")), (std::vector<float>{1.0f}));
}

TEST(StageIoTest, CheckpointRoundTripRestoresParametersAndOptimizerState) {
  const v1::ModelSpec spec = Spec();
  v1::OptimizerSpec os;
  os.set_lr(1e-3);
  os.set_beta1(0.9);
  os.set_beta2(0.99);
  os.set_eps(1e-8);
  os.set_weight_decay(0.1);
  GptStage a(spec, StageRangeFor(spec, 1, 2), 3);
  AdamW opt_a(a->named_params(), os);
  torch::Tensor h = torch::randn({2, 8, 16});
  for (int i = 0; i < 3; ++i) {
    GptStageImpl::Loss(a->forward(h), torch::randint(0, 50, {2, 8}, torch::kLong)).backward();
    opt_a.Step(1e-3, opt_a.GradSquaredNorm());
  }
  const ::aqswarm::testing::ScratchDir scratch;
  const std::string path = scratch.Sub("ckpt.safetensors");
  ASSERT_TRUE(SaveStageCheckpoint(path, *a, opt_a, "job").ok());

  GptStage b(spec, StageRangeFor(spec, 1, 2), 77);
  AdamW opt_b(b->named_params(), os);
  ASSERT_TRUE(LoadStageCheckpoint(path, *b, opt_b).ok());
  EXPECT_EQ(opt_b.step(), 3);
  for (size_t i = 0; i < a->named_params().size(); ++i) {
    EXPECT_TRUE(torch::equal(a->named_params()[i].second, b->named_params()[i].second));
  }
  auto sa = opt_a.NamedState(), sb = opt_b.NamedState();
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(torch::equal(sa[i].second, sb[i].second)) << sa[i].first;

  GptStage wrong(spec, StageRangeFor(spec, 0, 2), 3);
  AdamW opt_w(wrong->named_params(), os);
  EXPECT_EQ(LoadStageCheckpoint(path, *wrong, opt_w).code(), absl::StatusCode::kFailedPrecondition);
}

int OpenFds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// A checkpoint write that fails (its directory gone; the disk "full": the
// file size limit) is an error naming the path, and leaves neither a temp
// file nor an open descriptor; nothing is published.
TEST(SafetensorsTest, AFailedWriteLeavesNoTempFileAndNoOpenDescriptor) {
  aqswarm::testing::ScratchDir dir;
  const std::vector<float> values(1 << 16, 1.5f);
  const std::vector<StTensor> tensors = {{"w", {1 << 16}, values}};
  const int fds = OpenFds();
  const std::string gone = dir.Sub("gone") + "/state-3.ckpt";
  absl::Status s = WriteSafetensors(gone, tensors, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("state-3.ckpt"), std::string::npos) << s;
  EXPECT_EQ(OpenFds(), fds);

  struct rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  struct sigaction ign = {}, old_xfsz = {};
  ign.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ign, &old_xfsz), 0);  // a write past the limit fails with EFBIG instead
  struct rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string full = dir.Sub("state-4.ckpt");
  s = WriteSafetensors(full, tensors, {});
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::sigaction(SIGXFSZ, &old_xfsz, nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("state-4.ckpt"), std::string::npos) << s;
  EXPECT_EQ(OpenFds(), fds);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "a temp file or a partial state was left behind";
  // The same write with room succeeds and publishes the file.
  ASSERT_TRUE(WriteSafetensors(full, tensors, {}).ok());
  EXPECT_TRUE(SafetensorsFile::Open(full).ok());
}

}  // namespace
}  // namespace aqswarm::pipeline
