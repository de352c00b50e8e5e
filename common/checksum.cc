#include "common/checksum.h"

#include <xxhash.h>

namespace aqswarm {

uint64_t Checksum64(const void* data, size_t size, uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}

Checksummer::Checksummer(uint64_t seed) : state_(XXH3_createState()) {
  XXH3_64bits_reset_withSeed(static_cast<XXH3_state_t*>(state_), seed);
}
Checksummer::~Checksummer() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Checksummer::Update(const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
uint64_t Checksummer::Digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

}  // namespace aqswarm
