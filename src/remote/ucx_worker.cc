#include "remote/ucx_worker.h"

#include <cstdlib>

#include "platform/net.h"

namespace expert_arena::remote {

Status UcxStatus(ucs_status_t status, const std::string& what) {
  StatusCode code = StatusCode::kIoError;
  if (status == UCS_ERR_TIMED_OUT || status == UCS_ERR_ENDPOINT_TIMEOUT)
    code = StatusCode::kTimedOut;
  if (status == UCS_ERR_UNSUPPORTED) code = StatusCode::kUnsupported;
  return Status(code, what + ": " + ucs_status_string(status));
}

Result<std::unique_ptr<UcxWorker>> UcxWorker::Create(bool rma) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcxStatus(s, "ucp_config_read (check the UCX_* environment)");
  // A vanished peer (host down, cable out: no RST) fails its endpoints after a few missed
  // keepalives instead of UCX's default 20 s interval. The operator's setting wins.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    (void)ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
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

ucs_status_t UcxWorker::Accept(ucp_conn_request_h request, ucp_err_handler_t on_error,
                               ucp_ep_h* ep) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  params.conn_request = request;
  ucs_status_t s = CreateEndpoint(worker_, params, on_error, ep);
  if (s != UCS_OK) *ep = nullptr;
  return s;
}

Status UcxWorker::Connect(const platform::SocketAddress& address, ucp_err_handler_t on_error,
                          ucp_ep_h* ep, const std::string& what) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = address.get();
  params.sockaddr.addrlen = address.length;
  ucs_status_t s = CreateEndpoint(worker_, params, on_error, ep);
  if (s != UCS_OK) return UcxStatus(s, what);
  return Status::Ok();
}

std::string ConnectionRequestPeer(ucp_conn_request_h request) {
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(request, &attr) != UCS_OK) return "?";
  return platform::AddressText(reinterpret_cast<const sockaddr*>(&attr.client_address));
}

void CloseEndpoint(UcxWorker& worker, ucp_ep_h ep, bool force,
                   std::chrono::steady_clock::time_point deadline) {
  if (ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  // A flush to a peer that is gone ends when peer error handling fails the endpoint; past the
  // deadline the request is left to UCX (freed, it is released when it completes).
  while (ucp_request_check_status(request) == UCS_INPROGRESS &&
         std::chrono::steady_clock::now() < deadline) {
    worker.Progress(10);
  }
  ucp_request_free(request);
}

}  // namespace expert_arena::remote
