// A fresh directory for one test, removed (with everything in it) when the
// fixture goes away.
//
//   testing::ScratchDir dir;                 // under $TEST_TMPDIR, $TMPDIR or /tmp
//   Open(dir.Sub("store"));                  // <dir>/store
#ifndef AQSWARM_TESTS_TESTING_SCRATCH_DIR_H_
#define AQSWARM_TESTS_TESTING_SCRATCH_DIR_H_

#include <string>

namespace aqswarm::testing {

class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace aqswarm::testing

#endif  // AQSWARM_TESTS_TESTING_SCRATCH_DIR_H_
