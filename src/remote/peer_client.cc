#include "remote/peer_client.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <list>
#include <numeric>
#include <thread>
#include <vector>

#include "common/ready_front.h"
#include "common/units.h"
#include "format/arena_format.h"
#include "common/fast_xxh3.h"
#include "platform/file.h"
#include "platform/net.h"
#include "remote/front_door.h"
#include "remote/ucx_worker.h"
#include "remote/wire.h"

namespace expert_arena::remote {
namespace {

using Clock = std::chrono::steady_clock;

// Pieces of the data region read by one ucp_get_nbx, and how many are in flight; the
// defaults were chosen with bench/peer_fill_bench.sh (docs/cross-host.md), and
// EXPERT_ARENA_PEER_CHUNK_MIB / EXPERT_ARENA_PEER_WINDOW override them for such measurements.
uint64_t TuningFromEnvironment(const char* name, uint64_t fallback, uint64_t low, uint64_t high) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  unsigned long long value = std::strtoull(text, &end, 10);
  if (end == text || *end != '\0' || value < low || value > high) return fallback;
  return value;
}

std::chrono::nanoseconds Seconds(double s) {
  return std::chrono::nanoseconds(static_cast<int64_t>(s * 1e9));
}

// Test only: when EXPERT_ARENA_TEST_PEER_PAUSE_FILE names a path, the fill creates that file
// once half the data has landed and waits (at most 60 s) until it is removed, so a test can
// kill the server at a known point mid-transfer.
void PauseForTest(const std::string& pause_file) {
  auto fd = platform::OpenFile(pause_file, {.write = true, .create = true});
  if (!fd.ok()) return;
  fd->Reset();
  for (int i = 0; i < 600 && platform::StatPath(pause_file).ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// One read of a range of the peer's arena file into local memory, by get or by asking (am).
struct PendingRead {
  uint64_t id = 0;  // the caller's (a chunk number)
  std::byte* dest = nullptr;
  Range range{};  // file offsets; am: the request's body, kept until it is sent
  ucs_status_ptr_t request = nullptr;  // the get, or am's rendezvous receive
  ucs_status_ptr_t ask = nullptr;      // am: the request's send
  void* desc = nullptr;                // am: a rendezvous descriptor to receive
  bool arrived = false;                // am: the answer came (copied, or a descriptor)
  bool done = false;
  ucs_status_t status = UCS_OK;
  bool finished() const { return done && ask == nullptr && request == nullptr; }
};

}  // namespace

// The client side over one UCX worker and endpoint (plugin code: see ucx_plugin.h).
struct UcxPeerSource final : PeerSource {
  PeerOptions options;
  std::unique_ptr<UcxWorker> ucx;
  ucp_ep_h ep = nullptr;
  bool failed = false;
  ucs_status_t failure = UCS_OK;
  ucp_rkey_h rkey = nullptr;
  Offer offer{};
  bool offered = false;
  std::vector<std::byte> offer_bytes;
  format::ArenaTable peer_table;
  PeerTransport transport_used = PeerTransport::kGet;
  std::list<PendingRead> reads;  // in flight
  std::string protocol_error;    // am: the peer sent what was not asked for
  uint64_t received = 0;
  double seconds = 0;

  ~UcxPeerSource() override {
    if (rkey != nullptr) ucp_rkey_destroy(rkey);
    ReleaseReads();
    if (ucx) CloseEndpoint(*ucx, ep, failed, Clock::now() + std::chrono::seconds(2));
  }

  // Frees what is left of the reads (UCX releases a pending request when it completes).
  void ReleaseReads() {
    for (PendingRead& r : reads) {
      if (r.ask != nullptr) ucp_request_free(r.ask);
      if (r.request != nullptr) ucp_request_free(r.request);
      if (r.desc != nullptr) ucp_am_data_release(ucx->worker(), r.desc);
    }
    reads.clear();
  }

  // Starts reading [offset, +bytes) of the peer's file into `dest`.
  void StartRead(uint64_t id, std::byte* dest, uint64_t offset, uint64_t bytes) {
    PendingRead& r = reads.emplace_back();
    r.id = id;
    r.dest = dest;
    r.range = {offset, bytes};
    ucp_request_param_t param{};
    ucs_status_ptr_t p;
    if (transport_used == PeerTransport::kGet) {
      p = ucp_get_nbx(ep, dest, bytes, offer.region_address + offset, rkey, &param);
      r.done = !UCS_PTR_IS_PTR(p) || p == nullptr;
      if (UCS_PTR_IS_PTR(p)) r.request = p;
    } else {
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
      p = ucp_am_send_nbx(ep, kRangeRequestId, nullptr, 0, &r.range, sizeof r.range, &param);
      if (UCS_PTR_IS_ERR(p)) r.done = true;
      if (UCS_PTR_IS_PTR(p)) r.ask = p;
    }
    if (UCS_PTR_IS_ERR(p)) r.status = UCS_PTR_STATUS(p);
  }

  // Progresses the worker and the reads in flight (a finished read stays in `reads` for the
  // caller to take).
  void PollReads(int idle_ms) {
    ucx->Progress(idle_ms);
    for (PendingRead& r : reads) {
      if (r.ask != nullptr && ucp_request_check_status(r.ask) != UCS_INPROGRESS) {
        ucs_status_t s = ucp_request_check_status(r.ask);
        ucp_request_free(r.ask);
        r.ask = nullptr;
        if (s != UCS_OK && !r.done) {
          r.done = true;
          r.status = s;
        }
      }
      if (r.desc != nullptr) {
        // A rendezvous answer: received straight into the local arena.
        ucp_request_param_t param{};
        ucs_status_ptr_t p =
            ucp_am_recv_data_nbx(ucx->worker(), r.desc, r.dest, r.range.bytes, &param);
        r.desc = nullptr;
        if (UCS_PTR_IS_PTR(p) && p != nullptr) {
          r.request = p;
        } else {
          r.done = true;
          if (UCS_PTR_IS_ERR(p)) r.status = UCS_PTR_STATUS(p);
        }
      }
      if (r.request != nullptr && ucp_request_check_status(r.request) != UCS_INPROGRESS) {
        ucs_status_t s = ucp_request_check_status(r.request);
        ucp_request_free(r.request);
        r.request = nullptr;
        r.done = true;
        if (s != UCS_OK) r.status = s;
      }
    }
  }

  // The peer's answer to a range request (kRangeDataId): only a range that was asked for and
  // has not arrived is taken, into its own destination.
  ucs_status_t OnRangeData(const void* header, size_t header_length, void* data, size_t length,
                           const ucp_am_recv_param_t* param) {
    Range range{};
    if (header_length != sizeof range) {
      protocol_error = "an answer with a " + std::to_string(header_length) + "-byte header";
      return UCS_OK;
    }
    std::memcpy(&range, header, sizeof range);
    for (PendingRead& r : reads) {
      if (r.arrived || r.done || r.range.offset != range.offset || r.range.bytes != range.bytes)
        continue;
      if (length != range.bytes) break;
      r.arrived = true;
      if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        r.desc = data;  // received in PollReads, outside this callback
        return UCS_INPROGRESS;
      }
      std::memcpy(r.dest, data, length);
      r.done = true;
      return UCS_OK;
    }
    protocol_error = "bytes [" + std::to_string(range.offset) + ", +" + std::to_string(length) +
                     ") sent that were not asked for";
    return UCS_OK;
  }

  Status PeerGone(const std::string& doing) const {
    return Status(
        failure == UCS_ERR_ENDPOINT_TIMEOUT ? StatusCode::kTimedOut : StatusCode::kIoError,
        "peer " + options.address + " went away " + doing + " (" + ucs_status_string(failure) +
            ")");
  }

  // One bounded read of [remote, +bytes) of the peer's file into `local`.
  Status Read(void* local, uint64_t bytes, uint64_t remote, const std::string& what) {
    StartRead(0, static_cast<std::byte*>(local), remote, bytes);
    const auto deadline = Clock::now() + Seconds(options.stall_seconds);
    while (!reads.front().finished() && !failed && protocol_error.empty() &&
           Clock::now() < deadline) {
      PollReads(10);
    }
    if (failed) return PeerGone("while reading " + what);
    if (!protocol_error.empty()) return Corrupt("peer " + options.address + ": " + protocol_error);
    if (!reads.front().finished()) {
      return TimedOut("reading " + what + " from peer " + options.address +
                      ": no answer within the deadline");
    }
    ucs_status_t s = reads.front().status;
    reads.clear();
    if (s != UCS_OK) return UcxStatus(s, "reading " + what + " from peer " + options.address);
    received += bytes;
    return Status::Ok();
  }

  const format::ArenaTable& table() const override { return peer_table; }
  const std::string& address() const override { return options.address; }
  Status Fill(std::span<std::byte> data, const format::ArenaTable& table, const ReadyFront* front,
              uint64_t front_base) override;
  uint64_t bytes_received() const override { return received; }
  const char* transport() const override { return PeerTransportName(transport_used); }
  double fill_seconds() const override { return seconds; }
};

Result<std::unique_ptr<PeerSource>> ConnectUcxPeer(const PeerOptions& options) {
  auto state = std::make_unique<UcxPeerSource>();
  UcxPeerSource& st = *state;
  st.options = options;
  const std::string& peer = options.address;
  if (options.token.size() > kMaxTokenBytes) {
    return InvalidArgument("token of " + std::to_string(options.token.size()) + " bytes; at most " +
                           std::to_string(kMaxTokenBytes));
  }
  EA_RETURN_IF_ERROR(RequireDoorToken(options.token, options.allow_no_token, "peer " + peer,
                                      "--token, $EXPERT_ARENA_TOKEN, peer_token",
                                      "--insecure-no-token (peer_allow_no_token)"));
  EA_ASSIGN_OR_RETURN(platform::SocketAddress address, platform::ResolveHostPort(peer));
  // A client that only takes am needs no RMA: its worker then answers no get of the server.
  EA_ASSIGN_OR_RETURN(st.ucx, UcxWorker::Create(options.transport != "am"));

  ucp_am_recv_callback_t on_offer = [](void* arg, const void*, size_t, void* data, size_t length,
                                       const ucp_am_recv_param_t* param) -> ucs_status_t {
    auto* s = static_cast<UcxPeerSource*>(arg);
    if (s->offered || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) return UCS_OK;
    s->offered = true;
    auto* bytes = static_cast<const std::byte*>(data);
    s->offer_bytes.assign(bytes, bytes + std::min<size_t>(length, sizeof(Offer) + kMaxRkeyBytes));
    return UCS_OK;
  };
  EA_RETURN_IF_ERROR(st.ucx->SetAmHandler(kOfferId, &st, on_offer));
  ucp_am_recv_callback_t on_range_data = [](void* arg, const void* header, size_t header_length,
                                            void* data, size_t length,
                                            const ucp_am_recv_param_t* param) -> ucs_status_t {
    return static_cast<UcxPeerSource*>(arg)->OnRangeData(header, header_length, data, length,
                                                         param);
  };
  EA_RETURN_IF_ERROR(st.ucx->SetAmHandler(kRangeDataId, &st, on_range_data));

  // The front door first (plain TCP, bounded): the token is proved, never sent, and only then
  // are UCX worker addresses exchanged. A silent or wrong server fails here, before UCX has
  // anything pending.
  EA_ASSIGN_OR_RETURN(std::vector<std::byte> own_address, st.ucx->Address());
  auto door = FrontDoorConnect(address, options.token, DoorService::kPeerFill, own_address,
                               options.stall_seconds, "peer " + peer);
  if (!door.ok()) {
    const StatusCode code = door.status().code();
    if (code == StatusCode::kPermission || code == StatusCode::kBusy ||
        code == StatusCode::kTimedOut || code == StatusCode::kUnsupported ||
        code == StatusCode::kCorrupt) {
      return door.status();
    }
    return Status(StatusCode::kIoError, "cannot reach peer " + peer + " (" +
                                            door.status().message() +
                                            "): is `expert-arena serve` listening there?");
  }
  DoorEntry entry = std::move(door).value();
  EA_RETURN_IF_ERROR(st.ucx->ConnectToAddress(entry.worker_address, RecordFailureIn(&st), &st.ep,
                                              "connect to peer " + peer));

  // Hello: the front door's ticket names this endpoint to the server.
  Hello hello{kWireMagic, kWireVersion, 0, {}};
  std::memcpy(hello.ticket, entry.ticket.data(), sizeof hello.ticket);
  ucp_request_param_t send{};
  send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  send.flags = UCP_AM_SEND_FLAG_REPLY;
  const auto deadline = Clock::now() + Seconds(options.stall_seconds);
  Status sent = st.ucx->Wait(
      ucp_am_send_nbx(st.ep, kHelloId, nullptr, 0, &hello, sizeof hello, &send), deadline,
      "hello to peer " + peer);
  if (!sent.ok()) {
    if (st.failed) {
      return Status(StatusCode::kIoError, "cannot reach peer " + peer + " (" +
                                              ucs_status_string(st.failure) +
                                              "): is `expert-arena serve` listening there?");
    }
    return sent;
  }
  while (!st.offered && !st.failed) {
    if (Clock::now() > deadline) {
      return TimedOut("peer " + peer + " did not answer within " +
                      std::to_string(static_cast<int>(options.stall_seconds)) + " s");
    }
    st.ucx->Progress(10);
  }
  if (!st.offered) return st.PeerGone("before answering");

  if (st.offer_bytes.size() < sizeof(Offer)) return Corrupt("peer " + peer + ": short offer");
  std::memcpy(&st.offer, st.offer_bytes.data(), sizeof(Offer));
  const Offer& offer = st.offer;
  if (offer.magic != kWireMagic || offer.version != kWireVersion) {
    return Unsupported("peer " + peer + " speaks another protocol version (" +
                       std::to_string(offer.version) + ", this is " + std::to_string(kWireVersion) +
                       ")");
  }
  if (offer.payload_bytes > st.offer_bytes.size() - sizeof(Offer)) {
    return Corrupt("peer " + peer + ": offer shorter than its payload");
  }
  const std::byte* payload = st.offer_bytes.data() + sizeof(Offer);
  if (offer.status != static_cast<uint32_t>(OfferStatus::kOk)) {
    std::string why(reinterpret_cast<const char*>(payload),
                    std::min<size_t>(offer.payload_bytes, kMaxRefusalBytes));
    for (char& c : why)
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
    return PermissionDenied("peer " + peer + " refused: " + why);
  }
  if (offer.header_bytes < sizeof(format::HeaderFixed) || offer.header_bytes > 1024 * kMiB ||
      offer.header_bytes % 8 != 0 || offer.data_bytes > offer.region_bytes ||
      offer.header_bytes > offer.region_bytes - offer.data_bytes) {
    return Corrupt("peer " + peer + ": offer sizes do not fit (header " +
                   std::to_string(offer.header_bytes) + ", data " +
                   std::to_string(offer.data_bytes) + ", region " +
                   std::to_string(offer.region_bytes) + ")");
  }
  if (offer.transport > static_cast<uint32_t>(PeerTransport::kAm)) {
    return Unsupported("peer " + peer + " offers an unknown transport (" +
                       std::to_string(offer.transport) + ")");
  }
  st.transport_used = static_cast<PeerTransport>(offer.transport);
  const char* offered = PeerTransportName(st.transport_used);
  if (options.transport != "auto" && options.transport != offered) {
    return PermissionDenied("peer " + peer + " serves by " + offered + ", and this fill takes " +
                            options.transport + " only (--peer-transport)");
  }
  if (st.transport_used == PeerTransport::kGet) {
    ucs_status_t s = ucp_ep_rkey_unpack(st.ep, payload, &st.rkey);
    if (s != UCS_OK) return UcxStatus(s, "peer " + peer + ": unpack its rkey");
  }

  // The header region, validated like a local one: the peer's file size is header + data.
  std::vector<uint64_t> region(offer.header_bytes / 8);
  EA_RETURN_IF_ERROR(st.Read(region.data(), offer.header_bytes, 0, "the header region"));
  std::span<const std::byte> header(reinterpret_cast<const std::byte*>(region.data()),
                                    offer.header_bytes);
  auto summary = format::SummarizeHeader(header.first(sizeof(format::HeaderFixed)));
  if (summary.state != format::FileState::kPublished) {
    return Corrupt("peer " + peer + ": its arena is not published");
  }
  EA_RETURN_IF_ERROR(format::DecodeHeader(header, offer.header_bytes + offer.data_bytes,
                                          "peer " + peer, &st.peer_table, nullptr));
  if (st.peer_table.data_bytes != offer.data_bytes ||
      st.peer_table.identity_hash != offer.identity_hash) {
    return Corrupt("peer " + peer + ": its header does not match its offer");
  }
  return std::unique_ptr<PeerSource>(std::move(state));
}

Status UcxPeerSource::Fill(std::span<std::byte> data, const format::ArenaTable& table,
                           const ReadyFront* front, uint64_t front_base) {
  UcxPeerSource& st = *this;
  const auto start = Clock::now();
  const std::string& peer = st.options.address;
  // Tensors in data order, and the end of the last one: the padding after it is not read.
  std::vector<size_t> order(table.tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return table.tensors[a].arena_offset < table.tensors[b].arena_offset;
  });
  uint64_t end = 0;
  for (const auto& t : table.tensors) end = std::max(end, t.arena_offset + t.bytes);
  if (end > data.size() || end > st.offer.data_bytes) {
    return InvalidArgument("peer " + peer + ": tensors end at " + std::to_string(end) +
                           " past the data region");
  }
  const char* pause_env = std::getenv("EXPERT_ARENA_TEST_PEER_PAUSE_FILE");
  std::string pause_file = pause_env != nullptr ? pause_env : "";

