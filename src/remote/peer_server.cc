#include "remote/peer_server.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <list>
#include <vector>

#include "arena/arena_locks.h"
#include "common/logging.h"
#include "common/units.h"
#include "format/arena_format.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/net.h"
#include "platform/ofd_lock.h"
#include "platform/system_info.h"
#include "remote/ucx_worker.h"
#include "remote/wire.h"

namespace expert_arena::remote {
namespace {

using Clock = std::chrono::steady_clock;

// Ranges one peer may have asked for and not yet been sent (a client asks for a window of 8
// by default, 256 at most), and the sends of one peer in flight at once.
constexpr size_t kMaxAskedRanges = 1024;
constexpr size_t kMaxSendsPerPeer = 16;
// Ranges above this go by rendezvous: the client receives them straight into its arena.
constexpr uint64_t kEagerRangeBytes = 64 * 1024;
// A peer being disconnected whose sends are still in flight gets this long to take them
// before its endpoint is closed by force.
constexpr auto kSendDrain = std::chrono::seconds(10);

// One answer to a range request: its header lives until the send completes.
struct RangeSend {
  Range range{};
  ucs_status_ptr_t request = nullptr;
};

// One peer's endpoint, from its connection request to its close.
struct Connection {
  ucp_ep_h ep = nullptr;        // ours, made from the worker address the front door took
  ucp_ep_h reply_ep = nullptr;  // what its messages arrive on (the same, once UCX matched them)
  std::string peer;             // its address, for the log
  std::string host;             // without the port: the unit of max_peers_per_host
  DoorTicket ticket{};
  Clock::time_point since;
  Clock::time_point last_activity;
  bool failed = false;  // the endpoint's error callback ran
  ucs_status_t failure = UCS_OK;
  bool hello = false;  // a hello with its ticket arrived (checked in the main loop)
  bool hello_ok = false;
  bool answered = false;  // offer or refusal sent
  bool closing = false;
  Clock::time_point closing_since;
  std::vector<std::byte> reply;  // kept until the send completes
  ucs_status_ptr_t send = nullptr;
  std::deque<Range> asked;  // range requests not yet answered (checked in the main loop)
  std::string bad_request;  // a request that could not even be read
  std::list<RangeSend> sends;
};

}  // namespace

// The server over one UCX worker and the front door (plugin code: see ucx_plugin.h).
struct UcxPeerServer final : PeerServer {
  ServeInfo serve_info;
  ServeOptions options;
  double hello_timeout_seconds = 10;
  std::shared_ptr<spdlog::logger> log;
  platform::UniqueFd fd;  // holds USER shared: the file cannot be replaced while served
  platform::Mapping mapping;
  std::unique_ptr<UcxWorker> ucx;
  ucp_mem_h memory = nullptr;
  void* rkey = nullptr;
  size_t rkey_bytes = 0;
  std::unique_ptr<FrontDoorServer> door;
  std::vector<std::byte> worker_address;  // told to authenticated peers only
  std::list<Connection> connections;
  DoorCounters dropped;  // admitted peers dropped: timed_out, dropped
  uint64_t offered = 0;
  uint64_t refused = 0;
  uint64_t sent = 0;  // bytes of ranges whose send completed

  ~UcxPeerServer() override {
    auto deadline = Clock::now() + std::chrono::seconds(2);
    for (Connection& c : connections) {
      if (c.send != nullptr && !UCS_PTR_IS_ERR(c.send)) ucp_request_free(c.send);
      for (RangeSend& r : c.sends) ucp_request_free(r.request);
      CloseEndpoint(*ucx, c.ep, true, deadline);
    }
    connections.clear();
    if (rkey != nullptr) ucp_rkey_buffer_release(rkey);
    if (memory != nullptr) ucp_mem_unmap(ucx->context(), memory);
    ucx.reset();
  }

  Connection* Find(ucp_ep_h ep) {
    for (Connection& c : connections)
      if (c.hello && (c.ep == ep || c.reply_ep == ep)) return &c;
    return nullptr;
  }

