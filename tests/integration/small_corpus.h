// A fresh scratch directory for one test, holding a small corpus: the first
// `bytes` bytes of the first State of the Union speech (by name) as
// <dir>/corpus/small.txt.
#ifndef AQSWARM_TESTS_INTEGRATION_SMALL_CORPUS_H_
#define AQSWARM_TESTS_INTEGRATION_SMALL_CORPUS_H_

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gtest/gtest.h"

namespace aqswarm::testing {

// <tmp>/<prefix><pid>_<test name>, emptied, with corpus/small.txt from
// <data_dir>/sotu. Fails the test (ASSERT) when the corpus is missing.
inline void MakeSmallCorpusDir(const std::string& prefix, const std::string& data_dir, size_t bytes,
                               std::filesystem::path* dir) {
  namespace fs = std::filesystem;
  *dir = fs::temp_directory_path() /
         absl::StrCat(prefix, ::getpid(), "_", ::testing::UnitTest::GetInstance()->current_test_info()->name());
  RemoveTree(*dir).IgnoreError();
  fs::create_directories(*dir / "corpus");
  std::vector<fs::path> files;
  for (auto& e : fs::directory_iterator(fs::path(data_dir) / "sotu")) files.push_back(e.path());
  ASSERT_FALSE(files.empty());
  std::sort(files.begin(), files.end());
  std::ifstream in(files[0]);
  std::string text(bytes, '\0');
  in.read(text.data(), text.size());
  text.resize(in.gcount());
  std::ofstream(*dir / "corpus" / "small.txt") << text;
}

}  // namespace aqswarm::testing

#endif  // AQSWARM_TESTS_INTEGRATION_SMALL_CORPUS_H_
