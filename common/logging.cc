#include "common/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <mutex>

namespace aqswarm {
namespace {

LogSeverity SeverityFromEnv() {
  const char* v = std::getenv("AQSWARM_LOG_LEVEL");
  if (v == nullptr) return LogSeverity::kInfo;
  if (!std::strcmp(v, "debug")) return LogSeverity::kDebug;
  if (!std::strcmp(v, "warning")) return LogSeverity::kWarning;
  if (!std::strcmp(v, "error")) return LogSeverity::kError;
  return LogSeverity::kInfo;
}

std::atomic<int>& MinSeverity() {
  static std::atomic<int> s{static_cast<int>(SeverityFromEnv())};
  return s;
}

}  // namespace

LogSeverity MinLogSeverity() { return static_cast<LogSeverity>(MinSeverity().load()); }
void SetMinLogSeverity(LogSeverity s) { MinSeverity().store(static_cast<int>(s)); }

namespace internal {

LogMessage::LogMessage(LogSeverity severity, const char* file, int line) : severity_(severity) {
  static const char kLetters[] = "DIWE";
  const char* base = std::strrchr(file, '/');
  const auto now = std::chrono::system_clock::now();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm;
  gmtime_r(&secs, &tm);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms % 1000));
  stream_ << kLetters[static_cast<int>(severity)] << " " << buf << " " << (base ? base + 1 : file)
          << ":" << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << "\n";
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << stream_.str() << std::flush;
}

}  // namespace internal
}  // namespace aqswarm
