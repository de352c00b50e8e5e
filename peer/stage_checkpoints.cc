#include "peer/stage_checkpoints.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/logging.h"

namespace aqswarm::peer {
namespace {

namespace fs = std::filesystem;

constexpr char kPinsFile[] = "pinned";
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

void PruneStageCheckpoints(const std::string& dir, int64_t past, size_t keep) {
  std::vector<int64_t> steps = StageCheckpointSteps(dir);  // ascending
  std::error_code ec;
  while (!steps.empty() && steps.back() > past) {
    fs::remove(StageCheckpointPath(dir, steps.back()), ec);
    steps.pop_back();
  }
  absl::StatusOr<std::vector<int64_t>> pins = ReadStageCheckpointPins(dir);
  if (!pins.ok()) {
    AQSWARM_LOG(WARNING) << "keeping every state in " << dir << ": " << pins.status();
    return;
  }
  for (size_t i = 0; i + keep < steps.size(); ++i) {
    if (std::binary_search(pins->begin(), pins->end(), steps[i])) continue;
    fs::remove(StageCheckpointPath(dir, steps[i]), ec);
  }
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

}  // namespace aqswarm::peer
