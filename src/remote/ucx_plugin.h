// The UCX transport as a plugin. UCX's libucm hooks mmap, munmap, madvise and brk in every
// process that loads it, and an engine may bring its own UCX (another version, through NIXL):
// so UCX is never linked into the library, the tools or the Python module. Everything that
// calls UCX (ucx_worker.cc, peer_client.cc, peer_server.cc, stream_server.cc, stream_client.cc,
// ucx_plugin.cc) is built into
// libexpert_arena_ucx.so, the only object that links UCX, and the core reaches it through
// one extern "C" entry, expert_arena_ucx_v1, which returns a UcxPlugin table. Ucx() loads it
// at the first peer fill or server (docs/cross-host.md says where it is looked for).
//
// C++ types cross this boundary: the plugin and the core come from the same build and the
// same compiler, which the table's `build` string checks. The plugin carries no copy of the
// core: it links libexpert_arena.so (the EXPERT_ARENA_INTERNAL symbols, src/expert_arena.map),
// the copy the process already holds, so its fork registry, pin budget and kernel-feature probe
// are the process's (core_identity.h). Its own symbols stay local to it.
#pragma once

#include <memory>
#include <string>

#include "expert_arena/status.h"
#include "remote/core_identity.h"
#include "remote/peer_client.h"
#include "remote/peer_server.h"
#include "stream/stream_remote.h"

namespace expert_arena::remote {

// The plugin's file name and its one exported symbol, of type UcxPluginEntry.
inline constexpr char kUcxPluginFile[] = "libexpert_arena_ucx.so";
inline constexpr char kUcxPluginEntryName[] = "expert_arena_ucx_v1";

// What the plugin offers: factories of the transport's objects, each returning an object the
// core then uses through its abstract interface (PeerSource, PeerServer, StreamServer,
// StreamPeer).
//
// To add an entry: append
// a function pointer at the end, set it in ucx_plugin.cc's table, and call it through Ucx()
// from a core wrapper (as ucx_loader.cc does for ConnectPeer), with a refusal in
// remote_unavailable.cc for builds without UCX. Never reorder or remove an entry. No size
// check is needed: a plugin of another build is refused by `build`; the entry's name (v1)
// changes only if its own signature does.
struct UcxPlugin {
  // "<version> <compiler> <version> sanitize=<...>" of the build that made the plugin.
  const char* build;
  const char* ucx_version;  // the UCX the plugin runs on (ucp_get_version_string)
  Result<std::unique_ptr<PeerSource>> (*connect_peer)(const PeerOptions& options);
  Result<std::unique_ptr<PeerServer>> (*start_server)(const std::string& path,
                                                      const ServeOptions& options);
  // Tensor streams across hosts (stream_remote.h).
  Result<std::unique_ptr<StreamServer>> (*start_stream_server)(const StreamServerOptions& options);
  Result<std::shared_ptr<StreamPeer>> (*connect_stream_peer)(const StreamPeerOptions& options);
  // The core the plugin reaches (core_identity.h): the process's own.
  CoreIdentity (*core_identity)();
};

using UcxPluginEntry = const UcxPlugin* (*)();

// The plugin, loaded at the first call (thread-safe) and cached for the life of the process,
// a failure included. Looked for, in order: $EXPERT_ARENA_UCX_PLUGIN (a path; only it when
// set), the directory of the object that holds the core (libexpert_arena.so, the tool, the
// Python module), the installed libdir, then kUcxPluginFile by name (LD_LIBRARY_PATH, the
// cache). Loaded RTLD_NOW | RTLD_LOCAL. Errors: kUnsupported naming every path tried and the
// dynamic linker's text for each.
Result<const UcxPlugin*> Ucx();

}  // namespace expert_arena::remote
