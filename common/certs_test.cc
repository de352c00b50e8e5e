#include "common/certs.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/status_matchers.h"

namespace aqswarm {
namespace {

using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;
using ::aqswarm::testing::IsOk;
using ::aqswarm::testing::ScratchDir;

mode_t Mode(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

LeafOptions Leaf(const std::string& name) {
  LeafOptions o;
  o.name = name;
  o.ip_addresses = {"127.0.0.1", "10.0.0.5", "::1"};
  o.dns_names = {"host1.example", "host2"};
  return o;
}

TEST(CertsTest, CaAndLeafRoundTrip) {
  auto ca = CreateCa({});
  ASSERT_TRUE(ca.ok()) << ca.status();
  auto ca_info = DescribeCert(ca->cert_pem);
  ASSERT_TRUE(ca_info.ok()) << ca_info.status();
  EXPECT_TRUE(ca_info->is_ca);
  EXPECT_EQ(ca_info->subject_cn, "aqswarm swarm CA");
  EXPECT_EQ(ca_info->issuer_cn, ca_info->subject_cn);

  auto leaf = IssueCert(*ca, Leaf("peer-a"));
  ASSERT_TRUE(leaf.ok()) << leaf.status();
  auto info = DescribeCert(leaf->cert_pem);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->is_ca);
  EXPECT_EQ(info->subject_cn, "peer-a");
  EXPECT_EQ(info->issuer_cn, "aqswarm swarm CA");
  EXPECT_THAT(info->ip_addresses, UnorderedElementsAre("127.0.0.1", "10.0.0.5", "::1"));
  EXPECT_THAT(info->dns_names, UnorderedElementsAre("peer-a", "host1.example", "host2"));
  EXPECT_EQ(info->sha256_fingerprint.size(), 64u);
  // Default validity: from an hour ago (clock skew) for 365 days.
  EXPECT_LE(info->not_before, absl::Now() - absl::Minutes(59));
  EXPECT_NEAR(absl::ToDoubleHours(info->not_after - info->not_before), 365 * 24, 0.01);

  EXPECT_TRUE(VerifyCertChain(ca->cert_pem, leaf->cert_pem).ok());
  EXPECT_TRUE(CheckKeyMatchesCert(leaf->key_pem, leaf->cert_pem).ok());
  // Keys are P-256 PKCS#8.
  EXPECT_THAT(leaf->key_pem, HasSubstr("BEGIN PRIVATE KEY"));
}

TEST(CertsTest, LeafFromAnotherCaFailsVerification) {
  auto ca = CreateCa({});
  CaOptions other_opts;
  other_opts.common_name = "some other CA";
  auto other = CreateCa(other_opts);
  ASSERT_TRUE(ca.ok() && other.ok());
  auto foreign = IssueCert(*other, Leaf("intruder"));
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  absl::Status s = VerifyCertChain(ca->cert_pem, foreign->cert_pem);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_THAT(s.message(), HasSubstr("is not signed by the swarm CA"));
  EXPECT_THAT(s.message(), HasSubstr("some other CA"));

  // Same CA name, different key: still rejected (the signature is checked,
  // not the issuer name).
  auto twin = CreateCa({});
  ASSERT_TRUE(twin.ok());
  auto twin_leaf = IssueCert(*twin, Leaf("peer-a"));
  ASSERT_TRUE(twin_leaf.ok());
  EXPECT_EQ(VerifyCertChain(ca->cert_pem, twin_leaf->cert_pem).code(), absl::StatusCode::kUnauthenticated);

  // A CA cert is not a leaf of itself for our purposes either way, and a
  // leaf is not a CA: issuing from a leaf fails.
  KeyAndCert leaf_as_ca = *IssueCert(*ca, Leaf("peer-b"));
  EXPECT_EQ(IssueCert(leaf_as_ca, Leaf("peer-c")).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CertsTest, ExpiredAndNotYetValidAreDetected) {
  CaOptions ca_opts;
  ca_opts.not_before = absl::Now() - absl::Hours(24 * 30);  // so the CA itself was valid back then
  auto ca = CreateCa(ca_opts);
  ASSERT_TRUE(ca.ok());
  LeafOptions old = Leaf("old");
  old.not_before = absl::Now() - absl::Hours(24 * 10);
  old.validity_days = 2;
  auto expired = IssueCert(*ca, old);
  ASSERT_TRUE(expired.ok()) << expired.status();
  absl::Status s = VerifyCertChain(ca->cert_pem, expired->cert_pem);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_THAT(s.message(), HasSubstr("certificate 'old' expired at"));
  // ... but it was fine while it was valid (injected clock).
  EXPECT_TRUE(VerifyCertChain(ca->cert_pem, expired->cert_pem, absl::Now() - absl::Hours(24 * 9)).ok());

  LeafOptions zero = Leaf("zero");
  zero.validity_days = 0;  // notAfter == notBefore == now - 1h
  auto z = IssueCert(*ca, zero);
  ASSERT_TRUE(z.ok());
  EXPECT_THAT(VerifyCertChain(ca->cert_pem, z->cert_pem).message(), HasSubstr("expired at"));

  LeafOptions future = Leaf("future");
  future.not_before = absl::Now() + absl::Hours(48);
  auto f = IssueCert(*ca, future);
  ASSERT_TRUE(f.ok());
  EXPECT_THAT(VerifyCertChain(ca->cert_pem, f->cert_pem).message(), HasSubstr("is not valid before"));

  // An expired CA invalidates its leaves.
  CaOptions old_ca;
  old_ca.not_before = absl::Now() - absl::Hours(24 * 10);
  old_ca.validity_days = 1;
  auto dead_ca = CreateCa(old_ca);
  ASSERT_TRUE(dead_ca.ok());
  auto leaf = IssueCert(*dead_ca, Leaf("peer"));
  ASSERT_TRUE(leaf.ok());
  s = VerifyCertChain(dead_ca->cert_pem, leaf->cert_pem);
  EXPECT_THAT(s.message(), HasSubstr("certificate 'aqswarm swarm CA' expired at")) << s;
}

TEST(CertsTest, GarbledPemAndMismatchedKeyAreErrors) {
  auto ca = CreateCa({});
  ASSERT_TRUE(ca.ok());
  auto leaf = IssueCert(*ca, Leaf("peer-a"));
  ASSERT_TRUE(leaf.ok());

  EXPECT_EQ(DescribeCert("hello").status().code(), absl::StatusCode::kInvalidArgument);
  std::string garbled = leaf->cert_pem;
  garbled[garbled.size() / 2] = '!';  // inside the base64 body
  absl::Status s = VerifyCertChain(ca->cert_pem, garbled);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("not a PEM certificate"));
  EXPECT_EQ(VerifyCertChain("", leaf->cert_pem).code(), absl::StatusCode::kInvalidArgument);

  auto other = IssueCert(*ca, Leaf("peer-b"));
  ASSERT_TRUE(other.ok());
  s = CheckKeyMatchesCert(other->key_pem, leaf->cert_pem);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("does not belong to certificate 'peer-a'"));
  EXPECT_EQ(CheckKeyMatchesCert("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", leaf->cert_pem)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CertsTest, BadNamesAndAddressesAreRejected) {
  auto ca = CreateCa({});
  ASSERT_TRUE(ca.ok());
  for (const char* name : {"", "../etc", "a/b", "a,DNS:evil", "ca", "-x", "white space"}) {
    LeafOptions o;
    o.name = name;
    EXPECT_EQ(IssueCert(*ca, o).status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  LeafOptions o = Leaf("peer");
  o.ip_addresses = {"300.1.1.1"};
  absl::Status s = IssueCert(*ca, o).status();
  EXPECT_THAT(s.message(), HasSubstr("'300.1.1.1' is not an IPv4 or IPv6 address"));
  o = Leaf("peer");
  o.dns_names = {"x,IP:1.2.3.4"};
  EXPECT_EQ(IssueCert(*ca, o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Leaf("peer");
  o.validity_days = -1;
  EXPECT_EQ(IssueCert(*ca, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CertsTest, TlsDirLayoutModesAndLoading) {
  ScratchDir tmp;
  const std::string dir = tmp.path() + "/a/tls";  // parents are created
  ASSERT_TRUE(InitCaDir(dir, {}).ok());
  EXPECT_EQ(Mode(dir), 0700u);
  EXPECT_EQ(Mode(dir + "/ca.key"), 0600u);
  EXPECT_EQ(Mode(dir + "/ca.pem"), 0644u);
  // A second init must not replace the CA.
  absl::Status again = InitCaDir(dir, {});
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;

  auto path = IssueCertInDir(dir, Leaf("coordinator"));
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(*path, dir + "/coordinator.pem");
  EXPECT_EQ(Mode(dir + "/coordinator.key"), 0600u);
  EXPECT_EQ(Mode(dir + "/coordinator.pem"), 0644u);
  // No temp files left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
    ++files;
  }
  EXPECT_EQ(files, 4);

  auto loaded = LoadTlsFiles(dir, "coordinator");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_THAT(loaded->cert_pem, HasSubstr("BEGIN CERTIFICATE"));

  // Missing files are named.
  auto missing = LoadTlsFiles(dir, "nobody");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("nobody.pem does not exist"));
  auto no_ca = IssueCertInDir(tmp.path() + "/empty", Leaf("x"));
  EXPECT_EQ(no_ca.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_ca.status().message(), HasSubstr("aqswarm certs init"));

  // A peer's dir has no ca.key: issuing there says why.
  const std::string peer_dir = tmp.path() + "/peer";
  std::filesystem::create_directory(peer_dir);
  std::filesystem::copy_file(dir + "/ca.pem", peer_dir + "/ca.pem");
  auto no_key = IssueCertInDir(peer_dir, Leaf("x"));
  EXPECT_THAT(no_key.status().message(), HasSubstr("only one holding the CA key"));

  // Key of another cert: mismatch reported with both file names.
  ASSERT_TRUE(IssueCertInDir(dir, Leaf("peer-a")).ok());
  std::filesystem::copy_file(dir + "/peer-a.key", dir + "/coordinator.key",
                             std::filesystem::copy_options::overwrite_existing);
  auto mismatch = LoadTlsFiles(dir, "coordinator");
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mismatch.status().message(), HasSubstr("coordinator.key vs"));

  // Garbled file: the error names it.
  ASSERT_THAT(WriteFileAtomically(dir + "/peer-a.pem", "-----BEGIN CERTIFICATE-----\nzzz\n", 0644), IsOk());
  auto garbled = LoadTlsFiles(dir, "peer-a");
  EXPECT_EQ(garbled.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(garbled.status().message(), HasSubstr("peer-a.pem: not a PEM certificate"));

  // An expired leaf is refused at load time, with the file names.
  LeafOptions old = Leaf("old");
  old.not_before = absl::Now() - absl::Hours(24 * 10);
  old.validity_days = 1;
  ASSERT_TRUE(IssueCertInDir(dir, old).ok());
  auto expired = LoadTlsFiles(dir, "old");
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(expired.status().message(), HasSubstr("old.pem vs"));
  EXPECT_THAT(expired.status().message(), HasSubstr("expired at"));
}

}  // namespace
}  // namespace aqswarm
