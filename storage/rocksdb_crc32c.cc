#include "storage/rocksdb_crc32c.h"

#include <dlfcn.h>

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

// librocksdb's symbol (util/crc32c.h is not installed): same signature, so
// the same mangled name, _ZN7rocksdb6crc32c6ExtendEjPKcm.
namespace rocksdb::crc32c {
__attribute__((visibility("default"), used)) uint32_t Extend(uint32_t crc, const char* data,
                                                            size_t n);
}  // namespace rocksdb::crc32c

namespace aqswarm::storage::internal {
namespace {

constexpr char kExtendSymbol[] = "_ZN7rocksdb6crc32c6ExtendEjPKcm";

#if defined(__x86_64__)
// Bytes per stream in the three-stream loop: the crc32 instruction has a
// latency of 3 cycles and a throughput of 1, so three independent streams
// keep it busy; their registers are then combined with the linear map
// "append kStreamBytes zero bytes" (ShiftTables).
constexpr size_t kStreamBytes = 4096;

__attribute__((target("sse4.2"))) uint64_t Crc64(uint64_t reg, const char* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    reg = _mm_crc32_u64(reg, v);
  }
  uint32_t r = static_cast<uint32_t>(reg);
  for (; n > 0; --n, ++p) r = _mm_crc32_u8(r, static_cast<uint8_t>(*p));
  return r;
}

// T[k][b]: the register after kStreamBytes zero bytes, starting from byte b
// at byte position k of the register (the map is linear over GF(2)).
struct ShiftTables {
  std::array<std::array<uint32_t, 256>, 4> t;
};

__attribute__((target("sse4.2"))) ShiftTables MakeShiftTables() {
  static const char zeros[kStreamBytes] = {};
  uint32_t column[32];
  for (int bit = 0; bit < 32; ++bit) {
    column[bit] = static_cast<uint32_t>(Crc64(uint64_t{1} << bit, zeros, kStreamBytes));
  }
  ShiftTables s;
  for (int k = 0; k < 4; ++k) {
    for (int b = 0; b < 256; ++b) {
      uint32_t v = 0;
      for (int j = 0; j < 8; ++j) {
        if (b & (1 << j)) v ^= column[8 * k + j];
      }
      s.t[k][b] = v;
    }
  }
  return s;
}

inline uint32_t Shift(const ShiftTables& s, uint32_t reg) {
  return s.t[0][reg & 0xff] ^ s.t[1][(reg >> 8) & 0xff] ^ s.t[2][(reg >> 16) & 0xff] ^
         s.t[3][reg >> 24];
}

__attribute__((target("sse4.2"))) uint32_t HardwareExtend(uint32_t crc, const char* p, size_t n) {
  static const ShiftTables tables = MakeShiftTables();
  uint64_t reg = ~crc;
  for (; n >= 3 * kStreamBytes; n -= 3 * kStreamBytes, p += 3 * kStreamBytes) {
    uint64_t a = static_cast<uint32_t>(reg), b = 0, c = 0;
    for (size_t i = 0; i < kStreamBytes; i += 8) {
      uint64_t va, vb, vc;
      std::memcpy(&va, p + i, 8);
      std::memcpy(&vb, p + kStreamBytes + i, 8);
      std::memcpy(&vc, p + 2 * kStreamBytes + i, 8);
      a = _mm_crc32_u64(a, va);
      b = _mm_crc32_u64(b, vb);
      c = _mm_crc32_u64(c, vc);
    }
    // reg(s, A|B|C) = shift(shift(reg(s, A)) ^ reg(0, B)) ^ reg(0, C).
    reg = Shift(tables, Shift(tables, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
          static_cast<uint32_t>(c);
  }
  reg = Crc64(static_cast<uint32_t>(reg), p, n);
  return ~static_cast<uint32_t>(reg);
}

bool HasSse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif  // __x86_64__

// Bit-at-a-time CRC32C: only reached where neither SSE4.2 nor the library's
// symbol is available.
uint32_t PortableExtend(uint32_t crc, const char* p, size_t n) {
  uint32_t reg = ~crc;
  for (size_t i = 0; i < n; ++i) {
    reg ^= static_cast<uint8_t>(p[i]);
    for (int k = 0; k < 8; ++k) reg = (reg >> 1) ^ (0x82f63b78u & (0u - (reg & 1u)));
  }
  return ~reg;
}

}  // namespace

Crc32cExtendFn LibraryCrc32cExtend() {
  static const Crc32cExtendFn fn =
      reinterpret_cast<Crc32cExtendFn>(::dlsym(RTLD_NEXT, kExtendSymbol));
  return fn;
}

bool Crc32cIsHardware() {
#if defined(__x86_64__)
  return HasSse42();
#else
  return false;
#endif
}

uint32_t Crc32cExtend(uint32_t crc, const char* data, size_t n) {
#if defined(__x86_64__)
  if (HasSse42()) return HardwareExtend(crc, data, n);
#endif
  if (Crc32cExtendFn library = LibraryCrc32cExtend(); library != nullptr) {
    return library(crc, data, n);
  }
  return PortableExtend(crc, data, n);
}

bool Crc32cOverrideBound() {
  void* bound = ::dlsym(RTLD_DEFAULT, kExtendSymbol);
  return bound == reinterpret_cast<void*>(&rocksdb::crc32c::Extend);
}

}  // namespace aqswarm::storage::internal

namespace rocksdb::crc32c {

uint32_t Extend(uint32_t crc, const char* data, size_t n) {
  return aqswarm::storage::internal::Crc32cExtend(crc, data, n);
}

}  // namespace rocksdb::crc32c
