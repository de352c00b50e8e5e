#include "common/sha256.h"

#include <fstream>

#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"

namespace aqswarm {
namespace {

TEST(Sha256Test, KnownDigestsWholeAndInPiecesAndOfAFile) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  Sha256 s;
  s.Update("a");
  s.Update("bc");
  EXPECT_EQ(s.HexDigest(), Sha256Hex("abc"));
  aqswarm::testing::ScratchDir dir;
  const std::string path = dir.path() + "/f";
  std::string big(3 << 20, 'x');
  big[12345] = 'y';
  std::ofstream(path, std::ios::binary) << big;
  auto h = Sha256OfFile(path);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, Sha256Hex(big));
  EXPECT_TRUE(IsSha256Hex(*h));
  EXPECT_FALSE(IsSha256Hex("abc"));
  EXPECT_FALSE(IsSha256Hex(std::string(64, 'G')));
  EXPECT_EQ(Sha256OfFile(dir.path() + "/missing").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace aqswarm
