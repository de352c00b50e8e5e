#include "common/subprocess.h"

#include <pthread.h>
#include <signal.h>

#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace aqswarm {
namespace {

// A daemon blocks SIGTERM/SIGINT in every thread (it takes them with
// sigwait) and ignores SIGPIPE; a child it spawns must still stop on SIGTERM
// at once, not after its launcher's SIGKILL grace.
TEST(SubprocessTest, AChildSpawnedFromAThreadWithSigtermBlockedStopsOnSigterm) {
  absl::StatusOr<int> code = absl::UnknownError("not run");
  absl::Duration took;
  std::thread t([&] {
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &block, nullptr), 0);
    struct sigaction ign = {};
    ign.sa_handler = SIG_IGN;
    struct sigaction old_int = {};
    ASSERT_EQ(sigaction(SIGINT, &ign, &old_int), 0);
    // sleep(1) keeps the mask it starts with (a shell would reset it).
    // posix_spawn returns once the child has exec'd it.
    auto child = Subprocess::Spawn({"/bin/sleep", "30"}, {.capture_stdout = false});
    sigaction(SIGINT, &old_int, nullptr);
    ASSERT_TRUE(child.ok()) << child.status();
    const absl::Time start = absl::Now();
    (*child)->Signal(SIGTERM);
    code = (*child)->Wait(absl::Seconds(5));
    took = absl::Now() - start;
  });
  t.join();
  ASSERT_TRUE(code.ok()) << code.status() << " (the child ignored SIGTERM: it inherited the blocked mask)";
  EXPECT_EQ(*code, 128 + SIGTERM);
  EXPECT_LT(took, absl::Seconds(5));
}

TEST(SubprocessTest, AChildSpawnedWithSigintIgnoredStopsOnSigint) {
  struct sigaction ign = {}, old = {};
  ign.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGINT, &ign, &old), 0);
  auto child = Subprocess::Spawn({"/bin/sleep", "30"}, {.capture_stdout = false});
  sigaction(SIGINT, &old, nullptr);
  ASSERT_TRUE(child.ok()) << child.status();
  (*child)->Signal(SIGINT);
  absl::StatusOr<int> code = (*child)->Wait(absl::Seconds(5));
  ASSERT_TRUE(code.ok()) << code.status() << " (SIGINT stayed ignored in the child)";
  EXPECT_EQ(*code, 128 + SIGINT);
}

}  // namespace
}  // namespace aqswarm
