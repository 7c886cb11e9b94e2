#include "platform/net.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <ifaddrs.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace expert_arena::platform {

Result<SocketAddress> ResolveHostPort(const std::string& host_port) {
  std::string host;
  std::string port;
  if (!host_port.empty() && host_port[0] == '[') {
    auto close = host_port.find(']');
    if (close == std::string::npos || close + 1 >= host_port.size() || host_port[close + 1] != ':')
      return InvalidArgument("address '" + host_port + "': expected [IPV6]:PORT");
    host = host_port.substr(1, close - 1);
    port = host_port.substr(close + 2);
  } else {
    auto colon = host_port.rfind(':');
    if (colon == std::string::npos)
      return InvalidArgument("address '" + host_port + "': expected HOST:PORT");
    host = host_port.substr(0, colon);
    port = host_port.substr(colon + 1);
  }
  if (host.empty()) {
    return InvalidArgument("address '" + host_port +
                           "': no host (name the interface address to use; there is no default "
                           "on all interfaces)");
  }
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos ||
      port.size() > 5 || std::stoul(port) > 65535) {
    return InvalidArgument("address '" + host_port + "': port must be a number 0-65535");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return InvalidArgument("address '" + host_port + "': cannot resolve '" + host +
                           "': " + gai_strerror(rc));
  }
  SocketAddress address;
  std::memcpy(&address.storage, found->ai_addr, found->ai_addrlen);
  address.length = found->ai_addrlen;
  freeaddrinfo(found);
  return address;
}

std::string AddressText(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(address);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
    return std::string(text) + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (address->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(address);
    inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text);
    // Appended piece by piece: "[" + std::string(...) draws a bogus -Wrestrict from g++ 12 at
    // -O3 inside std::string (GCC PR 105651).
    std::string out = "[";
    out += text;
    out += "]:";
    out += std::to_string(ntohs(in6->sin6_port));
    return out;
  }
  return "?";
}

uint16_t AddressPort(const sockaddr* address) {
  if (address->sa_family == AF_INET)
    return ntohs(reinterpret_cast<const sockaddr_in*>(address)->sin_port);
  if (address->sa_family == AF_INET6)
    return ntohs(reinterpret_cast<const sockaddr_in6*>(address)->sin6_port);
  return 0;
}

Result<bool> WaitReadable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  int rc = poll(&p, 1, timeout_ms);
  if (rc < 0) {
    if (errno == EINTR) return false;
    return ErrnoStatus(errno, "poll", "event fd " + std::to_string(fd));
  }
  return rc > 0;
}

namespace {

bool SameHost(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr,
                       sizeof(in6_addr)) == 0;
  }
  return false;
}

int RemainingMs(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                  deadline - std::chrono::steady_clock::now())
                  .count();
  return left < 0 ? 0 : static_cast<int>(left);
}

}  // namespace

bool IsLoopback(const SocketAddress& address) {
  const sockaddr* a = address.get();
  if (a->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(a);
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (a->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a);
    if (IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr)) return true;
    return IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) && in6->sin6_addr.s6_addr[12] == 127;
  }
  return false;
}

std::string InterfaceOf(const SocketAddress& address) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* i = list; i != nullptr && name.empty(); i = i->ifa_next) {
    if (i->ifa_addr != nullptr && SameHost(i->ifa_addr, address.get())) name = i->ifa_name;
  }
  freeifaddrs(list);
  return name;
}

Result<UniqueFd> ListenTcp(const SocketAddress& address, int backlog) {
  const std::string text = AddressText(address.get());
  int fd = socket(address.get()->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "socket", text);
  UniqueFd owned(fd, text);
  int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (address.get()->sa_family == AF_INET6) {
    (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
  }
  if (bind(fd, address.get(), address.length) != 0) return ErrnoStatus(errno, "bind", text);
  if (listen(fd, backlog) != 0) return ErrnoStatus(errno, "listen", text);
  return owned;
}

Result<SocketAddress> LocalAddress(int fd) {
  SocketAddress address;
  address.length = sizeof address.storage;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address.storage), &address.length) != 0) {
    return ErrnoStatus(errno, "getsockname", "socket " + std::to_string(fd));
  }
  return address;
}

