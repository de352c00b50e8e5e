#include "cli/command.h"

namespace aqswarm::cli {

std::vector<Command> TokenizeCommands() { return {}; }

}  // namespace aqswarm::cli
