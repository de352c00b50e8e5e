#include "coordinator/connect_probe.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/ports.h"
#include "gtest/gtest.h"

namespace aqswarm::coordinator {
namespace {

TEST(ConnectProbeTest, OnlyAPortNobodyServesOnALiveHostCountsAsRefused) {
  const int closed = FreeLoopbackPort({});
  EXPECT_TRUE(ConnectRefused(absl::StrCat("127.0.0.1:", closed), absl::Milliseconds(500)));
  EXPECT_TRUE(ConnectRefused(absl::StrCat("localhost:", closed), absl::Milliseconds(500)));

  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  EXPECT_FALSE(ConnectRefused(absl::StrCat("127.0.0.1:", ntohs(a.sin_port)), absl::Milliseconds(500)))
      << "a server that accepts is alive";
  close(fd);

  EXPECT_FALSE(ConnectRefused("no-such-host.invalid:7000", absl::Milliseconds(500))) << "unresolved proves nothing";
  EXPECT_FALSE(ConnectRefused("127.0.0.1", absl::Milliseconds(500)));
  EXPECT_FALSE(ConnectRefused("127.0.0.1:notaport", absl::Milliseconds(500)));
}

}  // namespace
}  // namespace aqswarm::coordinator
