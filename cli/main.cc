// aqswarm: one binary, many subcommands. See `aqswarm --help`.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/command.h"

ABSL_FLAG(bool, dry_run, false,
          "Every command: parse and check the flags (unknown flags and bad values are rejected as usual), print "
          "'dry run: flags accepted' and exit 0 without running the command.");

namespace aqswarm::cli {
namespace {

std::vector<Command> AllCommands() {
  std::vector<Command> all;
  for (auto group : {VersionCommands, PipelineCommands, CertsCommands, BenchCommands, AllreduceCommands,
                     CoordinatorCommands, MetricsCommands, PeerCommands, ExportCommands, GenerateCommands,
                     TokenizeCommands, DataCommands, JobCommands}) {
    for (auto& c : group()) all.push_back(std::move(c));
  }
  return all;
}

void PrintTopHelp(const std::vector<Command>& commands) {
  std::cout << "aqswarm: train language models on a swarm of machines joined by slow links.\n\n"
               "usage: aqswarm COMMAND [flags] [args]\n\ncommands:\n";
  for (const auto& c : commands) {
    std::printf("  %-22s %s\n", c.name.c_str(), c.summary.c_str());
  }
  std::cout << "\n`aqswarm COMMAND --help` lists a command's flags.\n";
}

void PrintCommandHelp(const Command& c) {
  std::cout << "usage: aqswarm " << c.name << (c.flags.empty() ? "" : " [flags]") << "\n\n"
            << c.summary << "\n";
  if (!c.usage.empty()) std::cout << "\n" << c.usage << "\n";
  if (!c.flags.empty()) std::cout << "\nflags:\n";
  for (const auto& name : c.flags) {
    const absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
    if (f == nullptr) continue;
    std::cout << "  --" << name << " (default: " << f->DefaultValue() << ")\n      " << f->Help()
              << "\n";
  }
  std::cout << "\nevery command also takes --dry_run: check the flags, then exit 0 without running.\n";
}

// Returns the flag name of a "--name[=value]" / "-name" argument, or "".
std::string FlagName(const std::string& arg) {
  if (arg.size() < 2 || arg[0] != '-' || arg == "--") return "";
  std::string s = arg.substr(arg[1] == '-' ? 2 : 1);
  s = s.substr(0, s.find('='));
  return s;
}

int Main(int argc, char** argv) {
  const std::vector<Command> commands = AllCommands();
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    PrintTopHelp(commands);
    return args.empty() ? 2 : 0;
  }
  // Longest command whose words prefix the arguments.
  const Command* cmd = nullptr;
  size_t words = 0;
  for (const auto& c : commands) {
    std::vector<std::string> parts = absl::StrSplit(c.name, ' ');
    if (parts.size() > args.size() || parts.size() <= words) continue;
    if (std::equal(parts.begin(), parts.end(), args.begin())) {
      cmd = &c;
      words = parts.size();
    }
  }
  if (cmd == nullptr) {
    // A group name alone ("aqswarm bench") lists its members.
    std::vector<std::string> members;
    for (const auto& c : commands) {
      if (absl::StartsWith(c.name, args[0] + " ")) members.push_back(c.name);
    }
    if (!members.empty()) {
      // `aqswarm GROUP --help` lists the group's commands.
      if (args.size() > 1 && (args[1] == "--help" || args[1] == "-h")) {
        std::cout << "usage: aqswarm " << args[0] << " COMMAND [flags]\n\ncommands:\n";
        for (const auto& c : commands) {
          if (absl::StartsWith(c.name, args[0] + " ")) std::printf("  %-22s %s\n", c.name.c_str(), c.summary.c_str());
        }
        return 0;
      }
      std::cerr << "aqswarm " << args[0] << ": choose one of: " << absl::StrJoin(members, ", ")
                << "\n";
      return 2;
    }
    std::cerr << "aqswarm: unknown command '" << args[0] << "' (see aqswarm --help)\n";
    return 2;
  }
  std::vector<std::string> rest(args.begin() + words, args.end());
  for (const auto& a : rest) {
    if (a == "--") break;
    const std::string name = FlagName(a);
    if (name.empty()) continue;
    if (name == "help" || name == "h" || name == "helpfull") {
      PrintCommandHelp(*cmd);
      return 0;
    }
    bool known = (name == "dry_run") || (name == "nodry_run");
    for (const auto& f : cmd->flags) {
      known |= (name == f) || (name == "no" + f);
    }
    if (!known) {
      std::cerr << "aqswarm " << cmd->name << ": unknown flag '" << a << "'"
                << (cmd->flags.empty() ? " (this command takes no flags)"
                                       : "; accepted: --" + absl::StrJoin(cmd->flags, ", --"))
                << "\n";
      return 2;
    }
  }
  std::string prog = std::string("aqswarm ") + cmd->name;
  std::vector<char*> sub_argv = {prog.data()};
  for (auto& a : rest) sub_argv.push_back(a.data());
  absl::SetProgramUsageMessage(cmd->summary);
  std::vector<char*> positional = absl::ParseCommandLine(static_cast<int>(sub_argv.size()), sub_argv.data());
  std::vector<std::string> pos(positional.begin() + 1, positional.end());
  if (absl::GetFlag(FLAGS_dry_run)) {
    // For deployment checks (deploy/): the command line parses; nothing runs.
    std::cout << "dry run: flags accepted by aqswarm " << cmd->name;
    if (!pos.empty()) std::cout << " (" << pos.size() << " positional argument(s) not checked)";
    std::cout << "\n";
    return 0;
  }
  return cmd->run(pos);
}

}  // namespace
}  // namespace aqswarm::cli

int main(int argc, char** argv) { return aqswarm::cli::Main(argc, argv); }
