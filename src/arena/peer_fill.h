// The arena side of a fill from a peer (ArenaOptions::from_peer, `load --from-peer`): the
// peer's table (or the local model's, when it gives the peer's layout) is the plan, and the
// shared-arena protocol (FILL, allocate, fill, check, publish) runs as for a load, with the
// bytes read from the peer instead of the model files. Whatever fails (the peer unreachable
// or gone mid-transfer, a checksum, another model), nothing is published: the protocol's
// failure path removes the unfinished file. The fallback to the model files is the caller's
// (arena.cc). The bytes come through a PeerConnection (peer_transport.h) that src/remote
// implements; the fill is a filler of the protocol (arena_filler.h), not a branch of it.
#pragma once

#include <memory>

#include "arena/arena_impl.h"
#include "expert_arena/arena.h"

namespace expert_arena::arena {

Result<std::unique_ptr<Arena::Impl>> FillFromPeer(const ModelSpec& model,
                                                  const ArenaOptions& options, spdlog::logger& log);

// Why the local model's table and the peer's are not the same model laid out the same way
// (tensor names, dtypes, shapes, offsets, sizes; source file sizes, not their paths or
// times, which differ from host to host), or "" when they are.
std::string LayoutDifference(const format::ArenaTable& local, const format::ArenaTable& peer);

}  // namespace expert_arena::arena
