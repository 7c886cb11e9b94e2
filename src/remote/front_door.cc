#include "remote/front_door.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/logging.h"

namespace expert_arena::remote {
namespace {

using Clock = std::chrono::steady_clock;

template <typename T>
Result<T> ParseFixed(std::span<const std::byte> bytes, const char* what) {
  if (bytes.size() != sizeof(T)) {
    return InvalidArgument(std::string(what) + " of " + std::to_string(bytes.size()) +
                           " bytes; it has " + std::to_string(sizeof(T)));
  }
  T v;
  std::memcpy(&v, bytes.data(), sizeof v);
  if (v.magic != kDoorMagic) {
    return InvalidArgument(std::string(what) + ": bad magic (not an expert-arena front door)");
  }
  return v;
}

// The host part of "ADDR:PORT" / "[ADDR]:PORT".
std::string HostOf(const std::string& peer) {
  size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

int MsUntil(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms < 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

template <typename T>
std::span<const std::byte> BytesOf(const T& v) {
  return {reinterpret_cast<const std::byte*>(&v), sizeof v};
}

}  // namespace

Result<DoorHello> ParseDoorHello(std::span<const std::byte> bytes) {
  EA_ASSIGN_OR_RETURN(DoorHello h, ParseFixed<DoorHello>(bytes, "front door hello"));
  if (h.version != kDoorVersion) {
    return InvalidArgument("front door hello of version " + std::to_string(h.version) +
                           "; this build speaks " + std::to_string(kDoorVersion));
  }
  if (h.service != static_cast<uint32_t>(DoorService::kPeerFill) &&
      h.service != static_cast<uint32_t>(DoorService::kStream)) {
    return InvalidArgument("front door hello for an unknown service " + std::to_string(h.service));
  }
  return h;
}

Result<DoorChallenge> ParseDoorChallenge(std::span<const std::byte> bytes) {
  EA_ASSIGN_OR_RETURN(DoorChallenge c, ParseFixed<DoorChallenge>(bytes, "front door challenge"));
  if (c.version != kDoorVersion) {
    return InvalidArgument("front door challenge of version " + std::to_string(c.version) +
                           "; this build speaks " + std::to_string(kDoorVersion));
  }
  if (c.status > static_cast<uint32_t>(DoorStatus::kWrongVersion)) {
    return InvalidArgument("front door challenge with an unknown status " +
                           std::to_string(c.status));
  }
  return c;
}

Result<DoorProof> ParseDoorProof(std::span<const std::byte> bytes) {
  EA_ASSIGN_OR_RETURN(DoorProof p, ParseFixed<DoorProof>(bytes, "front door proof"));
  if (p.address_bytes == 0 || p.address_bytes > kMaxWorkerAddressBytes) {
    return InvalidArgument("front door proof announcing a worker address of " +
                           std::to_string(p.address_bytes) + " bytes (1.." +
                           std::to_string(kMaxWorkerAddressBytes) + ")");
  }
  if (p.reserved != 0) return InvalidArgument("front door proof with reserved bits set");
  return p;
}

Result<DoorAdmit> ParseDoorAdmit(std::span<const std::byte> bytes) {
  EA_ASSIGN_OR_RETURN(DoorAdmit a, ParseFixed<DoorAdmit>(bytes, "front door admit"));
  if (a.status > static_cast<uint32_t>(DoorStatus::kWrongVersion)) {
    return InvalidArgument("front door admit with an unknown status " + std::to_string(a.status));
  }
  if (a.status == static_cast<uint32_t>(DoorStatus::kOk) &&
      (a.address_bytes == 0 || a.address_bytes > kMaxWorkerAddressBytes)) {
    return InvalidArgument("front door admit announcing a worker address of " +
                           std::to_string(a.address_bytes) + " bytes (1.." +
                           std::to_string(kMaxWorkerAddressBytes) + ")");
  }
  if (a.status != static_cast<uint32_t>(DoorStatus::kOk) && a.address_bytes != 0) {
    return InvalidArgument("front door refusal that announces a worker address");
  }
  return a;
}

const char* DoorStatusText(uint32_t status) {
  switch (static_cast<DoorStatus>(status)) {
    case DoorStatus::kOk:
      return "admitted";
    case DoorStatus::kWrongToken:
      return "wrong token (the server asks for a shared token: --token, $EXPERT_ARENA_TOKEN)";
    case DoorStatus::kBusy:
      return "busy (too many connections; try again later)";
    case DoorStatus::kThrottled:
      return "throttled (too many failed token proofs from this address lately)";
    case DoorStatus::kWrongService:
      return "another service listens there (a stream producer and `serve` are not the same)";
    case DoorStatus::kWrongVersion:
      return "another protocol version of expert-arena";
  }
  return "refused";
}

Status RandomBytes(std::span<uint8_t> out) {
  if (RAND_bytes(out.data(), static_cast<int>(out.size())) != 1) {
    return Internal("OpenSSL's RAND_bytes failed (no entropy?)");
  }
  return Status::Ok();
}

std::array<uint8_t, kDoorProofBytes> DoorProofOf(std::string_view token, bool server,
                                                 uint32_t service, const uint8_t* client_nonce,
                                                 const uint8_t* server_nonce) {
  // A label per side: one side's proof is never a valid proof of the other.
  std::byte data[16 + 4 + 2 * kDoorNonceBytes];
  std::memcpy(data, server ? "EA door server\0\0" : "EA door client\0\0", 16);
  std::memcpy(data + 16, &service, 4);
  std::memcpy(data + 20, client_nonce, kDoorNonceBytes);
  std::memcpy(data + 20 + kDoorNonceBytes, server_nonce, kDoorNonceBytes);
  return HmacSha256(token, data);
}

// One handshake in progress.
struct FrontDoorServer::Conn {
  enum class State { kHello, kProof, kAddress, kClosing };
  platform::UniqueFd fd;
  std::string peer;
  std::string host;
  Clock::time_point since;
  State state = State::kHello;
  // The fixed-size message being read: never more than its size is taken from the socket.
  std::byte in[sizeof(DoorChallenge)]{};
  size_t have = 0;
  DoorHello hello{};
  DoorProof proof{};
  uint8_t server_nonce[kDoorNonceBytes]{};
  std::vector<std::byte> address;  // the client's worker address (after its proof held)
  std::vector<std::byte> out;      // bytes to send
  size_t sent = 0;
  bool done = false;
};

Result<std::unique_ptr<FrontDoorServer>> FrontDoorServer::Listen(
    const platform::SocketAddress& address, std::string token, DoorService service,
    const FrontDoorLimits& limits, std::string name, std::shared_ptr<spdlog::logger> log) {
  if (token.size() > kMaxDoorTokenBytes) {
    return InvalidArgument("token of " + std::to_string(token.size()) + " bytes; at most " +
                           std::to_string(kMaxDoorTokenBytes));
  }
  std::unique_ptr<FrontDoorServer> door(new FrontDoorServer());
  EA_ASSIGN_OR_RETURN(door->listen_, platform::ListenTcp(address, 128));
  EA_ASSIGN_OR_RETURN(platform::SocketAddress bound, platform::LocalAddress(door->listen_.get()));
  door->address_ = platform::AddressText(bound.get());
  door->port_ = platform::AddressPort(bound.get());
  door->token_ = std::move(token);
  door->service_ = service;
  door->limits_ = limits;
  door->name_ = std::move(name);
  door->log_ = ResolveLogger(std::move(log));
  return door;
}

FrontDoorServer::~FrontDoorServer() = default;

bool FrontDoorServer::Throttled(const std::string& host, Clock::time_point now) {
  auto it = failures_.find(host);
  if (it == failures_.end()) return false;
  if (now - it->second.since >
      std::chrono::duration<double>(limits_.failure_interval_seconds)) {
    failures_.erase(it);
    return false;
  }
  if (it->second.count < limits_.max_failures) return false;
  if (!it->second.logged) {
    it->second.logged = true;
    log_->warn("{} {}: peer {}: {} failed token proofs within {} s; refused until the interval "
               "passes (logged once per interval)",
               name_, address_, host, it->second.count, limits_.failure_interval_seconds);
  }
  return true;
}

void FrontDoorServer::RecordFailure(const std::string& host) {
  const auto now = Clock::now();
  if (failures_.size() >= 4096) {
    // Bounded memory whatever the number of addresses: expired entries go, then all.
    for (auto it = failures_.begin(); it != failures_.end();) {
      it = now - it->second.since >
                   std::chrono::duration<double>(limits_.failure_interval_seconds)
               ? failures_.erase(it)
               : std::next(it);
    }
    if (failures_.size() >= 4096) failures_.clear();
  }
  Failures& f = failures_[host];
  if (f.count == 0 ||
      now - f.since > std::chrono::duration<double>(limits_.failure_interval_seconds)) {
    f = Failures{now, 0, false};
  }
  ++f.count;
}

void FrontDoorServer::Advance(Conn& c, const AdmitFn& admit) {
  auto refuse = [&](const std::string& why) {
    ++counters_.refused;
    log_->info("{} {}: peer {}: refused: {}", name_, address_, c.peer, why);
    c.state = Conn::State::kClosing;
  };
  // A bounded number of rounds: a peer cannot keep this call busy.
  for (int round = 0; round < 8 && !c.done; ++round) {
    if (c.sent < c.out.size()) {
      auto n = platform::SendSome(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent);
      if (!n.ok()) {
        ++counters_.dropped;
        c.done = true;
        return;
      }
      if (*n < 0) return;  // the socket's buffer is full: wait for POLLOUT
      c.sent += static_cast<size_t>(*n);
      continue;
    }
    if (c.state == Conn::State::kClosing) {
      c.done = true;
      return;
    }
    size_t want = c.state == Conn::State::kHello   ? sizeof(DoorHello)
                  : c.state == Conn::State::kProof ? sizeof(DoorProof)
                                                   : c.address.size();
    std::byte* into = c.state == Conn::State::kAddress ? c.address.data() : c.in;
    if (c.have < want) {
      auto n = platform::RecvSome(c.fd.get(), into + c.have, want - c.have);
      if (!n.ok() || *n == 0) {
        ++counters_.dropped;
        log_->debug("{} {}: peer {} hung up mid-handshake", name_, address_, c.peer);
        c.done = true;
        return;
      }
      if (*n < 0) return;
      c.have += static_cast<size_t>(*n);
      if (c.have < want) continue;
    }
    c.have = 0;
    if (c.state == Conn::State::kHello) {
      auto hello = ParseDoorHello({c.in, sizeof(DoorHello)});
      DoorChallenge ch{};
      ch.magic = kDoorMagic;
      ch.version = kDoorVersion;
      if (!hello.ok()) {
        // Garbage (not our magic) gets no answer; another version of ours is told so.
        DoorHello raw;
        std::memcpy(&raw, c.in, sizeof raw);
        ++counters_.dropped;
        log_->info("{} {}: peer {}: {}; disconnected", name_, address_, c.peer,
                   hello.status().message());
        if (raw.magic != kDoorMagic) {
          c.done = true;
          return;
        }
        ch.status = static_cast<uint32_t>(DoorStatus::kWrongVersion);
        c.out.assign(BytesOf(ch).begin(), BytesOf(ch).end());
        c.state = Conn::State::kClosing;
        continue;
      }
      c.hello = *hello;
      if (c.hello.service != static_cast<uint32_t>(service_)) {
        ch.status = static_cast<uint32_t>(DoorStatus::kWrongService);
        c.out.assign(BytesOf(ch).begin(), BytesOf(ch).end());
        refuse("it asked for another service");
        continue;
      }
      if (!RandomBytes(c.server_nonce).ok()) {
        ++counters_.dropped;
        c.done = true;
        return;
      }
      ch.status = static_cast<uint32_t>(DoorStatus::kOk);
      std::memcpy(ch.nonce, c.server_nonce, kDoorNonceBytes);
      auto proof = DoorProofOf(token_, true, c.hello.service, c.hello.nonce, c.server_nonce);
      std::memcpy(ch.proof, proof.data(), proof.size());
      c.out.assign(BytesOf(ch).begin(), BytesOf(ch).end());
      c.sent = 0;
      c.state = Conn::State::kProof;
      continue;
    }
    if (c.state == Conn::State::kProof) {
      auto proof = ParseDoorProof({c.in, sizeof(DoorProof)});
      if (!proof.ok()) {
        ++counters_.dropped;
        log_->info("{} {}: peer {}: {}; disconnected", name_, address_, c.peer,
                   proof.status().message());
        c.done = true;
        return;
      }
      auto expected = DoorProofOf(token_, false, c.hello.service, c.hello.nonce, c.server_nonce);
      if (!SameSecret(expected, proof->proof)) {
        ++counters_.auth_failed;
        RecordFailure(c.host);
        log_->warn("{} {}: peer {}: wrong token (its proof failed); refused", name_, address_,
                   c.peer);
        DoorAdmit a{kDoorMagic, static_cast<uint32_t>(DoorStatus::kWrongToken), 0, {}};
        c.out.assign(BytesOf(a).begin(), BytesOf(a).end());
        c.sent = 0;
        c.state = Conn::State::kClosing;
        continue;
      }
      c.proof = *proof;
      c.address.resize(proof->address_bytes);  // authenticated: now its address is read
      c.state = Conn::State::kAddress;
      continue;
    }
    // kAddress: the whole worker address is in. Even an authenticated peer's is checked
    // before UCX sees it (an abort there would end the network process).
    if (Status checked = CheckWorkerAddress(c.address, "peer " + c.peer); !checked.ok()) {
      ++counters_.dropped;
      log_->info("{} {}: {}; disconnected", name_, address_, checked.message());
      c.done = true;
      return;
    }
    DoorAdmission admission;
    admission.peer = c.peer;
    admission.peer_host = c.host;
    admission.worker_address = std::move(c.address);
    DoorAdmit a{kDoorMagic, static_cast<uint32_t>(DoorStatus::kOk), 0, {}};
    if (!RandomBytes(a.ticket).ok()) {
      ++counters_.dropped;
      c.done = true;
      return;
    }
    std::memcpy(admission.ticket.data(), a.ticket, kDoorTicketBytes);
    auto ours = admit(admission);
    c.sent = 0;
    if (!ours.ok()) {
      a.status = static_cast<uint32_t>(DoorStatus::kBusy);
      c.out.assign(BytesOf(a).begin(), BytesOf(a).end());
      refuse(ours.status().message());
      continue;
    }
    a.address_bytes = static_cast<uint32_t>(ours->size());
    c.out.assign(BytesOf(a).begin(), BytesOf(a).end());
    c.out.insert(c.out.end(), ours->begin(), ours->end());
    ++counters_.admitted;
    c.state = Conn::State::kClosing;
  }
}

void FrontDoorServer::Step(const AdmitFn& admit) {
  const auto now = Clock::now();
  // Accept what waits (a bounded number per step), refusing at once past the limits.
  for (int i = 0; i < 64; ++i) {
    auto accepted = platform::AcceptTcp(listen_.get());
    if (!accepted.ok()) {
      // Out of descriptors: what waits stays in the backlog; say so once a step.
      log_->warn("{} {}: {}", name_, address_, accepted.status().message());
      break;
    }
    if (!accepted->fd.valid()) break;
    std::string peer = platform::AddressText(accepted->peer.get());
    std::string host = HostOf(peer);
    size_t of_host = 0;
    for (const auto& c : conns_) of_host += c->host == host ? 1 : 0;
    if (Throttled(host, now)) {
      ++counters_.refused;
      continue;  // closed as `accepted` goes
    }
    if (conns_.size() >= limits_.max_handshakes || of_host >= limits_.max_handshakes_per_peer) {
      ++counters_.refused;
      log_->debug("{} {}: peer {}: too many handshakes in progress; refused", name_, address_,
                  peer);
      continue;
    }
    auto c = std::make_unique<Conn>();
    c->fd = std::move(accepted->fd);
    c->peer = std::move(peer);
    c->host = std::move(host);
    c->since = now;
    conns_.push_back(std::move(c));
  }
  const auto limit = std::chrono::duration<double>(limits_.handshake_seconds);
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn& c = **it;
    Advance(c, admit);
    if (!c.done && Clock::now() - c.since > limit) {
      ++counters_.timed_out;
      log_->info("{} {}: peer {}: no complete handshake within {} s; disconnected", name_,
                 address_, c.peer, limits_.handshake_seconds);
      c.done = true;
    }
    it = c.done ? conns_.erase(it) : std::next(it);
  }
}

void FrontDoorServer::Wait(int extra_fd, int timeout_ms) {
  std::vector<pollfd> fds;
  fds.reserve(conns_.size() + 2);
  fds.push_back({listen_.get(), POLLIN, 0});
  auto nearest = Clock::now() + std::chrono::milliseconds(timeout_ms);
  const auto limit = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(limits_.handshake_seconds));
  for (const auto& c : conns_) {
    short events = c->sent < c->out.size() ? POLLOUT : POLLIN;
    fds.push_back({c->fd.get(), events, 0});
    nearest = std::min(nearest, c->since + limit);
  }
  if (extra_fd >= 0) fds.push_back({extra_fd, POLLIN, 0});
  (void)platform::PollFds(fds.data(), fds.size(), std::min(timeout_ms, MsUntil(nearest) + 1));
}

Status CheckWorkerAddress(std::span<const std::byte> address, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return Corrupt(what + " sent a UCX worker address that UCX would not take (" + why +
                   "); not used");
  };
  if (address.size() < 2 || address.size() > kMaxWorkerAddressBytes) {
    return bad(std::to_string(address.size()) + " bytes; 2.." +
               std::to_string(kMaxWorkerAddressBytes));
  }
  // UCX 1.13's header (front_door.h): the version in the low nibble of the first byte.
  constexpr uint8_t kVersionV1 = 0, kVersionV2 = 1;
  constexpr uint8_t kFlagDebugInfo = 1, kFlagWorkerUuid = 2, kFlagClientId = 4;
  constexpr uint8_t kKnownFlags = 0x0f;
  const auto* b = reinterpret_cast<const uint8_t*>(address.data());
  const uint8_t version = b[0] & 0x0f;
  uint8_t flags = 0;
  size_t at = 0;
  if (version == kVersionV1) {
    flags = b[0] >> 4;
    at = 1;
  } else if (version == kVersionV2) {
    flags = b[1];
    at = 2;
  } else {
    return bad("address version " + std::to_string(version) + "; UCX packs 0 or 1");
  }
  if ((flags & ~kKnownFlags) != 0) {
    char text[8];
    std::snprintf(text, sizeof text, "0x%02x", flags);
    return bad(std::string("unknown header flags ") + text);
  }
  if (flags & kFlagWorkerUuid) at += 8;
  if (flags & kFlagClientId) at += 8;
  if ((flags & kFlagDebugInfo) && at < address.size()) at += 1 + b[at];
  if (at >= address.size()) {
    return bad("its header runs past its " + std::to_string(address.size()) + " bytes");
  }
  if (b[at] == 0xff) return bad("it names no transport");
  return Status::Ok();
}

