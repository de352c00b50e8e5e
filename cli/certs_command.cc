// `aqswarm certs …`: the swarm's CA, per-process certificates and join
// tokens (layout of the TLS dir: common/certs.h; tokens: common/join_token.h).
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cli/command.h"
#include "common/certs.h"
#include "common/join_token.h"

// Other commands that take a TLS dir should ABSL_DECLARE_FLAG these rather
// than define their own.
ABSL_FLAG(std::string, tls_dir, "", "TLS dir: ca.pem, <name>.pem/.key, and on the issuing machine ca.key and "
          "join.secret.");
ABSL_FLAG(int32_t, days, 0, "Validity in days (0 = 3650 for the CA, 365 for a certificate).");
ABSL_FLAG(std::string, name, "", "Certificate name: subject CN, file stem <name>.pem and a DNS subjectAltName.");
ABSL_FLAG(std::string, ip, "", "Comma-separated IP addresses the process is dialed at (subjectAltName), "
          "e.g. 127.0.0.1,10.0.0.5.");
ABSL_FLAG(std::string, dns, "", "Comma-separated extra DNS names for subjectAltName.");
ABSL_FLAG(std::string, swarm, "", "Swarm id the join token admits to.");
ABSL_FLAG(std::string, peer, "", "Peer name the join token admits (required unless --any_peer).");
ABSL_FLAG(bool, any_peer, false,
          "Issue a wildcard join token that admits any peer name (each name once) instead of one --peer. "
          "Whoever copies it can join under any free name: prefer one token per peer.");
ABSL_FLAG(int64_t, ttl_s, 3600, "Join token lifetime in seconds.");

