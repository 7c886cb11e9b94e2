// The front door of `serve` and of a listening StreamProducer (docs/cross-host.md): a plain TCP
// listener of the project's own on the listen address, and the only thing of ours a peer can
// reach before it is authenticated. UCX's connection layer asserts on malformed input (a
// 109-byte packet killed the whole process), so UCX sees no byte of a peer that has not proved
// it knows the shared token:
//
//   client -> server  DoorHello      (48 bytes: magic, version, service, client nonce)
//   server -> client  DoorChallenge  (80 bytes: status, server nonce, the server's proof)
//   client -> server  DoorProof      (48 bytes: the client's proof, its UCX worker address'
//                                     size), then that address (read only once the proof holds)
//   server -> client  DoorAdmit      (32 bytes: status, a one-time ticket, the server's worker
//                                     address' size), then that address
//
// A proof is HMAC-SHA256 keyed by the token (OpenSSL's libcrypto) over a label of its side,
// the service and both nonces: each side proves knowledge of the token, and the token itself
// never crosses the wire. The client checks the server's proof before it sends its own. Then
// both sides make UCX endpoints from the worker addresses (UCP_EP_PARAM_FIELD_REMOTE_ADDRESS),
// and the client's first active message carries the ticket, which names its admission. No
// token: the same exchange with an empty key (it proves nothing; docs say what that exposes),
// which a client takes only when told to (RequireDoorToken).
//
// Bounds: the server reads at most the fixed size of the message it waits for (the worker
// address only after the proof held, at most kMaxWorkerAddressBytes); a whole handshake has a
// deadline; handshakes in progress are bounded in all and per peer address; a peer address with
// too many failed proofs in an interval is refused at accept until the interval passes (logged
// once per peer per interval). Every socket is closed when its handshake ends.
//
// The message parsers are pure functions (tests/fuzz/front_door_fuzzer.cc), and so is what a
// client makes of the server's answers (tests/fuzz/front_door_client_fuzzer.cc).
//
// Thread-safety: a FrontDoorServer is used by one thread; FrontDoorConnect is reentrant.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "common/door_counters.h"
#include "common/hmac.h"
#include "expert_arena/status.h"
#include "platform/file.h"
#include "platform/net.h"

namespace spdlog {
class logger;
}

