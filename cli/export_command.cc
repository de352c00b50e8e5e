// `aqswarm export`: a finished `aqswarm pipeline` run, or a live swarm, as a
// Hugging Face directory (pipeline/hf_checkpoint.h ExportHfModel does the
// work; peer/swarm_states.h fetches a live swarm's stage states).
#include <filesystem>
#include <iostream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "cli/command.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "peer/assignment.h"  // StageCheckpointDir
#include "peer/coordinator_client.h"
#include "stage/stage_checkpoints.h"
#include "peer/swarm_states.h"
#include "pipeline/hf_checkpoint.h"
#include "pipeline/job_spec.h"

ABSL_DECLARE_FLAG(std::string, job);          // cli/pipeline_command.cc
ABSL_DECLARE_FLAG(std::string, coordinator);  // cli/coordinator_command.cc
ABSL_DECLARE_FLAG(std::string, tls_dir);      // cli/certs_command.cc
ABSL_DECLARE_FLAG(std::string, name);

ABSL_FLAG(std::string, run, "", "Run directory of a finished `aqswarm pipeline` (its --out_dir).");
ABSL_FLAG(std::string, out, "", "Directory to write (config.json, model.safetensors, tokenizer files).");

namespace aqswarm::cli {
namespace {

namespace fs = std::filesystem;

int Fail(const absl::Status& s) {
  std::cerr << "aqswarm export: " << s.message() << "\n";
  return 1;
}

// The run's job and each stage's newest state (all of the same step).
absl::Status FindRun(const fs::path& run, pipeline::HfExportOptions* o, int64_t* step) {
  const std::string job_path = absl::GetFlag(FLAGS_job).empty() ? (run / "job.json").string() : absl::GetFlag(FLAGS_job);
  absl::StatusOr<v1::JobSpec> job = pipeline::LoadJobSpec(job_path);
  if (!job.ok()) return absl::Status(job.status().code(), absl::StrCat(job_path, ": ", job.status().message()));
  o->job = *job;
  *step = -1;
  for (uint32_t k = 0; k < job->stages(); ++k) {
    const fs::path dir = peer::StageCheckpointDir(run.string(), k);  // the peer daemon's layout too
    const std::vector<int64_t> steps = stage::StageCheckpointSteps(dir.string());
    if (steps.empty()) {
      return absl::NotFoundError(absl::StrCat("no state of stage ", k, " in ", dir.string(),
                                              " (did the run finish? runs before `aqswarm export` existed kept none)"));
    }
    if (*step >= 0 && steps.back() != *step) {
      return absl::FailedPreconditionError(absl::StrCat("stage ", k, "'s newest state is of step ", steps.back(),
                                                        ", stage 0's of step ", *step, ": not one model"));
    }
    *step = steps.back();
    o->stage_checkpoints.push_back(stage::StageCheckpointPath(dir.string(), *step));
  }
  return absl::OkStatus();
}

// A live swarm's newest complete model, fetched into <out>/.stage-states
// (removed once exported).
absl::Status FetchLive(const std::string& coordinator, pipeline::HfExportOptions* o, int64_t* step,
                       std::string* states_dir) {
  peer::FetchOptions fo;
  fo.tls = {absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_name)};
  if (fo.tls.enabled() && fo.tls.name.empty()) return absl::InvalidArgumentError("--tls_dir needs --name");
  AQSWARM_ASSIGN_OR_RETURN(auto client, peer::ConnectCoordinator(coordinator, fo.tls));
  *states_dir = (fs::path(o->out_dir) / ".stage-states").string();
  AQSWARM_ASSIGN_OR_RETURN(peer::SwarmModel m, peer::FetchSwarmModel(*client, fo, *states_dir));
  o->job = m.job;
  o->stage_checkpoints = m.stage_files;
  *step = m.step;
  return absl::OkStatus();
}

int RunExport(const std::vector<std::string>& args) {
  if (!args.empty()) return Fail(absl::InvalidArgumentError("unexpected argument " + args[0]));
  // Without --run, the live swarm at --coordinator (default 127.0.0.1:7000).
  const std::string run = absl::GetFlag(FLAGS_run), coordinator = absl::GetFlag(FLAGS_coordinator);
  if (absl::GetFlag(FLAGS_out).empty()) return Fail(absl::InvalidArgumentError("--out is required"));
  pipeline::HfExportOptions o;
  o.out_dir = absl::GetFlag(FLAGS_out);
  int64_t step = 0;
  std::string states_dir;
  absl::Status s = run.empty() ? FetchLive(coordinator, &o, &step, &states_dir) : FindRun(run, &o, &step);
  if (s.ok()) s = pipeline::ExportHfModel(o);
  if (!states_dir.empty()) RemoveTree(states_dir).IgnoreError();
  if (!s.ok()) return Fail(s);
  std::cout << "aqswarm export: " << pipeline::ModelFamilyName(o.job.model()) << " model of " << o.stage_checkpoints.size()
            << " stage(s) after " << step << " steps -> " << o.out_dir << " (config.json, model.safetensors"
            << (o.job.data().tokenizer().empty() ? "" : ", tokenizer") << ")\n";
  return 0;
}

}  // namespace

std::vector<Command> ExportCommands() {
  return {{"export",
           "Write a finished `aqswarm pipeline` run, or a live swarm, as a Hugging Face model directory.",
           "--run: reads <run>/job.json (or --job) and each stage's newest state in <run>/checkpoints/stage-<k>/\n"
           "(the layout of an `aqswarm pipeline` out_dir and of an `aqswarm peer` work_dir).\n"
           "Without --run: --coordinator HOST:PORT [--tls_dir D --name N] asks that swarm's coordinator for the job and the\n"
           "newest step every stage has a state of, and fetches those states from the peers over StateTransfer\n"
           "while they train. Either way it writes\n"
           "config.json (GPT2LMHeadModel / LlamaForCausalLM, float32), model.safetensors (all stages merged,\n"
           "Hugging Face names) and the job's tokenizer files. The result loads with transformers'\n"
           "from_pretrained, as model.initFrom of another job, and in `aqswarm generate --model`.",
           {"run", "coordinator", "tls_dir", "name", "out", "job"},
           RunExport}};
}

}  // namespace aqswarm::cli
