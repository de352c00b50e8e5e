// `aqswarm bench compression`: encode/decode throughput of every codec on
// activation-like float32 data ([rows, 768], per-channel scaled Laplace),
// against memcpy of the same buffer measured in the same run. One thread;
// each cell is the best of `repeats` timed runs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "common/random.h"
#include "compression/codec.h"

namespace aqswarm::bench {
namespace {

using compression::CodecOptions;
constexpr int64_t kChannels = 768;

template <typename F>
double BestSeconds(int repeats, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

std::vector<float> ActivationLike(int64_t rows) {
  Rng rng(20240611);
  std::vector<float> chan(kChannels);
  for (auto& c : chan) c = static_cast<float>(0.05 + 2.0 * rng.UnitDouble() * rng.UnitDouble());
  std::vector<float> v(static_cast<size_t>(rows * kChannels));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < kChannels; ++c) {
      const double u = rng.UnitDouble() - 0.5;  // Laplace via inverse CDF
      const double lap = (u < 0 ? 1 : -1) * std::log(1 - 2 * std::fabs(u) + 1e-300);
      v[r * kChannels + c] = static_cast<float>(chan[c] * lap);
    }
  }
  return v;
}

struct Cell {
  std::string codec;
  int bits;
  std::string rounding;
  std::string levels;
  CodecOptions options;
};

std::vector<Cell> Cells(const std::string& filter) {
  std::vector<std::string> wanted;
  if (!filter.empty()) wanted = absl::StrSplit(filter, ',', absl::SkipEmpty());
  auto want = [&](v1::Codec c) {
    return wanted.empty() || std::find(wanted.begin(), wanted.end(), compression::CodecName(c)) != wanted.end();
  };
  std::vector<Cell> cells;
  auto add = [&](v1::Codec c, int bits, v1::Rounding r, v1::LevelFamily lv, bool show_levels) {
    CodecOptions o;
    o.codec = c;
    o.bits = bits;
    o.rounding = r;
    o.levels = lv;
    o.bucket_size = 1024;
    o.min_compress_elements = 0;
    cells.push_back({compression::CodecName(c), bits,
                     r == v1::ROUNDING_NEAREST ? "nearest" : "stochastic",
                     show_levels ? (lv == v1::LEVELS_UNIFORM ? "uniform" : "exponential") : "", o});
  };
  if (want(v1::CODEC_RAW_F32)) add(v1::CODEC_RAW_F32, 32, v1::ROUNDING_NEAREST, v1::LEVELS_UNIFORM, false);
  if (want(v1::CODEC_RAW_F16)) add(v1::CODEC_RAW_F16, 16, v1::ROUNDING_NEAREST, v1::LEVELS_UNIFORM, false);
  for (v1::Codec c : {v1::CODEC_FIXED_POINT, v1::CODEC_QSGD, v1::CODEC_MINMAX}) {
    if (!want(c)) continue;
    // Fixed point also at 3 and 6 bits: AQ-SGD fw3bw6 links (odd widths
    // take the generic bit-packing path).
    const std::vector<int> widths =
        c == v1::CODEC_FIXED_POINT ? std::vector<int>{2, 3, 4, 6, 8} : std::vector<int>{2, 4, 8};
    for (int b : widths) {
      for (v1::Rounding r : {v1::ROUNDING_NEAREST, v1::ROUNDING_STOCHASTIC}) add(c, b, r, v1::LEVELS_UNIFORM, false);
    }
  }
  if (want(v1::CODEC_TILED)) {
    // The first-visit codec: tiles of 64; the "levels" column names the
    // rotation, and "+zstd" entropy coding.
    auto tiled = [&](int bits, compression::TileRotation rot, bool entropy) {
      add(v1::CODEC_TILED, bits, v1::ROUNDING_NEAREST, v1::LEVELS_UNIFORM, false);
      Cell& c = cells.back();
      c.options.bucket_size = 64;
      c.options.rotation = rot;
      c.options.entropy = entropy;
      c.levels = absl::StrCat(compression::TileRotationName(rot), entropy ? "+zstd" : "");
    };
    for (int b : {2, 3, 4}) tiled(b, compression::TileRotation::kOutliers, false);
    tiled(3, compression::TileRotation::kAll, false);
    tiled(3, compression::TileRotation::kNone, false);
    tiled(3, compression::TileRotation::kOutliers, true);
  }
  if (want(v1::CODEC_FIXED_POINT)) {
    add(v1::CODEC_FIXED_POINT, 3, v1::ROUNDING_NEAREST, v1::LEVELS_UNIFORM, false);
    cells.back().options.entropy = true;
    cells.back().levels = "+zstd";
  }
  if (want(v1::CODEC_GLOBAL_QSGD)) {
    for (v1::LevelFamily lv : {v1::LEVELS_UNIFORM, v1::LEVELS_EXPONENTIAL}) {
      for (int b : {2, 4, 8}) add(v1::CODEC_GLOBAL_QSGD, b, v1::ROUNDING_STOCHASTIC, lv, true);
    }
  }
  return cells;
}

}  // namespace

