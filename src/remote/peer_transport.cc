// The arena's PeerConnection (arena/peer_transport.h) over this folder's peer client: a
// PeerSource is one. Built with or without UCX (without, ConnectPeer refuses with
// kUnsupported: remote_unavailable.cc).
#include "arena/peer_transport.h"

#include "remote/peer_client.h"

namespace expert_arena::arena {

Result<std::unique_ptr<PeerConnection>> ConnectToPeer(const PeerConnectOptions& options) {
  remote::PeerOptions peer;
  peer.address = options.address;
  peer.token = options.token;
  peer.allow_no_token = options.allow_no_token;
  peer.stall_seconds = options.stall_seconds;
  peer.transport = options.transport;
  peer.logger = options.logger;
  EA_ASSIGN_OR_RETURN(std::unique_ptr<remote::PeerSource> source, remote::ConnectPeer(peer));
  return std::unique_ptr<PeerConnection>(std::move(source));
}

}  // namespace expert_arena::arena
