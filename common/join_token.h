// Join tokens: how a peer proves to the coordinator that the swarm's operator
// admitted it. TLS (common/certs.h) says "this machine holds a certificate from
// the swarm CA"; a join token says "the operator let this peer into swarm S
// until time T" and can be handed out (and expire) without issuing a new
// certificate. The coordinator holds the HMAC secret; peers only hold tokens.
//
//   AQSWARM_ASSIGN_OR_RETURN(std::string secret, LoadOrCreateJoinSecret(dir + "/join.secret"));
//   AQSWARM_ASSIGN_OR_RETURN(std::string token,
//                            IssueJoinToken(secret, "swarm-1", "peer-a", now_s + 3600));
//   ...  // the peer sends `token` in its Join request
//   AQSWARM_ASSIGN_OR_RETURN(JoinClaims claims, VerifyJoinToken(secret, token, now_s));
//   AQSWARM_RETURN_IF_ERROR(CheckJoinClaims(claims, "swarm-1", request.peer_name()));
//
// Wire format (printable, fits a flag or an env var):
//
//   aqj1.<base64url(payload)>.<base64url(HMAC-SHA256(secret, "aqj1." + base64url(payload)))>
//   payload = "<swarm_id>|<peer_name or *>|<expiry unix seconds>|<16 hex nonce>"
//
// The MAC is checked (in constant time, CRYPTO_memcmp) before the payload is
// parsed, so nothing an attacker writes is interpreted unless it was signed.
// The nonce makes every token distinct, and the coordinator makes it single
// use per peer name: it persists (nonce, name) at the first join until the
// token expires, and a second join with that token under that name must
// prove it is the same peer (its previous session token, or under TLS the
// same client certificate; coordinator/swarm_coordinator.h). A token bound
// to one peer (the default of `aqswarm certs token`) thus admits that peer
// once; a wildcard token (kAnyPeer, `--any_peer`) admits each name once.
// Under TLS the coordinator also requires the client certificate to name the
// peer, so a copied token is useless without that peer's key. Without TLS,
// tokens are bearer credentials until first use: keep TTLs short.
//
// Errors from VerifyJoinToken:
//   InvalidArgument  malformed token ("join token is malformed: …")
//   Unauthenticated  "join token signature does not match" (wrong secret or tampered)
//   Unauthenticated  "join token expired at <UTC time> …"
// and from CheckJoinClaims: PermissionDenied (valid token, other swarm/peer).
//
// Thread-safety: all functions are thread-safe.
#ifndef AQSWARM_COMMON_JOIN_TOKEN_H_
#define AQSWARM_COMMON_JOIN_TOKEN_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace aqswarm {

// Secrets are 32 random bytes; shorter ones are refused (a short HMAC key can
// be brute-forced from one token).
inline constexpr size_t kJoinSecretBytes = 32;
inline constexpr size_t kMinJoinSecretBytes = 16;
// peer_name value that admits any peer name.
inline constexpr char kAnyPeer[] = "*";

struct JoinClaims {
  std::string swarm_id;
  std::string peer_name;  // a name, or kAnyPeer
  int64_t expiry_unix_s = 0;
  std::string token_id;   // the nonce, 16 hex digits
};

// Creates a token for `peer_name` (or kAnyPeer) in `swarm_id`, valid until
// `expiry_unix_s`. swarm_id and peer_name: 1-128 of [A-Za-z0-9._-].
absl::StatusOr<std::string> IssueJoinToken(absl::string_view secret, absl::string_view swarm_id,
                                           absl::string_view peer_name, int64_t expiry_unix_s);

// Checks the token's MAC and expiry (a token is valid while now < expiry) and
// returns its claims. See the banner for the error codes.
absl::StatusOr<JoinClaims> VerifyJoinToken(absl::string_view secret, absl::string_view token, int64_t now_unix_s);

// PermissionDenied unless the claims admit `peer_name` into `swarm_id`.
absl::Status CheckJoinClaims(const JoinClaims& claims, absl::string_view swarm_id, absl::string_view peer_name);

// kJoinSecretBytes from the OS CSPRNG (RAND_bytes).
absl::StatusOr<std::string> GenerateJoinSecret();

// Reads a secret file (hex text). FailedPrecondition when the file is
// readable or writable by group/others (like ssh does for keys), or when the
// secret is shorter than kMinJoinSecretBytes; NotFound when missing.
absl::StatusOr<std::string> LoadJoinSecret(const std::string& path);

// Loads `path`, or creates it (mode 0600, atomically) with a new secret when
// it does not exist.
absl::StatusOr<std::string> LoadOrCreateJoinSecret(const std::string& path);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_JOIN_TOKEN_H_
