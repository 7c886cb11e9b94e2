// What crosses the wire in a peer fill (docs/cross-host.md). First the front door
// (front_door.h: plain TCP, the token proved by HMAC, UCX worker addresses exchanged); then two
// active messages, then the arena file (header region, then data) in one of two ways, the
// server's choice (Offer's transport, `serve --transport`):
//   client -> server  kHelloId: Hello (the front door's ticket: names the admitted peer)
//   server -> client  kOfferId: Offer, then the packed rkey (get) or nothing (am), or a
//                     refusal's text
//   get: the client reads the server's mapping with ucp_get_nbx through that rkey;
//   am:  the client asks for ranges of the file (kRangeRequestId: Range), and the server
//        answers each with kRangeDataId (header: the same Range; data: exactly those bytes),
//        after checking the range against the file; a range outside it closes the endpoint.
//   The client closes its endpoint when done.
// The structs are little-endian, fixed-size and versioned; every length is checked against
// the message's size before it is used.
#pragma once

#include <cstdint>
#include <type_traits>

namespace expert_arena::remote {

inline constexpr uint64_t kWireMagic = 0x4c4c4946'41524145ull;  // "EARAFILL"
inline constexpr uint32_t kWireVersion = 3;  // 3: the front door; the hello carries a ticket
inline constexpr uint32_t kHelloId = 0x4541;
inline constexpr uint32_t kOfferId = 0x4542;
inline constexpr uint32_t kRangeRequestId = 0x4543;
inline constexpr uint32_t kRangeDataId = 0x4544;
inline constexpr uint32_t kMaxTokenBytes = 256;
inline constexpr uint32_t kMaxRkeyBytes = 64 * 1024;
inline constexpr uint32_t kMaxRefusalBytes = 1024;
// The largest range one request may ask for (the client's chunk is at most 1 GiB too).
inline constexpr uint64_t kMaxRangeBytes = 1ull << 30;

// How the arena's bytes cross: the client reads the server's registered mapping (get), or the
// server sends the ranges the client asks for, each checked against the file (am).
enum class PeerTransport : uint32_t { kGet = 0, kAm = 1 };

inline const char* PeerTransportName(PeerTransport t) {
  return t == PeerTransport::kAm ? "am" : "get";
}

struct Hello {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved;
  uint8_t ticket[16];  // the front door's DoorAdmit::ticket
};

enum class OfferStatus : uint32_t { kOk = 0, kRefused = 1 };

struct Offer {
  uint64_t magic;
  uint32_t version;
  uint32_t status;          // OfferStatus
  uint64_t region_address;  // get: the server's mapping of its arena file (header, then data)
  uint64_t region_bytes;    // the whole file
  uint64_t header_bytes;
  uint64_t data_bytes;
  uint64_t identity_hash;
  uint32_t payload_bytes;  // get: the rkey (kOk); the refusal text (kRefused); after this struct
  uint32_t transport;      // PeerTransport
};

// A range of the server's arena file (offset 0: the header's first byte): the body of a
// kRangeRequestId, the header of the kRangeDataId that answers it.
struct Range {
  uint64_t offset;
  uint64_t bytes;
};

static_assert(sizeof(Hello) == 32);
static_assert(sizeof(Offer) == 64);
static_assert(sizeof(Range) == 16 && std::is_trivially_copyable_v<Range>);
static_assert(std::is_trivially_copyable_v<Hello> && std::is_trivially_copyable_v<Offer>);

}  // namespace expert_arena::remote