  // A peer the front door authenticated: an endpoint to its worker address, and ours for it.
  Result<std::span<const std::byte>> Admit(const DoorAdmission& a) {
    size_t all = 0;
    size_t of_host = 0;
    for (const Connection& c : connections) {
      if (c.closing || c.failed) continue;
      ++all;
      of_host += c.host == a.peer_host ? 1 : 0;
    }
    if (all >= options.max_peers || of_host >= options.max_peers_per_host) {
      return Busy(std::to_string(all) + " peers served (" + std::to_string(of_host) +
                  " of this address); at most " + std::to_string(options.max_peers) + " (" +
                  std::to_string(options.max_peers_per_host) + " per address)");
    }
    Connection& c = connections.emplace_back();
    c.peer = a.peer;
    c.host = a.peer_host;
    c.ticket = a.ticket;
    c.since = c.last_activity = Clock::now();
    Status s = ucx->ConnectToAddress(a.worker_address, RecordFailureIn(&c), &c.ep,
                                     "endpoint to peer " + a.peer);
    if (!s.ok()) {
      connections.pop_back();
      return s;
    }
    log->info("expert-arena serve: peer {} admitted", c.peer);
    return std::span<const std::byte>(worker_address);
  }

  void Hangup(Connection& c) {
    if (c.closing) return;
    c.closing = true;
    c.closing_since = Clock::now();
  }

  // Sends the ranges `c` asked for, each checked against the file first; anything else is
  // refused, logged, and the peer disconnected.
  void ServeRanges(Connection& c) {
    std::string why = c.bad_request;
    while (why.empty() && !c.asked.empty() && c.sends.size() < kMaxSendsPerPeer) {
      const Range r = c.asked.front();
      const uint64_t file = serve_info.file_bytes;
      if (serve_info.transport != PeerTransport::kAm) {
        why = "a range request to a server that serves by get (--transport get)";
      } else if (!c.hello_ok || !c.answered) {
        why = "a range request before the offer";
      } else if (r.bytes == 0 || r.bytes > kMaxRangeBytes || r.offset > file ||
                 r.bytes > file - r.offset) {
        why = "bytes [" + std::to_string(r.offset) + ", +" + std::to_string(r.bytes) +
              ") asked, outside the arena file (" + std::to_string(file) + " bytes)";
      }
      if (!why.empty()) break;
      c.asked.pop_front();
      RangeSend& send = c.sends.emplace_back();
      send.range = r;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = r.bytes > kEagerRangeBytes ? UCP_AM_SEND_FLAG_RNDV : 0;
      send.request = ucp_am_send_nbx(c.ep, kRangeDataId, &send.range, sizeof send.range,
                                     static_cast<const std::byte*>(mapping.data()) + r.offset,
                                     r.bytes, &param);
      if (send.request == nullptr) {  // sent at once
        sent += r.bytes;
        c.sends.pop_back();
      } else if (UCS_PTR_IS_ERR(send.request)) {
        c.failed = true;
        c.failure = UCS_PTR_STATUS(send.request);
        c.sends.pop_back();
        return;
      }
    }
    if (why.empty()) return;
    ++refused;
    log->warn("expert-arena serve: peer {}: refused {}; disconnected", c.peer, why);
    c.asked.clear();
    Hangup(c);
  }

