// A consumer's connection to a producer's stream server (stream_remote.h, docs/cross-host.md).
// One UCX worker per connection, progressed only inside the calls below (under `mu`): an open
// (or a batch of them, all requests in flight at once) sends the descriptor, then receives the
// bytes straight into the caller's buffer (eager: a copy in the callback; rendezvous:
// ucp_am_recv_data_nbx into it; a block over 4 MiB in chunks, each at its offset), checks their
// xxh3 (each chunk's as it lands), and waits for the producer's "done". Every wait is bounded
// by the timeout, and the endpoint's peer error handling (with UCX keepalive) ends it sooner
// when the producer dies or vanishes; a failed transfer closes the endpoint before the buffer
// is handed back, so nothing lands in it afterwards.
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "common/logging.h"
#include "common/fast_xxh3.h"
#include "platform/net.h"
#include "remote/front_door.h"
#include "stream/stream_remote.h"
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
  bool hashed = false;  // `hash` is the xxh3 of the bytes landed (taken while they are hot)
  uint64_t hash = 0;
  bool done = false;
  StreamDone done_msg{};
  std::string done_text;
  // Sent in chunks (kStreamChunkId): each received, hashed and checked on its own.
  struct Chunk {
    bool seen = false;
    void* rndv = nullptr;
    ucs_status_ptr_t receive = nullptr;
    uint64_t xxh3 = 0;
  };
  std::vector<Chunk> chunks;
  StreamChunk first_chunk{};  // the chunk size and hold every later chunk must have
  size_t chunks_landed = 0;
  bool chunk_damaged = false;  // a chunk's bytes did not match its xxh3
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
  std::vector<Result<uint64_t>> FetchMany(std::span<const std::string_view> descriptors,
                                          uint64_t instance_id,
                                          std::span<const std::span<std::byte>> into) override;

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
  // After a failed or stalled transfer: the endpoint goes, so nothing lands in the buffers.
  void Abandon() {
    for (auto& [id, f] : fetching_) {
      if (f->receive != nullptr && !UCS_PTR_IS_ERR(f->receive))
        ucp_request_cancel(ucx_->worker(), f->receive);
      for (Fetching::Chunk& c : f->chunks)
        if (c.receive != nullptr && !UCS_PTR_IS_ERR(c.receive))
          ucp_request_cancel(ucx_->worker(), c.receive);
    }
    CloseEndpoint(*ucx_, ep_, true, Clock::now() + std::chrono::seconds(2));
    ep_ = nullptr;
    for (auto& [id, f] : fetching_) {
      if (f->receive != nullptr && !UCS_PTR_IS_ERR(f->receive)) {
        for (int i = 0; i < 200 && ucp_request_check_status(f->receive) == UCS_INPROGRESS; ++i)
          ucx_->Progress(1);
        ucp_request_free(f->receive);
      }
      f->receive = nullptr;
      if (f->rndv != nullptr) ucp_am_data_release(ucx_->worker(), f->rndv);
      f->rndv = nullptr;
      for (Fetching::Chunk& c : f->chunks) {
        if (c.receive != nullptr && !UCS_PTR_IS_ERR(c.receive)) {
          for (int i = 0; i < 200 && ucp_request_check_status(c.receive) == UCS_INPROGRESS; ++i)
            ucx_->Progress(1);
          ucp_request_free(c.receive);
        }
        c.receive = nullptr;
        if (c.rndv != nullptr) ucp_am_data_release(ucx_->worker(), c.rndv);
        c.rndv = nullptr;
      }
    }
    if (!failed_) failure_ = UCS_ERR_CANCELED;
    failed_ = true;
  }

  ucs_status_t OnChunk(const StreamChunk& h, void* data, size_t length, bool rndv);
  // Starts the receive of `f`'s chunks that arrived by rendezvous and checks those that landed:
  // false when a receive failed.
  bool TendChunks(Fetching& f, bool* busy);
  // Chunk i of `f` is in its memory: checked against its xxh3 (while the bytes are hot).
  void ChunkLanded(Fetching& f, size_t i);

  Fetching* FindFetching(uint64_t request) {
    auto it = fetching_.find(request);
    return it == fetching_.end() ? nullptr : it->second;
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
  uint32_t features_ = 0;  // kStreamFeature*, from the welcome
  std::string welcome_text_;
  uint64_t next_request_ = 0;
  std::map<uint64_t, Fetching*> fetching_;  // the opens in flight, by request id
};

