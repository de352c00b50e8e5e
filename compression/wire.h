// Validation of untrusted aqswarm.v1.EncodedTensor messages (the proto's
// contract). Every Decode() calls ValidateEncodedTensor first, so a hostile
// or corrupt message yields an error status: never a crash, an out-of-bounds
// read or an allocation sized by unchecked fields.
//
// Checked, in this order, using only the message's header fields and the
// lengths of its byte strings (nothing is allocated or decoded before):
//   format_version == kFormatVersion; codec known; rounding/levels/norm known;
//   bits legal for the codec; bucket_size in 1..limits.max_bucket_size where
//   used; rank <= limits.max_rank; every dim in 0..limits.max_elements;
//   product of dims (overflow-checked) == num_elements <= limits.max_elements;
//   Global-QSGD: num_levels, num_summed, exponent_shift and the accumulator
//   width rule; scales and payload lengths exactly as ExpectedSizes says;
//   ENTROPY_ZSTD (fixed point, QSGD, min-max, tiled only): the payload is
//   exactly one zstd frame whose declared content is num_elements bytes;
//   tiled: tile size a power of two in 2..4096, tile_order and tile_grid
//   known (TILES_ALONG_ROWS and TILE_GRID_MIDRISE for every other codec),
//   midtread only with bits >= 2;
//   then the scale values (finite, and >= 0 where they are magnitudes; tiled:
//   rotation bits only on whole tiles);
//   then the checksum (XXH3-64 of scales||payload) when present.
//
// Example:
//   WireLimits limits;  limits.max_elements = 1 << 24;
//   AQSWARM_RETURN_IF_ERROR(ValidateEncodedTensor(msg, limits));
#ifndef AQSWARM_COMPRESSION_WIRE_H_
#define AQSWARM_COMPRESSION_WIRE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/tensor.pb.h"

namespace aqswarm::compression {

inline constexpr uint32_t kFormatVersion = 1;

struct WireLimits {
  // Largest num_elements (and largest single dim) accepted. Default: 2^30.
  uint64_t max_elements = uint64_t{1} << 30;
  // Largest number of dims. Default: 8.
  int max_rank = 8;
  // Largest bucket_size for bucketed codecs. Default: 2^24.
  uint64_t max_bucket_size = uint64_t{1} << 24;
};

struct ExpectedSizes {
  uint64_t scales_bytes = 0;
  uint64_t payload_bytes = 0;
};

// Exact byte lengths implied by the (already range-checked) header fields of
// `msg`; InvalidArgument when the header itself is illegal. Does not look at
// the byte strings.
absl::StatusOr<ExpectedSizes> ExpectedEncodedSizes(const v1::EncodedTensor& msg,
                                                   const WireLimits& limits = WireLimits());

// OK iff `msg` is safe to decode; see the header comment for the checks.
// InvalidArgument for illegal headers, DataLoss for wrong lengths, bad scale
// values or a checksum mismatch.
absl::Status ValidateEncodedTensor(const v1::EncodedTensor& msg,
                                   const WireLimits& limits = WireLimits());

// XXH3-64 of scales || payload (the value of the optional checksum field).
uint64_t EncodedTensorChecksum(const v1::EncodedTensor& msg);

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_WIRE_H_
