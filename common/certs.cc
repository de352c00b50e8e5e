#include "common/certs.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace aqswarm {
namespace {

// ------------------------------------------------------------ OpenSSL glue

template <typename T, void (*F)(T*)>
struct Deleter {
  void operator()(T* p) const { F(p); }
};
using PkeyPtr = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using X509Ptr = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using BioPtr = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;
using StorePtr = std::unique_ptr<X509_STORE, Deleter<X509_STORE, X509_STORE_free>>;
using StoreCtxPtr = std::unique_ptr<X509_STORE_CTX, Deleter<X509_STORE_CTX, X509_STORE_CTX_free>>;
using BnPtr = std::unique_ptr<BIGNUM, Deleter<BIGNUM, BN_free>>;
using ExtPtr = std::unique_ptr<X509_EXTENSION, Deleter<X509_EXTENSION, X509_EXTENSION_free>>;
using NamesPtr = std::unique_ptr<GENERAL_NAMES, Deleter<GENERAL_NAMES, GENERAL_NAMES_free>>;

// Drains OpenSSL's thread-local error queue into one line (so a later call
// does not report a stale error).
std::string OpenSslErrors() {
  std::vector<std::string> parts;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    parts.emplace_back(buf);
  }
  return parts.empty() ? "no OpenSSL error reported" : absl::StrJoin(parts, "; ");
}

absl::Status SslError(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", OpenSslErrors()));
}

std::string FormatUtc(absl::Time t) { return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", t, absl::UTCTimeZone()); }

absl::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, ": ", s.message()));
}

// Never prompts: an encrypted key is an error, not a tty prompt.
int NoPassword(char*, int, int, void*) { return 0; }

absl::StatusOr<X509Ptr> ParseCert(absl::string_view pem) {
  ERR_clear_error();
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (bio == nullptr) return SslError("BIO_new_mem_buf");
  X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, NoPassword, nullptr));
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("not a PEM certificate (", OpenSslErrors(), ")"));
  }
  return cert;
}

absl::StatusOr<PkeyPtr> ParseKey(absl::string_view pem) {
  ERR_clear_error();
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (bio == nullptr) return SslError("BIO_new_mem_buf");
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassword, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an unencrypted PEM private key (", OpenSslErrors(), ")"));
  }
  return key;
}

absl::StatusOr<std::string> CertToPem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || PEM_write_bio_X509(bio.get(), cert) != 1) return SslError("PEM_write_bio_X509");
  char* data = nullptr;
  long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, n);
}

absl::StatusOr<std::string> KeyToPem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return SslError("PEM_write_bio_PrivateKey");
  }
  char* data = nullptr;
  long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, n);
}

absl::StatusOr<PkeyPtr> NewP256Key() {
  PkeyPtr key(EVP_EC_gen("P-256"));
  if (key == nullptr) return SslError("generating an EC P-256 key");
  return key;
}

absl::Time FromAsn1Time(const ASN1_TIME* t) {
  struct tm tm {};
  if (t == nullptr || ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromTimeT(timegm(&tm));
}

std::string CommonName(const X509_NAME* name) {
  int i = X509_NAME_get_index_by_NID(name, NID_commonName, -1);
  if (i < 0) return "";
  ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(name, i));
  unsigned char* utf8 = nullptr;
  int n = ASN1_STRING_to_UTF8(&utf8, data);
  if (n < 0) return "";
  std::string out(reinterpret_cast<char*>(utf8), n);
  OPENSSL_free(utf8);
  return out;
}

// A name usable as a file stem and as a DNS SAN: no '/', no ',' (the SAN
// config syntax), no ".." tricks.
absl::Status ValidateName(absl::string_view name) {
  if (name.empty() || name.size() > 64) {
    return absl::InvalidArgumentError("certificate name must be 1-64 characters");
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat("certificate name '", name,
                                                     "' may contain only letters, digits, '.', '_' and '-'"));
    }
  }
  if (name[0] == '.' || name[0] == '-') {
    return absl::InvalidArgumentError(absl::StrCat("certificate name '", name, "' must start with a letter or digit"));
  }
  if (name == "ca" || name == "join") {
    return absl::InvalidArgumentError(absl::StrCat("certificate name '", name, "' is reserved in the TLS dir"));
  }
  return absl::OkStatus();
}

absl::Status ValidateDnsName(absl::string_view dns) {
  bool ok = !dns.empty() && dns.size() <= 253;
  for (char c : dns) {
    ok &= absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '*' || c == '_';
  }
  if (!ok) return absl::InvalidArgumentError(absl::StrCat("'", dns, "' is not a valid DNS name"));
  return absl::OkStatus();
}

