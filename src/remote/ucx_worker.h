// One UCX context and worker, progressed by the thread that owns them (UCS_THREAD_MODE_SINGLE),
// with the few operations peer fill needs: endpoints with peer error handling, active messages
// for the small control messages, a bounded wait on a request.
//
// Liveness: every endpoint is made with UCP_ERR_HANDLING_MODE_PEER, so a peer that dies or
// vanishes fails its endpoint (and every request on it) instead of leaving a request pending;
// UCX's keepalive (UCX_KEEPALIVE_INTERVAL, 1 s here unless the environment sets it) finds a
// peer that vanished without closing its connection. Every wait below has a deadline too.
//
// Thread-safety: none; one thread owns a UcxWorker and everything made from it.
//
// Plugin code (libexpert_arena_ucx.so, ucx_plugin.h): only the plugin includes UCX's headers.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "expert_arena/status.h"
#include "platform/net.h"
#include "remote/peer_client.h"
#include "remote/peer_server.h"
#include "stream/stream_remote.h"

namespace expert_arena::remote {

// "<what>: <UCX's text>" as a Status.
Status UcxStatus(ucs_status_t status, const std::string& what);

class UcxWorker {
 public:
  // kIoError naming the UCX call when UCX cannot start (no usable transport, bad UCX_TLS).
  // Without `rma` the context has no UCP_FEATURE_RMA: UCX then installs no handler for get or
  // put requests on this worker, so a peer cannot read or write this process's memory through
  // it, whatever it sends (on tcp, where get and put are emulated by the target's worker).
  // `net_devices` (when not empty, and UCX_NET_DEVICES is not set) restricts UCX's network
  // transports to those interfaces: a server's UCX listens only on the interface of its
  // listen address (docs/cross-host.md says what stays reachable).
  static Result<std::unique_ptr<UcxWorker>> Create(bool rma, const std::string& net_devices = "");
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }

  // Progresses the worker; when nothing was progressed, sleeps on the worker's event fd for up
  // to `idle_ms` (0: do not sleep). Returns whether anything was progressed.
  bool Progress(int idle_ms);

  // Progresses until `request` (the result of a ucp_*_nbx call) completes or `deadline`
  // passes; frees it. A request that is still pending at the deadline is cancelled and
  // kTimedOut returned (`what` names the operation).
  Status Wait(ucs_status_ptr_t request, std::chrono::steady_clock::time_point deadline,
              const std::string& what);

  // Arms the event fd for Wait-style sleeping elsewhere (a poll over more descriptors): false
  // when events arrived meanwhile (progress again instead of sleeping).
  bool Arm();
  int event_fd() const { return event_fd_; }

  // This worker's address (ucp_worker_get_address), to hand to an authenticated peer only.
  Result<std::vector<std::byte>> Address();

  // Registers `cb` (called with `arg`) for the active messages of `id`.
  Status SetAmHandler(uint32_t id, void* arg, ucp_am_recv_callback_t cb);

  // The endpoint has UCP_ERR_HANDLING_MODE_PEER and `on_error` as its error handler (see
  // RecordFailureIn); its error is UcxStatus(`what`).
  // An endpoint to the worker address a peer sent over the front door (front_door.h): UCX's
  // out-of-band pattern, no sockaddr listener anywhere.
  Status ConnectToAddress(std::span<const std::byte> address, ucp_err_handler_t on_error,
                          ucp_ep_h* ep, const std::string& what);

 private:
  UcxWorker() = default;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
};

// Closes an endpoint: flushes it (or forces it when `force`, or when the flush does not finish
// by `deadline`), progressing the worker until the close completes, so that nothing is left
// pending on it when the worker is destroyed (UCX 1.13 aborts then: "pending request ... should
// have been flushed").
void CloseEndpoint(UcxWorker& worker, ucp_ep_h ep, bool force,
                   std::chrono::steady_clock::time_point deadline);

// An endpoint error handler that records the failure in `*owner`: `owner->*Failed` becomes
// true and `owner->*Failure` UCX's status (members `failed` and `failure` unless named).
template <typename T, bool T::*Failed = &T::failed, ucs_status_t T::*Failure = &T::failure>
ucp_err_handler_t RecordFailureIn(T* owner) {
  ucp_err_handler_t handler{};
  handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
    auto* o = static_cast<T*>(arg);
    o->*Failed = true;
    o->*Failure = status;
  };
  handler.arg = owner;
  return handler;
}

// The plugin's factories (ucx_plugin.cc puts them in its table): ConnectPeer and
// PeerServer::Start of the core land here once the plugin is loaded.
Result<std::unique_ptr<PeerSource>> ConnectUcxPeer(const PeerOptions& options);
Result<std::unique_ptr<PeerServer>> StartUcxServer(const std::string& path,
                                                   const ServeOptions& options);
// StartStreamServer and ConnectStreamPeer of the core (stream_remote.h), likewise.
Result<std::unique_ptr<StreamServer>> StartUcxStreamServer(const StreamServerOptions& options);
Result<std::shared_ptr<StreamPeer>> ConnectUcxStreamPeer(const StreamPeerOptions& options);

}  // namespace expert_arena::remote
