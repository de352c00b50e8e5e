#include "peer/stage_command.h"

#include <functional>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace aqswarm::peer {
namespace {

// One flag: how to print a field and how to parse it back.
struct Flag {
  const char* name;
  std::function<std::string(const StageCommand&)> print;  // "" = default, left out
  std::function<bool(StageCommand&, const std::string&)> parse;
  bool boolean = false;
};

template <typename T>
Flag Number(const char* name, T StageCommand::*field) {
  return {name,
          [field](const StageCommand& c) {
            return c.*field == StageCommand().*field ? std::string() : absl::StrCat(c.*field);
          },
          [field](StageCommand& c, const std::string& v) { return absl::SimpleAtoi(v, &(c.*field)); }};
}

Flag Text(const char* name, std::string StageCommand::*field) {
  return {name, [field](const StageCommand& c) { return c.*field == StageCommand().*field ? "" : c.*field; },
          [field](StageCommand& c, const std::string& v) {
            c.*field = v;
            return true;
          }};
}

// Comma-separated.
Flag List(const char* name, std::vector<std::string> StageCommand::*field) {
  return {name, [field](const StageCommand& c) { return absl::StrJoin(c.*field, ","); },
          [field](StageCommand& c, const std::string& v) {
            c.*field = v.empty() ? std::vector<std::string>() : absl::StrSplit(v, ',');
            return true;
          }};
}

Flag Boolean(const char* name, bool StageCommand::*field) {
  return {name, [field](const StageCommand& c) { return c.*field ? std::string("true") : std::string(); },
          [field](StageCommand& c, const std::string& v) {
            if (v == "true" || v == "1") c.*field = true;
            else if (v == "false" || v == "0") c.*field = false;
            else return false;
            return true;
          },
          /*boolean=*/true};
}

const std::vector<Flag>& Flags() {
  static const auto* flags = new std::vector<Flag>{
      Text("job", &StageCommand::job),
      Number("stages", &StageCommand::stages),
      Number("dp", &StageCommand::dp),
      Number("stage", &StageCommand::stage),
      Number("pipeline_index", &StageCommand::pipeline),
      Text("listen", &StageCommand::listen),
      Text("next", &StageCommand::next),
      Text("previous", &StageCommand::previous),
      Boolean("dial_previous", &StageCommand::dial_previous),
      Boolean("accept_next", &StageCommand::accept_next),
      Boolean("peers_on_stdin", &StageCommand::peers_on_stdin),
      Text("store_dir", &StageCommand::store_dir),
      Number("generation", &StageCommand::generation),
      Number("next_generation", &StageCommand::next_generation),
      Number("previous_generation", &StageCommand::previous_generation),
      Text("exchange_listen", &StageCommand::exchange_listen),
      List("replicas", &StageCommand::replicas),
      Number("replica_generation", &StageCommand::replica_generation),
      Number("plan", &StageCommand::plan),
      Boolean("die_with_parent", &StageCommand::die_with_parent),
      Boolean("insecure", &StageCommand::insecure),
      Number("start_step", &StageCommand::start_step),
      Text("init_checkpoint", &StageCommand::init_checkpoint),
      Text("checkpoint_dir", &StageCommand::checkpoint_dir),
      Number("keep_checkpoints", &StageCommand::keep_checkpoints),
      Number("link_timeout_s", &StageCommand::link_timeout_s),
      Text("metrics_listen", &StageCommand::metrics_listen),
      Text("tls_dir", &StageCommand::tls_dir),
      Text("name", &StageCommand::name),
      Text("previous_peer", &StageCommand::previous_peer),
      Text("next_peer", &StageCommand::next_peer),
      List("replica_peers", &StageCommand::replica_peers),
      Number("uplink_kbps", &StageCommand::uplink_kbps),
  };
  return *flags;
}

}  // namespace

