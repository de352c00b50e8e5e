// SHA-256 (OpenSSL) of bytes and files, as 64 lowercase hex digits.
//
//   std::string h = Sha256Hex("abc");  // "ba7816bf..."
//   Sha256 s;  s.Update(piece1);  s.Update(piece2);  std::string h2 = s.HexDigest();
//   AQSWARM_ASSIGN_OR_RETURN(std::string h3, Sha256OfFile("/path/state-7.ckpt"));
#ifndef AQSWARM_COMMON_SHA256_H_
#define AQSWARM_COMMON_SHA256_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace aqswarm {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(absl::string_view data);
  // The digest of everything fed so far (the object may not be used after).
  std::string HexDigest();

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

std::string Sha256Hex(absl::string_view data);
// Reads the file in 1 MiB pieces. NotFound / PermissionDenied / Internal
// naming the path.
absl::StatusOr<std::string> Sha256OfFile(const std::string& path);
// 64 lowercase hex digits.
bool IsSha256Hex(absl::string_view s);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_SHA256_H_
