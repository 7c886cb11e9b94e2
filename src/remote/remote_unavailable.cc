// Built without UCX (EXPERT_ARENA_UCX OFF, or libucx-dev absent): no transport plugin, and the
// server and the client refuse with a message that says how to get them.
#include "remote/core_identity.h"
#include "remote/net_control.h"
#include "remote/peer_client.h"
#include "remote/peer_server.h"
#include "stream/stream_remote.h"
#include "remote/ucx_plugin.h"

namespace expert_arena::remote {
namespace {

Status NotBuilt() {
  return Unsupported(
      "expert-arena was built without UCX (install libucx-dev and rebuild with "
      "-DEXPERT_ARENA_UCX=ON): serving and filling from peers are not available");
}

}  // namespace

Result<std::unique_ptr<PeerSource>> ConnectPeer(const PeerOptions&) { return NotBuilt(); }
bool RemoteBuilt() { return false; }
Result<const UcxPlugin*> Ucx() { return NotBuilt(); }
Result<std::string> FindNetProcess() { return NotBuilt(); }
Result<CoreIdentity> PluginCoreIdentity() { return NotBuilt(); }

Result<std::unique_ptr<PeerServer>> PeerServer::Start(const std::string&, const ServeOptions&) {
  return NotBuilt();
}

Result<std::unique_ptr<StreamServer>> StartStreamServer(const StreamServerOptions&) {
  return Unsupported(
      "expert-arena was built without UCX (install libucx-dev and rebuild with "
      "-DEXPERT_ARENA_UCX=ON): a stream producer cannot listen for other hosts");
}
Result<std::shared_ptr<StreamPeer>> ConnectStreamPeer(const StreamPeerOptions& options) {
  return Unsupported(
      "expert-arena was built without UCX (install libucx-dev and rebuild with "
      "-DEXPERT_ARENA_UCX=ON): cannot open the descriptor of a stream producer on another host (" +
      options.address + ")");
}

}  // namespace expert_arena::remote
