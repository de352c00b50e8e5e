// The swarm's X.509 certificates: a private CA per swarm, and one leaf
// certificate per process (coordinator or peer) that serves as both its TLS
// server and client identity in mutual TLS. OpenSSL 3 only; no gRPC here
// (rpc/tls.h turns a TLS dir into gRPC credentials).
//
// A TLS dir ("--tls_dir") holds PEM files:
//
//   ca.pem          the swarm CA certificate; on every machine
//   ca.key          the CA private key (0600); ONLY on the machine that issues
//   <name>.pem      a leaf certificate, signed by the CA
//   <name>.key      its private key (0600)
//   join.secret     HMAC key for join tokens (0600; coordinator/issuer only,
//                   see common/join_token.h)
//
// Usage (what `aqswarm certs init/issue` do):
//
//   AQSWARM_RETURN_IF_ERROR(InitCaDir("/etc/aqswarm/tls", CaOptions{}));
//   LeafOptions leaf;
//   leaf.name = "peer-a";
//   leaf.ip_addresses = {"127.0.0.1", "10.0.0.5"};
//   AQSWARM_RETURN_IF_ERROR(IssueCertInDir("/etc/aqswarm/tls", leaf).status());
//   // On the peer, after copying ca.pem, peer-a.pem and peer-a.key:
//   AQSWARM_ASSIGN_OR_RETURN(TlsFiles files, LoadTlsFiles("/etc/aqswarm/tls", "peer-a"));
//
// Keys are EC P-256, signatures ECDSA-SHA256. Leaf certificates carry
// subjectAltName DNS:<name> plus the given DNS names and IP addresses (gRPC
// checks the dialed host against them: a cert used on 127.0.0.1 needs
// IP:127.0.0.1), and extendedKeyUsage serverAuth+clientAuth.
//
// Files are written atomically (temp file + rename) so a crash never leaves a
// half-written key; private keys and secrets are created with mode 0600.
//
// Thread-safety: all functions are thread-safe (no shared state besides
// OpenSSL's thread-local error queue, which they clear).
#ifndef AQSWARM_COMMON_CERTS_H_
#define AQSWARM_COMMON_CERTS_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/file_util.h"  // WriteFileAtomically

namespace aqswarm {

// File names inside a TLS dir.
inline constexpr char kCaCertFile[] = "ca.pem";
inline constexpr char kCaKeyFile[] = "ca.key";
inline constexpr char kJoinSecretFile[] = "join.secret";

// How far back notBefore is set by default, so that a machine whose clock is
// a little behind the issuer's still accepts a freshly issued certificate.
inline constexpr absl::Duration kCertClockSkewAllowance = absl::Hours(1);

// A private key and its certificate, both PEM.
struct KeyAndCert {
  std::string key_pem;
  std::string cert_pem;
};

struct CaOptions {
  // Subject common name. Default: "aqswarm swarm CA".
  std::string common_name = "aqswarm swarm CA";
  // Validity in days from not_before; must be >= 0 (0 = already expired at
  // not_before, for tests). Default: 3650.
  int64_t validity_days = 3650;
  // Start of validity. Default (nullopt): now - kCertClockSkewAllowance.
  std::optional<absl::Time> not_before;
};

struct LeafOptions {
  // Process name: the subject CN, the file stem (<name>.pem) and a DNS SAN.
  // Letters, digits, '.', '_' and '-' only; not "ca". Required.
  std::string name;
  // Extra subjectAltName DNS entries (host names the process is dialed by).
  std::vector<std::string> dns_names;
  // subjectAltName IP entries, IPv4 or IPv6 text ("127.0.0.1", "::1").
  std::vector<std::string> ip_addresses;
  // Validity in days from not_before; >= 0. Default: 365.
  int64_t validity_days = 365;
  // Start of validity. Default (nullopt): now - kCertClockSkewAllowance.
  std::optional<absl::Time> not_before;
};

// What a certificate says, for `aqswarm certs show` and tests.
struct CertInfo {
  std::string subject_cn;
  std::string issuer_cn;
  bool is_ca = false;
  absl::Time not_before;
  absl::Time not_after;
  std::vector<std::string> dns_names;     // subjectAltName DNS entries
  std::vector<std::string> ip_addresses;  // subjectAltName IPs, canonical text
  std::string sha256_fingerprint;         // hex of the DER's SHA-256, lowercase
};

// The PEM material one process needs for mutual TLS.
struct TlsFiles {
  std::string ca_cert_pem;  // trust anchor: ca.pem
  std::string cert_pem;     // <name>.pem
  std::string key_pem;      // <name>.key
};

// ---------------------------------------------------------------- in memory

// Creates a self-signed CA (CA:TRUE, pathlen 0, keyCertSign|cRLSign).
absl::StatusOr<KeyAndCert> CreateCa(const CaOptions& options);

// Issues a leaf certificate signed by `ca` (serverAuth+clientAuth). Fails
// with InvalidArgument on a bad name, DNS name or IP address.
absl::StatusOr<KeyAndCert> IssueCert(const KeyAndCert& ca, const LeafOptions& options);

// Checks that `cert_pem` is signed by the CA in `ca_cert_pem`, is valid at
// `now` and may be used for TLS client and server auth. Unauthenticated with
// the reason ("expired at …", "not signed by the swarm CA …") otherwise;
// InvalidArgument when either PEM cannot be parsed.
absl::Status VerifyCertChain(absl::string_view ca_cert_pem, absl::string_view cert_pem,
                             absl::Time now = absl::Now());

// InvalidArgument unless `key_pem` is the private key of `cert_pem`.
absl::Status CheckKeyMatchesCert(absl::string_view key_pem, absl::string_view cert_pem);

// Parses a PEM certificate.
absl::StatusOr<CertInfo> DescribeCert(absl::string_view cert_pem);

// ---------------------------------------------------------------- TLS dir

std::string CertPath(absl::string_view tls_dir, absl::string_view name);  // <dir>/<name>.pem
std::string KeyPath(absl::string_view tls_dir, absl::string_view name);   // <dir>/<name>.key

// Creates `tls_dir` (0700) if needed and writes ca.pem and ca.key. Refuses
// (AlreadyExists) when ca.pem or ca.key exists: replacing a CA silently would
// invalidate every certificate already handed out.
absl::Status InitCaDir(const std::string& tls_dir, const CaOptions& options);

// Reads ca.pem + ca.key from `tls_dir`, issues a certificate and writes
// <name>.pem and <name>.key (replacing an older pair: that is rotation).
// Returns the certificate path.
absl::StatusOr<std::string> IssueCertInDir(const std::string& tls_dir, const LeafOptions& options);

// Reads ca.pem, <name>.pem and <name>.key and checks them (key matches cert,
// cert chains to the CA and is valid at `now`), so that a misconfiguration is
// reported at startup with the file name rather than as an opaque handshake
// failure later. NotFound names the missing file.
absl::StatusOr<TlsFiles> LoadTlsFiles(const std::string& tls_dir, const std::string& name,
                                      absl::Time now = absl::Now());

// ---------------------------------------------------------------- files

// WriteFileAtomically (used for keys, certificates and secrets) is in
// common/file_util.h, included here.

// Reads a whole (small) file. NotFound when it does not exist.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_CERTS_H_
