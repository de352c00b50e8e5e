#include "common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace aqswarm {

std::string SelfExecutable() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

absl::Status ReadLineFromFd(int fd, std::string* line, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  line->clear();
  char c;
  while (true) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return absl::DeadlineExceededError("no complete line within the timeout");
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30))) <= 0) continue;
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::OutOfRangeError("end of input");
    if (c == '\n') return absl::OkStatus();
    line->push_back(c);
    if (line->size() > (1 << 20)) return absl::InvalidArgumentError("line longer than 1 MiB");
  }
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Spawn(const std::vector<std::string>& argv,
                                                              const SubprocessOptions& options) {
  if (argv.empty()) return absl::InvalidArgumentError("empty command");
  std::unique_ptr<Subprocess> p(new Subprocess());
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  int pipefd[2] = {-1, -1};
  if (options.capture_stdout) {
    if (::pipe2(pipefd, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
    posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDOUT_FILENO);
  }
  if (!options.stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, options.stderr_path.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
  }
  int inpipe[2] = {-1, -1};
  if (options.pipe_stdin) {
    if (::pipe2(inpipe, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
    posix_spawn_file_actions_adddup2(&actions, inpipe[0], STDIN_FILENO);
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The child starts with no signal blocked and every signal at its default
  // action: a daemon blocks SIGTERM/SIGINT in its threads to take them with
  // sigwait, and a stage child that inherited that mask would ignore the
  // SIGTERM it is stopped with.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  sigdelset(&all, SIGKILL);
  sigdelset(&all, SIGSTOP);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  const int rc = posix_spawn(&p->pid_, args[0], &actions, &attr, args.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (pipefd[1] >= 0) ::close(pipefd[1]);
  if (inpipe[0] >= 0) ::close(inpipe[0]);
  p->in_fd_ = inpipe[1];
  if (rc != 0) {
    if (pipefd[0] >= 0) ::close(pipefd[0]);
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": ", std::strerror(rc)));
  }
  p->out_fd_ = pipefd[0];
  return p;
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !exited_) {
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
  }
  if (out_fd_ >= 0) ::close(out_fd_);
  CloseStdin();
}

absl::Status Subprocess::WriteStdin(const std::string& data) {
  if (in_fd_ < 0) return absl::FailedPreconditionError("no stdin pipe");
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::write(in_fd_, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return absl::UnavailableError(absl::StrCat("write to child stdin: ", std::strerror(errno)));
    done += static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

void Subprocess::CloseStdin() {
  if (in_fd_ >= 0) ::close(in_fd_);
  in_fd_ = -1;
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0 && !exited_) ::kill(pid_, sig);
}

bool Subprocess::TakeLine(std::string* line) {
  const size_t nl = buffer_.find('\n');
  if (nl == std::string::npos) return false;
  *line = buffer_.substr(0, nl);
  buffer_.erase(0, nl + 1);
  return true;
}

absl::Status Subprocess::DrainLines(std::vector<std::string>* lines) {
  if (out_fd_ < 0) return absl::FailedPreconditionError("stdout not captured");
  char buf[65536];
  while (!eof_) {
    pollfd pfd{out_fd_, POLLIN, 0};
    if (::poll(&pfd, 1, 0) <= 0) break;
    const ssize_t n = ::read(out_fd_, buf, sizeof(buf));
    if (n > 0) {
      buffer_.append(buf, n);
    } else if (n == 0 || errno != EINTR) {
      eof_ = true;
    }
  }
  std::string line;
  while (TakeLine(&line)) lines->push_back(line);
  if (eof_ && lines->empty()) return absl::OutOfRangeError("end of output");
  return absl::OkStatus();
}

absl::Status Subprocess::ReadLine(std::string* line, absl::Duration timeout) {
  if (out_fd_ < 0) return absl::FailedPreconditionError("stdout not captured");
  const absl::Time deadline = absl::Now() + timeout;
  char buf[65536];
  while (!TakeLine(line)) {
    if (eof_) return absl::OutOfRangeError("end of output");
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return absl::DeadlineExceededError("no line within the timeout");
    pollfd pfd{out_fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    const ssize_t n = ::read(out_fd_, buf, sizeof(buf));
    if (n > 0) buffer_.append(buf, n);
    else if (n == 0 || errno != EINTR) eof_ = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  if (exited_) return exit_code_;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration nap = absl::Milliseconds(1);
  while (true) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (r < 0 && errno != EINTR) return absl::InternalError(absl::StrCat("waitpid: ", std::strerror(errno)));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("process ", pid_, " still running"));
    }
    // Polling waitpid (there is no portable waitpid-with-timeout); backs off to 50 ms.
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Milliseconds(50));
  }
}

}  // namespace aqswarm
