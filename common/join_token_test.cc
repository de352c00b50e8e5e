#include "common/join_token.h"

#include <sys/stat.h>
#include <unistd.h>

#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/certs.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using ::aqswarm::testing::IsOk;
using ::aqswarm::testing::StatusIs;

constexpr int64_t kNow = 1'700'000'000;  // fixed clock: 2023-11-14T22:13:20Z

class JoinTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    secret_ = *GenerateJoinSecret();
    ASSERT_EQ(secret_.size(), kJoinSecretBytes);
  }
  std::string Issue(const std::string& peer = "peer-a", int64_t expiry = kNow + 3600) {
    auto t = IssueJoinToken(secret_, "swarm-1", peer, expiry);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.value_or("");
  }
  std::string secret_;
};

TEST_F(JoinTokenTest, RoundTrip) {
  const std::string token = Issue();
  EXPECT_THAT(token, StartsWith("aqj1."));
  for (char c : token) EXPECT_TRUE(isalnum(c) || c == '-' || c == '_' || c == '.') << token;
  auto claims = VerifyJoinToken(secret_, token, kNow);
  ASSERT_TRUE(claims.ok()) << claims.status();
  EXPECT_EQ(claims->swarm_id, "swarm-1");
  EXPECT_EQ(claims->peer_name, "peer-a");
  EXPECT_EQ(claims->expiry_unix_s, kNow + 3600);
  EXPECT_EQ(claims->token_id.size(), 16u);
  // Pasted with a newline: still fine. Two tokens with the same claims differ.
  EXPECT_TRUE(VerifyJoinToken(secret_, token + "\n", kNow).ok());
  EXPECT_NE(Issue(), token);
}

// The coordinator makes a token single use per name by its nonce
// (token_id): every token needs its own, and the nonce cannot be edited.
TEST_F(JoinTokenTest, EveryTokenHasItsOwnNonceAndItIsSigned) {
  std::set<std::string> ids;
  for (int i = 0; i < 200; ++i) {
    auto claims = VerifyJoinToken(secret_, Issue(), kNow);
    ASSERT_TRUE(claims.ok()) << claims.status();
    for (char c : claims->token_id) EXPECT_TRUE(isxdigit(c)) << claims->token_id;
    ids.insert(claims->token_id);
  }
  EXPECT_EQ(ids.size(), 200u);
  // Another nonce with the same MAC: the signature no longer matches.
  const std::string token = Issue();
  const std::string payload = token.substr(5, token.rfind('.') - 5);
  std::string decoded;
  ASSERT_TRUE(absl::WebSafeBase64Unescape(payload, &decoded));
  decoded.back() = decoded.back() == '0' ? '1' : '0';
  std::string reencoded;
  absl::WebSafeBase64Escape(decoded, &reencoded);
  const std::string forged = "aqj1." + reencoded + token.substr(token.rfind('.'));
  EXPECT_THAT(VerifyJoinToken(secret_, forged, kNow), StatusIs(absl::StatusCode::kUnauthenticated));
}

TEST_F(JoinTokenTest, WrongSecretIsUnauthenticated) {
  const std::string token = Issue();
  auto other = *GenerateJoinSecret();
  auto s = VerifyJoinToken(other, token, kNow).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(s.message(), HasSubstr("join token signature does not match"));
}

