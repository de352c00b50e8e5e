// Dense bit packing of small unsigned codes (1..8 bits each).
//
// Layout (the wire contract of every packed codec): code i occupies bits
// [i*b, i*b + b) of the little-endian bit stream, least significant bit
// first. So 8 codes fill exactly b bytes, and n codes take ceil(n*b/8) bytes;
// the unused high bits of the last byte are written as zero and ignored when
// unpacking.
//
// Example:
//   std::vector<uint8_t> codes = {1, 2, 3};
//   std::vector<uint8_t> bytes(PackedBytes(codes.size(), 2));
//   PackBits(codes.data(), codes.size(), 2, bytes.data());   // bytes = {0x39}
//   UnpackBits(bytes.data(), codes.size(), 2, codes.data());
//
// Codes must already fit in b bits (higher bits are masked off). Thread-safe
// (pure functions). Widths 1, 2, 4 and 8 have byte-aligned fast paths; the
// others pack 8 codes per b bytes with BMI2's PEXT/PDEP where the CPU has
// them, else with an unrolled shift-and-mask loop.
#ifndef AQSWARM_COMPRESSION_BIT_PACK_H_
#define AQSWARM_COMPRESSION_BIT_PACK_H_

#include <cstddef>
#include <cstdint>

namespace aqswarm::compression {

// ceil(n * bits / 8); `bits` in 1..8. Callers must bound n (n*8 must not
// overflow), which wire validation does.
inline size_t PackedBytes(size_t n, int bits) {
  return (n / 8) * static_cast<size_t>(bits) + (n % 8 * static_cast<size_t>(bits) + 7) / 8;
}

// Packs n codes of `bits` bits (1..8) into PackedBytes(n, bits) bytes.
void PackBits(const uint8_t* codes, size_t n, int bits, uint8_t* out);

// Inverse of PackBits: reads PackedBytes(n, bits) bytes, writes n codes.
void UnpackBits(const uint8_t* in, size_t n, int bits, uint8_t* codes);

namespace internal {
// Tests only: false forces the portable loops on a CPU with BMI2.
void AllowBmi2ForTesting(bool allow);
}  // namespace internal

}  // namespace aqswarm::compression

#endif  // AQSWARM_COMPRESSION_BIT_PACK_H_
