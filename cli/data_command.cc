#include "cli/command.h"

namespace aqswarm::cli {

std::vector<Command> DataCommands() { return {}; }

}  // namespace aqswarm::cli
