// The stage process: `aqswarm stage --launch FILE` (cli/pipeline_command.cc
// only dispatches here). Reads the launch (stage/stage_launch.h), prints its
// ListeningEvent, reads the neighbour patch on stdin when the launch says
// so, trains (stage/stage_runner.h) and prints every event as one JSON line
// on stdout (proto/events.proto), the last one DoneEvent or ErrorEvent.
#ifndef AQSWARM_STAGE_STAGE_MAIN_H_
#define AQSWARM_STAGE_STAGE_MAIN_H_

#include <string>

namespace aqswarm::stage {

// The process's exit code: 0 when the job's steps are done; 1 with the
// reason on stderr (and, once it listened, as an ErrorEvent).
int RunStageProcess(const std::string& launch_path);

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_STAGE_MAIN_H_
