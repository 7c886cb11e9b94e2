// Tensor streams across hosts (docs/cross-host.md): what a listening StreamProducer and a
// StreamConsumer need from the network, declared here by the stream and implemented above it,
// in src/remote: the stream server a producer runs and the connection a consumer makes to it.
// The UCX code is in remote/stream_server.cc and remote/stream_client.cc (built with UCX only);
// without UCX the factories below refuse with kUnsupported (remote/remote_unavailable.cc).
// The names keep the namespace of the folder that defines them (expert_arena::remote); no
// src/stream file includes a remote/ header. As for the peer fill (arena/peer_transport.h),
// the factories are declarations resolved at link time: src/remote is always in the library.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/status.h"
#include "expert_arena/stream.h"
#include "common/door_counters.h"

namespace spdlog {
class logger;
}

namespace expert_arena::remote {

struct StreamServerOptions {
  std::string listen;  // "ADDR:PORT" (required; port 0: any free port)
  std::string token;   // checked before anything is served, when not empty
  // No token on an address other than loopback (StreamOptions::listen_allow_no_token).
  bool allow_no_token = false;
  double lease_seconds = 60;
  // The producer's directories: the server opens descriptors there like a local consumer, and
  // holds each remote consumer's share through that view.
  std::string directory;
  std::string spill_directory;
  // The producer's segment names start with it: nothing else is served.
  std::string segment_prefix;
  // The id descriptors carry; 0: a random one. A restarted network process keeps its
  // predecessor's, so that descriptors handed out before still open.
  uint64_t instance_id = 0;
  std::shared_ptr<spdlog::logger> logger;
};

// A remote consumer's hold on one block, as Pending() reports it.
struct RemoteHold {
  std::string segment;
  uint32_t slot = 0;
};

// Runs the front door (front_door.h; UCX has no listener) and a progress thread until destroyed
// (which releases every remote hold: the shares are spent, as a dead consumer's are).
// Thread-safe.
class StreamServer {
 public:
  virtual ~StreamServer() = default;
  // "ADDR:PORT" as listening.
  virtual const std::string& address() const = 0;
  // Random, fixed for this server's life; descriptors carry it.
  virtual uint64_t instance_id() const = 0;
  // The key was aborted: transfers of it in flight end with a refusal.
  virtual void Aborted(std::string_view key) = 0;
  // The holds of remote consumers now (after the expired leases were ended).
  virtual std::vector<RemoteHold> Holds() = 0;
  // What the front door did to consumers so far, and admitted consumers dropped since.
  virtual DoorCounters counters() = 0;
  // Times the network process was started again after it ended (net_stream_server.cc).
  virtual uint64_t restarts() { return 0; }
};

// The server of a listening producer, in a network process of its own (expert-arena-net,
// net_stream_server.cc): the object returned proxies this interface to it over a control
// socket (each call bounded), restarts the process when it ends, and says so. Fails with the
// process' own start error (the address cannot be bound, a bad option), or kUnsupported when
// the executable is not found (naming every path tried) or UCX is not built.
Result<std::unique_ptr<StreamServer>> StartStreamServer(const StreamServerOptions& options);
// The server in this process (the transport plugin's, loaded here): what the network process
// runs.
Result<std::unique_ptr<StreamServer>> StartStreamServerInProcess(
    const StreamServerOptions& options);

// One consumer's connection to one producer's stream server. Thread-safe (calls serialize).
class StreamPeer {
 public:
  virtual ~StreamPeer() = default;
  // Asks for the block of `descriptor` (its encoded form) and receives its bytes into `into`
  // (exactly the descriptor's length), checking their xxh3. Returns the hold's id at the
  // producer. Fails (never hangs past the timeout) when the producer refuses, dies or stalls.
  virtual Result<uint64_t> Fetch(std::string_view descriptor, uint64_t instance_id,
                                 std::span<std::byte> into) = 0;
  // Fetch of several blocks of the same producer instance, all requests in flight at once (one
  // round trip for the batch instead of one each). One result per descriptor, in order.
  virtual std::vector<Result<uint64_t>> FetchMany(std::span<const std::string_view> descriptors,
                                                  uint64_t instance_id,
                                                  std::span<const std::span<std::byte>> into) = 0;
  // Ends a hold: `spend` spends this reader's share (a release), else gives it back unspent.
  virtual void Release(uint64_t hold, bool spend) = 0;
  // False once the connection failed (the next open connects anew).
  virtual bool alive() const = 0;
  // The instance id of the server this connection reached.
  virtual uint64_t instance_id() const = 0;
};

struct StreamPeerOptions {
  std::string address;  // "ADDR:PORT"
  std::string token;
  bool allow_no_token = false;  // ConsumerOptions::remote_allow_no_token
  double timeout_seconds = 30;
  std::shared_ptr<spdlog::logger> logger;
};

// Connects and says hello (the token); fails with the server's refusal (a wrong token).
Result<std::shared_ptr<StreamPeer>> ConnectStreamPeer(const StreamPeerOptions& options);

}  // namespace expert_arena::remote
