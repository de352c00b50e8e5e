#include "common/join_token.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/certs.h"  // ReadSmallFile
#include "common/file_util.h"
#include "common/status_macros.h"

namespace aqswarm {
namespace {

constexpr absl::string_view kPrefix = "aqj1";
constexpr size_t kMacBytes = 32;        // SHA-256
constexpr size_t kMaxTokenChars = 1024;  // bounds work done on garbage input

absl::Status ValidateId(absl::string_view id, absl::string_view what, bool allow_any) {
  if (allow_any && id == kAnyPeer) return absl::OkStatus();
  bool ok = !id.empty() && id.size() <= 128;
  for (char c : id) ok &= absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", id, "' must be 1-128 characters of [A-Za-z0-9._-]", allow_any ? " or '*'" : ""));
  }
  return absl::OkStatus();
}

absl::Status CheckSecret(absl::string_view secret) {
  if (secret.size() < kMinJoinSecretBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("join secret is ", secret.size(), " bytes; at least ", kMinJoinSecretBytes, " are required"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Mac(absl::string_view secret, absl::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len) == nullptr ||
      len != kMacBytes) {
    return absl::InternalError("HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<char*>(out), len);
}

absl::Status Malformed(absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("join token is malformed: ", why));
}

std::string FormatUtc(int64_t unix_s) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixSeconds(unix_s), absl::UTCTimeZone());
}

}  // namespace

absl::StatusOr<std::string> IssueJoinToken(absl::string_view secret, absl::string_view swarm_id,
                                           absl::string_view peer_name, int64_t expiry_unix_s) {
  AQSWARM_RETURN_IF_ERROR(CheckSecret(secret));
  AQSWARM_RETURN_IF_ERROR(ValidateId(swarm_id, "swarm id", /*allow_any=*/false));
  AQSWARM_RETURN_IF_ERROR(ValidateId(peer_name, "peer name", /*allow_any=*/true));
  if (expiry_unix_s <= 0) return absl::InvalidArgumentError("join token expiry must be a positive unix time");
  unsigned char nonce[8];
  if (RAND_bytes(nonce, sizeof(nonce)) != 1) return absl::InternalError("RAND_bytes failed");
  const std::string payload = absl::StrCat(swarm_id, "|", peer_name, "|", expiry_unix_s, "|",
                                           absl::BytesToHexString(absl::string_view(
                                               reinterpret_cast<const char*>(nonce), sizeof(nonce))));
  const std::string signed_part = absl::StrCat(kPrefix, ".", absl::WebSafeBase64Escape(payload));
  AQSWARM_ASSIGN_OR_RETURN(std::string mac, Mac(secret, signed_part));
  return absl::StrCat(signed_part, ".", absl::WebSafeBase64Escape(mac));
}

