#include "stage/stage_checkpoints.h"

#include <algorithm>
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/logging.h"

namespace aqswarm::stage {
namespace {

namespace fs = std::filesystem;

constexpr char kPinsFile[] = "pinned";
constexpr char kQuarantineDir[] = "quarantine";
constexpr size_t kMaxPinsBytes = 4096;

}  // namespace

std::string StageCheckpointPath(const std::string& dir, int64_t steps) {
  return (fs::path(dir) / absl::StrCat("state-", steps, ".ckpt")).string();
}

std::vector<int64_t> StageCheckpointSteps(const std::string& dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    absl::string_view name = e.path().filename().c_str();
    int64_t n = 0;
    if (absl::ConsumePrefix(&name, "state-") && absl::ConsumeSuffix(&name, ".ckpt") && absl::SimpleAtoi(name, &n)) {
      steps.push_back(n);
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string StageQuarantineDir(const std::string& dir) { return (fs::path(dir) / kQuarantineDir).string(); }

std::vector<std::string> QuarantinedStates(const std::string& dir) {
  std::vector<std::pair<fs::file_time_type, std::string>> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(StageQuarantineDir(dir), ec)) {
    const std::string name = e.path().filename().string();
    if (!absl::StartsWith(name, "state-") || !absl::EndsWith(name, ".ckpt")) continue;
    std::error_code tec;
    files.emplace_back(fs::last_write_time(e.path(), tec), name);
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> out;
  for (auto& [t, name] : files) out.push_back(std::move(name));
  return out;
}

namespace {

// Moves `path` (state `step`) into the quarantine of `dir`.
bool Quarantine(const std::string& dir, int64_t step) {
  const fs::path q = StageQuarantineDir(dir);
  std::error_code ec;
  fs::create_directories(q, ec);
  const int64_t ms = absl::ToUnixMillis(absl::Now());
  fs::path to = q / absl::StrCat("state-", step, "-at-", ms, ".ckpt");
  for (int i = 1; fs::exists(to, ec); ++i) to = q / absl::StrCat("state-", step, "-at-", ms, "-", i, ".ckpt");
  fs::rename(StageCheckpointPath(dir, step), to, ec);
  if (ec) {
    AQSWARM_LOG(WARNING) << "cannot quarantine " << StageCheckpointPath(dir, step) << " (" << ec.message()
                         << "): removing it";
    fs::remove(StageCheckpointPath(dir, step), ec);
    return false;
  }
  // The rename is durable before anything else changes.
  const int dfd = ::open(q.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return true;
}

// Drops the oldest quarantined states until `limits` hold.
void TrimQuarantine(const std::string& dir, const QuarantineLimits& limits) {
  std::vector<std::string> names = QuarantinedStates(dir);  // oldest first
  const fs::path q = StageQuarantineDir(dir);
  std::error_code ec;
  uint64_t bytes = 0;
  for (const auto& n : names) bytes += fs::file_size(q / n, ec);
  size_t drop = 0;
  while (drop + 1 < names.size() &&
         (names.size() - drop > std::max<size_t>(limits.max_files, 1) ||
          (limits.max_bytes > 0 && bytes > limits.max_bytes))) {
    std::error_code sec;
    const uint64_t size = fs::file_size(q / names[drop], sec);
    bytes -= sec ? 0 : size;
    fs::remove(q / names[drop], ec);
    ++drop;
  }
}

}  // namespace

size_t PruneStageCheckpoints(const std::string& dir, int64_t past, size_t keep, const QuarantineLimits& limits) {
  std::vector<int64_t> steps = StageCheckpointSteps(dir);  // ascending
  std::error_code ec;
  size_t quarantined = 0;
  while (!steps.empty() && steps.back() > past) {
    if (Quarantine(dir, steps.back())) ++quarantined;
    steps.pop_back();
  }
  if (quarantined > 0) TrimQuarantine(dir, limits);
  absl::StatusOr<std::vector<int64_t>> pins = ReadStageCheckpointPins(dir);
  if (!pins.ok()) {
    AQSWARM_LOG(WARNING) << "keeping every state in " << dir << ": " << pins.status();
    return quarantined;
  }
  for (size_t i = 0; i + keep < steps.size(); ++i) {
    if (std::binary_search(pins->begin(), pins->end(), steps[i])) continue;
    fs::remove(StageCheckpointPath(dir, steps[i]), ec);
  }
  return quarantined;
}

absl::Status WriteStageCheckpointPins(const std::string& dir, const std::vector<int64_t>& steps) {
  for (int64_t s : steps) {
    if (s < 0) return absl::InvalidArgumentError(absl::StrCat("pinned step ", s, " is negative"));
  }
  const fs::path path = fs::path(dir) / kPinsFile;
  std::error_code ec;
  if (steps.empty()) {
    fs::remove(path, ec);
    return ec ? absl::InternalError(absl::StrCat("removing ", path.string(), ": ", ec.message())) : absl::OkStatus();
  }
  fs::create_directories(dir, ec);
  return WriteFileAtomically(path.string(), absl::StrCat(absl::StrJoin(steps, "\n"), "\n"), 0644);
}

absl::StatusOr<std::vector<int64_t>> ReadStageCheckpointPins(const std::string& dir) {
  const fs::path path = fs::path(dir) / kPinsFile;
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::vector<int64_t>();
  std::string text;
  text.resize(kMaxPinsBytes + 1);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxPinsBytes) {
    return absl::DataLossError(absl::StrCat(path.string(), " is over ", kMaxPinsBytes, " bytes"));
  }
  std::vector<int64_t> steps;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    int64_t s = 0;
    if (!absl::SimpleAtoi(line, &s) || s < 0) {
      return absl::DataLossError(absl::StrCat(path.string(), ": '", line, "' is not a step"));
    }
    steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

}  // namespace aqswarm::stage
