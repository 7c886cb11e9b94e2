#include "remote/ucx_worker.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "platform/net.h"

namespace expert_arena::remote {

Status UcxStatus(ucs_status_t status, const std::string& what) {
  StatusCode code = StatusCode::kIoError;
  if (status == UCS_ERR_TIMED_OUT || status == UCS_ERR_ENDPOINT_TIMEOUT)
    code = StatusCode::kTimedOut;
  if (status == UCS_ERR_UNSUPPORTED) code = StatusCode::kUnsupported;
  return Status(code, what + ": " + ucs_status_string(status));
}

Result<std::unique_ptr<UcxWorker>> UcxWorker::Create(bool rma, const std::string& net_devices) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcxStatus(s, "ucp_config_read (check the UCX_* environment)");
  // A vanished peer (host down, cable out: no RST) fails its endpoints after a few missed
  // keepalives instead of UCX's default 20 s interval. The operator's setting wins.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    (void)ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
  }
  if (!net_devices.empty() && std::getenv("UCX_NET_DEVICES") == nullptr) {
    ucs_status_t m = ucp_config_modify(config, "NET_DEVICES", net_devices.c_str());
    if (m != UCS_OK) {
      ucp_config_release(config);
      return UcxStatus(m, "UCX_NET_DEVICES=" + net_devices);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (rma ? UCP_FEATURE_RMA : 0);
  params.name = "expert-arena";
  s = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return UcxStatus(s, "ucp_init");
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(w->context_, &worker_params, &w->worker_);
  if (s != UCS_OK) return UcxStatus(s, "ucp_worker_create");
  s = ucp_worker_get_efd(w->worker_, &w->event_fd_);
  if (s != UCS_OK) return UcxStatus(s, "ucp_worker_get_efd");
  return w;
}

UcxWorker::~UcxWorker() {
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

bool UcxWorker::Progress(int idle_ms) {
  if (ucp_worker_progress(worker_) != 0) return true;
  if (idle_ms <= 0) return false;
  // Arm the event fd; UCS_ERR_BUSY means events arrived meanwhile: progress again.
  if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return ucp_worker_progress(worker_) != 0;
  (void)platform::WaitReadable(event_fd_, idle_ms);
  return ucp_worker_progress(worker_) != 0;
}

Status UcxWorker::Wait(ucs_status_ptr_t request, std::chrono::steady_clock::time_point deadline,
                       const std::string& what) {
  if (request == nullptr) return Status::Ok();
  if (UCS_PTR_IS_ERR(request)) return UcxStatus(UCS_PTR_STATUS(request), what);
  ucs_status_t s;
  while ((s = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    if (std::chrono::steady_clock::now() > deadline) {
      ucp_request_cancel(worker_, request);
      // A cancelled request completes at the next progress.
      for (int i = 0; i < 1000 && ucp_request_check_status(request) == UCS_INPROGRESS; ++i) {
        Progress(1);
      }
      ucp_request_free(request);
      return TimedOut(what + ": no answer within the deadline");
    }
    Progress(10);
  }
  ucp_request_free(request);
  if (s != UCS_OK) return UcxStatus(s, what);
  return Status::Ok();
}

bool UcxWorker::Arm() { return ucp_worker_arm(worker_) != UCS_ERR_BUSY; }

Result<std::vector<std::byte>> UcxWorker::Address() {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  ucs_status_t s = ucp_worker_get_address(worker_, &address, &length);
  if (s != UCS_OK) return UcxStatus(s, "ucp_worker_get_address");
  const auto* bytes = reinterpret_cast<const std::byte*>(address);
  std::vector<std::byte> out(bytes, bytes + length);
  ucp_worker_release_address(worker_, address);
  return out;
}

Status UcxWorker::SetAmHandler(uint32_t id, void* arg, ucp_am_recv_callback_t cb) {
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = id;
  am.arg = arg;
  am.cb = cb;
  ucs_status_t s = ucp_worker_set_am_recv_handler(worker_, &am);
  return s == UCS_OK ? Status::Ok() : UcxStatus(s, "ucp_worker_set_am_recv_handler");
}

namespace {

// `params` (what to connect to) with peer error handling and `on_error` as the error handler.
ucs_status_t CreateEndpoint(ucp_worker_h worker, ucp_ep_params_t params, ucp_err_handler_t on_error,
                            ucp_ep_h* ep) {
  params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler = on_error;
  return ucp_ep_create(worker, &params, ep);
}

}  // namespace

Status UcxWorker::ConnectToAddress(std::span<const std::byte> address, ucp_err_handler_t on_error,
                                   ucp_ep_h* ep, const std::string& what) {
  // UCX unpacks a worker address without knowing its length: a short one makes it read on,
  // and what it reads past the end is then zeros of this buffer, not whatever the heap holds.
  std::vector<std::byte> padded(address.size() + 4096);
  std::memcpy(padded.data(), address.data(), address.size());
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  params.address = reinterpret_cast<const ucp_address_t*>(padded.data());
  ucs_status_t s = CreateEndpoint(worker_, params, on_error, ep);
  if (s != UCS_OK) {
    *ep = nullptr;
    return UcxStatus(s, what);
  }
  return Status::Ok();
}

void CloseEndpoint(UcxWorker& worker, ucp_ep_h ep, bool force,
                   std::chrono::steady_clock::time_point deadline) {
  if (ep == nullptr) return;
  // A flush to a peer that is gone ends when peer error handling fails the endpoint; a flush
  // to a peer that is silent (stopped, hung: its kernel still acknowledges) never does. So the
  // flush runs until `deadline`, and an endpoint not flushed by then is closed by force, which
  // fails whatever is pending on it; then the worker progresses until the close completes
  // (bounded), so nothing stays pending for ucp_worker_destroy.
  ucp_request_param_t param{};
  ucs_status_ptr_t flush = nullptr;
  bool flushed = false;
  if (!force) {
    flush = ucp_ep_flush_nbx(ep, &param);
    if (flush == nullptr) {
      flushed = true;
    } else if (UCS_PTR_IS_PTR(flush)) {
      while (ucp_request_check_status(flush) == UCS_INPROGRESS &&
             std::chrono::steady_clock::now() < deadline) {
        worker.Progress(10);
      }
      flushed = ucp_request_check_status(flush) == UCS_OK;
    } else {
      flush = nullptr;
    }
  }
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = flushed ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  const bool closing = UCS_PTR_IS_PTR(request) && request != nullptr;
  for (int i = 0; i < 500; ++i) {
    bool busy = (closing && ucp_request_check_status(request) == UCS_INPROGRESS) ||
                (flush != nullptr && ucp_request_check_status(flush) == UCS_INPROGRESS);
    if (!busy) break;
    worker.Progress(10);
  }
  if (closing) ucp_request_free(request);
  if (flush != nullptr) ucp_request_free(flush);
}

}  // namespace expert_arena::remote
