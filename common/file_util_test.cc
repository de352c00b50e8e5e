#include "common/file_util.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm {
namespace {

using ::aqswarm::testing::IsOk;
using ::aqswarm::testing::ScratchDir;
using ::aqswarm::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

bool Exists(const std::string& p) {
  struct stat st;
  return ::lstat(p.c_str(), &st) == 0;
}

void Touch(const std::string& p) { std::ofstream(p) << "x"; }

// The names in a directory, sorted ("." and ".." left out).
std::vector<std::string> List(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::string Read(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

mode_t Mode(const std::string& p) {
  struct stat st;
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

class RemoveTreeTest : public ::testing::Test {
 protected:
  ScratchDir dir_;
  const std::string root_ = dir_.path();
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

TEST(WriteFileAtomicallyTest, WritesTheContentsWithTheModeAndLeavesNoTempFile) {
  ScratchDir dir;
  const std::string path = dir.Sub("secret");
  ASSERT_THAT(WriteFileAtomically(path, std::string("ab\0c", 4), 0640), IsOk());
  EXPECT_EQ(Read(path), std::string("ab\0c", 4));
  EXPECT_EQ(Mode(path), 0640u);  // not reduced by the umask
  EXPECT_THAT(List(dir.path()), ElementsAre("secret"));
  // Over an existing file: replaced whole, with the new mode.
  ASSERT_THAT(WriteFileAtomically(path, "second", 0600), IsOk());
  EXPECT_EQ(Read(path), "second");
  EXPECT_EQ(Mode(path), 0600u);
  ASSERT_THAT(WriteFileAtomically(path, "", 0644), IsOk());
  EXPECT_EQ(Read(path), "");
  EXPECT_THAT(List(dir.path()), ElementsAre("secret"));
}

TEST(WriteFileAtomicallyTest, AFailureLeavesNoTempFileAndNamesThePath) {
  ScratchDir dir;
  // A missing directory: no temp file can be created.
  EXPECT_THAT(WriteFileAtomically(dir.Sub("missing/f"), "x", 0644),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing/f")));
  EXPECT_TRUE(List(dir.path()).empty());
  // The target is a directory: the rename fails after the temp file was written.
  ASSERT_EQ(::mkdir(dir.Sub("d").c_str(), 0755), 0);
  Touch(dir.Sub("d/keep"));
  const absl::Status s = WriteFileAtomically(dir.Sub("d"), "x", 0644);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal, HasSubstr("renaming into " + dir.Sub("d"))));
  EXPECT_THAT(List(dir.path()), ElementsAre("d"));
  EXPECT_THAT(List(dir.Sub("d")), ElementsAre("keep"));
}

TEST(PublishFileAtomicallyTest, ReplacesAnExistingFileAndKeepsTheWrittenMode) {
  ScratchDir dir;
  const std::string path = dir.Sub("cache.bin");
  const std::string tmp = dir.Sub("cache.bin.tmp.7");
  std::ofstream(path) << "old";
  std::ofstream(tmp) << "new contents";
  ASSERT_EQ(::chmod(tmp.c_str(), 0604), 0);
  ASSERT_THAT(PublishFileAtomically(tmp, path), IsOk());
  EXPECT_EQ(Read(path), "new contents");
  EXPECT_EQ(Mode(path), 0604u);
  EXPECT_THAT(List(dir.path()), ElementsAre("cache.bin"));
}

TEST(PublishFileAtomicallyTest, AFailedRenameRemovesTheTempFileAndNamesThePath) {
  ScratchDir dir;
  ASSERT_EQ(::mkdir(dir.Sub("d").c_str(), 0755), 0);
  Touch(dir.Sub("d/keep"));
  const std::string tmp = dir.Sub("d.tmp");
  std::ofstream(tmp) << "x";
  EXPECT_THAT(PublishFileAtomically(tmp, dir.Sub("d")),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("renaming into " + dir.Sub("d"))));
  EXPECT_THAT(List(dir.path()), ElementsAre("d"));
  EXPECT_THAT(List(dir.Sub("d")), ElementsAre("keep"));
  // Into a missing directory: the same.
  std::ofstream(tmp) << "x";
  EXPECT_THAT(PublishFileAtomically(tmp, dir.Sub("missing/f")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing/f")));
  EXPECT_THAT(List(dir.path()), ElementsAre("d"));
  // No temp file at all: NotFound, naming it.
  EXPECT_THAT(PublishFileAtomically(dir.Sub("gone.tmp"), dir.Sub("f")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("gone.tmp")));
}

}  // namespace
}  // namespace aqswarm
