// The entry point of libexpert_arena_ucx.so (ucx_plugin.h): the only symbol it exports
// (ucx_plugin.map).
#include "remote/ucx_plugin.h"

#include <ucp/api/ucp.h>

#include "remote/ucx_worker.h"

extern "C" __attribute__((visibility("default"))) const expert_arena::remote::UcxPlugin*
expert_arena_ucx_v1() {
  using namespace expert_arena::remote;
  static const UcxPlugin plugin{
      .build = EXPERT_ARENA_UCX_PLUGIN_BUILD,
      .ucx_version = ucp_get_version_string(),
      .connect_peer = &ConnectUcxPeer,
      .start_server = &StartUcxServer,
      .start_stream_server = &StartUcxStreamServer,
      .connect_stream_peer = &ConnectUcxStreamPeer,
      // Bound to libexpert_arena.so's ThisCoreIdentity: the core this plugin links.
      .core_identity = &ThisCoreIdentity,
  };
  return &plugin;
}
