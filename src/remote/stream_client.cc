// A consumer's connection to a producer's stream server (stream_remote.h, docs/cross-host.md).
// One UCX worker per connection, progressed only inside the calls below (under `mu`): an open
// sends the descriptor, then receives the bytes straight into the caller's buffer (eager: a
// copy in the callback; rendezvous: ucp_am_recv_data_nbx into it), checks their xxh3, and waits
// for the producer's "done". Every wait is bounded by the timeout, and the endpoint's peer
// error handling (with UCX keepalive) ends it sooner when the producer dies or vanishes; a
// failed transfer closes the endpoint before the buffer is handed back, so nothing lands in it
// afterwards.
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstring>
#include <mutex>

#include "common/logging.h"
#include "load/fast_xxh3.h"
#include "platform/net.h"
#include "remote/stream_remote.h"
#include "remote/stream_wire.h"
#include "remote/ucx_worker.h"

namespace expert_arena::remote {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::nanoseconds Seconds(double s) {
  return std::chrono::nanoseconds(static_cast<int64_t>(s * 1e9));
}

std::string Printable(const void* data, size_t bytes) {
  std::string out(static_cast<const char*>(data), std::min<size_t>(bytes, kStreamMaxTextBytes));
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return out;
}

// The open in progress (one at a time).
struct Fetching {
  uint64_t request = 0;
  std::span<std::byte> into;
  bool header = false;  // the data message arrived
  StreamData data{};
  std::string refusal;
  void* rndv = nullptr;  // a rendezvous descriptor to receive
  ucs_status_ptr_t receive = nullptr;
  bool landed = false;
  bool done = false;
  StreamDone done_msg{};
  std::string done_text;
};

class Peer final : public StreamPeer {
 public:
  ~Peer() override {
    std::lock_guard lock(mu_);
    if (ucx_) CloseEndpoint(*ucx_, ep_, failed_, Clock::now() + std::chrono::seconds(2));
  }

  Status Connect(const StreamPeerOptions& options);

  Result<uint64_t> Fetch(std::string_view descriptor, uint64_t instance_id,
                         std::span<std::byte> into) override;

  void Release(uint64_t hold, bool spend) override {
    std::lock_guard lock(mu_);
    if (failed_ || !ucx_) return;
    StreamRelease r{hold, spend ? 1u : 0u, 0};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    Status s = ucx_->Wait(ucp_am_send_nbx(ep_, kStreamReleaseId, nullptr, 0, &r, sizeof r, &param),
                          Clock::now() + Seconds(std::min(options_.timeout_seconds, 5.0)),
                          "stream release to " + options_.address);
    if (!s.ok()) log_->warn("{} (the producer's lease ends the hold)", s.message());
  }

  bool alive() const override {
    std::lock_guard lock(mu_);
    return !failed_;
  }

  uint64_t instance_id() const override { return welcome_.instance_id; }  // set before shared

 private:
  Status Gone(const std::string& doing) {
    return Status(
        failure_ == UCS_ERR_ENDPOINT_TIMEOUT ? StatusCode::kTimedOut : StatusCode::kIoError,
        "stream producer at " + options_.address + " went away " + doing + " (" +
            ucs_status_string(failure_) + ")");
  }
  // After a failed or stalled transfer: the endpoint goes, so nothing lands in the buffer.
  void Abandon() {
    if (fetching_ != nullptr && fetching_->receive != nullptr &&
        !UCS_PTR_IS_ERR(fetching_->receive)) {
      ucp_request_cancel(ucx_->worker(), fetching_->receive);
    }
    CloseEndpoint(*ucx_, ep_, true, Clock::now() + std::chrono::seconds(2));
    ep_ = nullptr;
    if (fetching_ != nullptr && fetching_->receive != nullptr &&
        !UCS_PTR_IS_ERR(fetching_->receive)) {
      for (int i = 0; i < 200 && ucp_request_check_status(fetching_->receive) == UCS_INPROGRESS;
           ++i)
        ucx_->Progress(1);
      ucp_request_free(fetching_->receive);
      fetching_->receive = nullptr;
    }
    if (fetching_ != nullptr && fetching_->rndv != nullptr) {
      ucp_am_data_release(ucx_->worker(), fetching_->rndv);
      fetching_->rndv = nullptr;
    }
    if (!failed_) failure_ = UCS_ERR_CANCELED;
    failed_ = true;
  }

  StreamPeerOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  mutable std::mutex mu_;
  std::unique_ptr<UcxWorker> ucx_;
  ucp_ep_h ep_ = nullptr;
  bool failed_ = false;
  ucs_status_t failure_ = UCS_OK;
  bool welcomed_ = false;
  StreamWelcome welcome_{};
  std::string welcome_text_;
  uint64_t next_request_ = 0;
  Fetching* fetching_ = nullptr;
};

Status Peer::Connect(const StreamPeerOptions& options) {
  options_ = options;
  log_ = ResolveLogger(options.logger);
  const std::string& peer = options.address;
  if (options.token.size() > kStreamMaxTokenBytes) {
    return InvalidArgument("stream remote token of " + std::to_string(options.token.size()) +
                           " bytes; at most " + std::to_string(kStreamMaxTokenBytes));
  }
  EA_ASSIGN_OR_RETURN(platform::SocketAddress address, platform::ResolveHostPort(peer));
  EA_ASSIGN_OR_RETURN(ucx_, UcxWorker::Create());
  auto set_handler = [&](uint32_t id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = id;
    am.arg = this;
    am.cb = cb;
    ucs_status_t s = ucp_worker_set_am_recv_handler(ucx_->worker(), &am);
    return s == UCS_OK ? Status::Ok() : UcxStatus(s, "ucp_worker_set_am_recv_handler");
  };
  EA_RETURN_IF_ERROR(set_handler(
      kStreamWelcomeId,
      [](void* arg, const void*, size_t, void* data, size_t length,
         const ucp_am_recv_param_t* param) -> ucs_status_t {
        auto* self = static_cast<Peer*>(arg);
        if (self->welcomed_ || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
            length < sizeof(StreamWelcome))
          return UCS_OK;
        self->welcomed_ = true;
        std::memcpy(&self->welcome_, data, sizeof self->welcome_);
        self->welcome_text_ = Printable(static_cast<const char*>(data) + sizeof(StreamWelcome),
                                        length - sizeof(StreamWelcome));
        return UCS_OK;
      }));
  EA_RETURN_IF_ERROR(
      set_handler(kStreamDataId,
                  [](void* arg, const void* header, size_t header_length, void* data, size_t length,
                     const ucp_am_recv_param_t* param) -> ucs_status_t {
                    auto* self = static_cast<Peer*>(arg);
                    Fetching* f = self->fetching_;
                    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
                    if (header_length != sizeof(StreamData) || f == nullptr || f->header)
                      return UCS_OK;
                    StreamData h{};
                    std::memcpy(&h, header, sizeof h);
                    if (h.request != f->request) return UCS_OK;
                    f->header = true;
                    f->data = h;
                    if (h.status != static_cast<uint32_t>(StreamStatus::kOk)) {
                      f->refusal = rndv ? "refused (text not received)" : Printable(data, length);
                      return UCS_OK;
                    }
                    if (h.length != f->into.size() || length != f->into.size()) {
                      f->refusal = "the producer sent " + std::to_string(length) +
                                   " bytes for a block of " + std::to_string(f->into.size());
                      return UCS_OK;
                    }
                    if (rndv) {
                      f->rndv = data;
                      return UCS_INPROGRESS;  // received in Fetch with ucp_am_recv_data_nbx
                    }
                    if (length > 0) std::memcpy(f->into.data(), data, length);
                    f->landed = true;
                    return UCS_OK;
                  }));
  EA_RETURN_IF_ERROR(
      set_handler(kStreamDoneId,
                  [](void* arg, const void*, size_t, void* data, size_t length,
                     const ucp_am_recv_param_t* param) -> ucs_status_t {
                    auto* self = static_cast<Peer*>(arg);
                    Fetching* f = self->fetching_;
                    if (f == nullptr || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
                        length < sizeof(StreamDone))
                      return UCS_OK;
                    StreamDone d{};
                    std::memcpy(&d, data, sizeof d);
                    if (d.request != f->request) return UCS_OK;
                    f->done = true;
                    f->done_msg = d;
                    f->done_text = Printable(static_cast<const char*>(data) + sizeof d,
                                             std::min<size_t>(d.text_bytes, length - sizeof d));
                    return UCS_OK;
                  }));

  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = address.get();
  params.sockaddr.addrlen = address.length;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.arg = this;
  params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
    auto* self = static_cast<Peer*>(arg);
    self->failed_ = true;
    self->failure_ = status;
  };
  ucs_status_t s = ucp_ep_create(ucx_->worker(), &params, &ep_);
  if (s != UCS_OK) return UcxStatus(s, "connect to stream producer " + peer);

