#include "common/metrics.h"

#include <dlfcn.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <map>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"

// Interposes glibc's pthread_attr_setstacksize (see metrics.h): civetweb asks
// for 100 KiB stacks, too small once the static TLS of OpenBLAS and friends
// is carved out of them. The executable exports this symbol
// (--export-dynamic-symbol, common/CMakeLists.txt), so every library's call
// binds here first; the real function is the next definition (libc's).
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (real == nullptr) return ENOSYS;
  return real(attr, std::max(size, aqswarm::kMinThreadStackBytes));
}

namespace aqswarm {
namespace {

struct State {
  std::mutex mu;
  std::map<std::string, MetricInfo> catalog;
  std::map<uint64_t, std::function<void()>> samplers;
  uint64_t next_sampler = 1;
};

State& GlobalState() {
  static State* s = new State();
  return *s;
}

const std::shared_ptr<prometheus::Registry>& RegistryPtr() {
  static auto* r = new std::shared_ptr<prometheus::Registry>(std::make_shared<prometheus::Registry>());
  return *r;
}

void Record(const std::string& name, const char* type, const std::string& help, std::vector<std::string> labels) {
  State& s = GlobalState();
  std::lock_guard<std::mutex> l(s.mu);
  s.catalog[name] = MetricInfo{name, type, help, std::move(labels)};
}

// What the exposer serves: samplers first, then the registry.
class SampledRegistry final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    RunMetricsSamplers();
    return RegistryPtr()->Collect();
  }
};

const std::shared_ptr<SampledRegistry>& Sampled() {
  static auto* c = new std::shared_ptr<SampledRegistry>(std::make_shared<SampledRegistry>());
  return *c;
}

}  // namespace

prometheus::Registry& MetricsRegistry() { return *RegistryPtr(); }

prometheus::Family<prometheus::Counter>& DeclareCounter(const std::string& name, const std::string& help,
                                                         std::vector<std::string> labels) {
  Record(name, "counter", help, std::move(labels));
  return prometheus::BuildCounter().Name(name).Help(help).Register(MetricsRegistry());
}

prometheus::Family<prometheus::Gauge>& DeclareGauge(const std::string& name, const std::string& help,
                                                     std::vector<std::string> labels) {
  Record(name, "gauge", help, std::move(labels));
  return prometheus::BuildGauge().Name(name).Help(help).Register(MetricsRegistry());
}

prometheus::Family<prometheus::Histogram>& DeclareHistogram(const std::string& name, const std::string& help,
                                                             std::vector<std::string> labels) {
  Record(name, "histogram", help, std::move(labels));
  return prometheus::BuildHistogram().Name(name).Help(help).Register(MetricsRegistry());
}

std::vector<MetricInfo> MetricCatalog() {
  State& s = GlobalState();
  std::lock_guard<std::mutex> l(s.mu);
  std::vector<MetricInfo> out;
  for (const auto& [name, info] : s.catalog) out.push_back(info);
  return out;
}

MetricsSampler::MetricsSampler(std::function<void()> sample) {
  State& s = GlobalState();
  std::lock_guard<std::mutex> l(s.mu);
  id_ = s.next_sampler++;
  s.samplers[id_] = std::move(sample);
}

MetricsSampler::~MetricsSampler() {
  State& s = GlobalState();
  std::lock_guard<std::mutex> l(s.mu);
  s.samplers.erase(id_);
}

void RunMetricsSamplers() {
  State& s = GlobalState();
  // Samplers run under the lock: a sampler's owner cannot finish destroying
  // it while it runs. Samplers must not declare metrics or add samplers.
  std::lock_guard<std::mutex> l(s.mu);
  for (auto& [id, sample] : s.samplers) sample();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen) {
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  try {
    // One worker is plenty for a scrape every few seconds.
    server->exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  server->exposer_->RegisterCollectable(Sampled());
  std::vector<int> ports = server->exposer_->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError(absl::StrCat("metrics server on ", listen, " has no port"));
  server->port_ = ports[0];
  return server;
}

MetricsServer::~MetricsServer() = default;

absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("'", host_port, "' is not HOST:PORT"));
  std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host_port, ": ", gai_strerror(rc)));
  }
  int fd = -1;
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot connect to ", host_port));
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host_port, "\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("send to ", host_port, " failed"));
    }
    sent += n;
  }
  std::string response;
  char buf[16384];
  while (true) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, POLLIN, 0};
    if (left_ms <= 0 || ::poll(&p, 1, static_cast<int>(left_ms)) <= 0) {
      ::close(fd);
      return absl::DeadlineExceededError(absl::StrCat("GET ", host_port, path, ": no complete answer within ",
                                                      absl::FormatDuration(timeout)));
    }
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0) {
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("GET ", host_port, path, ": read failed"));
    }
    if (n == 0) break;
    response.append(buf, n);
  }
  ::close(fd);
  const size_t head_end = response.find("\r\n\r\n");
  if (head_end == std::string::npos) {
    return absl::DataLossError(absl::StrCat("GET ", host_port, path, ": malformed HTTP answer"));
  }
  const std::string status_line = response.substr(0, response.find("\r\n"));
  std::vector<std::string> parts = absl::StrSplit(status_line, absl::MaxSplits(' ', 2));
  int code = 0;
  if (parts.size() < 2 || !absl::SimpleAtoi(parts[1], &code) || code != 200) {
    return absl::FailedPreconditionError(absl::StrCat("GET ", host_port, path, ": ", status_line, ": ",
                                                      response.substr(head_end + 4, 500)));
  }
  return response.substr(head_end + 4);
}

}  // namespace aqswarm