Status Peer::Connect(const StreamPeerOptions& options) {
  options_ = options;
  log_ = ResolveLogger(options.logger);
  const std::string& peer = options.address;
  if (options.token.size() > kStreamMaxTokenBytes) {
    return InvalidArgument("stream remote token of " + std::to_string(options.token.size()) +
                           " bytes; at most " + std::to_string(kStreamMaxTokenBytes));
  }
  EA_RETURN_IF_ERROR(RequireDoorToken(options.token, options.allow_no_token,
                                      "the stream producer at " + peer,
                                      "the consumer's remote_token", "remote_allow_no_token"));
  EA_ASSIGN_OR_RETURN(platform::SocketAddress address, platform::ResolveHostPort(peer));
  EA_ASSIGN_OR_RETURN(ucx_, UcxWorker::Create(/*rma=*/false));
  auto set_handler = [&](uint32_t id, ucp_am_recv_callback_t cb) {
    return ucx_->SetAmHandler(id, this, cb);
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
        const char* rest = static_cast<const char*>(data) + sizeof(StreamWelcome);
        const size_t rest_bytes = length - sizeof(StreamWelcome);
        if (self->welcome_.status == static_cast<uint32_t>(StreamStatus::kOk)) {
          // What the producer takes beyond version 2's messages (absent from older ones).
          if (rest_bytes >= sizeof self->features_)
            std::memcpy(&self->features_, rest, sizeof self->features_);
        } else {
          self->welcome_text_ = Printable(rest, rest_bytes);
        }
        return UCS_OK;
      }));
  EA_RETURN_IF_ERROR(
      set_handler(kStreamDataId,
                  [](void* arg, const void* header, size_t header_length, void* data, size_t length,
                     const ucp_am_recv_param_t* param) -> ucs_status_t {
                    auto* self = static_cast<Peer*>(arg);
                    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
                    if (header_length != sizeof(StreamData)) return UCS_OK;
                    StreamData h{};
                    std::memcpy(&h, header, sizeof h);
                    Fetching* f = self->FindFetching(h.request);
                    if (f == nullptr || f->header) return UCS_OK;
                    f->header = true;
                    f->data = h;
                    if (h.status != static_cast<uint32_t>(StreamStatus::kOk)) {
                      f->refusal = rndv ? "refused (text not received)" : Printable(data, length);
                      return UCS_OK;
                    }
                    if (h.length != f->into.size() || length != f->into.size()) {
                      f->refusal = "the producer sent " + std::to_string(length) +
                                   " bytes (its header says " + std::to_string(h.length) +
                                   ") for a block of " + std::to_string(f->into.size());
                      return UCS_OK;
                    }
                    if (rndv) {
                      f->rndv = data;
                      return UCS_INPROGRESS;  // received in Fetch with ucp_am_recv_data_nbx
                    }
                    if (length > 0) std::memcpy(f->into.data(), data, length);
                    f->hash = FastXxh3(f->into.data(), f->into.size());
                    f->hashed = true;
                    f->landed = true;
                    return UCS_OK;
                  }));
  EA_RETURN_IF_ERROR(
      set_handler(kStreamDoneId,
                  [](void* arg, const void*, size_t, void* data, size_t length,
                     const ucp_am_recv_param_t* param) -> ucs_status_t {
                    auto* self = static_cast<Peer*>(arg);
                    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
                        length < sizeof(StreamDone))
                      return UCS_OK;
                    StreamDone d{};
                    std::memcpy(&d, data, sizeof d);
                    Fetching* f = self->FindFetching(d.request);
                    if (f == nullptr || f->done) return UCS_OK;
                    f->done = true;
                    f->done_msg = d;
                    f->done_text = Printable(static_cast<const char*>(data) + sizeof d,
                                             std::min<size_t>(d.text_bytes, length - sizeof d));
                    return UCS_OK;
                  }));
  EA_RETURN_IF_ERROR(
      set_handler(kStreamDoneManyId,
                  [](void* arg, const void*, size_t, void* data, size_t length,
                     const ucp_am_recv_param_t* param) -> ucs_status_t {
                    auto* self = static_cast<Peer*>(arg);
                    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
                        length != sizeof(StreamDoneMany))
                      return UCS_OK;
                    StreamDoneMany d{};
                    std::memcpy(&d, data, sizeof d);
                    if (d.status != static_cast<uint32_t>(StreamStatus::kOk) ||
                        d.count > self->fetching_.size())
                      return UCS_OK;
                    for (uint32_t i = 0; i < d.count; ++i) {
                      Fetching* f = self->FindFetching(d.first_request + i);
                      if (f == nullptr || f->done) continue;
                      f->done = true;
                      f->done_msg = StreamDone{f->request, d.status, 0};
                    }
                    return UCS_OK;
                  }));

  EA_RETURN_IF_ERROR(
      set_handler(kStreamChunkId,
                  [](void* arg, const void* header, size_t header_length, void* data, size_t length,
                     const ucp_am_recv_param_t* param) -> ucs_status_t {
                    if (header_length != sizeof(StreamChunk)) return UCS_OK;
                    StreamChunk h{};
                    std::memcpy(&h, header, sizeof h);
                    return static_cast<Peer*>(arg)->OnChunk(
                        h, data, length, (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
                  }));

  // The front door first (plain TCP, bounded): the token is proved, never sent, and only then
  // are UCX worker addresses exchanged. A silent producer fails here, before UCX has anything
  // pending.
  EA_ASSIGN_OR_RETURN(std::vector<std::byte> own_address, ucx_->Address());
  auto entry = FrontDoorConnect(address, options.token, DoorService::kStream, own_address,
                                options.timeout_seconds, "the stream producer at " + peer);
  if (!entry.ok()) {
    const StatusCode code = entry.status().code();
    if (code == StatusCode::kPermission || code == StatusCode::kBusy ||
        code == StatusCode::kTimedOut || code == StatusCode::kUnsupported ||
        code == StatusCode::kCorrupt) {
      return entry.status();
    }
    return Status(StatusCode::kIoError,
                  "cannot reach the stream producer at " + peer + " (" + entry.status().message() +
                      "): it exited, or does not listen there (a descriptor of a dead producer)");
  }
  EA_RETURN_IF_ERROR(ucx_->ConnectToAddress(
      entry->worker_address, RecordFailureIn<Peer, &Peer::failed_, &Peer::failure_>(this), &ep_,
      "connect to stream producer " + peer));

  StreamHello hello{kStreamMagic, kStreamVersion, 0, {}};
  std::memcpy(hello.ticket, entry->ticket.data(), sizeof hello.ticket);
  ucp_request_param_t send{};
  send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  send.flags = UCP_AM_SEND_FLAG_REPLY;
  const auto deadline = Clock::now() + Seconds(options.timeout_seconds);
  Status sent = ucx_->Wait(
      ucp_am_send_nbx(ep_, kStreamHelloId, nullptr, 0, &hello, sizeof hello, &send), deadline,
      "hello to stream producer " + peer);
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
  // Test only: a consumer of an earlier release, which takes no feature of the producer's.
  if (std::getenv("EXPERT_ARENA_TEST_STREAM_NO_FEATURES") != nullptr) features_ = 0;
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
  std::string_view one[] = {descriptor};
  std::span<std::byte> where[] = {into};
  return std::move(FetchMany(one, instance_id, where)[0]);
}

// A chunk of an open that asked for them, checked against the block it is part of: a chunk
// that does not fit the block (another length, an offset off the grid, another chunk size or
// hold than the chunks before it, a chunk sent twice) refuses the open by name, and the
// connection is not trusted further.
ucs_status_t Peer::OnChunk(const StreamChunk& h, void* data, size_t length, bool rndv) {
  Fetching* f = FindFetching(h.request);
  if (f == nullptr || !f->refusal.empty()) return UCS_OK;
  const uint64_t total = f->into.size();
  auto n = [](uint64_t v) { return std::to_string(v); };
  std::string wrong;
  if ((features_ & kStreamFeatureChunks) == 0 || (f->header && f->chunks.empty())) {
    wrong = "the producer sent a chunk for an open that did not ask for chunks or was answered";
  } else if (h.total != total) {
    wrong = "the producer sent a chunk of a block of " + n(h.total) + " bytes for a block of " +
            n(total);
  } else if (!ChunkFits(h, total, f->chunks.empty() ? nullptr : &f->first_chunk)) {
    wrong = "the producer sent a chunk of " + n(h.length) + " bytes at offset " + n(h.offset) +
            " (chunks of " + n(h.chunk_bytes) + ") that does not fit a block of " + n(total);
  } else if (length != h.length) {
    wrong = "the producer sent " + n(length) + " bytes (its header says " + n(h.length) +
            ") for the chunk at offset " + n(h.offset) + " of a block of " + n(total);
  }
  if (wrong.empty() && f->chunks.empty()) {
    f->header = true;
    f->data = StreamData{h.request, static_cast<uint32_t>(StreamStatus::kOk), 0, h.hold, total, 0};
    f->first_chunk = h;
    f->chunks.resize((total + h.chunk_bytes - 1) / h.chunk_bytes);
  }
  Fetching::Chunk* c = wrong.empty() ? &f->chunks[h.offset / h.chunk_bytes] : nullptr;
  if (c != nullptr && c->seen) {
    wrong = "the producer sent the chunk at offset " + n(h.offset) + " of a block of " +
            n(total) + " twice";
  }
  if (!wrong.empty()) {
    f->header = true;
    f->data.status = static_cast<uint32_t>(StreamStatus::kOk);  // with a refusal: malformed
    f->refusal = wrong;
    return UCS_OK;
  }
  c->seen = true;
  c->xxh3 = h.xxh3;
  if (rndv) {
    c->rndv = data;
    return UCS_INPROGRESS;  // received in TendChunks with ucp_am_recv_data_nbx
  }
  std::memcpy(f->into.data() + h.offset, data, length);
  ChunkLanded(*f, h.offset / h.chunk_bytes);
  return UCS_OK;
}

// Where chunk i of `f` lands: its part of the block, on the first chunk's grid.
std::span<std::byte> ChunkBytes(const Fetching& f, size_t i) {
  const uint64_t offset = i * f.first_chunk.chunk_bytes;
  return f.into.subspan(offset, std::min<uint64_t>(f.first_chunk.chunk_bytes,
                                                   f.into.size() - offset));
}

void Peer::ChunkLanded(Fetching& f, size_t i) {
  const std::span<std::byte> bytes = ChunkBytes(f, i);
  if (FastXxh3(bytes.data(), bytes.size()) != f.chunks[i].xxh3) f.chunk_damaged = true;
  if (++f.chunks_landed == f.chunks.size()) f.landed = true;
}

bool Peer::TendChunks(Fetching& f, bool* busy) {
  for (size_t i = 0; i < f.chunks.size(); ++i) {
    Fetching::Chunk& c = f.chunks[i];
    if (c.rndv != nullptr && c.receive == nullptr) {
      ucp_request_param_t param{};
      void* desc = c.rndv;
      c.rndv = nullptr;
      const std::span<std::byte> into = ChunkBytes(f, i);
      c.receive = ucp_am_recv_data_nbx(ucx_->worker(), desc, into.data(), into.size(), &param);
      if (UCS_PTR_IS_ERR(c.receive)) {
        c.receive = nullptr;
        return false;
      }
      if (c.receive == nullptr) ChunkLanded(f, i);
    } else if (c.receive != nullptr) {
      *busy = true;
      ucs_status_t s = ucp_request_check_status(c.receive);
      if (s == UCS_INPROGRESS) continue;
      ucp_request_free(c.receive);
      c.receive = nullptr;
      if (s != UCS_OK) return false;
      ChunkLanded(f, i);
    }
  }
  return true;
}

std::vector<Result<uint64_t>> Peer::FetchMany(std::span<const std::string_view> descriptors,
                                              uint64_t instance_id,
                                              std::span<const std::span<std::byte>> into) {
  std::lock_guard lock(mu_);
  const size_t n = descriptors.size();
  const std::string& peer = options_.address;
  std::vector<Result<uint64_t>> out;
  auto all = [&](const Status& s) {
    out.assign(n, Result<uint64_t>(s));
    return std::move(out);
  };
  if (failed_ || !ucx_) return all(Gone("earlier"));
  if (instance_id != welcome_.instance_id) {
    return all(Busy("the descriptor was made by another instance of the stream producer at " +
                    peer + " (it restarted since): stale, refused"));
  }
  for (std::string_view d : descriptors)
    if (d.size() > kStreamMaxDescriptorBytes) return all(InvalidArgument("descriptor too long"));
  std::vector<Fetching> fs(n);
  for (size_t i = 0; i < n; ++i) {
    fs[i].request = ++next_request_;
    fs[i].into = into[i];
    fetching_[fs[i].request] = &fs[i];
  }
  struct Clear {
    std::map<uint64_t, Fetching*>& map;
    ~Clear() { map.clear(); }
  } clear{fetching_};
  const auto deadline = Clock::now() + Seconds(options_.timeout_seconds);
  // Every open goes out before any answer is awaited: one round trip for the batch. A producer
  // that takes batches gets them as few messages (each under kStreamMaxOpenManyBytes) and
  // answers each with one "done"; an older one gets a message per open.
  const bool batches = (features_ & kStreamFeatureOpenMany) != 0;
  std::vector<std::vector<std::byte>> msgs;
  std::vector<uint32_t> counts;  // of each batch message's records
  auto append = [](std::vector<std::byte>& m, const void* p, size_t bytes) {
    const auto* b = static_cast<const std::byte*>(p);
    m.insert(m.end(), b, b + bytes);
  };
  for (size_t i = 0; i < n; ++i) {
    const size_t record = sizeof(StreamOpen) + descriptors[i].size();
    if (!batches || msgs.empty() || msgs.back().size() + record > kStreamMaxOpenManyBytes) {
      msgs.emplace_back();
      counts.push_back(0);
      if (batches) msgs.back().resize(sizeof(StreamOpenMany));  // its head, written below
    }
    // Every open asks for chunks where the producer sends them (it decides by the size).
    StreamOpen open{fs[i].request, instance_id, static_cast<uint32_t>(descriptors[i].size()),
                    (features_ & kStreamFeatureChunks) != 0 ? kStreamOpenChunks : 0};
    append(msgs.back(), &open, sizeof open);
    append(msgs.back(), descriptors[i].data(), descriptors[i].size());
    ++counts.back();
  }
  std::vector<ucs_status_ptr_t> sends(msgs.size(), nullptr);
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (batches) {
      const StreamOpenMany head{counts[i], 0};
      std::memcpy(msgs[i].data(), &head, sizeof head);
    }
    ucp_request_param_t send{};
    send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    send.flags = UCP_AM_SEND_FLAG_REPLY;
    sends[i] = ucp_am_send_nbx(ep_, batches ? kStreamOpenManyId : kStreamOpenId, nullptr, 0,
                               msgs[i].data(), msgs[i].size(), &send);
  }
  Status sent = Status::Ok();
  for (size_t i = 0; i < sends.size(); ++i) {
    Status s = ucx_->Wait(sends[i], deadline, "stream open request to " + peer);
    if (sent.ok() && !s.ok()) sent = s;
  }
  if (!sent.ok()) {
    bool gone = failed_;
    Abandon();
    return all(gone ? Gone("before the open was sent") : sent);
  }
  // The wait polls while messages come (and for kSpin after the last one) rather than sleeping
  // on the event fd between them: a batch of small eager blocks arrives as many messages, and
  // a wake-up per message showed (xstream_bench, 32 x 64 KiB, 2026-12-07: rounds of 1.15-2.15
  // ms sleeping, 1.11-1.15 ms polling, in turns).
  constexpr auto kSpin = std::chrono::microseconds(200);
  auto last_message = Clock::now();
  auto finished = [](const Fetching& f) {
    return (f.header && !f.refusal.empty()) || (f.landed && f.done);
  };
  for (;;) {
    bool busy = false;
    bool all_finished = true;
    for (Fetching& f : fs) {
      if (!f.chunks.empty() && f.refusal.empty() && !TendChunks(f, &busy)) {
        Abandon();
        return all(Gone("mid-transfer"));
      }
      if (f.rndv != nullptr && f.receive == nullptr) {
        ucp_request_param_t param{};
        void* desc = f.rndv;
        f.rndv = nullptr;
        f.receive = ucp_am_recv_data_nbx(ucx_->worker(), desc, f.into.data(), f.into.size(),
                                         &param);
        if (f.receive == nullptr) {
          f.landed = true;
        } else if (UCS_PTR_IS_ERR(f.receive)) {
          Status s = UcxStatus(UCS_PTR_STATUS(f.receive), "receiving a tensor from " + peer);
          f.receive = nullptr;
          Abandon();
          return all(s);
        }
      }
      if (f.receive != nullptr) {
        busy = true;
        ucs_status_t s = ucp_request_check_status(f.receive);
        if (s != UCS_INPROGRESS) {
          ucp_request_free(f.receive);
          f.receive = nullptr;
          if (s != UCS_OK) {
            Abandon();
            return all(Gone("mid-transfer"));
          }
          f.landed = true;
          f.hash = FastXxh3(f.into.data(), f.into.size());
          f.hashed = true;
        }
      }
      if (f.header && !f.refusal.empty() &&
          f.data.status == static_cast<uint32_t>(StreamStatus::kOk)) {
        Abandon();  // a malformed answer: this connection is not trusted further
        return all(Corrupt("stream open from " + peer + ": " + f.refusal));
      }
      all_finished = all_finished && finished(f);
    }
    if (all_finished) break;
    if (failed_) {
      bool any_header = false;
      for (const Fetching& f : fs) any_header = any_header || f.header;
      Abandon();
      return all(Gone(any_header ? "mid-transfer" : "before sending the tensor"));
    }
    if (Clock::now() > deadline) {
      Abandon();
      return all(TimedOut("stream open from " + peer + ": no tensor within " +
                          std::to_string(options_.timeout_seconds) +
                          " s (the producer stalled)"));
    }
    const bool spin = busy || Clock::now() - last_message < kSpin;
    if (ucx_->Progress(spin ? 0 : 5)) last_message = Clock::now();
  }
  fetching_.clear();
  for (Fetching& f : fs) {
    if (!f.refusal.empty()) {
      out.emplace_back(Busy("stream producer at " + peer + " refused the open: " + f.refusal));
      continue;
    }
    if (f.done_msg.status != static_cast<uint32_t>(StreamStatus::kOk)) {
      out.emplace_back(Busy("stream producer at " + peer + " refused the open: " + f.done_text));
      continue;
    }
    const bool damaged =
        f.chunks.empty()
            ? (f.hashed ? f.hash : FastXxh3(f.into.data(), f.into.size())) != f.data.xxh3
            : f.chunk_damaged;
    if (damaged) {
      // Give the hold back unspent: the bytes were damaged on the way, not read.
      StreamRelease r{f.data.hold, 0, 0};
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_AM_SEND_FLAG_REPLY;
      (void)ucx_->Wait(ucp_am_send_nbx(ep_, kStreamReleaseId, nullptr, 0, &r, sizeof r, &param),
                       Clock::now() + std::chrono::seconds(2), "stream give-back");
      out.emplace_back(Corrupt("stream open from " + peer + ": the " +
                               std::to_string(f.into.size()) +
                               " bytes received do not match the producer's xxh3 (damaged in "
                               "transit)"));
      continue;
    }
    out.emplace_back(f.data.hold);
  }
  return out;
}

}  // namespace

Result<std::shared_ptr<StreamPeer>> ConnectUcxStreamPeer(const StreamPeerOptions& options) {
  auto peer = std::make_shared<Peer>();
  Status s = peer->Connect(options);
  if (!s.ok()) return s;
  return std::shared_ptr<StreamPeer>(std::move(peer));
}

}  // namespace expert_arena::remote
