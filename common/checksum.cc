#include "common/checksum.h"

#include <new>

#define XXH_STATIC_LINKING_ONLY  // the definition of XXH3_state_t, to hold it in place
#include <xxhash.h>

namespace aqswarm {

uint64_t Checksum64(const void* data, size_t size, uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}

namespace {
XXH3_state_t* State(unsigned char* p) { return std::launder(reinterpret_cast<XXH3_state_t*>(p)); }
const XXH3_state_t* State(const unsigned char* p) {
  return std::launder(reinterpret_cast<const XXH3_state_t*>(p));
}
}  // namespace

Checksummer::Checksummer(uint64_t seed) {
  static_assert(sizeof(XXH3_state_t) <= kStateBytes, "XXH3_state_t outgrew Checksummer::state_");
  static_assert(alignof(XXH3_state_t) <= 64, "XXH3_state_t needs more alignment than Checksummer::state_");
  XXH3_state_t* state = new (state_) XXH3_state_t;
  XXH3_INITSTATE(state);  // as XXH3_createState does: reset_withSeed reads the previous seed
  XXH3_64bits_reset_withSeed(state, seed);
}
Checksummer::~Checksummer() = default;  // XXH3_state_t is plain data
void Checksummer::Update(const void* data, size_t size) { XXH3_64bits_update(State(state_), data, size); }
uint64_t Checksummer::Digest() const { return XXH3_64bits_digest(State(state_)); }

}  // namespace aqswarm