absl::Status ValidateIp(absl::string_view ip) {
  std::string s(ip);
  unsigned char buf[16];
  if (inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("'", ip, "' is not an IPv4 or IPv6 address"));
}

absl::Status AddExtension(X509* cert, X509V3_CTX* ctx, int nid, const std::string& value) {
  ExtPtr ext(X509V3_EXT_nconf_nid(nullptr, ctx, nid, value.c_str()));
  if (ext == nullptr || X509_add_ext(cert, ext.get(), -1) != 1) {
    return SslError(absl::StrCat("adding extension ", OBJ_nid2sn(nid), "=", value));
  }
  return absl::OkStatus();
}

absl::Status SetName(X509_NAME* name, const std::string& cn) {
  if (X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8, reinterpret_cast<const unsigned char*>("aqswarm"), -1,
                                 -1, 0) != 1 ||
      X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8, reinterpret_cast<const unsigned char*>(cn.c_str()), -1,
                                 -1, 0) != 1) {
    return SslError("setting the subject name");
  }
  return absl::OkStatus();
}

// Version, random positive 127-bit serial, validity, subject and public key.
absl::StatusOr<X509Ptr> NewCertSkeleton(EVP_PKEY* key, const std::string& cn, int64_t validity_days,
                                        const std::optional<absl::Time>& not_before_opt) {
  if (validity_days < 0) return absl::InvalidArgumentError("validity days must be >= 0");
  if (validity_days > 100 * 365) return absl::InvalidArgumentError("validity days must be <= 36500");
  X509Ptr cert(X509_new());
  if (cert == nullptr || X509_set_version(cert.get(), X509_VERSION_3) != 1) return SslError("X509_new");
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) return SslError("RAND_bytes");
  serial[0] &= 0x7f;  // DER INTEGER must be positive
  BnPtr bn(BN_bin2bn(serial, sizeof(serial), nullptr));
  if (bn == nullptr || BN_to_ASN1_INTEGER(bn.get(), X509_get_serialNumber(cert.get())) == nullptr) {
    return SslError("setting the serial number");
  }
  const absl::Time not_before = not_before_opt.value_or(absl::Now() - kCertClockSkewAllowance);
  const absl::Time not_after = not_before + absl::Hours(24) * validity_days;
  if (ASN1_TIME_set(X509_getm_notBefore(cert.get()), absl::ToTimeT(not_before)) == nullptr ||
      ASN1_TIME_set(X509_getm_notAfter(cert.get()), absl::ToTimeT(not_after)) == nullptr) {
    return SslError("setting the validity period");
  }
  AQSWARM_RETURN_IF_ERROR(SetName(X509_get_subject_name(cert.get()), cn));
  if (X509_set_pubkey(cert.get(), key) != 1) return SslError("X509_set_pubkey");
  return cert;
}

std::string JoinPath(absl::string_view dir, absl::string_view file) {
  if (dir.empty()) return std::string(file);
  if (dir.back() == '/') return absl::StrCat(dir, file);
  return absl::StrCat(dir, "/", file);
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}


}  // namespace

// ------------------------------------------------------------ in memory

absl::StatusOr<KeyAndCert> CreateCa(const CaOptions& options) {
  if (options.common_name.empty()) return absl::InvalidArgumentError("CA common name must not be empty");
  AQSWARM_ASSIGN_OR_RETURN(PkeyPtr key, NewP256Key());
  AQSWARM_ASSIGN_OR_RETURN(X509Ptr cert,
                           NewCertSkeleton(key.get(), options.common_name, options.validity_days, options.not_before));
  if (X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get())) != 1) return SslError("X509_set_issuer_name");
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, cert.get(), cert.get(), nullptr, nullptr, 0);
  // pathlen:0: the swarm CA signs leaves only, never intermediate CAs.
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_key_usage, "critical,keyCertSign,cRLSign"));
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_subject_key_identifier, "hash"));
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_authority_key_identifier, "keyid:always"));
  if (X509_sign(cert.get(), key.get(), EVP_sha256()) == 0) return SslError("signing the CA certificate");
  KeyAndCert out;
  AQSWARM_ASSIGN_OR_RETURN(out.key_pem, KeyToPem(key.get()));
  AQSWARM_ASSIGN_OR_RETURN(out.cert_pem, CertToPem(cert.get()));
  return out;
}

