// Network addresses, readiness waits and the plain TCP sockets of the cross-host transport's
// front door (src/remote/front_door.h): the only socket-level calls of the library. The bytes
// themselves cross by UCX; these sockets only authenticate peers.
//
// Linux only (compiled under __linux__).
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <cstdint>
#include <string>

#include "expert_arena/status.h"
#include "platform/file.h"

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

// Whether `address` is a loopback one (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104): reachable from
// this host only. A wildcard (0.0.0.0, ::) is not.
bool IsLoopback(const SocketAddress& address);

// The name of the network interface that holds `address` ("lo", "eth0"), or "" when none does
// (a wildcard address, or one of another host).
std::string InterfaceOf(const SocketAddress& address);

// A non-blocking TCP socket listening on exactly `address` (SO_REUSEADDR, close-on-exec).
Result<UniqueFd> ListenTcp(const SocketAddress& address, int backlog);
// The address a socket is bound to (getsockname).
Result<SocketAddress> LocalAddress(int fd);

// One accepted connection (non-blocking, close-on-exec, TCP_NODELAY), or none waiting
// (`fd` invalid). Errors only for the listening socket itself; a connection that went before
// it was taken (ECONNABORTED) reads as none.
struct Accepted {
  UniqueFd fd;
  SocketAddress peer;
};
Result<Accepted> AcceptTcp(int listen_fd);

// A connected, non-blocking TCP socket to `address`, or kTimedOut / kIoError (refused,
// unreachable) naming `what`, within `timeout_ms`.
Result<UniqueFd> ConnectTcp(const SocketAddress& address, int timeout_ms, const std::string& what);

// Non-blocking I/O: bytes moved (0 for recv: the peer closed), or -1 with errno EAGAIN when
// nothing could move; other errors are kIoError. Never SIGPIPE.
Result<long> SendSome(int fd, const void* data, size_t bytes);
Result<long> RecvSome(int fd, void* data, size_t bytes);

// Blocking, bounded forms over a non-blocking socket: all `bytes` or an error (kTimedOut when
// `timeout_ms` passed, kIoError when the peer closed or reset, naming `what`).
Status SendAll(int fd, const void* data, size_t bytes, int timeout_ms, const std::string& what);
Status RecvAll(int fd, void* data, size_t bytes, int timeout_ms, const std::string& what);

// poll(2) over `fds`: the count ready, 0 on timeout or EINTR.
Result<int> PollFds(pollfd* fds, size_t count, int timeout_ms);

}  // namespace expert_arena::platform
