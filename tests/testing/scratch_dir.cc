#include "tests/testing/scratch_dir.h"

#include <stdlib.h>

#include <cstdlib>

#include "common/file_util.h"
#include "gtest/gtest.h"

namespace aqswarm::testing {

ScratchDir::ScratchDir() {
  std::string root;
  for (const char* var : {"TEST_TMPDIR", "TMPDIR"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && *v != '\0') {
      root = v;
      break;
    }
  }
  if (root.empty()) root = "/tmp";
  std::string templ = root + "/aqswarm_test_XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) {
    ADD_FAILURE() << "cannot create a scratch directory under " << root;
    return;
  }
  path_ = templ;
}

ScratchDir::~ScratchDir() {
  if (!path_.empty()) RemoveTree(path_).IgnoreError();
}

}  // namespace aqswarm::testing
