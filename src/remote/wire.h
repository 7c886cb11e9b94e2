// What crosses the wire in a peer fill (docs/cross-host.md). Two active messages, then
// one-sided reads:
//   client -> server  kHelloId: Hello, then the token's bytes
//   server -> client  kOfferId: Offer, then the packed rkey (status kOk) or a refusal's text
//   client reads the server's arena file (header region, then data) with ucp_get_nbx through
//   that rkey, and closes its endpoint.
// The structs are little-endian, fixed-size and versioned; every length is checked against
// the message's size before it is used.
#pragma once

#include <cstdint>
#include <type_traits>

namespace expert_arena::remote {

inline constexpr uint64_t kWireMagic = 0x4c4c4946'41524145ull;  // "EARAFILL"
inline constexpr uint32_t kWireVersion = 1;
inline constexpr uint32_t kHelloId = 0x4541;
inline constexpr uint32_t kOfferId = 0x4542;
inline constexpr uint32_t kMaxTokenBytes = 256;
inline constexpr uint32_t kMaxRkeyBytes = 64 * 1024;
inline constexpr uint32_t kMaxRefusalBytes = 1024;

struct Hello {
  uint64_t magic;
  uint32_t version;
  uint32_t token_bytes;  // followed by that many bytes
};

enum class OfferStatus : uint32_t { kOk = 0, kRefused = 1 };

struct Offer {
  uint64_t magic;
  uint32_t version;
  uint32_t status;          // OfferStatus
  uint64_t region_address;  // the server's mapping of its arena file (header, then data)
  uint64_t region_bytes;    // the whole file
  uint64_t header_bytes;
  uint64_t data_bytes;
  uint64_t identity_hash;
  uint32_t payload_bytes;  // the rkey (kOk) or the refusal text (kRefused), after this struct
  uint32_t reserved;
};

static_assert(sizeof(Hello) == 16);
static_assert(sizeof(Offer) == 64);
static_assert(std::is_trivially_copyable_v<Hello> && std::is_trivially_copyable_v<Offer>);

}  // namespace expert_arena::remote
