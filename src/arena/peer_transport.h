// What a fill from a peer (arena/peer_fill.h) needs from the network: a connection to the
// peer's server that gives its tensor table and reads its data region into a local one. The
// arena declares it; src/remote, above the arena, implements it over UCX (remote/peer_client.h:
// PeerSource is a PeerConnection; remote/peer_transport.cc defines ConnectToPeer).
//
// Why a declaration resolved at link time and not a registration: the library is one object
// library (libexpert_arena.so, and the static expert_arena_internal for the tools and tests),
// src/remote is always in it (without UCX its connections refuse with kUnsupported), so the
// definition is always there; a function pointer set by a static initializer in src/remote
// would be dropped from the static library whenever nothing else pulled its object in.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "expert_arena/status.h"
#include "format/arena_table.h"

namespace spdlog {
class logger;
}

namespace expert_arena {
class ReadyFront;
}

namespace expert_arena::arena {

class PeerConnection {
 public:
  virtual ~PeerConnection() = default;

  // The peer's table as its header holds it (sources, tensors with checksums, identity).
  virtual const format::ArenaTable& table() const = 0;

  // Reads the peer's tensor bytes into `data` (the local data region, laid out like the
  // peer's: `table` has the peer's arena offsets) and checks every tensor's checksum against
  // `table` as it lands. When `front` is given, bytes are written only below
  // front->ready() - front_base (the local pages are being made alongside). Errors: the peer
  // gone (naming the bytes received), a checksum that differs (naming the tensor), a stall.
  // On error nothing more is written into `data` once this returns.
  virtual Status Fill(std::span<std::byte> data, const format::ArenaTable& table,
                      const ReadyFront* front, uint64_t front_base) = 0;

  virtual uint64_t bytes_received() const = 0;  // header region and data
  virtual const char* transport() const = 0;    // "am" or "get", as the peer offered
  virtual double fill_seconds() const = 0;
};

struct PeerConnectOptions {
  std::string address;  // HOST:PORT of the server
  std::string token;
  bool allow_no_token = false;  // ArenaOptions::peer_allow_no_token
  // The longest wait for anything (connect, offer, a chunk) before the fill is abandoned.
  double stall_seconds = 30;
  std::string transport = "auto";  // "auto", "am" or "get"
  spdlog::logger* logger = nullptr;
};

// Connects and reads the peer's table. Errors name the peer: refused (token, version),
// unreachable, timed out, or a header that fails validation; kUnsupported when the transport
// cannot be loaded or is not built. Defined in src/remote (peer_transport.cc).
Result<std::unique_ptr<PeerConnection>> ConnectToPeer(const PeerConnectOptions& options);

}  // namespace expert_arena::arena
