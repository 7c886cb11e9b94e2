// Built without UCX (EXPERT_ARENA_UCX OFF, or libucx-dev absent): the server and the client
// refuse with a message that says how to get them.
#include "remote/peer_client.h"
#include "remote/peer_server.h"
#include "remote/stream_remote.h"

namespace expert_arena::remote {
namespace {

Status NotBuilt() {
  return Unsupported(
      "expert-arena was built without UCX (install libucx-dev and rebuild with "
      "-DEXPERT_ARENA_UCX=ON): serving and filling from peers are not available");
}

}  // namespace

struct PeerSource::State {};
PeerSource::PeerSource(std::unique_ptr<State> state) : state_(std::move(state)) {}
PeerSource::~PeerSource() = default;
PeerSource::PeerSource(PeerSource&&) noexcept = default;
PeerSource& PeerSource::operator=(PeerSource&&) noexcept = default;
const format::ArenaTable& PeerSource::table() const {
  static const format::ArenaTable empty;
  return empty;
}
const std::string& PeerSource::address() const {
  static const std::string none;
  return none;
}
Status PeerSource::Fill(std::span<std::byte>, const format::ArenaTable&, const ReadyFront*,
                        uint64_t) {
  return NotBuilt();
}
uint64_t PeerSource::bytes_received() const { return 0; }
double PeerSource::fill_seconds() const { return 0; }
Result<PeerSource> ConnectPeer(const PeerOptions&) { return NotBuilt(); }
bool RemoteBuilt() { return false; }

struct PeerServer::State {};
Result<std::unique_ptr<PeerServer>> PeerServer::Start(const std::string&, const ServeOptions&) {
  return NotBuilt();
}
PeerServer::PeerServer(std::unique_ptr<State> state) : state_(std::move(state)) {}
PeerServer::~PeerServer() = default;
const ServeInfo& PeerServer::info() const {
  static const ServeInfo none;
  return none;
}
Status PeerServer::Run(const std::function<bool()>&) { return NotBuilt(); }
uint64_t PeerServer::peers_offered() const { return 0; }

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
