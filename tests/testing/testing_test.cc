#include <filesystem>
#include <fstream>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/ports.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ScratchDirTest, IsFreshAndGoneAfterwards) {
  std::string path;
  {
    ScratchDir dir;
    path = dir.path();
    ASSERT_TRUE(std::filesystem::is_directory(path));
    EXPECT_TRUE(std::filesystem::is_empty(path));
    std::ofstream(dir.Sub("f")) << "x";
    ScratchDir other;
    EXPECT_NE(other.path(), path);
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(StatusMatchersTest, MatchStatusAndStatusOr) {
  EXPECT_THAT(absl::OkStatus(), IsOk());
  EXPECT_THAT(absl::StatusOr<int>(3), IsOk());
  EXPECT_THAT(absl::NotFoundError("no state"), Not(IsOk()));
  EXPECT_THAT(absl::NotFoundError("no state here"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(absl::StatusOr<int>(absl::InvalidArgumentError("bad flag --x")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--x")));
  EXPECT_THAT(absl::InvalidArgumentError("bad flag --x"), Not(StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--y"))));
  EXPECT_THAT(absl::OkStatus(), Not(StatusIs(absl::StatusCode::kInternal)));
  ASSERT_OK_AND_ASSIGN(const int v, absl::StatusOr<int>(7));
  EXPECT_EQ(v, 7);
}

TEST(PortsTest, ListeningPortReadsEitherListeningEvent) {
  for (const auto& [line, port] : std::vector<std::pair<std::string, int>>{
           {R"({"listening":{"stage":1,"pipeline":0,"port":4100,"exchange_port":0,"metrics_port":0}})", 4100},
           {R"({"listening":{"port":7000,"metrics_port":9090}})", 7000}}) {
    ASSERT_OK_AND_ASSIGN(auto child, Subprocess::Spawn({"/bin/echo", line}, {.capture_stdout = true}));
    ASSERT_OK_AND_ASSIGN(const int got, ListeningPort(*child, absl::Seconds(10)));
    EXPECT_EQ(got, port);
  }
  ASSERT_OK_AND_ASSIGN(auto child, Subprocess::Spawn({"/bin/echo", "hello"}, {.capture_stdout = true}));
  EXPECT_THAT(ListeningPort(*child, absl::Seconds(10)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hello")));
}

TEST(PortsTest, UniqueLoopbackPortsAreNeverHandedOutTwice) {
  std::set<int> seen;
  for (int i = 0; i < 50; ++i) EXPECT_TRUE(seen.insert(UniqueLoopbackPort()).second);
}

}  // namespace
}  // namespace aqswarm::testing