Status RequireDoorToken(std::string_view token, bool allow_no_token, const std::string& what,
                        const std::string& how, const std::string& opt_in) {
  if (!token.empty() || allow_no_token) return Status::Ok();
  return PermissionDenied(
      what + ": refused: no token given (" + how +
      "): without one nothing proves who answers on that port, and this process would hand "
      "its UCX a worker address of that stranger's choice; give the server's token, or set " +
      opt_in + " to take an unauthenticated peer (a trusted private network only)");
}

Status CheckListenToken(const std::string& listen, std::string_view token, bool allow_no_token,
                        const std::string& what, const std::string& opt_in, spdlog::logger& log) {
  if (!token.empty()) return Status::Ok();
  EA_ASSIGN_OR_RETURN(platform::SocketAddress address, platform::ResolveHostPort(listen));
  if (platform::IsLoopback(address)) return Status::Ok();
  if (!allow_no_token) {
    return PermissionDenied(
        what + " on " + listen +
        " without a token: refused. Any host that reaches that address would be admitted and "
        "could read what is served; give a token (--token, $EXPERT_ARENA_TOKEN, listen_token), "
        "or " + opt_in + " on a trusted private network");
  }
  log.warn(
      "{} on {} without a token ({}): any host that reaches that address is admitted and can "
      "read what is served",
      what, listen, opt_in);
  return Status::Ok();
}