namespace expert_arena::remote {

inline constexpr uint64_t kDoorMagic = 0x524f4f44'41524145ull;  // "EARADOOR"
inline constexpr uint32_t kDoorVersion = 1;
inline constexpr size_t kDoorNonceBytes = 32;
inline constexpr size_t kDoorProofBytes = 32;  // HMAC-SHA256
inline constexpr size_t kDoorTicketBytes = 16;
inline constexpr uint32_t kMaxWorkerAddressBytes = 16 * 1024;
inline constexpr size_t kMaxDoorTokenBytes = 256;

// What the client asks for: the server of the other service refuses it.
enum class DoorService : uint32_t { kPeerFill = 1, kStream = 2 };

enum class DoorStatus : uint32_t {
  kOk = 0,
  kWrongToken = 1,    // the client's proof failed
  kBusy = 2,          // too many connections (in all, or of this peer address)
  kThrottled = 3,     // too many failed proofs from this peer address lately
  kWrongService = 4,  // a stream client at a peer-fill server, or the reverse
  kWrongVersion = 5,
};

struct DoorHello {
  uint64_t magic;
  uint32_t version;
  uint32_t service;  // DoorService
  uint8_t nonce[kDoorNonceBytes];
};

struct DoorChallenge {
  uint64_t magic;
  uint32_t version;
  uint32_t status;  // DoorStatus; kOk: the nonce and the proof are valid
  uint8_t nonce[kDoorNonceBytes];
  uint8_t proof[kDoorProofBytes];
};

struct DoorProof {
  uint64_t magic;
  uint32_t address_bytes;  // the client's worker address follows
  uint32_t reserved;       // 0
  uint8_t proof[kDoorProofBytes];
};

struct DoorAdmit {
  uint64_t magic;
  uint32_t status;         // DoorStatus
  uint32_t address_bytes;  // kOk: the server's worker address follows
  uint8_t ticket[kDoorTicketBytes];
};

static_assert(sizeof(DoorHello) == 48 && sizeof(DoorChallenge) == 80);
static_assert(sizeof(DoorProof) == 48 && sizeof(DoorAdmit) == 32);
static_assert(std::is_trivially_copyable_v<DoorHello> &&
              std::is_trivially_copyable_v<DoorChallenge> &&
              std::is_trivially_copyable_v<DoorProof> && std::is_trivially_copyable_v<DoorAdmit>);

using DoorTicket = std::array<uint8_t, kDoorTicketBytes>;

// The parsers: exactly the message's size, the magic, the version and every field in range,
// else kInvalidArgument naming what is wrong. Pure: no I/O, no allocation beyond the message.
Result<DoorHello> ParseDoorHello(std::span<const std::byte> bytes);
Result<DoorChallenge> ParseDoorChallenge(std::span<const std::byte> bytes);
Result<DoorProof> ParseDoorProof(std::span<const std::byte> bytes);
Result<DoorAdmit> ParseDoorAdmit(std::span<const std::byte> bytes);

// "wrong token", "busy", ... for messages.
const char* DoorStatusText(uint32_t status);

// HMAC-SHA256 and the constant-time comparison (common/hmac.h).
using ::expert_arena::HmacSha256;
using ::expert_arena::SameSecret;
// Random bytes from OpenSSL's generator; kInternal when it has no entropy.
Status RandomBytes(std::span<uint8_t> out);

// The proof of `server` (or the client) for one exchange.
std::array<uint8_t, kDoorProofBytes> DoorProofOf(std::string_view token, bool server,
                                                 uint32_t service, const uint8_t* client_nonce,
                                                 const uint8_t* server_nonce);

struct FrontDoorLimits {
  double handshake_seconds = 10;  // a whole handshake, from accept to the admit
  size_t max_handshakes = 64;     // in progress at once, in all
  size_t max_handshakes_per_peer = 8;
  uint32_t max_failures = 5;  // failed proofs of one peer address per interval before refusal
  double failure_interval_seconds = 10;
};

// An authenticated peer, handed to the admit callback.
struct DoorAdmission {
  std::string peer;       // "ADDR:PORT" of its TCP connection
  std::string peer_host;  // its address without the port (the unit of limits and throttling)
  DoorTicket ticket{};
  std::vector<std::byte> worker_address;  // the peer's UCX worker address
};

class FrontDoorServer {
 public:
  // Listens on exactly `address` (port 0: any free one). `name` prefixes the log lines
  // ("expert-arena serve", "stream server"). Errors: the address cannot be bound.
  static Result<std::unique_ptr<FrontDoorServer>> Listen(const platform::SocketAddress& address,
                                                         std::string token, DoorService service,
                                                         const FrontDoorLimits& limits,
                                                         std::string name,
                                                         std::shared_ptr<spdlog::logger> log);
  ~FrontDoorServer();

  const std::string& address() const { return address_; }  // "ADDR:PORT" as bound
  uint16_t port() const { return port_; }
  const DoorCounters& counters() const { return counters_; }
  size_t handshakes() const { return conns_.size(); }

  // Called for a peer whose proof held, with its worker address: returns the worker address to
  // send it, or an error status whose code kBusy refuses it as busy (any other: refused too).
  using AdmitFn = std::function<Result<std::span<const std::byte>>(const DoorAdmission&)>;

  // Accepts what waits and advances every handshake as far as its bytes allow; never blocks.
  void Step(const AdmitFn& admit);
  // Waits up to `timeout_ms` for one of the door's sockets, or `extra_fd` (>= 0), to be ready.
  void Wait(int extra_fd, int timeout_ms);
  // A failed proof of `peer_host` outside the door (a ticket never used), for the throttle.
  void RecordFailure(const std::string& peer_host);

 private:
  struct Conn;
  FrontDoorServer() = default;
  void Advance(Conn& c, const AdmitFn& admit);
  bool Throttled(const std::string& host, std::chrono::steady_clock::time_point now);