  std::vector<std::byte> hello_bytes(sizeof(StreamHello) + options.token.size());
  StreamHello hello{kStreamMagic, kStreamVersion, static_cast<uint32_t>(options.token.size())};
  std::memcpy(hello_bytes.data(), &hello, sizeof hello);
  if (!options.token.empty())
    std::memcpy(hello_bytes.data() + sizeof hello, options.token.data(), options.token.size());
  ucp_request_param_t send{};
  send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  send.flags = UCP_AM_SEND_FLAG_REPLY;
  const auto deadline = Clock::now() + Seconds(options.timeout_seconds);
  Status sent = ucx_->Wait(ucp_am_send_nbx(ep_, kStreamHelloId, nullptr, 0, hello_bytes.data(),
                                           hello_bytes.size(), &send),
                           deadline, "hello to stream producer " + peer);
  if (!sent.ok()) {
    if (failed_) {
      return Status(StatusCode::kIoError,
                    "cannot reach the stream producer at " + peer + " (" +
                        ucs_status_string(failure_) +
                        "): it exited, or does not listen there (a descriptor of a dead producer)");
    }
    return sent;
  }
  while (!welcomed_ && !failed_) {
    if (Clock::now() > deadline) {
      return TimedOut("stream producer at " + peer + " did not answer within " +
                      std::to_string(options.timeout_seconds) + " s");
    }
    ucx_->Progress(10);
  }
  if (!welcomed_) return Gone("before answering the hello");
  if (welcome_.magic != kStreamMagic || welcome_.version != kStreamVersion) {
    return Unsupported("stream producer at " + peer + " speaks another protocol version (" +
                       std::to_string(welcome_.version) + ", this is " +
                       std::to_string(kStreamVersion) + ")");
  }
  if (welcome_.status != static_cast<uint32_t>(StreamStatus::kOk)) {
    return PermissionDenied("stream producer at " + peer + " refused: " + welcome_text_);
  }
  return Status::Ok();
}

