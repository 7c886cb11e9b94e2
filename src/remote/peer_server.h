// Serving a published arena to peers over UCX (`expert-arena serve`).
//
// The server holds USER on the arena file like an engine (so nobody replaces or removes it
// while it is served) and maps it read-only. A peer connects to the front door (front_door.h:
// plain TCP on the listen address, the shared token proved by HMAC both ways, bounded), which
// hands an authenticated peer the server's UCX worker address and a ticket; UCX has no
// listener. The peer's first active message carries the ticket; only then does it get the
// offer (sizes, identity, transport). Then, by the transport:
//   am (default): the peer asks for ranges of the file; the server checks each against the
//     file and sends exactly those bytes (ucp_am_send_nbx, rendezvous for large ones); a
//     range outside the file is refused, logged, and the endpoint closed. The context has no
//     RMA feature: no get or put request is served at all.
//   get: the mapping is registered with UCX once and its rkey sent in the offer; the peer
//     reads with ucp_get_nbx. On UCX's tcp transport a get request carries no key: an
//     admitted peer could read any address of this process (docs/cross-host.md), so get needs
//     a token (only peers that know it are admitted) and trusted networks.
// Many peers may read at once. See docs/cross-host.md.
//
// Thread-safety: none; Run() progresses the worker on the calling thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "expert_arena/status.h"
#include "remote/front_door.h"
#include "remote/wire.h"

namespace spdlog {
class logger;
}

namespace expert_arena::remote {

struct ServeOptions {
  // ADDR:PORT to listen on (port 0: any free port, reported in info()). Required: nothing
  // listens on all interfaces by default.
  std::string listen;
  // When not empty, a peer must present it before it is offered anything.
  std::string token;
  // A peer that has not finished the front door's handshake, or not sent its first active
  // message after it, by then is disconnected.
  double hello_timeout_seconds = 10;
  // An admitted peer with nothing asked and nothing in flight for this long is disconnected.
  double idle_timeout_seconds = 60;
  // Admitted peers at once, in all and per peer address; handshakes in progress, likewise.
  size_t max_peers = 64;
  size_t max_peers_per_host = 8;
  FrontDoorLimits door;
  PeerTransport transport = PeerTransport::kAm;
  std::shared_ptr<spdlog::logger> logger;
};

struct ServeInfo {
  std::string address;  // as listening, e.g. "10.213.0.1:40011"
  uint16_t port = 0;
  std::string path;
  std::string identity;
  uint64_t identity_hash = 0;
  uint64_t data_bytes = 0;
  uint64_t file_bytes = 0;
  PeerTransport transport = PeerTransport::kAm;
};

// A listening server. Made by Start; the UCX implementation lives in the transport plugin
// (ucx_plugin.h), whose code stays loaded for the life of the process.
class PeerServer {
 public:
  // Attaches to the published arena at `path` and starts listening. Fails when the file is
  // absent, not published, being loaded, or when UCX cannot listen on the address;
  // kUnsupported when the transport plugin cannot be loaded (naming every path tried) or UCX
  // is not built. Loads the plugin at first use.
  static Result<std::unique_ptr<PeerServer>> Start(const std::string& path,
                                                   const ServeOptions& options);
  virtual ~PeerServer() = default;

  virtual const ServeInfo& info() const = 0;
  // Serves until `stop` returns true (asked at least every 100 ms). Errors only when UCX fails
  // as a whole; a peer's failure is logged and its endpoint closed.
  virtual Status Run(const std::function<bool()>& stop) = 0;
  // Peers that were offered the arena so far.
  virtual uint64_t peers_offered() const = 0;
  // Range requests refused (outside the file, before an offer, on a get server) so far.
  virtual uint64_t ranges_refused() const = 0;
  // Bytes of the arena file sent to peers in answer to their range requests (--transport am;
  // a get server's peers read the mapping themselves, uncounted).
  virtual uint64_t bytes_sent() const = 0;
  // What the front door did to peers, and admitted peers dropped since (timed_out: no first
  // message in time; dropped: idle past idle_timeout_seconds, or a malformed request).
  virtual DoorCounters counters() const = 0;
};

}  // namespace expert_arena::remote
