// Counter-based randomness: the value for element i of stream (seed, stream)
// is a pure function of (seed, stream, i). Quantizers use it so that
// stochastic rounding is reproducible from the seed, independent of threading
// or vector width, and cheap enough to vectorise.
#ifndef AQSWARM_COMMON_RANDOM_H_
#define AQSWARM_COMMON_RANDOM_H_

#include <cstdint>

namespace aqswarm {

// SplitMix64 finaliser: a bijective 64-bit mixer.
inline uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A 32-bit mixer (lowbias32, Wellons) for per-element draws.
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Key for one stream: derive once per message, then draw per element.
inline uint32_t StreamKey(uint64_t seed, uint64_t stream) {
  return static_cast<uint32_t>(Mix64(seed ^ Mix64(stream)));
}

// Uniform 32-bit draw for element `i` of a stream.
inline uint32_t DrawU32(uint32_t key, uint32_t i) { return Mix32(i * 0x9e3779b9u + key); }

// Uniform in [0, 1) with 24 bits of resolution (exact in float).
inline float DrawUnit(uint32_t key, uint32_t i) {
  return static_cast<float>(DrawU32(key, i) >> 8) * (1.0f / 16777216.0f);
}

// Sequential generator for non-hot paths (tests, permutations).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return Mix64(state_++); }
  // Uniform in [0, n).
  uint64_t Uniform(uint64_t n) { return static_cast<uint64_t>((static_cast<unsigned __int128>(Next()) * n) >> 64); }
  double UnitDouble() { return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0); }

 private:
  uint64_t state_;
};

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_RANDOM_H_