  platform::UniqueFd listen_;
  std::string address_;
  uint16_t port_ = 0;
  std::string token_;
  DoorService service_ = DoorService::kPeerFill;
  FrontDoorLimits limits_;
  std::string name_;
  std::shared_ptr<spdlog::logger> log_;
  std::list<std::unique_ptr<Conn>> conns_;
  struct Failures {
    std::chrono::steady_clock::time_point since;
    uint32_t count = 0;
    bool logged = false;
  };
  std::map<std::string, Failures> failures_;
  DoorCounters counters_;
};

// The structural check of a UCX worker address a peer sent, made before UCX sees it: UCX
// unpacks a worker address without its length and asserts on what it does not expect (a wrong
// version is `address.c:1051 Assertion '*addr_version == UCP_OBJECT_VERSION_V2'`, which aborts
// the process). What UCX 1.13 packs (src/ucp/wireup/address.c): a header byte whose low 4 bits
// are the address version (0: v1, its flags in the high 4 bits; 1: v2, its flags in a second
// byte); flags above bit 3 unknown; then a worker uuid and a client id (8 bytes each) when
// their flags say, a worker name (a length byte, then that many bytes) with the debug-info
// flag, then the device list, which must name at least one device (0xff: none). The check
// stops at the header: the device list is UCX's own business, and a peer that passes the check
// has either proved the token or was let in by an explicit opt-in (docs/cross-host.md).
// Errors: kCorrupt naming `what` and what is wrong.
Status CheckWorkerAddress(std::span<const std::byte> address, const std::string& what);

// A client refuses to go through the door without a token unless `allow_no_token`: with an
// empty key the server's proof proves nothing, so whoever answers on that port would hand
// this process's UCX a worker address of its choice. `how` names the setting that gives a
// token (`remote_token`, `--token`) and `opt_in` the one that lifts the refusal. kPermission
// naming `what`; Ok when a token is given or the opt-in is.
Status RequireDoorToken(std::string_view token, bool allow_no_token, const std::string& what,
                        const std::string& how, const std::string& opt_in);

// A server (serve, a listening producer) on an address other hosts can reach, without a
// token, would admit whoever reaches its port: refused (kPermission naming `what` and
// `opt_in`) unless `allow_no_token`, and then a warning says what is exposed. Loopback
// addresses are reachable from this host only and pass. kInvalidArgument for an address
// that does not parse.
Status CheckListenToken(const std::string& listen, std::string_view token, bool allow_no_token,
                        const std::string& what, const std::string& opt_in, spdlog::logger& log);

// What a client makes of the server's answers, as pure functions of the bytes received (the
// steps of FrontDoorConnect; tests/fuzz/front_door_client_fuzzer.cc drives them):
// - the challenge to `hello`: parsed, a refusal reported, the server's proof checked against
//   `token` (kPermission when it does not hold);
// - the admit: parsed, a refusal reported (kBusy, kPermission), else the size of the worker
//   address that follows;
// - that address, checked by CheckWorkerAddress.
// Errors name `what` as FrontDoorConnect's do.
struct DoorEntry {
  DoorTicket ticket{};
  std::vector<std::byte> worker_address;
};
Result<DoorChallenge> ReadDoorChallenge(const DoorHello& hello, std::span<const std::byte> bytes,
                                        std::string_view token, const std::string& what);
Result<DoorAdmit> ReadDoorAdmit(std::span<const std::byte> bytes, const std::string& what);
Result<DoorEntry> ReadDoorEntry(const DoorAdmit& admit, std::span<const std::byte> address,
                                const std::string& what);

// The client's side: connects to `address`, proves the token, checks the server's proof,
// sends `worker_address` and returns the server's (checked by CheckWorkerAddress) with the
// ticket. Every step is bounded by `timeout_seconds`. Errors: kTimedOut (a silent server),
// kIoError (unreachable, reset), kPermission (a wrong token on either side, throttled, or
// refused), kBusy (the server is full), kUnsupported (another protocol version), kCorrupt (a
// malformed admit or worker address), all naming `what` (e.g. "peer 10.0.0.1:4791"). Callers
// check RequireDoorToken first.
Result<DoorEntry> FrontDoorConnect(const platform::SocketAddress& address, std::string_view token,
                                   DoorService service, std::span<const std::byte> worker_address,
                                   double timeout_seconds, const std::string& what);

}  // namespace expert_arena::remote
