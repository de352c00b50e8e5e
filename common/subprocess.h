// Child processes for launchers and integration tests (POSIX).
//
//   AQSWARM_ASSIGN_OR_RETURN(auto child, Subprocess::Spawn({"/bin/echo", "hi"}, {.stderr_path = "log"}));
//   std::string line;
//   while (child->ReadLine(&line, absl::Seconds(5)).ok()) { ... }   // stdout, line by line
//   AQSWARM_ASSIGN_OR_RETURN(int code, child->Wait(absl::Seconds(10)));
//
// The destructor kills (SIGKILL) and reaps a child that is still running, so
// no test or launcher leaks processes. Not thread-safe except Signal().
#ifndef AQSWARM_COMMON_SUBPROCESS_H_
#define AQSWARM_COMMON_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace aqswarm {

struct SubprocessOptions {
  // Capture the child's stdout through a pipe (ReadLine). Default: true.
  bool capture_stdout = true;
  // Send the child's stderr to this file (appended); empty = inherit.
  std::string stderr_path;
  // Give the child a stdin pipe (WriteStdin); otherwise it inherits ours.
  // Default: false.
  bool pipe_stdin = false;
};

class Subprocess {
 public:
  static absl::StatusOr<std::unique_ptr<Subprocess>> Spawn(const std::vector<std::string>& argv,
                                                           const SubprocessOptions& options = {});
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  // Next line of stdout (without '\n'). OutOfRange at EOF, DeadlineExceeded
  // after `timeout`.
  absl::Status ReadLine(std::string* line, absl::Duration timeout);
  // The stdout pipe's fd (for poll() over several children); -1 if none.
  int stdout_fd() const { return out_fd_; }
  // Non-blocking read of whatever stdout holds into the line buffer; returns
  // complete lines. OutOfRange once EOF was seen and no line is left.
  absl::Status DrainLines(std::vector<std::string>* lines);
  // Writes to the child's stdin (pipe_stdin); then CloseStdin for EOF.
  absl::Status WriteStdin(const std::string& data);
  void CloseStdin();
  void Signal(int sig);
  // Waits for exit: exit code, or 128 + signal number if killed.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  bool exited() const { return exited_; }

 private:
  Subprocess() = default;
  bool TakeLine(std::string* line);
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int in_fd_ = -1;
  std::string buffer_;
  bool eof_ = false;
  bool exited_ = false;
  int exit_code_ = 0;
};

// Path of the running executable (/proc/self/exe).
std::string SelfExecutable();

// Reads one '\n'-terminated line from `fd` (e.g. 0 = stdin) within `timeout`
// (DeadlineExceeded; OutOfRange at EOF; InvalidArgument past 1 MiB).
absl::Status ReadLineFromFd(int fd, std::string* line, absl::Duration timeout);

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_SUBPROCESS_H_
