// Filling an arena from a peer's (the client side of `load --from-peer`).
//
// ConnectPeer connects to a server (peer_server.h), presents the token, takes the offer and
// reads the server's header region (by the offered transport: ucp_get_nbx, or range requests
// answered by active messages), which it validates like a local header
// (sizes, checksums, every range): the peer's tensor table, with every tensor's checksum.
// PeerSource::Fill then reads the data region into a local one in pipelined chunks (the same
// transport; am's answers are received straight into the local region) and checks
// each tensor's xxh3-64 as soon as its last byte landed.
//
// Never a hang: the endpoint has peer error handling (a reset or a missed keepalive fails it),
// and each wait is bounded by `stall_seconds` without progress.
//
// Thread-safety: none; a PeerSource is used by one thread.
//
// UCX is not linked into the library: ConnectPeer loads the transport plugin at first use
// (ucx_plugin.h), so a process that never fills from a peer never maps UCX.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "arena/peer_transport.h"
#include "expert_arena/status.h"
#include "format/arena_table.h"

namespace spdlog {
class logger;
}

namespace expert_arena {
class ReadyFront;
}

namespace expert_arena::remote {

struct PeerOptions {
  std::string address;  // HOST:PORT of the server
  std::string token;
  // Go through the front door without a token (RequireDoorToken in front_door.h).
  bool allow_no_token = false;
  // The longest wait for anything (connect, offer, a chunk) before the fill is abandoned.
  double stall_seconds = 30;
  // "auto": the transport the server offers; "am" or "get": only that one (another is
  // refused). With "am" the client's UCX context has no RMA feature either.
  std::string transport = "auto";
  spdlog::logger* logger = nullptr;
};

// A connected peer and its table (the arena's PeerConnection: arena/peer_transport.h says what
// table() and Fill() do). Made by ConnectPeer; the UCX implementation lives in the transport
// plugin (ucx_plugin.h), whose code stays loaded for the life of the process.
class PeerSource : public arena::PeerConnection {
 public:
  virtual const std::string& address() const = 0;
};

// Connects and reads the peer's table. Errors name the peer: refused (token, version),
// unreachable, timed out, or a header that fails validation; kUnsupported when the transport
// plugin cannot be loaded (naming every path tried) or UCX is not built.
Result<std::unique_ptr<PeerSource>> ConnectPeer(const PeerOptions& options);

// Whether UCX is compiled in (the plugin is built); when not, ConnectPeer and the server
// refuse with kUnsupported.
bool RemoteBuilt();

}  // namespace expert_arena::remote
