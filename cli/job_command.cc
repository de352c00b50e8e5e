// `aqswarm job show`: a job as it runs, every default filled in
// (pipeline/job_spec.h JobSpecJson), after the same checks every command
// makes when it loads a job.
#include <iostream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "cli/command.h"
#include "pipeline/job_spec.h"

ABSL_DECLARE_FLAG(std::string, job);  // cli/pipeline_command.cc

namespace aqswarm::cli {

std::vector<Command> JobCommands() {
  return {{"job show", "Print a job with every default filled in, as it runs.",
           "Loads --job (defaults, then every check a run makes) and prints the effective job as JSON, every\n"
           "field included: what each `aqswarm pipeline` run also writes to <out_dir>/job.json. A job that\n"
           "would be refused is refused here, with the field named (exit 1).",
           {"job"},
           [](const std::vector<std::string>& args) {
             if (!args.empty()) {
               std::cerr << "aqswarm job show: unexpected argument " << args[0] << "\n";
               return 2;
             }
             if (absl::GetFlag(FLAGS_job).empty()) {
               std::cerr << "aqswarm job show: --job is required\n";
               return 2;
             }
             absl::StatusOr<v1::JobSpec> job = pipeline::LoadJobSpec(absl::GetFlag(FLAGS_job));
             if (!job.ok()) {
               std::cerr << "aqswarm job show: " << job.status().message() << "\n";
               return 1;
             }
             std::cout << pipeline::JobSpecJson(*job);
             return 0;
           }}};
}

}  // namespace aqswarm::cli
