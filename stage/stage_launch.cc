#include "stage/stage_launch.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"
#include "nlohmann/json.hpp"
#include "pipeline/job_spec.h"

namespace aqswarm::stage {

absl::StatusOr<v1::StageLaunch> ParseStageLaunch(std::string_view json) {
  nlohmann::json tree = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!tree.is_object()) return absl::InvalidArgumentError("stage launch: expects a JSON object");
  if (!tree.contains("job") || !tree["job"].is_object()) {
    return absl::InvalidArgumentError("stage launch: no \"job\" object");
  }
  AQSWARM_ASSIGN_OR_RETURN(v1::JobSpec job, pipeline::ParseJobSpec(tree["job"].dump()));
  tree.erase("job");
  v1::StageLaunch launch;
  google::protobuf::util::JsonParseOptions po;
  po.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(tree.dump(), &launch, po);
  if (!status.ok()) return absl::InvalidArgumentError(absl::StrCat("stage launch: ", status.ToString()));
  *launch.mutable_job() = std::move(job);
  ApplyStageLaunchDefaults(&launch);
  AQSWARM_RETURN_IF_ERROR(ValidateStageLaunch(launch));
  return launch;
}

absl::StatusOr<v1::StageLaunch> ReadStageLaunch(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("stage launch: cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<v1::StageLaunch> launch = ParseStageLaunch(ss.str());
  if (!launch.ok()) return absl::Status(launch.status().code(), absl::StrCat(path, ": ", launch.status().message()));
  return launch;
}

std::string StageLaunchJson(const v1::StageLaunch& launch) {
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(launch, &json);
  // The job as jobs are written (its choices by their JSON names: "1f1b").
  nlohmann::ordered_json tree = nlohmann::ordered_json::parse(json);
  if (launch.has_job()) tree["job"] = nlohmann::ordered_json::parse(pipeline::JobSpecJson(launch.job()));
  return tree.dump();
}

absl::Status WriteStageLaunch(const std::string& path, const v1::StageLaunch& launch) {
  return WriteFileAtomically(path, StageLaunchJson(launch) + "\n", 0644);
}

void ApplyStageLaunchDefaults(v1::StageLaunch* l) {
  if (l->listen().empty()) l->set_listen(kDefaultListen);
  if (!l->has_keep_checkpoints()) l->set_keep_checkpoints(kDefaultKeepCheckpoints);
  if (!l->has_link_timeout()) l->mutable_link_timeout()->set_seconds(kDefaultLinkTimeoutSeconds);
}

bool IsFirstStage(const v1::StageLaunch& l) { return l.stage() == 0; }
bool IsLastStage(const v1::StageLaunch& l) { return l.stage() + 1 == l.job().stages(); }

namespace {

absl::Status ValidateReplicas(const v1::StageLaunch& l) {
  const uint32_t d = l.job().data_parallel();
  if (d <= 1) {
    if (l.replicas_size() > 0) return absl::InvalidArgumentError("replicas given but the job has no data parallelism");
    return absl::OkStatus();
  }
  if (l.replicas_size() == 0 && l.neighbors_on_stdin()) return absl::OkStatus();
  if (l.replicas_size() != static_cast<int>(d)) {
    return absl::InvalidArgumentError(absl::StrCat(l.replicas_size(), " replicas for data_parallel ", d,
                                                   " (one per pipeline, this stage's own included)"));
  }
  for (int i = 0; i < l.replicas_size(); ++i) {
    const v1::Neighbor& r = l.replicas(i);
    if (r.pipeline() != static_cast<uint32_t>(i)) {
      return absl::InvalidArgumentError(absl::StrCat("replicas[", i, "] is pipeline ", r.pipeline(),
                                                     ": replicas are indexed by pipeline"));
    }
    if (r.gradient_exchange_address().empty() && i != static_cast<int>(l.pipeline())) {
      return absl::InvalidArgumentError(absl::StrCat("replicas[", i, "] has no gradient_exchange_address"));
    }
    if (r.link_generation() != l.replicas(0).link_generation()) {
      return absl::InvalidArgumentError(absl::StrCat("replicas disagree on the DP group's generation (",
                                                     l.replicas(0).link_generation(), " and ", r.link_generation(),
                                                     ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateStageLaunch(const v1::StageLaunch& l) {
  if (l.stage() >= l.job().stages()) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", l.stage(), " outside [0, ", l.job().stages(), ")"));
  }
  if (l.pipeline() >= l.job().data_parallel()) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline ", l.pipeline(), " outside [0, ",
                                                   l.job().data_parallel(), ")"));
  }
  if (l.start_step() < 0) return absl::InvalidArgumentError("start_step must be >= 0");
  if (!(l.uplink_mbps() >= 0)) {  // NaN too
    return absl::InvalidArgumentError("uplink_mbps must be >= 0");
  }
  if (l.link_timeout().seconds() < 0 || l.link_timeout().nanos() < 0 ||
      (l.link_timeout().seconds() == 0 && l.link_timeout().nanos() == 0)) {
    return absl::InvalidArgumentError("link_timeout must be positive");
  }
  if (!l.tls().dir().empty() && l.tls().name().empty()) {
    return absl::InvalidArgumentError("tls.dir needs tls.name (this process's certificate)");
  }
  if (!IsLastStage(l) && !l.next().reversed() && l.next().stage_link_address().empty() && !l.neighbors_on_stdin()) {
    return absl::InvalidArgumentError(
        "a stage before the last needs next.stage_link_address (or neighbors_on_stdin, or next.reversed)");
  }
  if (!IsFirstStage(l) && l.previous().reversed() && l.previous().stage_link_address().empty()) {
    return absl::InvalidArgumentError(
        "previous.reversed needs previous.stage_link_address (this stage dials the previous one)");
  }
  return ValidateReplicas(l);
}

absl::Status ApplyNeighborPatch(const v1::StageLaunch& patch, v1::StageLaunch* l) {
  v1::StageLaunch rest = patch;
  rest.clear_next();
  rest.clear_replicas();
  if (rest.ByteSizeLong() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a neighbour patch sets only next and replicas: ",
                                                   rest.ShortDebugString()));
  }
  const bool want_next = !IsLastStage(*l) && !l->next().reversed();
  if (want_next) {
    if (patch.next().stage_link_address().empty()) {
      return absl::InvalidArgumentError("neighbour patch: no next.stage_link_address for this stage");
    }
    l->mutable_next()->MergeFrom(patch.next());
  } else if (patch.has_next()) {
    return absl::InvalidArgumentError("neighbour patch: this stage does not dial a next stage");
  }
  if (l->job().data_parallel() > 1) {
    if (patch.replicas_size() == 0) {
      return absl::InvalidArgumentError("neighbour patch: no replicas for data parallelism");
    }
    // The stage's exchange group was formed at start-up, under the launch's
    // generation.
    if (ReplicaGeneration(patch) != ReplicaGeneration(*l)) {
      return absl::InvalidArgumentError(absl::StrCat("neighbour patch: replicas of DP-group generation ",
                                                     ReplicaGeneration(patch), ", the launch's is ",
                                                     ReplicaGeneration(*l)));
    }
    *l->mutable_replicas() = patch.replicas();
  } else if (patch.replicas_size() > 0) {
    return absl::InvalidArgumentError("neighbour patch: replicas given but the job has no data parallelism");
  }
  l->set_neighbors_on_stdin(false);
  return ValidateStageLaunch(*l);
}

uint64_t LinkGeneration(const v1::Neighbor& n) { return n.link_generation() == 0 ? 1 : n.link_generation(); }

uint64_t ReplicaGeneration(const v1::StageLaunch& l) {
  return l.replicas_size() > 0 ? l.replicas(0).link_generation() : 0;
}

absl::Duration LinkTimeout(const v1::StageLaunch& l) {
  return absl::Seconds(l.link_timeout().seconds()) + absl::Nanoseconds(l.link_timeout().nanos());
}

uint64_t StoreCapacityBytes(const v1::StageLaunch& l) {
  const v1::LinkCompression& c = l.job().compression();
  return c.has_store_bytes() ? c.store_bytes() : kDefaultStoreBytes;
}

}  // namespace aqswarm::stage
