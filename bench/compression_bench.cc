#include "bench/bench.h"
namespace aqswarm::bench {
absl::Status RunCompressionBench(const CompressionBenchOptions&, std::ostream&) {
  return absl::UnimplementedError("not built yet");
}
}  // namespace aqswarm::bench
