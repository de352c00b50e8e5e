// Status helpers used across aqswarm.
//
//   AQSWARM_RETURN_IF_ERROR(DoThing());
//   AQSWARM_ASSIGN_OR_RETURN(auto db, OpenDb(path));
//   AQSWARM_CHECK(ptr != nullptr) << "why";   // broken invariant only: aborts
#ifndef AQSWARM_COMMON_STATUS_MACROS_H_
#define AQSWARM_COMMON_STATUS_MACROS_H_

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define AQSWARM_CONCAT_INNER_(a, b) a##b
#define AQSWARM_CONCAT_(a, b) AQSWARM_CONCAT_INNER_(a, b)

#define AQSWARM_RETURN_IF_ERROR(expr)                \
  do {                                               \
    ::absl::Status aqswarm_status_ = (expr);         \
    if (!aqswarm_status_.ok()) return aqswarm_status_; \
  } while (0)

#define AQSWARM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return std::move(tmp).status();       \
  lhs = std::move(tmp).value()

#define AQSWARM_ASSIGN_OR_RETURN(lhs, expr) \
  AQSWARM_ASSIGN_OR_RETURN_IMPL_(AQSWARM_CONCAT_(aqswarm_statusor_, __LINE__), lhs, expr)

namespace aqswarm::internal {
// Streams a message, then aborts in its destructor.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* cond) {
    stream_ << file << ":" << line << ": AQSWARM_CHECK failed: " << cond << " ";
  }
  [[noreturn]] ~CheckFailure() {
    std::cerr << stream_.str() << std::endl;
    std::abort();
  }
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};
}  // namespace aqswarm::internal

#define AQSWARM_CHECK(cond) \
  if (cond) {               \
  } else                    \
    ::aqswarm::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()

#endif  // AQSWARM_COMMON_STATUS_MACROS_H_
