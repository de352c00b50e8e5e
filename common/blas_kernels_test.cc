#include "common/blas_kernels.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace aqswarm {
namespace {

// This test binary does not link OpenBLAS (no torch in common/).
TEST(BlasKernelsTest, WithoutOpenBlasNothingIsSet) {
  unsetenv("OPENBLAS_CORETYPE");
  EXPECT_EQ(OpenBlasCore(), "");
  EXPECT_EQ(PickOpenBlasCoreForChildren(), "");
  EXPECT_EQ(std::getenv("OPENBLAS_CORETYPE"), nullptr);
}

TEST(BlasKernelsTest, AnExplicitChoiceIsLeftAlone) {
  setenv("OPENBLAS_CORETYPE", "Prescott", 1);
  EXPECT_EQ(PickOpenBlasCoreForChildren(), "Prescott");
  EXPECT_STREQ(std::getenv("OPENBLAS_CORETYPE"), "Prescott");
  unsetenv("OPENBLAS_CORETYPE");
}

}  // namespace
}  // namespace aqswarm
