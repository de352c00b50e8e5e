// OpenBLAS (libtorch's BLAS on Debian) picks its kernels by CPU model when it
// loads, and a model it does not know gets the generic ones: on this project's
// Xeons (family 6 model 207) Debian's OpenBLAS 0.3.21 ran sgemm on the Prescott
// (SSE3) kernels, ~25% of a stage's CPU (docs/notebook/slownet.md, OpenBLAS kernels).
// A process cannot change its own choice, only that of the processes it
// starts, through OPENBLAS_CORETYPE:
//
//   const std::string core = PickOpenBlasCoreForChildren();  // before spawning stages
//
// Kernel choice changes float rounding, not an invariant: replicas stay
// bit-identical (they apply the same averaged update elementwise) and both
// ends of an AQ-SGD link keep the values that were sent, not recomputed ones.
#ifndef AQSWARM_COMMON_BLAS_KERNELS_H_
#define AQSWARM_COMMON_BLAS_KERNELS_H_

#include <string>

namespace aqswarm {

// OpenBLAS's kernel set in this process ("" when OpenBLAS is not loaded).
std::string OpenBlasCore();

// The kernel set child processes will use: OPENBLAS_CORETYPE when set (left
// alone: `OPENBLAS_CORETYPE=Prescott` reproduces runs made before this
// existed), else OpenBLAS's own choice, except that a pre-AVX2 choice on a CPU
// with AVX2 and FMA sets OPENBLAS_CORETYPE to SkylakeX (with AVX-512F) or
// Haswell, and says so on stderr once. "" without OpenBLAS.
std::string PickOpenBlasCoreForChildren();

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_BLAS_KERNELS_H_
