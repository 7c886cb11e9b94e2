// Filling an arena from a peer's (the client side of `load --from-peer`).
//
// ConnectPeer connects to a server (peer_server.h), presents the token, takes the offer and
// reads the server's header region (ucp_get_nbx), which it validates like a local header
// (sizes, checksums, every range): the peer's tensor table, with every tensor's checksum.
// PeerSource::Fill then reads the data region into a local one in pipelined chunks and checks
// each tensor's xxh3-64 as soon as its last byte landed.
//
// Never a hang: the endpoint has peer error handling (a reset or a missed keepalive fails it),
// and each wait is bounded by `stall_seconds` without progress.
//
// Thread-safety: none; a PeerSource is used by one thread.
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
  spdlog::logger* logger = nullptr;
};

class PeerSource {
 public:
  struct State;
  explicit PeerSource(std::unique_ptr<State> state);
  ~PeerSource();
  PeerSource(PeerSource&&) noexcept;
  PeerSource& operator=(PeerSource&&) noexcept;

  // The peer's table as its header holds it (sources, tensors with checksums, identity).
  const format::ArenaTable& table() const;
  const std::string& address() const;

  // Reads the peer's tensor bytes into `data` (the local data region, laid out like the
  // peer's: `table` has the peer's arena offsets) and checks every tensor's checksum against
  // `table` as it lands. When `front` is given, bytes are written only below
  // front->ready() - front_base (the local pages are being made alongside). Errors: the peer
  // gone (naming the bytes received), a checksum that differs (naming the tensor), a stall.
  // On error nothing more is written into `data` once this returns.
  Status Fill(std::span<std::byte> data, const format::ArenaTable& table, const ReadyFront* front,
              uint64_t front_base);

  uint64_t bytes_received() const;  // header region and data
  double fill_seconds() const;

 private:
  std::unique_ptr<State> state_;
};

// Connects and reads the peer's table. Errors name the peer: refused (token, version),
// unreachable, timed out, or a header that fails validation.
Result<PeerSource> ConnectPeer(const PeerOptions& options);

// Whether UCX is compiled in; when not, ConnectPeer and the server refuse with kUnsupported.
bool RemoteBuilt();

}  // namespace expert_arena::remote