std::vector<std::string> StageCommand::ToArgv(const std::string& executable) const {
  std::vector<std::string> argv = {executable, "stage"};
  for (const Flag& f : Flags()) {
    const std::string v = f.print(*this);
    if (v.empty()) continue;
    argv.push_back(f.boolean ? absl::StrCat("--", f.name) : absl::StrCat("--", f.name, "=", v));
  }
  return argv;
}

absl::StatusOr<StageCommand> StageCommand::FromArgs(const std::vector<std::string>& args) {
  StageCommand c;
  for (const std::string& arg : args) {
    if (!absl::StartsWith(arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("aqswarm stage takes no positional argument: '", arg, "'"));
    }
    const size_t eq = arg.find('=');
    std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    std::string value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    const Flag* flag = nullptr;
    bool negated = false;
    for (const Flag& f : Flags()) {
      if (name == f.name) flag = &f;
      if (f.boolean && name == absl::StrCat("no", f.name)) flag = &f, negated = true;
    }
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag of aqswarm stage: '", arg, "'"));
    if (flag->boolean && eq == std::string::npos) value = negated ? "false" : "true";
    if ((negated && eq != std::string::npos) || (!flag->boolean && eq == std::string::npos) ||
        !flag->parse(c, value)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value for --", flag->name, ": '", arg, "'"));
    }
  }
  return c;
}

std::vector<std::string> StageCommand::FlagNames() {
  std::vector<std::string> names;
  for (const Flag& f : Flags()) names.push_back(f.name);
  return names;
}

bool StageCommand::operator==(const StageCommand& o) const {
  auto tie = [](const StageCommand& c) {
    return std::tie(c.job, c.stages, c.dp, c.stage, c.pipeline, c.listen, c.next, c.previous, c.dial_previous,
                    c.accept_next, c.peers_on_stdin, c.store_dir,
                    c.generation, c.next_generation, c.previous_generation, c.exchange_listen, c.replicas,
                    c.replica_generation, c.plan, c.die_with_parent, c.start_step, c.init_checkpoint,
                    c.checkpoint_dir, c.keep_checkpoints, c.link_timeout_s, c.metrics_listen, c.tls_dir, c.name,
                    c.previous_peer, c.next_peer, c.replica_peers, c.insecure, c.uplink_kbps);
  };
  return tie(*this) == tie(o);
}

StageRunnerOptions StageRunnerOptionsFor(const StageCommand& c, const v1::JobSpec& job) {
  StageRunnerOptions o;
  o.job = job;
  o.stage = c.stage;
  o.pipeline = c.pipeline;
  o.listen = c.listen;
  o.next = c.next;
  o.previous = c.previous;
  o.dial_previous = c.dial_previous;
  o.accept_next = c.accept_next;
  o.store_dir = c.store_dir;
  o.generation = c.generation;
  o.next_generation = c.next_generation;
  o.previous_generation = c.previous_generation;
  o.exchange_listen = c.exchange_listen;
  o.replica_generation = c.replica_generation;
  o.plan = c.plan;
  o.start_step = c.start_step;
  o.init_checkpoint = c.init_checkpoint;
  o.checkpoint_dir = c.checkpoint_dir;
  o.keep_checkpoints = c.keep_checkpoints;
  o.link_timeout = absl::Seconds(c.link_timeout_s);
  o.tls.dir = c.tls_dir;
  o.tls.name = c.name;
  o.previous_peer = c.previous_peer;
  o.next_peer = c.next_peer;
  o.replica_peers = c.replica_peers;
  if (c.uplink_kbps > 0) {
    // This stage's sends go out at the emulated uplink (the receivers hold
    // each frame for its wire time, whatever their own shaping).
    o.job.mutable_shaping()->set_bandwidth_mbps(c.uplink_kbps / 1000.0);
    o.job.mutable_shaping()->clear_bandwidth_schedule_mbps();
  }
  // compression.storeBytes: unset = 64 GiB, 0 = no limit.
  o.store_capacity_bytes = job.compression().has_store_bytes() ? job.compression().store_bytes() : kDefaultStoreBytes;
  return o;
}

}  // namespace aqswarm::peer
