// The stream server of a listening StreamProducer (stream_remote.h, docs/cross-host.md).
//
// One thread owns the UCX worker (UCS_THREAD_MODE_SINGLE) and the front door (front_door.h):
// a consumer proves the token there before UCX sees a byte of it, then its first active
// message carries the door's ticket; then the thread serves opens. A descriptor is opened here
// as a local one only (its remote fields stripped): the server never connects out to an
// address a peer named. A served open is a
// view of the block through this process's own StreamConsumer (a reader entry of the
// producer's segment, like any local consumer), so the block stays while the remote consumer
// holds it; its bytes go out as one active message (header, then the bytes: UCX picks eager or
// rendezvous), followed by a "done" message once the send completed (a refusal instead when
// the key was aborted meanwhile). The hold ends with the consumer's release (the share is
// spent) or give-back (unspent), when its endpoint fails (consumer died, vanished, closed:
// spent, as a dead local reader's share is) or when the lease passes, counted from the start of
// the send: a consumer that stops reading mid-transfer is disconnected then, its hold spent.
// Other threads only call Aborted() and Holds(), under `mu`.
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
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
#include "common/fast_xxh3.h"
#include "platform/file.h"
#include "platform/net.h"
#include "stream/stream_remote.h"
#include "remote/stream_wire.h"
#include "remote/ucx_worker.h"

namespace expert_arena::remote {
namespace {

using Clock = std::chrono::steady_clock;

struct Conn {
  ucp_ep_h ep = nullptr;        // ours, to the worker address the front door took
  ucp_ep_h reply_ep = nullptr;  // what its messages arrive on
  DoorTicket ticket{};
  std::string host;
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
  uint64_t batch = 0;  // a kStreamOpenManyId message's (Batch::id), 0 for a single open
};

// A batch of opens from one message: answered with one StreamDoneMany once every data send of
// it completed (StreamDone per request instead when a key was aborted meanwhile).
struct Batch {
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  uint64_t first_request = 0;
  uint32_t count = 0;
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
  uint64_t batch = 0;  // OpenAsk::batch
  std::unique_ptr<StreamTensor> tensor;
  StreamData header{};
  ucs_status_ptr_t send = nullptr;
  // A block sent in chunks (the open asked for them and the block is over kStreamChunkBytes):
  // their headers, alive until the sends complete, and the sends started so far (at most
  // kChunksInFlight unfinished), each chunk hashed just before it goes.
  std::vector<StreamChunk> chunks;
  std::vector<ucs_status_ptr_t> chunk_sends;
  ucs_status_t chunk_failure = UCS_OK;
  bool sending = false;
  bool served = false;   // "done" sent: the lease runs
  bool aborted = false;  // the key was aborted while its bytes were sent
  bool orphan = false;   // its connection failed while sending: end once the send is over
  bool lease_out = false;  // the lease passed mid-send: spent once the send is over
  Clock::time_point send_started;
  Clock::time_point served_at;
};

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

  DoorCounters counters() override {
    std::lock_guard lock(mu_);
    return counters_;
  }

  Status Start(const StreamServerOptions& options);

 private:
  void Loop();
  void Tend();
  Result<std::span<const std::byte>> Admit(const DoorAdmission& a);
  Conn* Find(ucp_ep_h ep) {
    for (Conn& c : conns_)
      if (c.hello && (c.ep == ep || c.reply_ep == ep) && !c.closing) return &c;
    return nullptr;
  }
  void Send(Conn& c, uint32_t id, std::vector<std::byte> header, std::vector<std::byte> body);
  void Refuse(Conn& c, uint64_t request, const std::string& why);
  void SendDone(Conn& c, const Hold& h);
  void Serve(OpenAsk& ask);
  void AnswerBatchesLocked();
  void EndLocked(std::list<Hold>::iterator it, bool spend, const char* why);
  void EndExpiredLocked();
  void Teardown();
  void PauseForTest();
  void DamageForTest(StreamData& header, std::span<const std::byte>* bytes) const;
  // Reaps `h`'s finished chunk sends and starts the next chunks (while its connection stands),
  // then: UCS_INPROGRESS while a chunk is left or in flight, else UCS_OK or why a send failed.
  ucs_status_t TendChunks(Hold& h);
  void DamageChunkForTest(StreamChunk& header, std::span<const std::byte>* bytes) const;
  // Every send of `h` cancelled (teardown), then waited for and freed.
  void CancelSends(Hold& h);
  void FreeSends(Hold& h);

  StreamServerOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  std::string address_;
  uint64_t instance_ = 0;
  std::string segment_prefix_;
  std::unique_ptr<StreamConsumer> local_;
  std::unique_ptr<UcxWorker> ucx_;
  std::unique_ptr<FrontDoorServer> door_;
  std::vector<std::byte> worker_address_;
  DoorCounters dropped_;  // admitted consumers dropped (thread only)
  std::thread thread_;
  std::atomic<bool> stop_{false};
  // Filled by UCX callbacks (on the thread), consumed by Tend (on the thread).
  std::vector<OpenAsk> opens_;
  std::vector<ReleaseAsk> releases_;
  std::list<Batch> batches_;  // in the order of their ids
  uint64_t next_batch_ = 0;
  uint64_t served_batches_ = 0;  // every batch up to this id had its opens served
  std::list<Conn> conns_;
  std::list<Outgoing> outgoing_;
  std::mutex mu_;  // holds_
  std::list<Hold> holds_;
  std::deque<std::string> aborted_keys_;
  uint64_t next_hold_ = 0;
  DoorCounters counters_;  // a copy of the door's and dropped_, for counters()
  std::string damage_;     // test only: EXPERT_ARENA_TEST_STREAM_DAMAGE
  bool no_features_ = false;  // test only: EXPERT_ARENA_TEST_STREAM_NO_FEATURES (an older server)
};

// Chunks of one block in flight at once (Hold::chunks).
constexpr size_t kChunksInFlight = 2;

// Bounds of admitted consumers, in all and per address (the front door bounds handshakes).
constexpr size_t kMaxConsumers = 256;
constexpr size_t kMaxConsumersPerHost = 64;

Result<std::span<const std::byte>> Server::Admit(const DoorAdmission& a) {
  size_t all = 0;
  size_t of_host = 0;
  for (const Conn& c : conns_) {
    if (c.closing || c.failed) continue;
    ++all;
    of_host += c.host == a.peer_host ? 1 : 0;
  }
  if (all >= kMaxConsumers || of_host >= kMaxConsumersPerHost) {
    return Busy(std::to_string(all) + " consumers connected (" + std::to_string(of_host) +
                " of this address)");
  }
  Conn& c = conns_.emplace_back();
  c.peer = a.peer;
  c.host = a.peer_host;
  c.ticket = a.ticket;
  c.since = Clock::now();
  Status s = ucx_->ConnectToAddress(a.worker_address, RecordFailureIn(&c), &c.ep,
                                    "endpoint to consumer " + a.peer);
  if (!s.ok()) {
    conns_.pop_back();
    return s;
  }
  return std::span<const std::byte>(worker_address_);
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
  std::vector<std::byte> out(sizeof v + text.size());
  auto* p = reinterpret_cast<char*>(out.data());
  const auto* head = reinterpret_cast<const char*>(&v);
  // Byte by byte, not memcpy or insert: g++ 12 at -O3 drew a bogus -Warray-bounds from both.
  for (size_t i = 0; i < sizeof v; ++i) p[i] = head[i];
  for (size_t i = 0; i < text.size(); ++i) p[sizeof v + i] = text[i];
  return out;
}

// A hold's "done", once its data send completed: ok, or refused when its key was aborted
// meanwhile.
void Server::SendDone(Conn& c, const Hold& h) {
  StreamDone done{h.request, static_cast<uint32_t>(StreamStatus::kOk), 0};
  std::string text;
  if (h.aborted) {
    text = "key " + QuoteForMessage(h.key) + " was aborted by the producer during the transfer";
    done.status = static_cast<uint32_t>(StreamStatus::kRefused);
    done.text_bytes = static_cast<uint32_t>(text.size());
  }
  Send(c, kStreamDoneId, {}, Bytes(done, text));
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
  if (!options_.token.empty() && !TensorDescriptor::MacMatches(ask.descriptor, options_.token)) {
    return Refuse(*c, request,
                  "the descriptor's MAC does not hold for this producer's token (rewritten on "
                  "its way, or made by another producer)");
  }
  if (d->remote != address_) {
    return Refuse(*c, request,
                  "the descriptor names producer " + QuoteForMessage(d->remote) + ", not " +
                      address_);
  }
  // Opened as a local descriptor only: whatever remote fields a peer wrote, this process
  // never connects out to an address it named.
  TensorDescriptor local = *d;
  local.remote.clear();
  local.producer_instance = 0;
  local.boot_id.clear();
  local.mac.clear();
  auto tensor = local_->Open(local.Encode());
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
  h.batch = ask.batch;
  h.tensor = std::make_unique<StreamTensor>(std::move(tensor).value());
  auto bytes = h.tensor->bytes();
  h.header.request = request;
  h.header.status = static_cast<uint32_t>(StreamStatus::kOk);
  h.header.hold = h.id;
  h.header.length = bytes.size();
  if ((ask.open.flags & kStreamOpenChunks) != 0 && bytes.size() > kStreamChunkBytes) {
    const uint64_t n = (bytes.size() + kStreamChunkBytes - 1) / kStreamChunkBytes;
    h.chunks.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t offset = i * kStreamChunkBytes;
      h.chunks[i] = {request,      h.id, bytes.size(), offset,
                     std::min<uint64_t>(kStreamChunkBytes, bytes.size() - offset),
                     kStreamChunkBytes, 0};
    }
    h.chunk_sends.reserve(n);
    h.sending = true;
    h.send_started = Clock::now();
    (void)TendChunks(h);  // the first goes now
    return;
  }
  h.header.xxh3 = FastXxh3(bytes.data(), bytes.size());
  if (!damage_.empty()) DamageForTest(h.header, &bytes);
  // A small block goes eager: rendezvous costs a round trip per block before its bytes move,
  // a 64 KiB block's round took 1.14x as long with it (xstream_bench, docs/cross-host.md).
  ucp_request_param_t param{};
  if (bytes.size() <= kStreamEagerMaxBytes) {
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
  }
  h.send = ucp_am_send_nbx(c->ep, kStreamDataId, &h.header, sizeof h.header, bytes.data(),
                           bytes.size(), &param);
  h.sending = true;
  h.send_started = Clock::now();
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

// Test only: EXPERT_ARENA_TEST_STREAM_DAMAGE makes this a producer that lies about every block
// it sends: "xxh3" (a hash the bytes do not have), "short" (one byte fewer than the block),
// "long" (a header that claims one byte more).
void Server::DamageForTest(StreamData& header, std::span<const std::byte>* bytes) const {
  if (damage_ == "xxh3") header.xxh3 ^= 1;
  if (damage_ == "short" && !bytes->empty()) *bytes = bytes->first(bytes->size() - 1);
  if (damage_ == "long") ++header.length;
}

ucs_status_t Server::TendChunks(Hold& h) {
  size_t in_flight = 0;
  for (ucs_status_ptr_t& send : h.chunk_sends) {
    if (send == nullptr) continue;
    ucs_status_t s = UCS_PTR_IS_ERR(send) ? UCS_PTR_STATUS(send) : ucp_request_check_status(send);
    if (s == UCS_INPROGRESS) {
      ++in_flight;
      continue;
    }
    if (!UCS_PTR_IS_ERR(send)) ucp_request_free(send);
    send = nullptr;
    if (s != UCS_OK && h.chunk_failure == UCS_OK) h.chunk_failure = s;
  }
  const bool can_send = h.conn != nullptr && !h.conn->closing && !h.conn->failed && !h.orphan &&
                        !h.lease_out && h.chunk_failure == UCS_OK;
  // A few in flight: the next is hashed while the ones before it cross.
  while (can_send && in_flight < kChunksInFlight && h.chunk_sends.size() < h.chunks.size()) {
    StreamChunk& header = h.chunks[h.chunk_sends.size()];
    auto bytes = h.tensor->bytes().subspan(header.offset, header.length);
    header.xxh3 = FastXxh3(bytes.data(), bytes.size());
    if (!damage_.empty()) DamageChunkForTest(header, &bytes);
    ucp_request_param_t param{};
    ucs_status_ptr_t send = ucp_am_send_nbx(h.conn->ep, kStreamChunkId, &header, sizeof header,
                                            bytes.data(), bytes.size(), &param);
    h.chunk_sends.push_back(send);
    if (UCS_PTR_IS_ERR(send)) {
      h.chunk_failure = UCS_PTR_STATUS(send);
      h.chunk_sends.back() = nullptr;
      break;
    }
    if (send != nullptr) ++in_flight;
  }
  if (in_flight > 0) return UCS_INPROGRESS;
  if (h.chunk_failure != UCS_OK) return h.chunk_failure;
  if (h.chunk_sends.size() == h.chunks.size()) return UCS_OK;
  // Chunks left: they go while the connection stands, and none will once it does not.
  return can_send ? UCS_INPROGRESS : UCS_ERR_CANCELED;
}

void Server::CancelSends(Hold& h) {
  if (h.send != nullptr && !UCS_PTR_IS_ERR(h.send)) ucp_request_cancel(ucx_->worker(), h.send);
  for (ucs_status_ptr_t send : h.chunk_sends)
    if (send != nullptr && !UCS_PTR_IS_ERR(send)) ucp_request_cancel(ucx_->worker(), send);
}

void Server::FreeSends(Hold& h) {
  h.chunk_sends.push_back(h.send);
  h.send = nullptr;
  for (ucs_status_ptr_t& send : h.chunk_sends) {
    if (send != nullptr && !UCS_PTR_IS_ERR(send)) {
      for (int i = 0; i < 200 && ucp_request_check_status(send) == UCS_INPROGRESS; ++i)
        ucx_->Progress(1);
      ucp_request_free(send);
    }
    send = nullptr;
  }
  h.chunk_sends.clear();
}

// Test only, for chunks: "xxh3" (the first chunk's hash wrong), "short" (the last chunk one
// byte short of its header), "long" (headers that claim a block one byte longer), "twice" (the
// second chunk sent as the first one again: its offset).
void Server::DamageChunkForTest(StreamChunk& header, std::span<const std::byte>* bytes) const {
  if (damage_ == "xxh3" && header.offset == 0) header.xxh3 ^= 1;
  if (damage_ == "short" && header.offset + header.length == header.total)
    *bytes = bytes->first(bytes->size() - 1);
  if (damage_ == "long") ++header.total;
  if (damage_ == "twice" && header.offset == header.chunk_bytes) header.offset = 0;
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

// A batch whose data sends all completed gets its answer: one StreamDoneMany, or, when a key
// of it was aborted during the transfer, one StreamDone per hold (refused for the aborted ones)
// as for single opens, so the consumer never takes an aborted key's bytes as done. A batch
// whose connection is going is dropped (its holds end as single opens' do then). A batch whose
// opens are not all served yet (it arrived during this Tend) waits.
void Server::AnswerBatchesLocked() {
  for (auto b = batches_.begin(); b != batches_.end();) {
    if (b->id > served_batches_) break;
    Conn* c = Find(b->ep);
    if (c == nullptr) {
      for (Hold& h : holds_)
        if (h.batch == b->id) h.batch = 0;
      b = batches_.erase(b);
      continue;
    }
    bool sending = false;
    bool aborted = false;
    for (const Hold& h : holds_) {
      if (h.batch != b->id) continue;
      sending = sending || h.sending;
      aborted = aborted || h.aborted;
    }
    if (sending) {
      ++b;
      continue;
    }
    for (auto it = holds_.begin(); it != holds_.end();) {
      auto next = std::next(it);
      Hold& h = *it;
      if (h.batch != b->id) {
        it = next;
        continue;
      }
      h.batch = 0;
      if (aborted) {
        SendDone(*c, h);
      }
      if (h.aborted) {
        EndLocked(it, true, "aborted");
      } else {
        h.served = true;
        h.served_at = Clock::now();
      }
      it = next;
    }
    if (!aborted) {
      StreamDoneMany done{b->first_request, b->count, static_cast<uint32_t>(StreamStatus::kOk)};
      Send(*c, kStreamDoneManyId, {}, Bytes(done));
    }
    b = batches_.erase(b);
  }
}

void Server::Tend() {
  const auto now = Clock::now();
  for (Conn& c : conns_) {
    if (c.failed || c.closing || !c.hello || c.welcomed) continue;
    StreamWelcome w{kStreamMagic, kStreamVersion,
                    static_cast<uint32_t>(c.hello_ok ? StreamStatus::kOk : StreamStatus::kRefused),
                    instance_};
    std::string text;
    if (!c.hello_ok) {
      text = "bad hello (another version of expert-arena?)";
      log_->warn("stream server {}: consumer {} refused: {}", address_, c.peer, text);
    }
    std::vector<std::byte> body = Bytes(w, text);
    if (c.hello_ok && !no_features_) {
      const uint32_t features = kStreamFeatureOpenMany | kStreamFeatureChunks;
      const size_t at = body.size();
      body.resize(at + sizeof features);  // (not insert(): a bogus -Warray-bounds from g++ 12)
      std::memcpy(body.data() + at, &features, sizeof features);
    }
    Send(c, kStreamWelcomeId, {}, std::move(body));
    c.welcomed = true;
  }
  std::vector<OpenAsk> opens;
  opens.swap(opens_);
  for (OpenAsk& ask : opens) {
    Serve(ask);
    served_batches_ = std::max(served_batches_, ask.batch);
  }
  if (!opens.empty()) PauseForTest();
  std::lock_guard lock(mu_);
  for (const ReleaseAsk& r : releases_) {
    for (auto it = holds_.begin(); it != holds_.end(); ++it) {
      if (it->id == r.release.hold && it->conn != nullptr &&
          (it->conn->ep == r.ep || it->conn->reply_ep == r.ep) && it->served) {
        EndLocked(it, r.release.spend != 0, r.release.spend != 0 ? "released" : "given back");
        break;
      }
    }
  }
  releases_.clear();
  for (auto it = holds_.begin(); it != holds_.end();) {
    auto next = std::next(it);
    Hold& h = *it;
    if (h.sending && !h.lease_out && h.conn != nullptr &&
        now - h.send_started > std::chrono::duration<double>(options_.lease_seconds)) {
      // A consumer that stopped reading (stopped, or reading one byte a second) holds the
      // block no longer than the lease: its connection goes (closed by force below, which
      // fails the send), and the hold is spent once UCX let go of the bytes.
      log_->warn("stream server {}: consumer {} did not take key {} within the lease ({} s); "
                 "disconnected",
                 address_, h.conn->peer, QuoteForMessage(h.key), options_.lease_seconds);
      h.lease_out = true;
      h.conn->closing = true;
      ++dropped_.timed_out;
    }
    if (h.sending) {
      ucs_status_t s = UCS_OK;
      if (!h.chunks.empty()) {
        s = TendChunks(h);
        if (s == UCS_INPROGRESS) {
          it = next;
          continue;
        }
      } else if (UCS_PTR_IS_ERR(h.send)) {
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
      if (h.lease_out) {
        EndLocked(it, true, "lease ran out mid-transfer");
        it = next;
        continue;
      }
      if (h.orphan || s != UCS_OK) {
        EndLocked(it, false, "send failed");
        it = next;
        continue;
      }
      if (h.batch != 0) {  // answered with its batch, below
        it = next;
        continue;
      }
      SendDone(*h.conn, h);
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
  AnswerBatchesLocked();
  EndExpiredLocked();
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn& c = *it;
    bool idle_too_long = !c.hello && std::chrono::duration<double>(now - c.since).count() > 10;
    if (idle_too_long && !c.closing && !c.failed) ++dropped_.timed_out;
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
    for (auto b = batches_.begin(); b != batches_.end();) {
      if (b->ep != c.ep && b->ep != c.reply_ep) {
        ++b;
        continue;
      }
      for (Hold& h : holds_)
        if (h.batch == b->id) h.batch = 0;
      b = batches_.erase(b);
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
  const FrontDoorServer::AdmitFn admit = [this](const DoorAdmission& a) { return Admit(a); };
  while (!stop_.load()) {
    for (int i = 0; i < 64 && ucx_->Progress(0); ++i) {
    }
    door_->Step(admit);
    Tend();
    {
      std::lock_guard lock(mu_);
      counters_ = door_->counters();
      counters_.timed_out += dropped_.timed_out;
      counters_.dropped += dropped_.dropped;
    }
    bool busy = false;
    {
      std::lock_guard lock(mu_);
      for (const Hold& h : holds_) busy = busy || h.sending;
    }
    busy = busy || !outgoing_.empty();
    if (ucx_->Arm()) door_->Wait(ucx_->event_fd(), busy ? 1 : 50);
    ucx_->Progress(0);
  }
}

void Server::Teardown() {
  if (!ucx_) return;
  {
    std::lock_guard lock(mu_);
    for (Hold& h : holds_) CancelSends(h);
  }
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  for (Conn& c : conns_) CloseEndpoint(*ucx_, c.ep, true, deadline);
  conns_.clear();
  {
    std::lock_guard lock(mu_);
    for (Hold& h : holds_) FreeSends(h);
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
  door_.reset();
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
  instance_ = options.instance_id != 0 ? options.instance_id : RandomId();
  if (const char* damage = std::getenv("EXPERT_ARENA_TEST_STREAM_DAMAGE")) damage_ = damage;
  no_features_ = std::getenv("EXPERT_ARENA_TEST_STREAM_NO_FEATURES") != nullptr;
  segment_prefix_ = options.segment_prefix;
  EA_ASSIGN_OR_RETURN(platform::SocketAddress listen, platform::ResolveHostPort(options.listen));
  ConsumerOptions co;
  co.directory = options.directory;
  co.spill_directory = options.spill_directory;
  co.logger = options.logger;
  EA_ASSIGN_OR_RETURN(StreamConsumer local, StreamConsumer::Create(co));
  local_ = std::make_unique<StreamConsumer>(std::move(local));
  // UCX's network transports only on the listen address' interface (docs/cross-host.md).
  EA_ASSIGN_OR_RETURN(ucx_, UcxWorker::Create(/*rma=*/false, platform::InterfaceOf(listen)));

  auto set_handler = [&](uint32_t id, ucp_am_recv_callback_t cb) {
    return ucx_->SetAmHandler(id, this, cb);
  };
  EA_RETURN_IF_ERROR(set_handler(
      kStreamHelloId,
      [](void* arg, const void*, size_t, void* data, size_t length,
         const ucp_am_recv_param_t* param) -> ucs_status_t {
        auto* self = static_cast<Server*>(arg);
        if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
        StreamHello hello{};
        if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length != sizeof hello)
          return UCS_OK;
        std::memcpy(&hello, data, sizeof hello);
        // The ticket names the admission (one use); an unknown one is ignored.
        for (Conn& c : self->conns_) {
          if (c.hello || c.closing || !SameSecret(c.ticket, hello.ticket)) continue;
          c.hello = true;
          c.reply_ep = param->reply_ep;
          c.hello_ok = hello.magic == kStreamMagic && hello.version == kStreamVersion;
          break;
        }
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
  // (An older server, for tests, has no handler: a batch sent to it anyway would go unanswered.)
  if (!no_features_) EA_RETURN_IF_ERROR(set_handler(
      kStreamOpenManyId,
      [](void* arg, const void*, size_t, void* data, size_t length,
         const ucp_am_recv_param_t* param) -> ucs_status_t {
        auto* self = static_cast<Server*>(arg);
        if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
        if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;
        std::vector<StreamOpenRecord> records;
        if (!ParseOpenMany(std::span(static_cast<const std::byte*>(data), length), &records))
          return UCS_OK;  // malformed: dropped whole, as a malformed single open is
        Batch& b = self->batches_.emplace_back();
        b.id = ++self->next_batch_;
        b.ep = param->reply_ep;
        b.first_request = records.front().open.request;
        b.count = static_cast<uint32_t>(records.size());
        for (const StreamOpenRecord& r : records) {
          OpenAsk& ask = self->opens_.emplace_back();
          ask.ep = param->reply_ep;
          ask.open = r.open;
          ask.descriptor.assign(r.descriptor);
          ask.batch = b.id;
        }
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

  EA_ASSIGN_OR_RETURN(worker_address_, ucx_->Address());
  FrontDoorLimits limits;
  EA_ASSIGN_OR_RETURN(door_, FrontDoorServer::Listen(listen, options.token, DoorService::kStream,
                                                     limits, "stream server", log_));
  address_ = door_->address();
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