absl::StatusOr<JoinClaims> VerifyJoinToken(absl::string_view secret, absl::string_view token, int64_t now_unix_s) {
  AQSWARM_RETURN_IF_ERROR(CheckSecret(secret));
  token = absl::StripAsciiWhitespace(token);  // pasted from a terminal
  if (token.empty()) return Malformed("empty");
  if (token.size() > kMaxTokenChars) return Malformed(absl::StrCat("longer than ", kMaxTokenChars, " characters"));
  std::vector<absl::string_view> parts = absl::StrSplit(token, '.');
  if (parts.size() != 3) return Malformed(absl::StrCat("expected 3 '.'-separated parts, got ", parts.size()));
  if (parts[0] != kPrefix) return Malformed(absl::StrCat("unknown format '", parts[0], "' (expected ", kPrefix, ")"));
  std::string mac;
  if (!absl::WebSafeBase64Unescape(parts[2], &mac) || mac.size() != kMacBytes) {
    return Malformed("the signature part is not a base64url HMAC-SHA256");
  }
  // Only the canonical encoding: the last character of a 32-byte MAC carries
  // 2 unused bits, and a token that differs there must not verify too.
  if (absl::WebSafeBase64Escape(mac) != parts[2]) {
    return Malformed("the signature part is not canonical base64url");
  }
  std::string payload;
  if (parts[1].empty() || !absl::WebSafeBase64Unescape(parts[1], &payload)) {
    return Malformed("the payload part is not base64url");
  }
  // The MAC covers the exact transmitted text, so no two encodings of one
  // payload can both verify.
  const absl::string_view signed_part = token.substr(0, parts[0].size() + 1 + parts[1].size());
  AQSWARM_ASSIGN_OR_RETURN(std::string want, Mac(secret, signed_part));
  if (CRYPTO_memcmp(want.data(), mac.data(), kMacBytes) != 0) {
    return absl::UnauthenticatedError("join token signature does not match (wrong swarm secret, or the token was altered)");
  }
  // Signed by us from here on: a parse failure means a bug, still an error.
  std::vector<std::string> fields = absl::StrSplit(payload, '|');
  JoinClaims claims;
  if (fields.size() != 4 || !absl::SimpleAtoi(fields[2], &claims.expiry_unix_s)) {
    return Malformed("signed payload has an unexpected layout");
  }
  claims.swarm_id = fields[0];
  claims.peer_name = fields[1];
  claims.token_id = fields[3];
  if (now_unix_s >= claims.expiry_unix_s) {
    return absl::UnauthenticatedError(absl::StrCat("join token expired at ", FormatUtc(claims.expiry_unix_s),
                                                   " (now ", FormatUtc(now_unix_s), "); ask the operator for a new one"));
  }
  return claims;
}

absl::Status CheckJoinClaims(const JoinClaims& claims, absl::string_view swarm_id, absl::string_view peer_name) {
  if (claims.swarm_id != swarm_id) {
    return absl::PermissionDeniedError(
        absl::StrCat("join token is for swarm '", claims.swarm_id, "', not '", swarm_id, "'"));
  }
  if (claims.peer_name != kAnyPeer && claims.peer_name != peer_name) {
    return absl::PermissionDeniedError(
        absl::StrCat("join token is for peer '", claims.peer_name, "', not '", peer_name, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> GenerateJoinSecret() {
  std::string secret(kJoinSecretBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(secret.data()), static_cast<int>(secret.size())) != 1) {
    return absl::InternalError("RAND_bytes failed");
  }
  return secret;
}

absl::StatusOr<std::string> LoadJoinSecret(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    return absl::InternalError(absl::StrCat("stat ", path, ": ", std::strerror(errno)));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s is accessible by group/others (mode %04o); run `chmod 600 %s`", path, st.st_mode & 07777, path));
  }
  AQSWARM_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path));
  std::string secret;
  const absl::string_view hex = absl::StripAsciiWhitespace(text);
  bool is_hex = !hex.empty() && hex.size() % 2 == 0;
  for (char c : hex) is_hex &= absl::ascii_isxdigit(static_cast<unsigned char>(c));
  if (!is_hex) return absl::InvalidArgumentError(absl::StrCat(path, " does not hold a hex secret"));
  secret = absl::HexStringToBytes(hex);
  if (secret.size() < kMinJoinSecretBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " holds a ", secret.size(), "-byte secret; at least ", kMinJoinSecretBytes, " are required"));
  }
  return secret;
}

absl::StatusOr<std::string> LoadOrCreateJoinSecret(const std::string& path) {
  auto loaded = LoadJoinSecret(path);
  if (!absl::IsNotFound(loaded.status())) return loaded;
  AQSWARM_ASSIGN_OR_RETURN(std::string secret, GenerateJoinSecret());
  AQSWARM_RETURN_IF_ERROR(WriteFileAtomically(path, absl::StrCat(absl::BytesToHexString(secret), "\n"), 0600));
  return secret;
}

}  // namespace aqswarm