  void Answer(Connection& c) {
    Offer offer{};
    offer.magic = kWireMagic;
    offer.version = kWireVersion;
    std::string refusal;
    if (!c.hello_ok) {
      refusal = "bad hello (another version of expert-arena?)";
      offer.status = static_cast<uint32_t>(OfferStatus::kRefused);
      offer.payload_bytes = static_cast<uint32_t>(refusal.size());
    } else {
      offer.status = static_cast<uint32_t>(OfferStatus::kOk);
      offer.transport = static_cast<uint32_t>(serve_info.transport);
      // am: no address, no key; the peer names ranges of the file.
      const bool get = serve_info.transport == PeerTransport::kGet;
      offer.region_address = get ? reinterpret_cast<uint64_t>(mapping.data()) : 0;
      offer.region_bytes = get ? mapping.size() : serve_info.file_bytes;
      offer.header_bytes = serve_info.file_bytes - serve_info.data_bytes;
      offer.data_bytes = serve_info.data_bytes;
      offer.identity_hash = serve_info.identity_hash;
      offer.payload_bytes = get ? static_cast<uint32_t>(rkey_bytes) : 0;
    }
    c.reply.resize(sizeof offer + offer.payload_bytes);
    std::memcpy(c.reply.data(), &offer, sizeof offer);
    if (c.hello_ok) {
      if (offer.payload_bytes > 0) std::memcpy(c.reply.data() + sizeof offer, rkey, rkey_bytes);
    } else {
      std::memcpy(c.reply.data() + sizeof offer, refusal.data(), refusal.size());
    }
    ucp_request_param_t param{};
    c.send = ucp_am_send_nbx(c.ep, kOfferId, nullptr, 0, c.reply.data(), c.reply.size(), &param);
    c.answered = true;
    if (c.hello_ok) {
      ++offered;
      log->info("expert-arena serve: peer {}: offered {} ({}) by {}", c.peer,
                FormatBytes(serve_info.file_bytes), serve_info.identity,
                PeerTransportName(serve_info.transport));
    } else {
      log->warn("expert-arena serve: peer {}: refused: {}", c.peer, refusal);
    }
  }

  // One pass over the connections: answers hellos, finishes sends, closes the dead.
  void Tend() {
    const auto now = Clock::now();
    for (auto it = connections.begin(); it != connections.end();) {
      Connection& c = *it;
      if (c.send != nullptr) {
        if (UCS_PTR_IS_ERR(c.send)) {
          c.failed = true;
          c.failure = UCS_PTR_STATUS(c.send);
          c.send = nullptr;
        } else if (ucp_request_check_status(c.send) != UCS_INPROGRESS) {
          ucp_request_free(c.send);
          c.send = nullptr;
          if (!c.hello_ok) Hangup(c);  // the refusal is out: hang up
        }
      }
      for (auto s = c.sends.begin(); s != c.sends.end();) {
        ucs_status_t status = ucp_request_check_status(s->request);
        if (status == UCS_INPROGRESS) {
          ++s;
          continue;
        }
        ucp_request_free(s->request);
        c.last_activity = now;
        if (status == UCS_OK) sent += s->range.bytes;
        if (status != UCS_OK && !c.failed) {
          c.failed = true;
          c.failure = status;
        }
        s = c.sends.erase(s);
      }
      if (!c.failed && !c.closing && c.hello && !c.answered) Answer(c);
      if (!c.failed && !c.closing) ServeRanges(c);
      if (!c.failed && !c.closing && !c.hello &&
          std::chrono::duration<double>(now - c.since).count() > hello_timeout_seconds) {
        log->warn("expert-arena serve: peer {}: no hello within {} s; disconnected", c.peer,
                  hello_timeout_seconds);
        ++dropped.timed_out;
        Hangup(c);
      }
      if (!c.failed && !c.closing && c.answered && c.asked.empty() && c.sends.empty() &&
          c.send == nullptr &&
          std::chrono::duration<double>(now - c.last_activity).count() >
              options.idle_timeout_seconds) {
        log->warn("expert-arena serve: peer {}: idle for {} s; disconnected", c.peer,
                  options.idle_timeout_seconds);
        ++dropped.dropped;
        Hangup(c);
      }
      // A peer disconnected while answers to it are in flight gets kSendDrain to take them:
      // a forced close with answers queued can trip UCX 1.13's tcp transport
      // (uct_tcp_ep_pending_purge; docs/cross-host.md).
      const bool drained =
          c.sends.empty() || c.failed || (c.closing && now - c.closing_since > kSendDrain);
      if ((c.failed || c.closing) && c.send == nullptr && drained) {
        if (c.failed) {
          // A peer that finished closes its endpoint: that reaches us as a reset.
          log->info("expert-arena serve: peer {} disconnected ({})", c.peer,
                    ucs_status_string(c.failure));
        }
        for (RangeSend& r : c.sends) ucp_request_free(r.request);  // released as they fail
        c.sends.clear();
        CloseEndpoint(*ucx, c.ep, true, Clock::now() + std::chrono::seconds(2));
        it = connections.erase(it);
        continue;
      }
      ++it;
    }
  }

