// Helpers for the coordinator tests: a small job, a join secret with tokens,
// and a SwarmCoordinator on an rpc::FakeClock. (Scratch dirs:
// aqswarm::testing::ScratchDir, tests/testing/scratch_dir.h.)
#ifndef AQSWARM_COORDINATOR_COORDINATOR_TESTING_H_
#define AQSWARM_COORDINATOR_COORDINATOR_TESTING_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "common/join_token.h"
#include "rpc/clock.h"
#include "coordinator/swarm_coordinator.h"
#include "gtest/gtest.h"
#include "proto/job.pb.h"

namespace aqswarm::coordinator::testing {

inline v1::JobSpec TestJob(int stages, int pipelines) {
  v1::JobSpec job;
  job.set_name("test-job");
  job.set_stages(stages);
  job.set_data_parallel(pipelines);
  job.mutable_model()->set_n_layer(2 * stages);
  job.mutable_model()->set_d_model(64);
  job.mutable_model()->set_seq_len(32);
  return job;
}

inline constexpr char kTestSwarm[] = "test-job";

// A fixed 32-byte secret (hex in files; raw bytes here).
inline std::string TestSecret() { return std::string(32, '\x5a'); }

inline std::string TokenFor(const rpc::FakeClock& clock, const std::string& peer, const std::string& secret = TestSecret(),
                            const std::string& swarm = kTestSwarm, int64_t ttl_s = 3600) {
  auto token = IssueJoinToken(secret, swarm, peer, absl::ToUnixSeconds(clock.Now()) + ttl_s);
  EXPECT_TRUE(token.ok()) << token.status();
  return token.ok() ? *token : "";
}

inline JoinParams JoinAs(const rpc::FakeClock& clock, const std::string& peer, int port = 5000) {
  JoinParams p;
  p.peer_name = peer;
  p.join_token = TokenFor(clock, peer);
  p.stage_link_address = absl::StrCat("127.0.0.1:", port);
  p.gradient_exchange_address = absl::StrCat("127.0.0.1:", port + 1);
  p.seconds_per_layer = 0.01;
  p.memory_bytes = uint64_t{8} << 30;
  return p;
}

inline SwarmCoordinatorOptions TestOptions(const rpc::FakeClock* clock, const std::string& dir, int stages,
                                           int pipelines) {
  SwarmCoordinatorOptions o;
  o.job = TestJob(stages, pipelines);
  o.join_secret = TestSecret();
  o.lease = absl::Seconds(10);
  o.state.dir = dir;
  o.state.sync = false;
  o.clock = clock;
  return o;
}

}  // namespace aqswarm::coordinator::testing

#endif  // AQSWARM_COORDINATOR_COORDINATOR_TESTING_H_
