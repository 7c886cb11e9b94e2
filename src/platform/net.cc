#include "platform/net.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>

#include <cerrno>
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

}  // namespace expert_arena::platform
