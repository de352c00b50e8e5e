// The torch device the end-to-end tests put their stages on.
#ifndef AQSWARM_TESTS_INTEGRATION_TEST_DEVICE_H_
#define AQSWARM_TESTS_INTEGRATION_TEST_DEVICE_H_

#include <cstdlib>
#include <string>

namespace aqswarm {

// AQSWARM_TEST_DEVICE (e.g. "cuda:0", on a machine with a GPU and a CUDA
// libtorch: scripts/cuda_check.sh), else "cpu".
inline std::string TestDevice() {
  const char* d = std::getenv("AQSWARM_TEST_DEVICE");
  return d != nullptr && *d != '\0' ? d : "cpu";
}

}  // namespace aqswarm

#endif  // AQSWARM_TESTS_INTEGRATION_TEST_DEVICE_H_
