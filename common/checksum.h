// Checksums for wire messages and stored rows: XXH3-64 (fast, portable,
// identical on every platform). Seed 0 unless a caller needs domain separation.
#ifndef AQSWARM_COMMON_CHECKSUM_H_
#define AQSWARM_COMMON_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace aqswarm {

uint64_t Checksum64(const void* data, size_t size, uint64_t seed = 0);

// Incremental form: feed pieces, then Digest(). Same value as Checksum64 of the
// concatenation. The hash state lives inside the object (no allocation): a
// Checksummer on the stack is cheap enough for a few dozen bytes per row.
class Checksummer {
 public:
  explicit Checksummer(uint64_t seed = 0);
  ~Checksummer();
  Checksummer(const Checksummer&) = delete;
  Checksummer& operator=(const Checksummer&) = delete;
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  // An XXH3_state_t (576 bytes in xxHash 0.8, 64-byte aligned); checksum.cc
  // checks that it fits.
  static constexpr size_t kStateBytes = 640;
  alignas(64) unsigned char state_[kStateBytes];
};

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_CHECKSUM_H_
