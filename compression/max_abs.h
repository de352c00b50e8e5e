// Largest |x| of a float span as its IEEE bit pattern (sign cleared), by an
// integer max that vectorises: finite values order like their bit patterns,
// and NaN/Inf (>= 0x7f800000) sort above every finite value, so one pass
// gives both the max magnitude and a finite check. Internal to compression/.
#ifndef AQSWARM_COMPRESSION_MAX_ABS_H_
#define AQSWARM_COMPRESSION_MAX_ABS_H_

#include <cstddef>
#include <cstdint>

namespace aqswarm::compression::internal {

uint32_t MaxAbsBits(const float* x, size_t n);

}  // namespace aqswarm::compression::internal

#endif  // AQSWARM_COMPRESSION_MAX_ABS_H_
