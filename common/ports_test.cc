#include "common/ports.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>

#include "gtest/gtest.h"

namespace aqswarm {
namespace {

TEST(FreeLoopbackPortTest, APortBelowTheEphemeralRangeThatBindsAndIsNotAvoided) {
  int lo = 0, hi = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> lo >> hi;
  std::set<int> avoid;
  for (int i = 0; i < 20; ++i) {
    const int port = FreeLoopbackPort(avoid);
    ASSERT_GT(port, 0);
    EXPECT_FALSE(avoid.count(port)) << port;
    if (lo > 11000) EXPECT_LT(port, lo) << "inside the ephemeral range " << lo << "-" << hi;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << "port " << port << " does not bind";
    close(fd);
    avoid.insert(port);
  }
}

}  // namespace
}  // namespace aqswarm