absl::Status RunCompressionBench(const CompressionBenchOptions& options, std::ostream& out) {
  if (options.mebibytes < 1 || options.mebibytes > 4096 || options.repeats < 1) {
    return absl::InvalidArgumentError("compression bench: need --mib in 1..4096 and --repeats >= 1");
  }
  const std::vector<Cell> cells = Cells(options.codecs);
  if (cells.empty()) return absl::InvalidArgumentError("compression bench: no codec matches --codecs");
  const int64_t rows = std::max<int64_t>(1, options.mebibytes * (1 << 20) / 4 / kChannels);
  const std::vector<float> x = ActivationLike(rows);
  const int64_t shape[2] = {rows, kChannels};
  const double bytes = 4.0 * static_cast<double>(x.size());
  std::vector<float> dst(x.size()), decoded(x.size());
  if (!options.json) {
    out << absl::StrFormat("compression bench: %d x %d float32 (%.1f MiB), best of %d, one thread\n",
                           rows, kChannels, bytes / (1 << 20), options.repeats);
    out << absl::StrFormat("%-12s %4s %-10s %-13s %9s %9s %9s %7s %7s %7s\n", "codec", "bits",
                           "rounding", "levels", "enc GB/s", "dec GB/s", "memcpy", "enc %", "dec %", "ratio");
  }
  for (const Cell& cell : cells) {
    const double t_copy = BestSeconds(options.repeats, [&] {
      std::memcpy(dst.data(), x.data(), 4 * x.size());
    });
    v1::EncodedTensor msg;
    absl::Status status;
    const double t_enc = BestSeconds(options.repeats, [&] {
      status = compression::Encode(cell.options, x, shape, 7, &msg);
    });
    if (!status.ok()) return status;
    const double t_dec = BestSeconds(options.repeats, [&] {
      status = compression::Decode(msg, absl::MakeSpan(decoded));
    });
    if (!status.ok()) return status;
    const double enc = bytes / t_enc / 1e9, dec = bytes / t_dec / 1e9, cpy = bytes / t_copy / 1e9;
    const double ratio = bytes / static_cast<double>(compression::EncodedBytes(msg));
    if (options.json) {
      out << absl::StrFormat(
          "{\"bench\":\"compression\",\"codec\":\"%s\",\"bits\":%d,\"rounding\":\"%s\",\"levels\":\"%s\","
          "\"encode_gbps\":%.3f,\"decode_gbps\":%.3f,\"memcpy_gbps\":%.3f,\"ratio\":%.3f,"
          "\"encode_pct_memcpy\":%.1f,\"decode_pct_memcpy\":%.1f,\"mib\":%d,\"repeats\":%d}\n",
          cell.codec, cell.bits, cell.rounding, cell.levels, enc, dec, cpy, ratio, 100 * enc / cpy,
          100 * dec / cpy, options.mebibytes, options.repeats);
    } else {
      out << absl::StrFormat("%-12s %4d %-10s %-13s %9.2f %9.2f %9.2f %6.0f%% %6.0f%% %7.2f\n", cell.codec,
                             cell.bits, cell.rounding, cell.levels, enc, dec, cpy, 100 * enc / cpy,
                             100 * dec / cpy, ratio);
    }
    out.flush();
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::bench