  const uint64_t chunk_bytes =
      TuningFromEnvironment("EXPERT_ARENA_PEER_CHUNK_MIB", 16, 1, 1024) * kMiB;
  const size_t window = TuningFromEnvironment("EXPERT_ARENA_PEER_WINDOW", 8, 1, 256);
  const uint64_t chunks = (end + chunk_bytes - 1) / chunk_bytes;
  std::vector<uint8_t> done(chunks, 0);
  uint64_t next = 0;    // the next chunk to ask for
  uint64_t landed = 0;  // chunks [0, landed) are all in place
  size_t hashed = 0;    // tensors (in `order`) checked so far
  Status error = Status::Ok();
  auto last_progress = Clock::now();
  const uint64_t remote_data = st.offer.header_bytes;
  auto failure = [&](ucs_status_t s) {
    if (st.failed) return st.PeerGone("mid-transfer after " + FormatBytes(st.received));
    if (!st.protocol_error.empty()) return Corrupt("peer " + peer + ": " + st.protocol_error);
    return UcxStatus(s, "read from peer " + peer);
  };

  while (error.ok() && (landed < chunks || hashed < order.size())) {
    while (error.ok() && st.reads.size() < window && next < chunks) {
      uint64_t offset = next * chunk_bytes;
      uint64_t bytes = std::min(chunk_bytes, end - offset);
      if (front != nullptr) {
        error = front->WaitFor(front_base + offset + bytes);
        if (!error.ok()) break;
      }
      st.StartRead(next, data.data() + offset, remote_data + offset, bytes);
      ++next;
    }
    if (!error.ok()) break;
    st.PollReads(st.reads.empty() ? 0 : 1);
    for (auto it = st.reads.begin(); it != st.reads.end();) {
      if (!it->finished()) {
        ++it;
        continue;
      }
      if (it->status != UCS_OK) {
        error = failure(it->status);
        st.reads.erase(it);
        break;
      }
      st.received += it->range.bytes;
      done[it->id] = 1;
      last_progress = Clock::now();
      it = st.reads.erase(it);
    }
    if (!error.ok()) break;
    if (st.failed || !st.protocol_error.empty()) {
      error = failure(UCS_OK);
      break;
    }
    uint64_t before = landed;
    while (landed < chunks && done[landed]) ++landed;
    // Every tensor whose last byte landed is checked now.
    const uint64_t landed_bytes = std::min(end, landed * chunk_bytes);
    while (hashed < order.size()) {
      const format::TensorRecord& t = table.tensors[order[hashed]];
      if (t.arena_offset + t.bytes > landed_bytes) break;
      uint64_t sum = FastXxh3(data.data() + t.arena_offset, t.bytes);
      if (sum != t.checksum) {
        char text[96];
        std::snprintf(text, sizeof text, "%016llx, expected %016llx",
                      static_cast<unsigned long long>(sum),
                      static_cast<unsigned long long>(t.checksum));
        error = Corrupt("tensor " + t.name + " from peer " + peer + ": checksum " + text +
                        "; not published");
        break;
      }
      ++hashed;
    }
    if (!pause_file.empty() && landed * 2 >= chunks && before * 2 < chunks && landed < chunks) {
      PauseForTest(pause_file);
      last_progress = Clock::now();
    }
    if (error.ok() && !st.reads.empty() &&
        Clock::now() - last_progress > Seconds(st.options.stall_seconds)) {
      error = TimedOut("peer " + peer + ": no data for " +
                       std::to_string(static_cast<int>(st.options.stall_seconds)) + " s after " +
                       FormatBytes(st.received));
    }
  }
  // Nothing may land in `data` after we return (the caller unmaps it on failure). A peer that
  // is alive (a checksum failed here) answers the reads in flight: let them land, then close
  // gently. Closing by force while the server still has answers queued trips an assertion in
  // UCX 1.13's tcp transport on the server (uct_tcp_ep_pending_purge, seen once in ~10 runs).
  const auto drain_deadline = Clock::now() + Seconds(st.options.stall_seconds);
  auto drop_finished = [&st] {
    st.reads.remove_if([](const PendingRead& r) { return r.finished(); });
  };
  drop_finished();
  while (!st.reads.empty() && !st.failed && st.protocol_error.empty() &&
         Clock::now() < drain_deadline) {
    st.PollReads(1);
    drop_finished();
  }
  if (!st.reads.empty()) {
    // The peer is gone, silent or misbehaving: a forced close fails every request on the
    // endpoint, and they complete before we leave.
    CloseEndpoint(*st.ucx, st.ep, true, Clock::now() + std::chrono::seconds(5));
    st.ep = nullptr;
    // A read with no UCX request left (am: asked, not answered) can no longer land anything.
    auto drop_idle = [&st] {
      st.reads.remove_if([](const PendingRead& r) {
        return r.finished() || (r.ask == nullptr && r.request == nullptr && r.desc == nullptr);
      });
    };
    drop_idle();
    for (int i = 0; i < 500 && !st.reads.empty(); ++i) {
      st.PollReads(10);
      drop_idle();
    }
    st.ReleaseReads();
  }
  st.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return error;
}

}  // namespace expert_arena::remote