absl::StatusOr<KeyAndCert> IssueCert(const KeyAndCert& ca, const LeafOptions& options) {
  AQSWARM_RETURN_IF_ERROR(ValidateName(options.name));
  std::vector<std::string> san = {absl::StrCat("DNS:", options.name)};
  for (const auto& dns : options.dns_names) {
    AQSWARM_RETURN_IF_ERROR(ValidateDnsName(dns));
    if (dns != options.name) san.push_back(absl::StrCat("DNS:", dns));
  }
  for (const auto& ip : options.ip_addresses) {
    AQSWARM_RETURN_IF_ERROR(ValidateIp(ip));
    san.push_back(absl::StrCat("IP:", ip));
  }
  auto ca_cert = ParseCert(ca.cert_pem);
  if (!ca_cert.ok()) return Prefixed(ca_cert.status(), "CA certificate");
  auto ca_key = ParseKey(ca.key_pem);
  if (!ca_key.ok()) return Prefixed(ca_key.status(), "CA key");
  if (X509_check_private_key(ca_cert->get(), ca_key->get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the CA key does not belong to the CA certificate");
  }
  if ((X509_get_extension_flags(ca_cert->get()) & EXFLAG_CA) == 0) {
    return absl::InvalidArgumentError("the CA certificate is not a CA (basicConstraints CA:TRUE missing)");
  }

  AQSWARM_ASSIGN_OR_RETURN(PkeyPtr key, NewP256Key());
  AQSWARM_ASSIGN_OR_RETURN(X509Ptr cert,
                           NewCertSkeleton(key.get(), options.name, options.validity_days, options.not_before));
  if (X509_set_issuer_name(cert.get(), X509_get_subject_name(ca_cert->get())) != 1) {
    return SslError("X509_set_issuer_name");
  }
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, ca_cert->get(), cert.get(), nullptr, nullptr, 0);
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_basic_constraints, "critical,CA:FALSE"));
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_key_usage, "critical,digitalSignature"));
  // One certificate per process serves both ends of mutual TLS.
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_ext_key_usage, "serverAuth,clientAuth"));
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_subject_alt_name, absl::StrJoin(san, ",")));
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_subject_key_identifier, "hash"));
  AQSWARM_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_authority_key_identifier, "keyid"));
  if (X509_sign(cert.get(), ca_key->get(), EVP_sha256()) == 0) return SslError("signing the certificate");
  KeyAndCert out;
  AQSWARM_ASSIGN_OR_RETURN(out.key_pem, KeyToPem(key.get()));
  AQSWARM_ASSIGN_OR_RETURN(out.cert_pem, CertToPem(cert.get()));
  return out;
}

absl::Status VerifyCertChain(absl::string_view ca_cert_pem, absl::string_view cert_pem, absl::Time now) {
  auto ca = ParseCert(ca_cert_pem);
  if (!ca.ok()) return Prefixed(ca.status(), "CA certificate");
  auto leaf = ParseCert(cert_pem);
  if (!leaf.ok()) return Prefixed(leaf.status(), "certificate");
  const std::string leaf_cn = CommonName(X509_get_subject_name(leaf->get()));
  const std::string ca_cn = CommonName(X509_get_subject_name(ca->get()));

  StorePtr store(X509_STORE_new());
  StoreCtxPtr ctx(X509_STORE_CTX_new());
  if (store == nullptr || ctx == nullptr || X509_STORE_add_cert(store.get(), ca->get()) != 1 ||
      X509_STORE_CTX_init(ctx.get(), store.get(), leaf->get(), nullptr) != 1) {
    return SslError("setting up certificate verification");
  }
  X509_VERIFY_PARAM_set_time(X509_STORE_CTX_get0_param(ctx.get()), absl::ToTimeT(now));
  if (X509_verify_cert(ctx.get()) != 1) {
    const int err = X509_STORE_CTX_get_error(ctx.get());
    X509* bad = X509_STORE_CTX_get_current_cert(ctx.get());
    if (bad == nullptr) bad = leaf->get();
    const std::string bad_cn = CommonName(X509_get_subject_name(bad));
    ERR_clear_error();
    switch (err) {
      case X509_V_ERR_CERT_HAS_EXPIRED:
        return absl::UnauthenticatedError(absl::StrCat("certificate '", bad_cn, "' expired at ",
                                                       FormatUtc(FromAsn1Time(X509_get0_notAfter(bad))),
                                                       " (now ", FormatUtc(now), ")"));
      case X509_V_ERR_CERT_NOT_YET_VALID:
        return absl::UnauthenticatedError(absl::StrCat("certificate '", bad_cn, "' is not valid before ",
                                                       FormatUtc(FromAsn1Time(X509_get0_notBefore(bad))),
                                                       " (now ", FormatUtc(now), "; check the clocks)"));
      case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY:
      case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT:
      case X509_V_ERR_CERT_SIGNATURE_FAILURE:
      case X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE:
      case X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT:
      case X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN:
        return absl::UnauthenticatedError(absl::StrCat(
            "certificate '", leaf_cn, "' (issuer '", CommonName(X509_get_issuer_name(leaf->get())),
            "') is not signed by the swarm CA '", ca_cn, "': ", X509_verify_cert_error_string(err)));
      default:
        return absl::UnauthenticatedError(absl::StrCat("certificate '", bad_cn, "' does not verify against CA '",
                                                       ca_cn, "': ", X509_verify_cert_error_string(err)));
    }
  }
  if (X509_check_purpose(leaf->get(), X509_PURPOSE_SSL_SERVER, 0) != 1 ||
      X509_check_purpose(leaf->get(), X509_PURPOSE_SSL_CLIENT, 0) != 1) {
    ERR_clear_error();
    return absl::UnauthenticatedError(absl::StrCat(
        "certificate '", leaf_cn, "' is not valid for both TLS server and client auth (extendedKeyUsage)"));
  }
  return absl::OkStatus();
}