Result<uint64_t> Peer::Fetch(std::string_view descriptor, uint64_t instance_id,
                             std::span<std::byte> into) {
  std::lock_guard lock(mu_);
  const std::string& peer = options_.address;
  if (failed_) return Gone("earlier");
  if (instance_id != welcome_.instance_id) {
    return Busy("the descriptor was made by another instance of the stream producer at " + peer +
                " (it restarted since): stale, refused");
  }
  if (descriptor.size() > kStreamMaxDescriptorBytes) return InvalidArgument("descriptor too long");
  Fetching f;
  f.request = ++next_request_;
  f.into = into;
  fetching_ = &f;
  struct Clear {
    Fetching*& p;
    ~Clear() { p = nullptr; }
  } clear{fetching_};
  std::vector<std::byte> msg(sizeof(StreamOpen) + descriptor.size());
  StreamOpen open{f.request, instance_id, static_cast<uint32_t>(descriptor.size()), 0};
  std::memcpy(msg.data(), &open, sizeof open);
  std::memcpy(msg.data() + sizeof open, descriptor.data(), descriptor.size());
  ucp_request_param_t send{};
  send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  send.flags = UCP_AM_SEND_FLAG_REPLY;
  const auto deadline = Clock::now() + Seconds(options_.timeout_seconds);
  Status sent =
      ucx_->Wait(ucp_am_send_nbx(ep_, kStreamOpenId, nullptr, 0, msg.data(), msg.size(), &send),
                 deadline, "stream open request to " + peer);
  if (!sent.ok()) {
    if (failed_) return Gone("before the open was sent");
    Abandon();
    return sent;
  }
  for (;;) {
    if (f.rndv != nullptr && f.receive == nullptr) {
      ucp_request_param_t param{};
      void* desc = f.rndv;
      f.rndv = nullptr;
      f.receive = ucp_am_recv_data_nbx(ucx_->worker(), desc, into.data(), into.size(), &param);
      if (f.receive == nullptr) {
        f.landed = true;
      } else if (UCS_PTR_IS_ERR(f.receive)) {
        Status s = UcxStatus(UCS_PTR_STATUS(f.receive), "receiving a tensor from " + peer);
        f.receive = nullptr;
        Abandon();
        return s;
      }
    }
    if (f.receive != nullptr) {
      ucs_status_t s = ucp_request_check_status(f.receive);
      if (s != UCS_INPROGRESS) {
        ucp_request_free(f.receive);
        f.receive = nullptr;
        if (s != UCS_OK) {
          Abandon();
          return Gone("mid-transfer");
        }
        f.landed = true;
      }
    }
    if (f.header && !f.refusal.empty()) {
      if (f.data.status == static_cast<uint32_t>(StreamStatus::kOk)) {
        Abandon();  // a malformed answer: this connection is not trusted further
        return Corrupt("stream open from " + peer + ": " + f.refusal);
      }
      return Busy("stream producer at " + peer + " refused the open: " + f.refusal);
    }
    if (f.landed && f.done) break;
    if (failed_) {
      Abandon();
      return Gone(f.header ? "mid-transfer" : "before sending the tensor");
    }
    if (Clock::now() > deadline) {
      Abandon();
      return TimedOut("stream open from " + peer + ": no tensor within " +
                      std::to_string(options_.timeout_seconds) + " s (the producer stalled)");
    }
    ucx_->Progress(f.receive != nullptr ? 0 : 5);
  }
  if (f.done_msg.status != static_cast<uint32_t>(StreamStatus::kOk)) {
    return Busy("stream producer at " + peer + " refused the open: " + f.done_text);
  }
  const uint64_t hash = load::FastXxh3(into.data(), into.size());
  if (hash != f.data.xxh3) {
    fetching_ = nullptr;
    // Give the hold back unspent: the bytes were damaged on the way, not read.
    StreamRelease r{f.data.hold, 0, 0};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    (void)ucx_->Wait(ucp_am_send_nbx(ep_, kStreamReleaseId, nullptr, 0, &r, sizeof r, &param),
                     Clock::now() + std::chrono::seconds(2), "stream give-back");
    return Corrupt("stream open from " + peer + ": the " + std::to_string(into.size()) +
                   " bytes received do not match the producer's xxh3 (damaged in transit)");
  }
  return f.data.hold;
}

}  // namespace

Result<std::shared_ptr<StreamPeer>> ConnectStreamPeer(const StreamPeerOptions& options) {
  auto peer = std::make_shared<Peer>();
  Status s = peer->Connect(options);
  if (!s.ok()) return s;
  return std::shared_ptr<StreamPeer>(std::move(peer));
}

}  // namespace expert_arena::remote