  const ServeInfo& info() const override { return serve_info; }
  uint64_t peers_offered() const override { return offered; }
  uint64_t ranges_refused() const override { return refused; }
  uint64_t bytes_sent() const override { return sent; }
  DoorCounters counters() const override {
    DoorCounters out = door ? door->counters() : DoorCounters{};
    out.timed_out += dropped.timed_out;
    out.dropped += dropped.dropped;
    return out;
  }
  Status Run(const std::function<bool()>& stop) override;
};

Result<std::unique_ptr<PeerServer>> StartUcxServer(const std::string& path,
                                                   const ServeOptions& options) {
  auto state = std::make_unique<UcxPeerServer>();
  state->log = ResolveLogger(options.logger);
  state->options = options;
  state->hello_timeout_seconds = options.hello_timeout_seconds;
  state->serve_info.transport = options.transport;
  if (options.token.size() > kMaxTokenBytes) {
    return InvalidArgument("token of " + std::to_string(options.token.size()) + " bytes; at most " +
                           std::to_string(kMaxTokenBytes));
  }
  if (options.transport == PeerTransport::kGet && options.token.empty()) {
    return InvalidArgument(
        "--transport get needs a token (--token or $EXPERT_ARENA_TOKEN): on UCX's tcp transport a "
        "get carries no key, so any admitted peer could read this process's memory; without a "
        "token every peer is admitted. Serve by am (the default), or set a token and keep get to "
        "trusted networks");
  }
  EA_ASSIGN_OR_RETURN(platform::SocketAddress listen, platform::ResolveHostPort(options.listen));

  // Attach like an engine: USER shared, then a published header validated against the size.
  EA_ASSIGN_OR_RETURN(state->fd, platform::OpenFile(path, {}));
  EA_ASSIGN_OR_RETURN(
      bool user, platform::TryLockByte(state->fd, arena::kUserByte, platform::LockMode::kShared));
  if (!user) return Busy(path + ": an engine is loading or replacing it; serve it once published");
  EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(state->fd));
  if (st.size < sizeof(format::HeaderFixed)) return Corrupt(path + ": not an arena (too small)");
  auto fs = platform::StatFilesystem(arena::DirectoryOf(path));
  uint64_t alignment = fs.ok() && fs->kind == platform::FsKind::kHugetlbfs
                           ? std::max(fs->block_bytes, kHugePageBytes)
                           : kHugePageBytes;
  EA_ASSIGN_OR_RETURN(state->mapping,
                      platform::Mapping::MapFile(state->fd, st.size, false, alignment));
  auto summary = format::SummarizeHeader(state->mapping.bytes().first(sizeof(format::HeaderFixed)));
  if (!summary.our_magic) return Corrupt(path + ": not an expert-arena file");
  if (summary.state != format::FileState::kPublished)
    return Corrupt(path + ": not published (a load did not finish); nothing to serve");
  uint64_t header_bytes = summary.layout.header_bytes;
  if (header_bytes == 0 || header_bytes > st.size)
    return Corrupt(path + ": header size " + std::to_string(header_bytes) +
                   " does not fit the file");
  // Validates the whole table (checksums, every range) before serving a byte of it.
  EA_RETURN_IF_ERROR(
      format::TableView::Open(state->mapping.bytes().first(header_bytes), st.size, path).status());
  state->serve_info.path = path;
  state->serve_info.identity = summary.identity_text;
  state->serve_info.identity_hash = summary.identity_hash;
  state->serve_info.data_bytes = summary.layout.data_bytes;
  state->serve_info.file_bytes = header_bytes + summary.layout.data_bytes;
  if (state->serve_info.file_bytes > st.size)
    return Corrupt(path + ": data region past the file's end");