TEST_F(JoinTokenTest, TamperedPayloadIsUnauthenticated) {
  const std::string token = Issue("peer-a");
  std::vector<std::string> parts = absl::StrSplit(token, '.');
  ASSERT_EQ(parts.size(), 3u);
  // Re-encode a payload naming another peer and a later expiry, keep the MAC.
  std::string payload;
  ASSERT_TRUE(absl::WebSafeBase64Unescape(parts[1], &payload));
  std::vector<std::string> fields = absl::StrSplit(payload, '|');
  fields[1] = "mallory";
  fields[2] = std::to_string(kNow + 10 * 365 * 86400);
  const std::string forged = "aqj1." + absl::WebSafeBase64Escape(absl::StrJoin(fields, "|")) + "." + parts[2];
  auto s = VerifyJoinToken(secret_, forged, kNow).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_THAT(s.message(), HasSubstr("signature does not match"));

  // Flip one character inside the MAC (all 6 bits there are MAC bits).
  std::string flipped = token;
  const size_t mid = token.size() - 10;
  flipped[mid] = flipped[mid] == 'A' ? 'B' : 'A';
  EXPECT_EQ(VerifyJoinToken(secret_, flipped, kNow).status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(JoinTokenTest, NonCanonicalSignatureEncodingIsRejected) {
  // The last base64url character of a 32-byte MAC has 2 unused low bits:
  // setting them gives a string that decodes to the same MAC. It must not
  // verify (tokens are not malleable).
  const std::string token = Issue("peer-a");
  const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  const size_t v = alphabet.find(token.back());
  ASSERT_NE(v, std::string::npos);
  ASSERT_EQ(v & 3u, 0u) << "canonical encodings leave the unused bits zero";
  std::string variant = token;
  variant.back() = alphabet[v | 1u];
  auto s = VerifyJoinToken(secret_, variant, kNow).status();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("canonical"));
}

TEST_F(JoinTokenTest, MalformedTokensAreInvalidArgumentAndSayWhy) {
  const std::string token = Issue();
  struct Case {
    std::string token;
    std::string why;
  };
  const std::vector<Case> cases = {
      {"", "empty"},
      {"garbage", "expected 3 '.'-separated parts, got 1"},
      {token.substr(0, token.size() / 2), "parts"},  // truncated inside the payload
      {token.substr(0, token.size() - 5), "signature part"},  // truncated MAC
      {"aqj2" + token.substr(4), "unknown format 'aqj2'"},
      {"aqj1.!!!!." + token.substr(token.rfind('.') + 1), "payload part is not base64url"},
      {"aqj1..x", "signature part"},
      {std::string(5000, 'a'), "longer than"},
  };
  for (const auto& c : cases) {
    auto s = VerifyJoinToken(secret_, c.token, kNow).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.token << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("join token is malformed"));
    EXPECT_THAT(s.message(), HasSubstr(c.why)) << c.token;
  }
}

TEST_F(JoinTokenTest, ExpiredIsUnauthenticatedWithTheTime) {
  const std::string token = Issue("peer-a", kNow + 60);
  EXPECT_TRUE(VerifyJoinToken(secret_, token, kNow + 59).ok());
  auto s = VerifyJoinToken(secret_, token, kNow + 60).status();  // valid while now < expiry
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(s.message(), HasSubstr("join token expired at 2023-11-14T22:14:20Z"));
}

TEST_F(JoinTokenTest, PeerAndSwarmBinding) {
  auto bound = VerifyJoinToken(secret_, Issue("peer-a"), kNow);
  ASSERT_TRUE(bound.ok());
  EXPECT_TRUE(CheckJoinClaims(*bound, "swarm-1", "peer-a").ok());
  absl::Status s = CheckJoinClaims(*bound, "swarm-1", "peer-b");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("for peer 'peer-a', not 'peer-b'"));
  EXPECT_EQ(CheckJoinClaims(*bound, "swarm-2", "peer-a").code(), absl::StatusCode::kPermissionDenied);

  auto any = VerifyJoinToken(secret_, Issue(kAnyPeer), kNow);
  ASSERT_TRUE(any.ok());
  EXPECT_TRUE(CheckJoinClaims(*any, "swarm-1", "whoever").ok());
  EXPECT_FALSE(CheckJoinClaims(*any, "swarm-2", "whoever").ok());
}

TEST_F(JoinTokenTest, IssueValidatesItsInputs) {
  EXPECT_EQ(IssueJoinToken("short", "s", "p", kNow).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(IssueJoinToken(secret_, "a|b", "p", kNow).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IssueJoinToken(secret_, "s", "p|*", kNow).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IssueJoinToken(secret_, "", "p", kNow).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IssueJoinToken(secret_, "s", "p", 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(VerifyJoinToken("", Issue(), kNow).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(JoinSecretTest, CreatedOnceWith0600AndRefusedWhenOpen) {
  const ::aqswarm::testing::ScratchDir dir;
  const std::string path = dir.Sub("join.secret");
  EXPECT_EQ(LoadJoinSecret(path).status().code(), absl::StatusCode::kNotFound);
  auto created = LoadOrCreateJoinSecret(path);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->size(), kJoinSecretBytes);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto again = LoadOrCreateJoinSecret(path);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *created);  // not regenerated

  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  auto open = LoadJoinSecret(path);
  EXPECT_EQ(open.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(open.status().message(), HasSubstr("chmod 600"));

  ASSERT_THAT(WriteFileAtomically(path, "not hex\n", 0600), IsOk());
  EXPECT_THAT(LoadJoinSecret(path), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(WriteFileAtomically(path, "abcd\n", 0600), IsOk());
  EXPECT_THAT(LoadJoinSecret(path), StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace aqswarm
