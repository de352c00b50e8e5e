// libFuzzer target: join tokens (common/join_token.h) as the coordinator
// checks a Join request. Input byte 0 picks:
//   even: the rest is a token, verified under a fixed secret at a fixed
//         time (VerifyJoinToken, then CheckJoinClaims); a malformed or
//         forged token is an error, never a crash;
//   odd:  the rest is split into swarm id, peer name and expiry; a token
//         issued for them must verify and give back exactly those claims
//         (aborts otherwise: the token format must round-trip).
// Seeds: fuzz/corpus/join_token (tokens issued under the same secret).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/join_token.h"
#include "fuzz/fuzz_input.h"

using namespace aqswarm;

namespace {
// Also the seed generator's secret (fuzz/seed_gen.cc).
constexpr char kSecret[] = "fuzz-secret-0123456789abcdef0123";
constexpr int64_t kNow = 1'800'000'000;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  const uint8_t mode = in.U8();
  if ((mode & 1) == 0) {
    const std::string_view token = in.Rest();
    absl::StatusOr<JoinClaims> claims = VerifyJoinToken(kSecret, absl::string_view(token.data(), token.size()), kNow);
    if (claims.ok()) {
      (void)CheckJoinClaims(*claims, "swarm-1", "peer-a");
      (void)CheckJoinClaims(*claims, claims->swarm_id, claims->peer_name);
    }
    return 0;
  }
  const std::string swarm(in.Record()), peer(in.Record());
  const int64_t expiry = static_cast<int64_t>(in.U64());
  absl::StatusOr<std::string> token = IssueJoinToken(kSecret, swarm, peer, expiry);
  if (!token.ok()) return 0;
  absl::StatusOr<JoinClaims> claims = VerifyJoinToken(kSecret, *token, kNow);
  if (expiry > kNow) {
    if (!claims.ok() || claims->swarm_id != swarm || claims->peer_name != peer || claims->expiry_unix_s != expiry ||
        !CheckJoinClaims(*claims, swarm, peer).ok()) {
      std::abort();
    }
  } else if (claims.ok()) {
    std::abort();  // expired tokens must be refused
  }
  if (VerifyJoinToken("another-secret-0123456789abcdef0", *token, kNow).ok()) std::abort();
  return 0;
}
