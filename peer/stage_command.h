// The `aqswarm stage` command line as one struct: what a launcher (the peer
// daemon, `aqswarm pipeline`) fills in and turns into argv, and what the
// stage process reads back. Each field is one flag of `aqswarm stage`
// (cli/pipeline_command.cc declares them); ToArgv writes only the fields
// that differ from their defaults, FromArgs reads them back, and
// StageRunnerOptionsFor hands them to the stage runner.
//
//   StageCommand c;  c.job = "run/job.json";  c.stage = 1;  c.next = "10.0.0.2:7001";
//   Subprocess::Spawn(c.ToArgv(SelfExecutable()), ...);   // aqswarm stage --job=... --stage=1 ...
//   AQSWARM_ASSIGN_OR_RETURN(StageCommand back, StageCommand::FromArgs({"--job=run/job.json", "--stage=1"}));
#ifndef AQSWARM_PEER_STAGE_COMMAND_H_
#define AQSWARM_PEER_STAGE_COMMAND_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "peer/stage_runner.h"

namespace aqswarm::peer {

struct StageCommand {
  std::string job;                     // --job: the job spec (JSON)
  int32_t stages = 0;                  // --stages: overrides the job's when > 0
  int32_t dp = 0;                      // --dp: overrides the job's data_parallel when > 0
  int32_t stage = 0;                   // --stage
  int32_t pipeline = 0;                // --pipeline_index
  std::string listen = "127.0.0.1:0";  // --listen: the StageLink server
  std::string next;                    // --next: stage+1's address
  std::string previous;                // --previous: stage-1's address (dialed with --dial_previous)
  bool dial_previous = false;          // --dial_previous: this stage opens the link from stage-1 (reversed)
  bool accept_next = false;            // --accept_next: stage+1 opens the link to this stage (reversed)
  bool peers_on_stdin = false;         // --peers_on_stdin: next/replicas come on stdin
  std::string store_dir;               // --store_dir
  uint64_t generation = 1;             // --generation
  uint64_t next_generation = 0;        // --next_generation
  uint64_t previous_generation = 0;    // --previous_generation
  std::string exchange_listen;         // --exchange_listen
  std::vector<std::string> replicas;   // --replicas (comma-separated)
  uint64_t replica_generation = 0;     // --replica_generation
  uint64_t plan = 0;                   // --plan
  bool die_with_parent = false;        // --die_with_parent
  int64_t start_step = 0;              // --start_step
  std::string init_checkpoint;         // --init_checkpoint
  std::string checkpoint_dir;          // --checkpoint_dir
  int32_t keep_checkpoints = 4;        // --keep_checkpoints
  int32_t link_timeout_s = 120;        // --link_timeout_s
  std::string metrics_listen;          // --metrics_listen
  std::string tls_dir;                 // --tls_dir
  std::string name;                    // --name: the TLS certificate's name
  std::string previous_peer;           // --previous_peer: stage-1's peer (certificate) name
  std::string next_peer;               // --next_peer: stage+1's peer (certificate) name
  std::vector<std::string> replica_peers;  // --replica_peers (comma-separated, by pipeline)
  bool insecure = false;               // --insecure: plaintext servers off loopback allowed (rpc::CheckListenSecurity)
  int32_t uplink_kbps = 0;             // --uplink_kbps: emulated uplink for what this stage sends (0: the job's shaping)

  // {executable, "stage", "--flag=value"...}.
  std::vector<std::string> ToArgv(const std::string& executable) const;
  // The flags after "stage" ("--flag=value", "--flag" for true, "--noflag"
  // for false). Errors: an unknown flag, a value that does not parse, a
  // positional argument.
  static absl::StatusOr<StageCommand> FromArgs(const std::vector<std::string>& args);
  // Every flag name, in ToArgv's order.
  static std::vector<std::string> FlagNames();

  bool operator==(const StageCommand& o) const;
};

// The runner's options for this command and its (loaded, overridden) job;
// `report` and the addresses that come on stdin are the caller's.
StageRunnerOptions StageRunnerOptionsFor(const StageCommand& c, const v1::JobSpec& job);

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_STAGE_COMMAND_H_
