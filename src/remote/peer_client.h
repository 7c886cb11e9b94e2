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
  // The longest wait for anything (connect, offer, a chunk) before the fill is abandoned.
  double stall_seconds = 30;
  // "auto": the transport the server offers; "am" or "get": only that one (another is
  // refused). With "am" the client's UCX context has no RMA feature either.
  std::string transport = "auto";
  spdlog::logger* logger = nullptr;
};

// A connected peer and its table. Made by ConnectPeer; the UCX implementation lives in the
// transport plugin (ucx_plugin.h), whose code stays loaded for the life of the process.
class PeerSource {
 public:
  virtual ~PeerSource() = default;

  // The peer's table as its header holds it (sources, tensors with checksums, identity).
  virtual const format::ArenaTable& table() const = 0;
  virtual const std::string& address() const = 0;

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

// Connects and reads the peer's table. Errors name the peer: refused (token, version),
// unreachable, timed out, or a header that fails validation; kUnsupported when the transport
// plugin cannot be loaded (naming every path tried) or UCX is not built.
Result<std::unique_ptr<PeerSource>> ConnectPeer(const PeerOptions& options);

// Whether UCX is compiled in (the plugin is built); when not, ConnectPeer and the server
// refuse with kUnsupported.
bool RemoteBuilt();

}  // namespace expert_arena::remote
