#include "common/sha256.h"

#include <openssl/evp.h>

#include <cerrno>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"

namespace aqswarm {

struct Sha256::Ctx {
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  ~Ctx() { EVP_MD_CTX_free(md); }
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) { EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr); }

Sha256::~Sha256() = default;

void Sha256::Update(absl::string_view data) { EVP_DigestUpdate(ctx_->md, data.data(), data.size()); }

std::string Sha256::HexDigest() {
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_DigestFinal_ex(ctx_->md, d, &n);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (unsigned int i = 0; i < n; ++i) {
    out.push_back(kHex[d[i] >> 4]);
    out.push_back(kHex[d[i] & 15]);
  }
  return out;
}

std::string Sha256Hex(absl::string_view data) {
  Sha256 s;
  s.Update(data);
  return s.HexDigest();
}

absl::StatusOr<std::string> Sha256OfFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return FileError(errno, absl::StrCat("opening ", path));
  Sha256 s;
  std::string buf(1 << 20, '\0');
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    s.Update(absl::string_view(buf.data(), static_cast<size_t>(in.gcount())));
  }
  if (in.bad()) return FileError(errno, absl::StrCat("reading ", path));
  return s.HexDigest();
}

bool IsSha256Hex(absl::string_view s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace aqswarm
