// The core's side of the UCX transport plugin (ucx_plugin.h): finds and loads
// libexpert_arena_ucx.so at the first peer fill or server, and forwards ConnectPeer and
// PeerServer::Start to it. No UCX header or symbol here.
#include <cstdlib>
#include <string>
#include <vector>

#include "common/logging.h"
#include "platform/process.h"
#include "platform/shared_object.h"
#include "remote/core_identity.h"
#include "remote/net_control.h"
#include "remote/ucx_plugin.h"

namespace expert_arena::remote {
namespace {

// An object of this translation unit: its address names the file that holds the core.
const char kCoreAnchor = 0;

// One candidate: the plugin when `path` loads, has the entry and comes from this build.
Result<const UcxPlugin*> LoadFrom(const std::string& path) {
  EA_ASSIGN_OR_RETURN(platform::SharedObject object, platform::OpenSharedObject(path));
  EA_ASSIGN_OR_RETURN(void* symbol, platform::FindSymbol(object, kUcxPluginEntryName));
  auto entry = reinterpret_cast<UcxPluginEntry>(symbol);
  const UcxPlugin* plugin = entry();
  if (plugin == nullptr || plugin->build == nullptr) {
    return Unsupported(path + ": " + kUcxPluginEntryName + " returned no table");
  }
  if (std::string(plugin->build) != EXPERT_ARENA_UCX_PLUGIN_BUILD) {
    // The object stays loaded (never closed), unused.
    return Unsupported(path + ": built by another build (" + plugin->build + "; this is " +
                       EXPERT_ARENA_UCX_PLUGIN_BUILD + ")");
  }
  return plugin;
}

std::string DirectoryOf(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

Result<const UcxPlugin*> Load() {
  const char* given = std::getenv("EXPERT_ARENA_UCX_PLUGIN");
  if (given != nullptr && given[0] != '\0') {
    // The operator named the file: no other is tried in its place.
    auto plugin = LoadFrom(given);
    if (plugin.ok()) return plugin;
    return Unsupported("cannot load the UCX transport plugin named by EXPERT_ARENA_UCX_PLUGIN (" +
                       plugin.status().message() + ")");
  }
  std::vector<std::string> candidates;
  auto core = platform::PathOfObjectContaining(&kCoreAnchor);
  if (core.ok()) candidates.push_back(DirectoryOf(*core) + "/" + kUcxPluginFile);
  candidates.push_back(std::string(EXPERT_ARENA_UCX_PLUGIN_LIBDIR) + "/" + kUcxPluginFile);
  candidates.push_back(kUcxPluginFile);  // by name: LD_LIBRARY_PATH, the cache
  std::string tried;
  for (size_t i = 0; i < candidates.size(); ++i) {
    bool seen = false;
    for (size_t j = 0; j < i; ++j) seen = seen || candidates[j] == candidates[i];
    if (seen) continue;
    auto plugin = LoadFrom(candidates[i]);
    if (plugin.ok()) return plugin;
    tried += (tried.empty() ? "" : "; ") + plugin.status().message();
  }
  return Unsupported(std::string("cannot load the UCX transport plugin ") + kUcxPluginFile +
                     " (peer fill and serve need it); tried: " + tried +
                     ". Put it next to the library or tool, or name it in "
                     "EXPERT_ARENA_UCX_PLUGIN");
}

}  // namespace

Result<std::string> FindNetProcess() {
  const char* given = std::getenv("EXPERT_ARENA_NET_PROCESS");
  if (given != nullptr && given[0] != '\0') {
    if (platform::IsExecutableFile(given)) return std::string(given);
    return Unsupported(std::string("the network process named by EXPERT_ARENA_NET_PROCESS (") +
                       given + ") is not an executable file");
  }
  std::vector<std::string> candidates;
  const char* plugin = std::getenv("EXPERT_ARENA_UCX_PLUGIN");
  if (plugin != nullptr && plugin[0] != '\0') {
    candidates.push_back(DirectoryOf(plugin) + "/" + kNetProcessFile);
  }
  auto core = platform::PathOfObjectContaining(&kCoreAnchor);
  if (core.ok()) candidates.push_back(DirectoryOf(*core) + "/" + kNetProcessFile);
  candidates.push_back(std::string(EXPERT_ARENA_UCX_PLUGIN_LIBDIR) + "/" + kNetProcessFile);
  std::string tried;
  for (const std::string& c : candidates) {
    if (platform::IsExecutableFile(c)) return c;
    tried += (tried.empty() ? "" : ", ") + c;
  }
  return Unsupported(std::string("cannot find the network process ") + kNetProcessFile +
                     " (a listening producer and serve run their network side in it); tried: " +
                     tried + ". Put it next to " + kUcxPluginFile +
                     ", or name it in EXPERT_ARENA_NET_PROCESS");
}

Result<const UcxPlugin*> Ucx() {
  static const Result<const UcxPlugin*> loaded = Load();
  return loaded;
}

bool RemoteBuilt() { return true; }

Result<CoreIdentity> PluginCoreIdentity() {
  EA_ASSIGN_OR_RETURN(const UcxPlugin* ucx, Ucx());
  return ucx->core_identity();
}

Result<std::unique_ptr<PeerSource>> ConnectPeer(const PeerOptions& options) {
  EA_ASSIGN_OR_RETURN(const UcxPlugin* ucx, Ucx());
  return ucx->connect_peer(options);
}

Result<std::unique_ptr<PeerServer>> PeerServer::Start(const std::string& path,
                                                      const ServeOptions& options) {
  EA_ASSIGN_OR_RETURN(const UcxPlugin* ucx, Ucx());
  // The process's logger, resolved here as for every call into the plugin.
  ServeOptions resolved = options;
  resolved.logger = ResolveLogger(options.logger);
  return ucx->start_server(path, resolved);
}

Result<std::unique_ptr<StreamServer>> StartStreamServerInProcess(
    const StreamServerOptions& options) {
  EA_ASSIGN_OR_RETURN(const UcxPlugin* ucx, Ucx());
  StreamServerOptions resolved = options;
  resolved.logger = ResolveLogger(options.logger);
  return ucx->start_stream_server(resolved);
}

Result<std::shared_ptr<StreamPeer>> ConnectStreamPeer(const StreamPeerOptions& options) {
  EA_ASSIGN_OR_RETURN(const UcxPlugin* ucx, Ucx());
  StreamPeerOptions resolved = options;
  resolved.logger = ResolveLogger(options.logger);
  return ucx->connect_stream_peer(resolved);
}

}  // namespace expert_arena::remote
