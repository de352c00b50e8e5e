// Subcommands of the `aqswarm` binary. main() only dispatches: it finds the
// command named by the leading words of argv, rejects flags that command does
// not declare, parses the rest with absl flags and calls Run().
#ifndef AQSWARM_CLI_COMMAND_H_
#define AQSWARM_CLI_COMMAND_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aqswarm {
class MetricsServer;
}

namespace aqswarm::cli {

struct Command {
  std::string name;                // e.g. "bench compression"
  std::string summary;             // one line for `aqswarm --help`
  std::string usage;               // extra text for `aqswarm NAME --help`
  std::vector<std::string> flags;  // absl flag names this command accepts
  // Gets the positional arguments left after flag parsing; returns the exit code.
  std::function<int(const std::vector<std::string>& args)> run;
};

// Shared by the `bench ...` commands: 2 (with a message) when positional
// arguments were given, else 0.
int BenchNoArgs(const std::vector<std::string>& args, const char* name);
// 0 for OK; otherwise prints "aqswarm bench NAME: STATUS" and returns 1.
int BenchReport(const absl::Status& s, const char* name);

// Each group of commands lives in its own file.
std::vector<Command> VersionCommands();
std::vector<Command> BenchCommands();
std::vector<Command> PipelineCommands();
std::vector<Command> CertsCommands();
std::vector<Command> AllreduceCommands();
std::vector<Command> CoordinatorCommands();
std::vector<Command> MetricsCommands();
std::vector<Command> ExportCommands();    // cli/export_command.cc
std::vector<Command> GenerateCommands();  // cli/generate_command.cc
std::vector<Command> TokenizeCommands();  // cli/tokenize_command.cc
std::vector<Command> DataCommands();      // cli/data_command.cc
std::vector<Command> JobCommands();       // cli/job_command.cc

// The metrics endpoint named by --metrics_listen (cli/metrics_command.cc);
// null when the flag is empty.
absl::StatusOr<std::unique_ptr<MetricsServer>> StartMetricsFromFlags();
std::vector<Command> PeerCommands();

}  // namespace aqswarm::cli

#endif  // AQSWARM_CLI_COMMAND_H_