  const bool get = options.transport == PeerTransport::kGet;
  // am: no RMA feature, so this worker answers no get or put request of any peer.
  // UCX's network transports only on the listen address' interface (docs/cross-host.md).
  EA_ASSIGN_OR_RETURN(state->ucx, UcxWorker::Create(get, platform::InterfaceOf(listen)));
  ucs_status_t s = UCS_OK;
  if (get) {
    // Registered once, read-only: peers may read the file, never write it.
    ucp_mem_map_params_t map{};
    map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                     UCP_MEM_MAP_PARAM_FIELD_PROT;
    map.address = state->mapping.data();
    map.length = state->serve_info.file_bytes;
    map.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_REMOTE_READ;
    s = ucp_mem_map(state->ucx->context(), &map, &state->memory);
    if (s != UCS_OK) return UcxStatus(s, "ucp_mem_map of " + path);
    s = ucp_rkey_pack(state->ucx->context(), state->memory, &state->rkey, &state->rkey_bytes);
    if (s != UCS_OK) return UcxStatus(s, "ucp_rkey_pack of " + path);
    if (state->rkey_bytes > kMaxRkeyBytes) return Internal("packed rkey too large");
  }

  ucp_am_recv_callback_t on_hello = [](void* arg, const void*, size_t, void* data, size_t length,
                                       const ucp_am_recv_param_t* param) -> ucs_status_t {
    auto* st = static_cast<UcxPeerServer*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    Hello hello{};
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length != sizeof hello) return UCS_OK;
    std::memcpy(&hello, data, sizeof hello);
    // The ticket names the admission (one use); an unknown one is ignored.
    for (Connection& c : st->connections) {
      if (c.hello || c.closing || !SameSecret(c.ticket, hello.ticket)) continue;
      c.hello = true;
      c.reply_ep = param->reply_ep;
      c.hello_ok = hello.magic == kWireMagic && hello.version == kWireVersion;
      break;
    }
    return UCS_OK;
  };
  EA_RETURN_IF_ERROR(state->ucx->SetAmHandler(kHelloId, state.get(), on_hello));
  // Range requests are queued here and checked in the main loop (ServeRanges).
  ucp_am_recv_callback_t on_range_request = [](void* arg, const void*, size_t, void* data,
                                               size_t length,
                                               const ucp_am_recv_param_t* param) -> ucs_status_t {
    auto* st = static_cast<UcxPeerServer*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    Connection* c = st->Find(param->reply_ep);
    if (c == nullptr || !c->bad_request.empty()) return UCS_OK;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length != sizeof(Range)) {
      c->bad_request = "a malformed range request (" + std::to_string(length) + " bytes)";
    } else if (c->asked.size() >= kMaxAskedRanges) {
      c->bad_request = "more than " + std::to_string(kMaxAskedRanges) + " ranges asked at once";
    } else {
      Range r{};
      std::memcpy(&r, data, sizeof r);
      c->asked.push_back(r);
      c->last_activity = Clock::now();
    }
    return UCS_OK;
  };
  EA_RETURN_IF_ERROR(state->ucx->SetAmHandler(kRangeRequestId, state.get(), on_range_request));

  EA_ASSIGN_OR_RETURN(state->worker_address, state->ucx->Address());
  FrontDoorLimits limits = options.door;
  limits.handshake_seconds = options.hello_timeout_seconds;
  limits.max_handshakes = std::max(limits.max_handshakes, options.max_peers);
  EA_ASSIGN_OR_RETURN(state->door,
                      FrontDoorServer::Listen(listen, options.token, DoorService::kPeerFill, limits,
                                              "expert-arena serve", state->log));
  state->serve_info.address = state->door->address();
  state->serve_info.port = state->door->port();
  return std::unique_ptr<PeerServer>(std::move(state));
}

Status UcxPeerServer::Run(const std::function<bool()>& stop) {
  const FrontDoorServer::AdmitFn admit = [this](const DoorAdmission& a) { return Admit(a); };
  while (!stop()) {
    // Busy while peers read (tcp's get, and am's sends, progress on this worker), asleep on the
    // event fd and the front door's sockets otherwise.
    for (int i = 0; i < 64 && ucx->Progress(0); ++i) {
    }
    door->Step(admit);
    Tend();
    if (ucx->Arm()) door->Wait(ucx->event_fd(), connections.empty() ? 100 : 1);
    ucx->Progress(0);
    door->Step(admit);
    Tend();
  }
  return Status::Ok();
}

}  // namespace expert_arena::remote
