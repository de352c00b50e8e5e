// Checksums for wire messages and stored rows: XXH3-64 (fast, portable,
// identical on every platform). Seed 0 unless a caller needs domain separation.
#ifndef AQSWARM_COMMON_CHECKSUM_H_
#define AQSWARM_COMMON_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace aqswarm {

uint64_t Checksum64(const void* data, size_t size, uint64_t seed = 0);

// Incremental form: feed pieces, then Digest(). Same value as Checksum64 of the
// concatenation.
class Checksummer {
 public:
  explicit Checksummer(uint64_t seed = 0);
  ~Checksummer();
  Checksummer(const Checksummer&) = delete;
  Checksummer& operator=(const Checksummer&) = delete;
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t
};

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_CHECKSUM_H_
