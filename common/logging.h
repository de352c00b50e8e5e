// Minimal leveled logging to stderr (absl 20220623 has no absl/log).
//   AQSWARM_LOG(INFO) << "joined as " << peer_id;
#ifndef AQSWARM_COMMON_LOGGING_H_
#define AQSWARM_COMMON_LOGGING_H_

#include <sstream>

namespace aqswarm {

enum class LogSeverity { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this severity are dropped. Default kInfo; env AQSWARM_LOG_LEVEL.
LogSeverity MinLogSeverity();
void SetMinLogSeverity(LogSeverity s);

namespace internal {
class LogMessage {
 public:
  LogMessage(LogSeverity severity, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};
}  // namespace internal
}  // namespace aqswarm

#define AQSWARM_LOG_SEVERITY_DEBUG ::aqswarm::LogSeverity::kDebug
#define AQSWARM_LOG_SEVERITY_INFO ::aqswarm::LogSeverity::kInfo
#define AQSWARM_LOG_SEVERITY_WARNING ::aqswarm::LogSeverity::kWarning
#define AQSWARM_LOG_SEVERITY_ERROR ::aqswarm::LogSeverity::kError

#define AQSWARM_LOG(sev)                                                  \
  if (AQSWARM_LOG_SEVERITY_##sev < ::aqswarm::MinLogSeverity()) {         \
  } else                                                                  \
    ::aqswarm::internal::LogMessage(AQSWARM_LOG_SEVERITY_##sev, __FILE__, \
                                    __LINE__)                             \
        .stream()

#endif  // AQSWARM_COMMON_LOGGING_H_