Result<DoorChallenge> ReadDoorChallenge(const DoorHello& hello, std::span<const std::byte> bytes,
                                        std::string_view token, const std::string& what) {
  auto challenge = ParseDoorChallenge(bytes);
  if (!challenge.ok()) {
    return Unsupported(what + " is not an expert-arena front door of this version (" +
                       challenge.status().message() + ")");
  }
  if (challenge->status != static_cast<uint32_t>(DoorStatus::kOk)) {
    return PermissionDenied(what + " refused: " + DoorStatusText(challenge->status));
  }
  auto expected = DoorProofOf(token, true, hello.service, hello.nonce, challenge->nonce);
  if (!SameSecret(expected, challenge->proof)) {
    return PermissionDenied(what +
                            ": refused: wrong token: the server's proof does not match this "
                            "token (give both sides the same token: --token, $EXPERT_ARENA_TOKEN)");
  }
  return challenge;
}

Result<DoorAdmit> ReadDoorAdmit(std::span<const std::byte> bytes, const std::string& what) {
  auto admit = ParseDoorAdmit(bytes);
  if (!admit.ok()) return Corrupt(what + ": " + admit.status().message());
  if (admit->status != static_cast<uint32_t>(DoorStatus::kOk)) {
    const std::string why = what + " refused: " + DoorStatusText(admit->status);
    if (admit->status == static_cast<uint32_t>(DoorStatus::kBusy)) return Busy(why);
    return PermissionDenied(why);
  }
  return admit;
}

