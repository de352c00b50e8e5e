#include <iostream>

#include "cli/command.h"
#include "pipeline/torch_info.h"

#ifndef AQSWARM_VERSION
#define AQSWARM_VERSION "unknown"
#endif

namespace aqswarm::cli {

std::vector<Command> VersionCommands() {
  return {{"version", "Print the aqswarm version and the libraries it runs on.", "", {},
           [](const std::vector<std::string>& args) {
             if (!args.empty()) {
               std::cerr << "aqswarm version: takes no arguments\n";
               return 2;
             }
             std::cout << "aqswarm " << AQSWARM_VERSION << "\n" << pipeline::TorchInfo() << "\n";
             return 0;
           }}};
}

}  // namespace aqswarm::cli