namespace aqswarm::cli {
namespace {

// Usage errors exit 2, failures 1 (as the other commands do).
int UsageError(const std::string& cmd, const std::string& what) {
  std::cerr << "aqswarm certs " << cmd << ": " << what << " (see aqswarm certs " << cmd << " --help)\n";
  return 2;
}

int Fail(const std::string& cmd, const absl::Status& s) {
  std::cerr << "aqswarm certs " << cmd << ": " << s << "\n";
  return 1;
}

// Checks the flags every certs command shares; returns an exit code or 0.
int CommonChecks(const std::string& cmd, const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError(cmd, "unexpected argument '" + args[0] + "'");
  if (absl::GetFlag(FLAGS_tls_dir).empty()) return UsageError(cmd, "--tls_dir is required");
  if (absl::GetFlag(FLAGS_days) < 0) return UsageError(cmd, "--days must be >= 0");
  return 0;
}

std::vector<std::string> SplitList(const std::string& s) {
  return absl::StrSplit(s, ',', absl::SkipWhitespace());
}

std::string FormatUtc(absl::Time t) { return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", t, absl::UTCTimeZone()); }

void PrintCert(const std::string& label, const CertInfo& info) {
  std::cout << label << ":\n"
            << "  subject      " << info.subject_cn << (info.is_ca ? " (CA)" : "") << "\n"
            << "  issuer       " << info.issuer_cn << "\n"
            << "  valid        " << FormatUtc(info.not_before) << " .. " << FormatUtc(info.not_after) << "\n";
  if (!info.dns_names.empty()) std::cout << "  dns          " << absl::StrJoin(info.dns_names, ",") << "\n";
  if (!info.ip_addresses.empty()) std::cout << "  ip           " << absl::StrJoin(info.ip_addresses, ",") << "\n";
  std::cout << "  sha256       " << info.sha256_fingerprint << "\n";
}

int RunInit(const std::vector<std::string>& args) {
  if (int rc = CommonChecks("init", args)) return rc;
  const std::string dir = absl::GetFlag(FLAGS_tls_dir);
  CaOptions options;
  if (int days = absl::GetFlag(FLAGS_days); days > 0) options.validity_days = days;
  if (absl::Status s = InitCaDir(dir, options); !s.ok()) return Fail("init", s);
  std::cout << "created the swarm CA: " << dir << "/" << kCaCertFile << " (copy to every machine) and " << dir
            << "/" << kCaKeyFile << " (keep here, never copy)\n";
  return 0;
}

int RunIssue(const std::vector<std::string>& args) {
  if (int rc = CommonChecks("issue", args)) return rc;
  const std::string dir = absl::GetFlag(FLAGS_tls_dir);
  LeafOptions options;
  options.name = absl::GetFlag(FLAGS_name);
  if (options.name.empty()) return UsageError("issue", "--name is required");
  options.ip_addresses = SplitList(absl::GetFlag(FLAGS_ip));
  options.dns_names = SplitList(absl::GetFlag(FLAGS_dns));
  if (int days = absl::GetFlag(FLAGS_days); days > 0) options.validity_days = days;
  auto path = IssueCertInDir(dir, options);
  if (!path.ok()) return Fail("issue", path.status());
  std::cout << "issued " << *path << " and " << KeyPath(dir, options.name) << "; copy them with "
            << kCaCertFile << " to the machine that runs '" << options.name << "'\n";
  if (options.ip_addresses.empty()) {
    std::cerr << "note: no --ip given: clients dialing this process by IP address will reject it\n";
  }
  return 0;
}

int RunToken(const std::vector<std::string>& args) {
  if (int rc = CommonChecks("token", args)) return rc;
  const std::string swarm = absl::GetFlag(FLAGS_swarm);
  if (swarm.empty()) return UsageError("token", "--swarm is required");
  const int64_t ttl = absl::GetFlag(FLAGS_ttl_s);
  if (ttl <= 0) return UsageError("token", "--ttl_s must be > 0");
  std::string peer = absl::GetFlag(FLAGS_peer);
  if (absl::GetFlag(FLAGS_any_peer)) {
    if (!peer.empty()) return UsageError("token", "give --peer NAME or --any_peer, not both");
    peer = kAnyPeer;
  } else if (peer.empty()) {
    return UsageError("token", "--peer NAME is required (a token admits one peer; --any_peer for a wildcard)");
  } else if (peer == kAnyPeer) {
    return UsageError("token", "a wildcard token needs --any_peer (not --peer '*')");
  }
  const std::string path = absl::StrCat(absl::GetFlag(FLAGS_tls_dir), "/", kJoinSecretFile);
  auto secret = LoadOrCreateJoinSecret(path);
  if (!secret.ok()) return Fail("token", secret.status());
  const int64_t expiry = absl::ToUnixSeconds(absl::Now()) + ttl;
  auto token = IssueJoinToken(*secret, swarm, peer, expiry);
  if (!token.ok()) return Fail("token", token.status());
  // The token alone on stdout (for $(...)); the explanation on stderr.
  std::cerr << (peer == kAnyPeer ? std::string("wildcard join token (any peer name, each once)")
                                 : absl::StrCat("join token for peer '", peer, "'"))
            << " in swarm '" << swarm << "', single use per name, expires "
            << FormatUtc(absl::FromUnixSeconds(expiry)) << " (secret: " << path << ")\n";
  std::cout << *token << "\n";
  return 0;
}

int RunShow(const std::vector<std::string>& args) {
  if (int rc = CommonChecks("show", args)) return rc;
  const std::string dir = absl::GetFlag(FLAGS_tls_dir);
  const std::string name = absl::GetFlag(FLAGS_name);
  auto ca_pem = ReadSmallFile(absl::StrCat(dir, "/", kCaCertFile));
  if (!ca_pem.ok()) return Fail("show", ca_pem.status());
  auto ca = DescribeCert(*ca_pem);
  if (!ca.ok()) return Fail("show", ca.status());
  PrintCert(absl::StrCat(dir, "/", kCaCertFile), *ca);
  if (name.empty()) return 0;
  auto cert_pem = ReadSmallFile(CertPath(dir, name));
  if (!cert_pem.ok()) return Fail("show", cert_pem.status());
  auto info = DescribeCert(*cert_pem);
  if (!info.ok()) return Fail("show", absl::Status(info.status().code(), absl::StrCat(CertPath(dir, name), ": ",
                                                                                       info.status().message())));
  PrintCert(CertPath(dir, name), *info);
  // The same checks a process does before it serves or dials with this cert.
  auto loaded = LoadTlsFiles(dir, name);
  if (!loaded.ok()) return Fail("show", loaded.status());
  std::cout << "ok: " << name << " matches its key, chains to the swarm CA and is valid now\n";
  return 0;
}

}  // namespace

std::vector<Command> CertsCommands() {
  return {
      {"certs init", "Create the swarm CA (ca.pem, ca.key) in a new TLS dir.",
       "Run once, on the machine that will issue certificates. Refuses to replace an existing CA.\n"
       "example: aqswarm certs init --tls_dir ./tls",
       {"tls_dir", "days"}, RunInit},
      {"certs issue", "Issue <name>.pem/.key signed by the swarm CA (for a coordinator or a peer).",
       "The certificate serves both TLS server and client auth. Give every IP and host name the process\n"
       "is dialed at: clients check them.\n"
       "example: aqswarm certs issue --tls_dir ./tls --name peer-a --ip 127.0.0.1,10.0.0.5 --dns peer-a.lan",
       {"tls_dir", "name", "ip", "dns", "days"}, RunIssue},
      {"certs token", "Print a join token (HMAC-SHA256, expiring) that admits one peer to a swarm.",
       "Creates <tls_dir>/join.secret (0600) on first use; the coordinator verifies tokens with it.\n"
       "A token admits its peer once; the peer rejoins later with its session or certificate, not the token.\n"
       "--any_peer issues a wildcard (any name, each once) instead.\n"
       "example: aqswarm certs token --tls_dir ./tls --swarm demo --peer peer-a --ttl_s 600",
       {"tls_dir", "swarm", "peer", "any_peer", "ttl_s"}, RunToken},
      {"certs show", "Print the CA and a certificate, and check that they fit together.",
       "example: aqswarm certs show --tls_dir ./tls --name peer-a",
       {"tls_dir", "name"}, RunShow},
  };
}

}  // namespace aqswarm::cli
