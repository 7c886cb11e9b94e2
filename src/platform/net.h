// Network addresses and readiness waits for the cross-host transport (src/remote): the only
// socket-level calls of the library (name resolution, address text, poll on an event fd).
// The transport itself is UCX; nothing here opens a socket.
//
// Linux only (compiled under __linux__).
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>

#include "expert_arena/status.h"

namespace expert_arena::platform {

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// "HOST:PORT" or "[IPV6]:PORT" to an address. HOST must be given (never a wildcard by
// default); a name is resolved (first address). kInvalidArgument names the text and why.
Result<SocketAddress> ResolveHostPort(const std::string& host_port);

// "10.213.0.1:4791" / "[::1]:4791" of an IPv4 or IPv6 address; "?" for other families.
std::string AddressText(const sockaddr* address);
uint16_t AddressPort(const sockaddr* address);

// Waits up to timeout_ms for `fd` to be readable: true when it is, false on timeout or EINTR.
Result<bool> WaitReadable(int fd, int timeout_ms);

}  // namespace expert_arena::platform
