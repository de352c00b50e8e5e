#include "bench/bench.h"
namespace aqswarm::bench {
absl::Status RunStoreBench(const StoreBenchOptions&, std::ostream&) {
  return absl::UnimplementedError("not built yet");
}
}  // namespace aqswarm::bench