absl::Status CheckKeyMatchesCert(absl::string_view key_pem, absl::string_view cert_pem) {
  AQSWARM_ASSIGN_OR_RETURN(PkeyPtr key, ParseKey(key_pem));
  AQSWARM_ASSIGN_OR_RETURN(X509Ptr cert, ParseCert(cert_pem));
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("the private key does not belong to certificate '",
                                                   CommonName(X509_get_subject_name(cert.get())), "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CertInfo> DescribeCert(absl::string_view cert_pem) {
  AQSWARM_ASSIGN_OR_RETURN(X509Ptr cert, ParseCert(cert_pem));
  CertInfo info;
  info.subject_cn = CommonName(X509_get_subject_name(cert.get()));
  info.issuer_cn = CommonName(X509_get_issuer_name(cert.get()));
  info.is_ca = (X509_get_extension_flags(cert.get()) & EXFLAG_CA) != 0;
  info.not_before = FromAsn1Time(X509_get0_notBefore(cert.get()));
  info.not_after = FromAsn1Time(X509_get0_notAfter(cert.get()));
  NamesPtr names(static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert.get(), NID_subject_alt_name, nullptr, nullptr)));
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names.get()); ++i) {
    const GENERAL_NAME* gen = sk_GENERAL_NAME_value(names.get(), i);
    if (gen->type == GEN_DNS) {
      const ASN1_STRING* s = gen->d.dNSName;
      info.dns_names.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(s)), ASN1_STRING_length(s));
    } else if (gen->type == GEN_IPADD) {
      const ASN1_OCTET_STRING* s = gen->d.iPAddress;
      char text[INET6_ADDRSTRLEN] = {};
      const int family = ASN1_STRING_length(s) == 4 ? AF_INET : AF_INET6;
      if (inet_ntop(family, ASN1_STRING_get0_data(s), text, sizeof(text)) != nullptr) {
        info.ip_addresses.emplace_back(text);
      }
    }
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int md_len = 0;
  if (X509_digest(cert.get(), EVP_sha256(), md, &md_len) != 1) return SslError("X509_digest");
  static constexpr char kHex[] = "0123456789abcdef";
  for (unsigned int i = 0; i < md_len; ++i) {
    info.sha256_fingerprint.push_back(kHex[md[i] >> 4]);
    info.sha256_fingerprint.push_back(kHex[md[i] & 15]);
  }
  ERR_clear_error();
  return info;
}

// ------------------------------------------------------------ TLS dir

std::string CertPath(absl::string_view tls_dir, absl::string_view name) {
  return JoinPath(tls_dir, absl::StrCat(name, ".pem"));
}
std::string KeyPath(absl::string_view tls_dir, absl::string_view name) {
  return JoinPath(tls_dir, absl::StrCat(name, ".key"));
}

