#include "compression/bit_pack.h"

#include <cstring>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "bit packing assumes a little-endian host");

namespace aqswarm::compression {
namespace {

// 8 codes -> B bytes. The loop over j has constant shifts, so the compiler
// unrolls it fully; the outer loop auto-vectorises for the aligned widths.
template <int B>
void PackGroups(const uint8_t* codes, size_t groups, uint8_t* out) {
  constexpr uint64_t kMask = (1u << B) - 1;
  for (size_t g = 0; g < groups; ++g) {
    uint64_t v = 0;
    for (int j = 0; j < 8; ++j) v |= (static_cast<uint64_t>(codes[8 * g + j]) & kMask) << (j * B);
    std::memcpy(out + B * g, &v, B);
  }
}

template <int B>
void UnpackGroups(const uint8_t* in, size_t groups, uint8_t* codes) {
  constexpr uint64_t kMask = (1u << B) - 1;
  for (size_t g = 0; g < groups; ++g) {
    uint64_t v = 0;
    std::memcpy(&v, in + B * g, B);
    for (int j = 0; j < 8; ++j) codes[8 * g + j] = static_cast<uint8_t>((v >> (j * B)) & kMask);
  }
}

// Byte-aligned widths: simpler loops that vectorise well.
__attribute__((target_clones("avx2", "default")))
void Pack4(const uint8_t* codes, size_t groups, uint8_t* out) {
  const size_t bytes = groups * 4;
  for (size_t i = 0; i < bytes; ++i) {
    out[i] = static_cast<uint8_t>((codes[2 * i] & 15u) | ((codes[2 * i + 1] & 15u) << 4));
  }
}
__attribute__((target_clones("avx2", "default")))
void Unpack4(const uint8_t* in, size_t groups, uint8_t* codes) {
  const size_t bytes = groups * 4;
  for (size_t i = 0; i < bytes; ++i) {
    codes[2 * i] = in[i] & 15u;
    codes[2 * i + 1] = in[i] >> 4;
  }
}
__attribute__((target_clones("avx2", "default")))
void Pack2(const uint8_t* codes, size_t groups, uint8_t* out) {
  const size_t bytes = groups * 2;
  for (size_t i = 0; i < bytes; ++i) {
    const uint8_t* c = codes + 4 * i;
    out[i] = static_cast<uint8_t>((c[0] & 3u) | ((c[1] & 3u) << 2) | ((c[2] & 3u) << 4) |
                                  ((c[3] & 3u) << 6));
  }
}
__attribute__((target_clones("avx2", "default")))
void Unpack2(const uint8_t* in, size_t groups, uint8_t* codes) {
  const size_t bytes = groups * 2;
  for (size_t i = 0; i < bytes; ++i) {
    uint8_t* c = codes + 4 * i;
    c[0] = in[i] & 3u;
    c[1] = (in[i] >> 2) & 3u;
    c[2] = (in[i] >> 4) & 3u;
    c[3] = in[i] >> 6;
  }
}

void PackFull(const uint8_t* codes, size_t groups, int bits, uint8_t* out) {
  switch (bits) {
    case 1: PackGroups<1>(codes, groups, out); return;
    case 2: Pack2(codes, groups, out); return;
    case 3: PackGroups<3>(codes, groups, out); return;
    case 4: Pack4(codes, groups, out); return;
    case 5: PackGroups<5>(codes, groups, out); return;
    case 6: PackGroups<6>(codes, groups, out); return;
    case 7: PackGroups<7>(codes, groups, out); return;
    case 8: std::memcpy(out, codes, groups * 8); return;
  }
}

void UnpackFull(const uint8_t* in, size_t groups, int bits, uint8_t* codes) {
  switch (bits) {
    case 1: UnpackGroups<1>(in, groups, codes); return;
    case 2: Unpack2(in, groups, codes); return;
    case 3: UnpackGroups<3>(in, groups, codes); return;
    case 4: Unpack4(in, groups, codes); return;
    case 5: UnpackGroups<5>(in, groups, codes); return;
    case 6: UnpackGroups<6>(in, groups, codes); return;
    case 7: UnpackGroups<7>(in, groups, codes); return;
    case 8: std::memcpy(codes, in, groups * 8); return;
  }
}

}  // namespace

void PackBits(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  const size_t groups = n / 8;
  PackFull(codes, groups, bits, out);
  const size_t rem = n % 8;
  if (rem == 0) return;
  // Tail: pad to a full group in scratch, then copy only the bytes it owns.
  uint8_t tmp_codes[8] = {0};
  uint8_t tmp_out[8] = {0};
  std::memcpy(tmp_codes, codes + 8 * groups, rem);
  PackFull(tmp_codes, 1, bits, tmp_out);
  std::memcpy(out + groups * bits, tmp_out, (rem * bits + 7) / 8);
}

void UnpackBits(const uint8_t* in, size_t n, int bits, uint8_t* codes) {
  const size_t groups = n / 8;
  UnpackFull(in, groups, bits, codes);
  const size_t rem = n % 8;
  if (rem == 0) return;
  uint8_t tmp_in[8] = {0};
  uint8_t tmp_codes[8];
  std::memcpy(tmp_in, in + groups * bits, (rem * bits + 7) / 8);
  UnpackFull(tmp_in, 1, bits, tmp_codes);
  std::memcpy(codes + 8 * groups, tmp_codes, rem);
}

}  // namespace aqswarm::compression