Result<DoorEntry> ReadDoorEntry(const DoorAdmit& admit, std::span<const std::byte> address,
                                const std::string& what) {
  if (address.size() != admit.address_bytes) {
    return Corrupt(what + ": a worker address of " + std::to_string(address.size()) +
                   " bytes where the admit announced " + std::to_string(admit.address_bytes));
  }
  EA_RETURN_IF_ERROR(CheckWorkerAddress(address, what));
  DoorEntry entry;
  std::memcpy(entry.ticket.data(), admit.ticket, kDoorTicketBytes);
  entry.worker_address.assign(address.begin(), address.end());
  return entry;
}

Result<DoorEntry> FrontDoorConnect(const platform::SocketAddress& address, std::string_view token,
                                   DoorService service, std::span<const std::byte> worker_address,
                                   double timeout_seconds, const std::string& what) {
  if (token.size() > kMaxDoorTokenBytes) {
    return InvalidArgument("token of " + std::to_string(token.size()) + " bytes; at most " +
                           std::to_string(kMaxDoorTokenBytes));
  }
  if (worker_address.empty() || worker_address.size() > kMaxWorkerAddressBytes) {
    return Internal("UCX worker address of " + std::to_string(worker_address.size()) + " bytes");
  }
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::max(timeout_seconds, 0.001)));
  auto silent = [&](const Status& s) {
    if (s.code() != StatusCode::kTimedOut) return s;
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g s", timeout_seconds);
    return TimedOut(what + " did not answer within " + seconds +
                    " (a hung or stopped server, a host that went down, or another service "
                    "on that port)");
  };
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::ConnectTcp(address, MsUntil(deadline),
                                                                  what));
  DoorHello hello{kDoorMagic, kDoorVersion, static_cast<uint32_t>(service), {}};
  EA_RETURN_IF_ERROR(RandomBytes(hello.nonce));
  Status s = platform::SendAll(fd.get(), &hello, sizeof hello, MsUntil(deadline), what);
  if (!s.ok()) return silent(s);
  std::byte buffer[sizeof(DoorChallenge)];
  s = platform::RecvAll(fd.get(), buffer, sizeof(DoorChallenge), MsUntil(deadline), what);
  if (!s.ok()) return silent(s);
  EA_ASSIGN_OR_RETURN(DoorChallenge challenge, ReadDoorChallenge(hello, buffer, token, what));
  DoorProof proof{kDoorMagic, static_cast<uint32_t>(worker_address.size()), 0, {}};
  auto mine = DoorProofOf(token, false, hello.service, hello.nonce, challenge.nonce);
  std::memcpy(proof.proof, mine.data(), mine.size());
  std::vector<std::byte> message(sizeof proof + worker_address.size());
  std::memcpy(message.data(), &proof, sizeof proof);
  std::memcpy(message.data() + sizeof proof, worker_address.data(), worker_address.size());
  s = platform::SendAll(fd.get(), message.data(), message.size(), MsUntil(deadline), what);
  if (!s.ok()) return silent(s);
  std::byte admit_bytes[sizeof(DoorAdmit)];
  s = platform::RecvAll(fd.get(), admit_bytes, sizeof admit_bytes, MsUntil(deadline), what);
  if (!s.ok()) return silent(s);
  EA_ASSIGN_OR_RETURN(DoorAdmit admit, ReadDoorAdmit(admit_bytes, what));
  std::vector<std::byte> theirs(admit.address_bytes);
  s = platform::RecvAll(fd.get(), theirs.data(), theirs.size(), MsUntil(deadline), what);
  if (!s.ok()) return silent(s);
  return ReadDoorEntry(admit, theirs, what);
}

}  // namespace expert_arena::remote
