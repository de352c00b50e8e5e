#include "peer/swarm_states.h"

#include <filesystem>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "proto/held_states.h"

namespace aqswarm::peer {

namespace fs = std::filesystem;

absl::StatusOr<SwarmStateSources> PickSwarmStateSources(const v1::StatusResponse& status) {
  const uint32_t stages = status.job().stages();
  if (stages == 0) return absl::FailedPreconditionError("the coordinator's status names no job stages");
  // stage -> step -> (address, reported SHA-256) of each peer serving it
  std::vector<std::map<int64_t, std::vector<std::pair<std::string, std::string>>>> served(stages);
  for (const v1::PeerStatus& p : status.peers()) {
    if (p.state_transfer_address().empty()) continue;
    for (const v1::StageCheckpoints& h : p.held()) {
      if (h.stage() >= stages) continue;
      const absl::StatusOr<std::vector<v1::HeldState>> states = v1::HeldStatesOf(h);
      if (!states.ok()) continue;  // an older coordinator's malformed list: that peer serves nothing here
      for (const v1::HeldState& state : *states) {
        if (state.step() >= 1) served[h.stage()][state.step()].emplace_back(p.state_transfer_address(), state.sha256());
      }
    }
  }
  std::set<int64_t> common;
  for (const auto& [step, unused] : served[0]) common.insert(step);
  for (uint32_t k = 1; k < stages; ++k) {
    std::set<int64_t> next;
    for (int64_t step : common) {
      if (served[k].count(step)) next.insert(step);
    }
    common = std::move(next);
  }
  if (common.empty()) {
    std::vector<std::string> per_stage;
    for (uint32_t k = 0; k < stages; ++k) {
      std::vector<int64_t> steps;
      for (const auto& [step, unused] : served[k]) steps.push_back(step);
      per_stage.push_back(absl::StrCat("stage ", k, ": ", steps.empty() ? "none" : absl::StrJoin(steps, ",")));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("no step has a served state of every stage of job '", status.job().name(), "' (",
                     absl::StrJoin(per_stage, "; "), "): has the swarm trained a step yet?"));
  }
  SwarmStateSources out;
  out.step = *common.rbegin();
  for (uint32_t k = 0; k < stages; ++k) {
    out.addresses.emplace_back();
    out.sha256.emplace_back();
    for (const auto& [address, sha] : served[k].at(out.step)) {
      out.addresses.back().push_back(address);
      out.sha256.back().push_back(sha);
    }
  }
  return out;
}

absl::StatusOr<SwarmModel> FetchSwarmModel(CoordinatorClient& coordinator, const FetchOptions& options,
                                           const std::string& dir, int attempts) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  std::vector<std::string> errors;
  for (int attempt = 0; attempt < attempts; ++attempt) {
    AQSWARM_ASSIGN_OR_RETURN(v1::StatusResponse status, coordinator.Status());
    AQSWARM_ASSIGN_OR_RETURN(SwarmStateSources sources, PickSwarmStateSources(status));
    SwarmModel model;
    model.job = status.job();
    model.step = sources.step;
    for (uint32_t k = 0; k < sources.addresses.size(); ++k) {
      v1::StateRequest req;
      req.set_job_name(status.job().name());
      req.set_stage(k);
      req.set_step(sources.step);
      const std::string path = (fs::path(dir) / absl::StrCat("stage-", k, ".safetensors")).string();
      bool fetched = false;
      for (size_t i = 0; i < sources.addresses[k].size(); ++i) {
        const std::string& address = sources.addresses[k][i];
        FetchOptions o = options;
        o.expected_sha256 = sources.sha256[k][i];
        absl::StatusOr<FetchedState> s = FetchStateToFile(address, req, path, o);
        if (s.ok() && s->step != static_cast<uint64_t>(sources.step)) {
          fs::remove(path, ec);
          s = absl::DataLossError(absl::StrCat("asked for step ", sources.step, ", got step ", s->step));
        }
        if (!s.ok()) {
          errors.push_back(absl::StrCat("stage ", k, " step ", sources.step, " from ", address, ": ",
                                        s.status().message()));
          continue;
        }
        fetched = true;
        break;
      }
      if (!fetched) break;
      model.stage_files.push_back(path);
    }
    if (model.stage_files.size() == sources.addresses.size()) return model;
  }
  return absl::UnavailableError(absl::StrCat("could not fetch every stage's state after ", attempts,
                                             " tries: ", absl::StrJoin(errors, "; ")));
}

}  // namespace aqswarm::peer
