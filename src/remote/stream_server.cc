// The stream server of a listening StreamProducer (stream_remote.h, docs/cross-host.md).
//
// One thread owns the UCX worker (UCS_THREAD_MODE_SINGLE): it accepts connections, checks each
// consumer's hello (the token) before anything else, and serves opens. A served open is a
// view of the block through this process's own StreamConsumer (a reader entry of the
// producer's segment, like any local consumer), so the block stays while the remote consumer
// holds it; its bytes go out as one active message (header, then the bytes: UCX picks eager or
// rendezvous), followed by a "done" message once the send completed (a refusal instead when
// the key was aborted meanwhile). The hold ends with the consumer's release (the share is
// spent) or give-back (unspent), when its endpoint fails (consumer died, vanished, closed:
// spent, as a dead local reader's share is) or when the lease passes after it was served.
// Other threads only call Aborted() and Holds(), under `mu`.
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "common/escape.h"
#include "common/logging.h"
#include "common/units.h"
#include "load/fast_xxh3.h"
#include "platform/file.h"
#include "platform/net.h"
#include "remote/stream_remote.h"
#include "remote/stream_wire.h"
#include "remote/ucx_worker.h"

namespace expert_arena::remote {
namespace {

using Clock = std::chrono::steady_clock;

struct Conn {
  ucp_ep_h ep = nullptr;
  std::string peer;
  Clock::time_point since;
  bool failed = false;
  ucs_status_t failure = UCS_OK;
  bool hello = false;
  bool hello_ok = false;
  bool welcomed = false;
  bool closing = false;
};

// A small message kept until its send completes.
struct Outgoing {
  std::vector<std::byte> header;
  std::vector<std::byte> body;
  ucs_status_ptr_t request = nullptr;
};

struct OpenAsk {
  ucp_ep_h ep = nullptr;
  StreamOpen open{};
  std::string descriptor;
};

struct ReleaseAsk {
  ucp_ep_h ep = nullptr;
  StreamRelease release{};
};

struct Hold {
  uint64_t id = 0;
  Conn* conn = nullptr;
  uint64_t request = 0;
  std::string key;
  std::string segment;
  uint32_t slot = 0;
  std::unique_ptr<StreamTensor> tensor;
  StreamData header{};
  ucs_status_ptr_t send = nullptr;
  bool sending = false;
  bool served = false;   // "done" sent: the lease runs
  bool aborted = false;  // the key was aborted while its bytes were sent
  bool orphan = false;   // its connection failed while sending: end once the send is over
  Clock::time_point served_at;
};

bool SameToken(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

uint64_t RandomId() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = (uint64_t{rd()} << 32) | rd();
  return id;
}

class Server final : public StreamServer {
 public:
  ~Server() override {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    Teardown();
  }

  const std::string& address() const override { return address_; }
  uint64_t instance_id() const override { return instance_; }

  void Aborted(std::string_view key) override {
    std::lock_guard lock(mu_);
    for (Hold& h : holds_)
      if (!h.served && h.key == key) h.aborted = true;
    // Remembered (the latest 4096) so that a later open says why, not just "free".
    aborted_keys_.emplace_back(key);
    if (aborted_keys_.size() > 4096) aborted_keys_.pop_front();
  }

  std::vector<RemoteHold> Holds() override {
    std::lock_guard lock(mu_);
    EndExpiredLocked();
    std::vector<RemoteHold> out;
    for (const Hold& h : holds_) out.push_back({h.segment, h.slot});
    return out;
  }

  Status Start(const StreamServerOptions& options);

 private:
  void Loop();
  void Tend();
  void Accept(ucp_conn_request_h request);
  Conn* Find(ucp_ep_h ep) {
    for (Conn& c : conns_)
      if (c.ep == ep && !c.closing) return &c;
    return nullptr;
  }
  void Send(Conn& c, uint32_t id, std::vector<std::byte> header, std::vector<std::byte> body);
  void Refuse(Conn& c, uint64_t request, const std::string& why);
  void Serve(OpenAsk& ask);
  void EndLocked(std::list<Hold>::iterator it, bool spend, const char* why);
  void EndExpiredLocked();
  void Teardown();
  void PauseForTest();

  StreamServerOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  std::string address_;
  uint64_t instance_ = 0;
  std::string segment_prefix_;
  std::unique_ptr<StreamConsumer> local_;
  std::unique_ptr<UcxWorker> ucx_;
  ucp_listener_h listener_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  // Filled by UCX callbacks (on the thread), consumed by Tend (on the thread).
  std::vector<ucp_conn_request_h> requests_;
  std::vector<OpenAsk> opens_;
  std::vector<ReleaseAsk> releases_;
  std::list<Conn> conns_;
  std::list<Outgoing> outgoing_;
  std::mutex mu_;  // holds_
  std::list<Hold> holds_;
  std::deque<std::string> aborted_keys_;
  uint64_t next_hold_ = 0;
};

void Server::Accept(ucp_conn_request_h request) {
  const std::string peer = ConnectionRequestPeer(request);
  Conn& c = conns_.emplace_back();
  c.peer = peer;
  c.since = Clock::now();
  ucs_status_t s = ucx_->Accept(request, RecordFailureIn(&c), &c.ep);
  if (s != UCS_OK) {
    log_->warn("stream server {}: consumer {}: cannot accept: {}", address_, peer,
               ucs_status_string(s));
    c.closing = true;
  }
}

void Server::Send(Conn& c, uint32_t id, std::vector<std::byte> header,
                  std::vector<std::byte> body) {
  Outgoing& o = outgoing_.emplace_back();
  o.header = std::move(header);
  o.body = std::move(body);
  ucp_request_param_t param{};
  o.request = ucp_am_send_nbx(c.ep, id, o.header.empty() ? nullptr : o.header.data(),
                              o.header.size(), o.body.data(), o.body.size(), &param);
}

template <typename T>
std::vector<std::byte> Bytes(const T& v, const std::string& text = "") {
  const auto* head = reinterpret_cast<const std::byte*>(&v);
  const auto* tail = reinterpret_cast<const std::byte*>(text.data());
  std::vector<std::byte> out(head, head + sizeof v);
  out.insert(out.end(), tail, tail + text.size());
  return out;
}

void Server::Refuse(Conn& c, uint64_t request, const std::string& why) {
  std::string text = why.substr(0, kStreamMaxTextBytes);
  StreamData header{};
  header.request = request;
  header.status = static_cast<uint32_t>(StreamStatus::kRefused);
  header.length = text.size();
  std::vector<std::byte> body(text.size());
  std::memcpy(body.data(), text.data(), text.size());
  Send(c, kStreamDataId, Bytes(header), std::move(body));
  log_->info("stream server {}: consumer {}: open refused: {}", address_, c.peer, text);
}

void Server::Serve(OpenAsk& ask) {
  Conn* c = Find(ask.ep);
  if (c == nullptr) return;
  const uint64_t request = ask.open.request;
  if (!c->hello_ok) return Refuse(*c, request, "no accepted hello on this connection");
  if (ask.open.instance_id != instance_) {
    return Refuse(*c, request,
                  "the descriptor was made by another instance of the producer at " + address_ +
                      " (it restarted, or another producer took the port): stale, refused");
  }
  auto d = TensorDescriptor::Decode(ask.descriptor);
  if (!d.ok()) return Refuse(*c, request, d.status().message());
  if (d->segment.rfind(segment_prefix_, 0) != 0) {
    return Refuse(*c, request,
                  "segment " + QuoteForMessage(d->segment) + " is not this producer's");
  }
  auto tensor = local_->Open(ask.descriptor);
  std::lock_guard lock(mu_);
  if (!tensor.ok()) {
    for (const std::string& k : aborted_keys_) {
      if (k == d->key) {
        return Refuse(*c, request,
                      "key " + QuoteForMessage(d->key) + " was aborted by the producer");
      }
    }
    return Refuse(*c, request, tensor.status().message());
  }
  Hold& h = holds_.emplace_back();
  h.id = ++next_hold_;
  h.conn = c;
  h.request = request;
  h.key = d->key;
  h.segment = d->segment;
  h.slot = d->slot;
  h.tensor = std::make_unique<StreamTensor>(std::move(tensor).value());
  auto bytes = h.tensor->bytes();
  h.header.request = request;
  h.header.status = static_cast<uint32_t>(StreamStatus::kOk);
  h.header.hold = h.id;
  h.header.length = bytes.size();
  h.header.xxh3 = load::FastXxh3(bytes.data(), bytes.size());
  ucp_request_param_t param{};
  h.send = ucp_am_send_nbx(c->ep, kStreamDataId, &h.header, sizeof h.header, bytes.data(),
                           bytes.size(), &param);
  h.sending = true;
}

// Test only: when EXPERT_ARENA_TEST_STREAM_PAUSE_FILE names a path, the server creates it once
// a data send has started and stops serving (at most 60 s, holding no lock) until it is
// removed, so a test can kill the producer, or abort the key, at a known point mid-transfer.
void Server::PauseForTest() {
  const char* path = std::getenv("EXPERT_ARENA_TEST_STREAM_PAUSE_FILE");
  if (path == nullptr || *path == '\0') return;
  for (int i = 0; i < 100; ++i) ucx_->Progress(1);  // the request leaves
  auto fd = platform::OpenFile(path, {.write = true, .create = true});
  if (!fd.ok()) return;
  fd->Reset();
  for (int i = 0; i < 600 && platform::StatPath(path).ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void Server::EndLocked(std::list<Hold>::iterator it, bool spend, const char* why) {
  Hold& h = *it;
  if (h.tensor) {
    if (spend) {
      h.tensor->Release();
    } else {
      h.tensor->GiveBack();
    }
  }
  log_->debug("stream server {}: hold {} of key {} ended ({})", address_, h.id,
              QuoteForMessage(h.key), why);
  holds_.erase(it);
}

void Server::EndExpiredLocked() {
  const auto now = Clock::now();
  const auto lease = std::chrono::duration<double>(options_.lease_seconds);
  for (auto it = holds_.begin(); it != holds_.end();) {
    auto next = std::next(it);
    if (it->served && now - it->served_at > lease) {
      log_->info("stream server {}: the lease of key {} held by consumer {} ran out ({} s)",
                 address_, QuoteForMessage(it->key), it->conn ? it->conn->peer : "?",
                 options_.lease_seconds);
      EndLocked(it, true, "lease");
    }
    it = next;
  }
}

void Server::Tend() {
  for (ucp_conn_request_h r : requests_) Accept(r);
  requests_.clear();
  const auto now = Clock::now();
  for (Conn& c : conns_) {
    if (c.failed || c.closing || !c.hello || c.welcomed) continue;
    StreamWelcome w{kStreamMagic, kStreamVersion,
                    static_cast<uint32_t>(c.hello_ok ? StreamStatus::kOk : StreamStatus::kRefused),
                    instance_};
    std::string text;
    if (!c.hello_ok) {
      text = options_.token.empty() ? "bad hello (another version of expert-arena?)"
                                    : "wrong token: the producer asks for a shared token";
      log_->warn("stream server {}: consumer {} refused: {}", address_, c.peer, text);
    }
    Send(c, kStreamWelcomeId, {}, Bytes(w, text));
    c.welcomed = true;
  }
  std::vector<OpenAsk> opens;
  opens.swap(opens_);
  for (OpenAsk& ask : opens) Serve(ask);
  if (!opens.empty()) PauseForTest();
  std::lock_guard lock(mu_);
  for (const ReleaseAsk& r : releases_) {
    for (auto it = holds_.begin(); it != holds_.end(); ++it) {
      if (it->id == r.release.hold && it->conn != nullptr && it->conn->ep == r.ep && it->served) {
        EndLocked(it, r.release.spend != 0, r.release.spend != 0 ? "released" : "given back");
        break;
      }
    }
  }
  releases_.clear();
  for (auto it = holds_.begin(); it != holds_.end();) {
    auto next = std::next(it);
    Hold& h = *it;
    if (h.sending) {
      ucs_status_t s = UCS_OK;
      if (UCS_PTR_IS_ERR(h.send)) {
        s = UCS_PTR_STATUS(h.send);
      } else if (h.send != nullptr) {
        s = ucp_request_check_status(h.send);
        if (s == UCS_INPROGRESS) {
          it = next;
          continue;
        }
        ucp_request_free(h.send);
      }
      h.send = nullptr;
      h.sending = false;
      if (h.orphan || s != UCS_OK) {
        EndLocked(it, false, "send failed");
        it = next;
        continue;
      }
      StreamDone done{h.request, static_cast<uint32_t>(StreamStatus::kOk), 0};
      std::string text;
      if (h.aborted) {
        text = "key " + QuoteForMessage(h.key) + " was aborted by the producer during the transfer";
        done.status = static_cast<uint32_t>(StreamStatus::kRefused);
        done.text_bytes = static_cast<uint32_t>(text.size());
      }
      Send(*h.conn, kStreamDoneId, {}, Bytes(done, text));
      if (h.aborted) {
        EndLocked(it, true, "aborted");
        it = next;
        continue;
      }
      h.served = true;
      h.served_at = Clock::now();
    }
    it = next;
  }
  EndExpiredLocked();
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn& c = *it;
    bool idle_too_long = !c.hello && std::chrono::duration<double>(now - c.since).count() > 10;
    bool refused_out = c.welcomed && !c.hello_ok;
    if (!c.failed && !c.closing && !idle_too_long && !refused_out) {
      ++it;
      continue;
    }
    if (refused_out && !c.failed) {
      // Let the refusal go out first.
      bool pending = false;
      for (Outgoing& o : outgoing_)
        if (o.request != nullptr && !UCS_PTR_IS_ERR(o.request) &&
            ucp_request_check_status(o.request) == UCS_INPROGRESS)
          pending = true;
      if (pending) {
        ++it;
        continue;
      }
    }
    bool sending = false;
    for (auto h = holds_.begin(); h != holds_.end();) {
      auto hn = std::next(h);
      if (h->conn == &c) {
        if (h->sending) {
          h->orphan = true;
          sending = true;
          h->conn = nullptr;
        } else {
          EndLocked(h, true, "consumer gone");
        }
      }
      h = hn;
    }
    if (c.failed) {
      log_->info("stream server {}: consumer {} disconnected ({}){}", address_, c.peer,
                 ucs_status_string(c.failure), sending ? "" : "; its holds were released");
    }
    CloseEndpoint(*ucx_, c.ep, true, Clock::now() + std::chrono::seconds(2));
    it = conns_.erase(it);
  }
  for (auto it = outgoing_.begin(); it != outgoing_.end();) {
    Outgoing& o = *it;
    if (o.request != nullptr && !UCS_PTR_IS_ERR(o.request)) {
      if (ucp_request_check_status(o.request) == UCS_INPROGRESS) {
        ++it;
        continue;
      }
      ucp_request_free(o.request);
    }
    it = outgoing_.erase(it);
  }
}

void Server::Loop() {
  while (!stop_.load()) {
    for (int i = 0; i < 64 && ucx_->Progress(0); ++i) {
    }
    Tend();
    bool busy = false;
    {
      std::lock_guard lock(mu_);
      for (const Hold& h : holds_) busy = busy || h.sending;
    }
    busy = busy || !outgoing_.empty();
    ucx_->Progress(busy ? 1 : 50);
  }
}

void Server::Teardown() {
  if (!ucx_) return;
  {
    std::lock_guard lock(mu_);
    for (Hold& h : holds_) {
      if (h.send != nullptr && !UCS_PTR_IS_ERR(h.send)) {
        ucp_request_cancel(ucx_->worker(), h.send);
      }
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  for (Conn& c : conns_) CloseEndpoint(*ucx_, c.ep, true, deadline);
  conns_.clear();
  {
    std::lock_guard lock(mu_);
    for (Hold& h : holds_) {
      if (h.send != nullptr && !UCS_PTR_IS_ERR(h.send)) {
        for (int i = 0; i < 200 && ucp_request_check_status(h.send) == UCS_INPROGRESS; ++i)
          ucx_->Progress(1);
        ucp_request_free(h.send);
      }
      h.send = nullptr;
    }
    while (!holds_.empty()) EndLocked(holds_.begin(), true, "producer closed");
  }
  for (Outgoing& o : outgoing_) {
    if (o.request != nullptr && !UCS_PTR_IS_ERR(o.request)) {
      ucp_request_cancel(ucx_->worker(), o.request);
      ucx_->Progress(0);
      ucp_request_free(o.request);
    }
  }
  outgoing_.clear();
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  listener_ = nullptr;
  ucx_.reset();
  local_.reset();
}

Status Server::Start(const StreamServerOptions& options) {
  options_ = options;
  log_ = ResolveLogger(options.logger);
  if (options.token.size() > kStreamMaxTokenBytes) {
    return InvalidArgument("stream listen token of " + std::to_string(options.token.size()) +
                           " bytes; at most " + std::to_string(kStreamMaxTokenBytes));
  }
  if (!(options.lease_seconds > 0)) {
    return InvalidArgument("stream remote lease " + std::to_string(options.lease_seconds) +
                           " s: must be more than 0");
  }
  instance_ = RandomId();
  segment_prefix_ = options.segment_prefix;
  EA_ASSIGN_OR_RETURN(platform::SocketAddress listen, platform::ResolveHostPort(options.listen));
  ConsumerOptions co;
  co.directory = options.directory;
  co.spill_directory = options.spill_directory;
  co.logger = options.logger;
  EA_ASSIGN_OR_RETURN(StreamConsumer local, StreamConsumer::Create(co));
  local_ = std::make_unique<StreamConsumer>(std::move(local));
  EA_ASSIGN_OR_RETURN(ucx_, UcxWorker::Create(/*rma=*/false));

  auto set_handler = [&](uint32_t id, ucp_am_recv_callback_t cb) {
    return ucx_->SetAmHandler(id, this, cb);
  };
  EA_RETURN_IF_ERROR(set_handler(
      kStreamHelloId,
      [](void* arg, const void*, size_t, void* data, size_t length,
         const ucp_am_recv_param_t* param) -> ucs_status_t {
        auto* self = static_cast<Server*>(arg);
        if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
        Conn* c = self->Find(param->reply_ep);
        if (c == nullptr || c->hello) return UCS_OK;
        c->hello = true;
        StreamHello hello{};
        if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length < sizeof hello) return UCS_OK;
        std::memcpy(&hello, data, sizeof hello);
        if (hello.magic != kStreamMagic || hello.version != kStreamVersion ||
            hello.token_bytes > kStreamMaxTokenBytes || hello.token_bytes != length - sizeof hello)
          return UCS_OK;
        std::string token(static_cast<const char*>(data) + sizeof hello, hello.token_bytes);
        c->hello_ok = SameToken(token, self->options_.token);
        return UCS_OK;
      }));
  EA_RETURN_IF_ERROR(set_handler(
      kStreamOpenId,
      [](void* arg, const void*, size_t, void* data, size_t length,
         const ucp_am_recv_param_t* param) -> ucs_status_t {
        auto* self = static_cast<Server*>(arg);
        if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
        if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length < sizeof(StreamOpen))
          return UCS_OK;
        OpenAsk ask;
        ask.ep = param->reply_ep;
        std::memcpy(&ask.open, data, sizeof ask.open);
        if (ask.open.descriptor_bytes > kStreamMaxDescriptorBytes ||
            ask.open.descriptor_bytes != length - sizeof ask.open)
          return UCS_OK;
        ask.descriptor.assign(static_cast<const char*>(data) + sizeof ask.open,
                              ask.open.descriptor_bytes);
        self->opens_.push_back(std::move(ask));
        return UCS_OK;
      }));
  EA_RETURN_IF_ERROR(set_handler(kStreamReleaseId,
                                 [](void* arg, const void*, size_t, void* data, size_t length,
                                    const ucp_am_recv_param_t* param) -> ucs_status_t {
                                   auto* self = static_cast<Server*>(arg);
                                   if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
                                     return UCS_OK;
                                   if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
                                       length != sizeof(StreamRelease))
                                     return UCS_OK;
                                   ReleaseAsk ask;
                                   ask.ep = param->reply_ep;
                                   std::memcpy(&ask.release, data, sizeof ask.release);
                                   self->releases_.push_back(ask);
                                   return UCS_OK;
                                 }));

  ucp_listener_params_t listener{};
  listener.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  listener.sockaddr.addr = listen.get();
  listener.sockaddr.addrlen = listen.length;
  listener.conn_handler.arg = this;
  listener.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
    static_cast<Server*>(arg)->requests_.push_back(request);
  };
  ucs_status_t s = ucp_listener_create(ucx_->worker(), &listener, &listener_);
  if (s != UCS_OK) return UcxStatus(s, "stream listen on " + options.listen);
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = ucp_listener_query(listener_, &attr);
  if (s != UCS_OK) return UcxStatus(s, "ucp_listener_query");
  address_ = platform::AddressText(reinterpret_cast<const sockaddr*>(&attr.sockaddr));
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<StreamServer>> StartUcxStreamServer(const StreamServerOptions& options) {
  auto server = std::make_unique<Server>();
  Status s = server->Start(options);
  if (!s.ok()) return s;
  return std::unique_ptr<StreamServer>(std::move(server));
}

}  // namespace expert_arena::remote