absl::Status InitCaDir(const std::string& tls_dir, const CaOptions& options) {
  if (tls_dir.empty()) return absl::InvalidArgumentError("the TLS dir must not be empty");
  // Like `mkdir -p`, but the TLS dir itself is private.
  std::error_code ignored;
  const std::filesystem::path parent = std::filesystem::path(tls_dir).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ignored);
  if (::mkdir(tls_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return FileError(errno, absl::StrCat("creating ", tls_dir));
  }
  const std::string cert_path = JoinPath(tls_dir, kCaCertFile);
  const std::string key_path = JoinPath(tls_dir, kCaKeyFile);
  for (const auto& p : {cert_path, key_path}) {
    if (FileExists(p)) {
      return absl::AlreadyExistsError(absl::StrCat(
          p, " already exists: refusing to replace the swarm CA (every certificate it issued would stop "
             "working); remove it by hand if that is what you want"));
    }
  }
  AQSWARM_ASSIGN_OR_RETURN(KeyAndCert ca, CreateCa(options));
  // Key first: ca.pem existing then implies ca.key exists.
  AQSWARM_RETURN_IF_ERROR(WriteFileAtomically(key_path, ca.key_pem, 0600));
  return WriteFileAtomically(cert_path, ca.cert_pem, 0644);
}

absl::StatusOr<std::string> IssueCertInDir(const std::string& tls_dir, const LeafOptions& options) {
  AQSWARM_RETURN_IF_ERROR(ValidateName(options.name));
  KeyAndCert ca;
  const std::string ca_cert_path = JoinPath(tls_dir, kCaCertFile);
  const std::string ca_key_path = JoinPath(tls_dir, kCaKeyFile);
  auto cert = ReadSmallFile(ca_cert_path);
  if (absl::IsNotFound(cert.status())) {
    return absl::NotFoundError(
        absl::StrCat(ca_cert_path, " does not exist: run `aqswarm certs init --tls_dir ", tls_dir, "` first"));
  }
  if (!cert.ok()) return cert.status();
  auto key = ReadSmallFile(ca_key_path);
  if (absl::IsNotFound(key.status())) {
    return absl::NotFoundError(absl::StrCat(ca_key_path,
                                            " does not exist: certificates are issued on the machine that ran "
                                            "`aqswarm certs init` (the only one holding the CA key)"));
  }
  if (!key.ok()) return key.status();
  ca.cert_pem = *std::move(cert);
  ca.key_pem = *std::move(key);
  auto leaf = IssueCert(ca, options);
  if (!leaf.ok()) return Prefixed(leaf.status(), absl::StrCat("issuing '", options.name, "' from ", tls_dir));
  const std::string cert_path = CertPath(tls_dir, options.name);
  AQSWARM_RETURN_IF_ERROR(WriteFileAtomically(KeyPath(tls_dir, options.name), leaf->key_pem, 0600));
  AQSWARM_RETURN_IF_ERROR(WriteFileAtomically(cert_path, leaf->cert_pem, 0644));
  return cert_path;
}

absl::StatusOr<TlsFiles> LoadTlsFiles(const std::string& tls_dir, const std::string& name, absl::Time now) {
  AQSWARM_RETURN_IF_ERROR(ValidateName(name));
  const std::string ca_path = JoinPath(tls_dir, kCaCertFile);
  const std::string cert_path = CertPath(tls_dir, name);
  const std::string key_path = KeyPath(tls_dir, name);
  TlsFiles files;
  AQSWARM_ASSIGN_OR_RETURN(files.ca_cert_pem, ReadSmallFile(ca_path));
  AQSWARM_ASSIGN_OR_RETURN(files.cert_pem, ReadSmallFile(cert_path));
  AQSWARM_ASSIGN_OR_RETURN(files.key_pem, ReadSmallFile(key_path));
  // Parse each file on its own first so the error names the bad one.
  if (auto c = ParseCert(files.ca_cert_pem); !c.ok()) return Prefixed(c.status(), ca_path);
  if (auto c = ParseCert(files.cert_pem); !c.ok()) return Prefixed(c.status(), cert_path);
  if (auto k = ParseKey(files.key_pem); !k.ok()) return Prefixed(k.status(), key_path);
  AQSWARM_RETURN_IF_ERROR(Prefixed(CheckKeyMatchesCert(files.key_pem, files.cert_pem),
                                   absl::StrCat(key_path, " vs ", cert_path)));
  AQSWARM_RETURN_IF_ERROR(
      Prefixed(VerifyCertChain(files.ca_cert_pem, files.cert_pem, now), absl::StrCat(cert_path, " vs ", ca_path)));
  return files;
}

// ------------------------------------------------------------ files

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  constexpr size_t kMaxBytes = 1 << 20;  // PEM files and secrets are a few KiB
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    return FileError(errno, absl::StrCat("opening ", path));
  }
  std::string out;
  char buf[8192];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return FileError(err, absl::StrCat("reading ", path));
    }
    if (n == 0) break;
    out.append(buf, n);
    if (out.size() > kMaxBytes) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, " is larger than ", kMaxBytes, " bytes"));
    }
  }
  ::close(fd);
  return out;
}

}  // namespace aqswarm