Result<Accepted> AcceptTcp(int listen_fd) {
  Accepted out;
  out.peer.length = sizeof out.peer.storage;
  int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&out.peer.storage), &out.peer.length,
                   SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED || errno == EINTR ||
        errno == EPROTO) {
      return out;
    }
    // EMFILE, ENFILE, ENOBUFS: the caller retries later; the connection waits in the backlog.
    return ErrnoStatus(errno, "accept", "listening socket " + std::to_string(listen_fd));
  }
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  out.fd = UniqueFd(fd, AddressText(out.peer.get()));
  return out;
}

Result<UniqueFd> ConnectTcp(const SocketAddress& address, int timeout_ms,
                            const std::string& what) {
  int fd = socket(address.get()->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "socket", what);
  UniqueFd owned(fd, what);
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(fd, address.get(), address.length) != 0) {
    if (errno != EINPROGRESS) return ErrnoStatus(errno, "connect", what);
    pollfd p{fd, POLLOUT, 0};
    int rc;
    do {
      rc = poll(&p, 1, timeout_ms);
    } while (rc < 0 && errno == EINTR);
    if (rc == 0) return TimedOut("connect to " + what + ": no answer within " +
                                 std::to_string(timeout_ms) + " ms");
    if (rc < 0) return ErrnoStatus(errno, "poll", what);
    int error = 0;
    socklen_t length = sizeof error;
    (void)getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) return ErrnoStatus(error, "connect", what);
  }
  return owned;
}

Result<long> SendSome(int fd, const void* data, size_t bytes) {
  ssize_t n = send(fd, data, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      errno = EAGAIN;
      return -1L;
    }
    return ErrnoStatus(errno, "send", "socket " + std::to_string(fd));
  }
  return static_cast<long>(n);
}

Result<long> RecvSome(int fd, void* data, size_t bytes) {
  ssize_t n = recv(fd, data, bytes, MSG_DONTWAIT);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      errno = EAGAIN;
      return -1L;
    }
    return ErrnoStatus(errno, "recv", "socket " + std::to_string(fd));
  }
  return static_cast<long>(n);
}

Status SendAll(int fd, const void* data, size_t bytes, int timeout_ms, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    EA_ASSIGN_OR_RETURN(long n, SendSome(fd, p, bytes));
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    int left = RemainingMs(deadline);
    if (left == 0) return TimedOut(what + ": the peer took nothing within the deadline");
    pollfd pfd{fd, POLLOUT, 0};
    (void)poll(&pfd, 1, left);
  }
  return Status::Ok();
}

Status RecvAll(int fd, void* data, size_t bytes, int timeout_ms, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    auto n = RecvSome(fd, p, bytes);
    if (!n.ok()) return Status(StatusCode::kIoError, what + ": " + n.status().message());
    if (*n == 0) return Status(StatusCode::kIoError, what + ": the peer closed the connection");
    if (*n > 0) {
      p += *n;
      bytes -= static_cast<size_t>(*n);
      continue;
    }
    int left = RemainingMs(deadline);
    if (left == 0) return TimedOut(what + ": no answer within the deadline");
    pollfd pfd{fd, POLLIN, 0};
    (void)poll(&pfd, 1, left);
  }
  return Status::Ok();
}

Result<int> PollFds(pollfd* fds, size_t count, int timeout_ms) {
  int rc = poll(fds, count, timeout_ms);
  if (rc < 0) {
    if (errno == EINTR) return 0;
    return ErrnoStatus(errno, "poll", std::to_string(count) + " sockets");
  }
  return rc;
}

}  // namespace expert_arena::platform
