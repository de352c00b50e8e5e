#include "common/file_util.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace aqswarm {
namespace {

bool Exists(const std::string& p) {
  struct stat st;
  return ::lstat(p.c_str(), &st) == 0;
}

void Touch(const std::string& p) { std::ofstream(p) << "x"; }

class RemoveTreeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "/aqswarm_remove_tree.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
  }
  void TearDown() override { ::system(("rm -rf '" + root_ + "'").c_str()); }
  std::string root_;
};

TEST_F(RemoveTreeTest, RemovesANestedTree) {
  const std::string t = root_ + "/tree";
  ASSERT_EQ(::mkdir(t.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((t + "/a").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((t + "/a/b").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((t + "/empty").c_str(), 0755), 0);
  Touch(t + "/f");
  Touch(t + "/a/g");
  Touch(t + "/a/b/h");
  ASSERT_TRUE(RemoveTree(t).ok());
  EXPECT_FALSE(Exists(t));
  EXPECT_TRUE(Exists(root_));
}

TEST_F(RemoveTreeTest, RemovesLinksWithoutFollowingThem) {
  const std::string outside = root_ + "/outside";
  ASSERT_EQ(::mkdir(outside.c_str(), 0755), 0);
  Touch(outside + "/keep");
  const std::string t = root_ + "/tree";
  ASSERT_EQ(::mkdir(t.c_str(), 0755), 0);
  ASSERT_EQ(::symlink(outside.c_str(), (t + "/dir_link").c_str()), 0);
  ASSERT_EQ(::symlink((outside + "/keep").c_str(), (t + "/file_link").c_str()), 0);
  ASSERT_TRUE(RemoveTree(t).ok());
  EXPECT_FALSE(Exists(t));
  EXPECT_TRUE(Exists(outside + "/keep"));
  // A link given as the path itself goes; its target stays.
  const std::string link = root_ + "/link";
  ASSERT_EQ(::symlink(outside.c_str(), link.c_str()), 0);
  ASSERT_TRUE(RemoveTree(link).ok());
  EXPECT_FALSE(Exists(link));
  EXPECT_TRUE(Exists(outside + "/keep"));
}

TEST_F(RemoveTreeTest, RemovesAPlainFileAndAcceptsAMissingPath) {
  Touch(root_ + "/file");
  EXPECT_TRUE(RemoveTree(root_ + "/file").ok());
  EXPECT_FALSE(Exists(root_ + "/file"));
  EXPECT_TRUE(RemoveTree(root_ + "/never_there").ok());
}

TEST_F(RemoveTreeTest, ReportsWhatItCannotRemove) {
  Touch(root_ + "/file");
  const absl::Status s = RemoveTree(root_ + "/file/below");  // a file is not a directory
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("file/below"), std::string::npos) << s;
  EXPECT_TRUE(Exists(root_ + "/file"));
}

}  // namespace
}  // namespace aqswarm
