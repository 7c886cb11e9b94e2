// Fuzz target: signed descriptors (TensorDescriptor::MacMatches and Decode, src/stream/
// descriptor.cc), what a consumer with a remote_token and a listening producer's stream server
// apply to a descriptor a peer sent. The MAC check comes first there, and random bytes never
// pass it: here the input is signed with the token before it is checked (the MAC check as good
// as off), so the fuzzer reaches what runs after it.
//
// Input: u8 flags | the descriptor bytes. The descriptor's flags get the MAC bit, its total
// length is patched, its last 40 bytes become the MAC (HMAC-SHA256 keyed by the token over
// every byte before it) and the xxh3, as a producer that knows the token would write them.
// Flag 1 leaves the MAC bit as the input has it (a descriptor that claims no MAC); flag 2
// signs with another token than the one checked.
//
// Checks: MacMatches holds exactly for a descriptor signed with the token checked; an accepted
// descriptor keeps its MAC, re-encodes to exactly its bytes, and re-signing it with the token
// gives them again; one bit changed anywhere in what the MAC covers fails the MAC; the
// server's local copy (remote fields and MAC stripped) decodes, names no producer and carries
// no MAC; refusals say what is wrong, with no control byte.
#include <xxhash.h>

#include <cstring>
#include <string>

#include "common/escape.h"
#include "common/hmac.h"
#include "expert_arena/stream.h"
#include "fuzz_util.h"

using namespace expert_arena;

namespace {

constexpr uint16_t kFlagMac = 4;  // descriptor.cc's flag bit
constexpr size_t kMacBytes = 32;
constexpr char kToken[] = "t0ken";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t flags = data[0];
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if (bytes.size() < 16 + kMacBytes + 8) return 0;
  uint16_t dflags = 0;
  std::memcpy(&dflags, bytes.data() + 6, sizeof dflags);
  if (!(flags & 1)) dflags |= kFlagMac;
  std::memcpy(bytes.data() + 6, &dflags, sizeof dflags);
  const uint32_t total = static_cast<uint32_t>(bytes.size());
  std::memcpy(bytes.data() + 8, &total, sizeof total);
  const size_t covered = bytes.size() - kMacBytes - 8;
  const std::string key = (flags & 2) ? "another" : kToken;
  auto mac = HmacSha256(key, {reinterpret_cast<const std::byte*>(bytes.data()), covered});
  std::memcpy(bytes.data() + covered, mac.data(), kMacBytes);
  const uint64_t hash = XXH3_64bits(bytes.data(), bytes.size() - 8);
  std::memcpy(bytes.data() + bytes.size() - 8, &hash, sizeof hash);

  const bool signed_here = (dflags & kFlagMac) != 0 && !(flags & 2);
  FUZZ_CHECK(TensorDescriptor::MacMatches(bytes, kToken) == signed_here);
  FUZZ_CHECK(!TensorDescriptor::MacMatches(bytes, ""));
  if (signed_here) {
    // One bit changed in what the MAC covers: the MAC no longer holds.
    std::string changed = bytes;
    changed[flags % covered] ^= 0x40;
    FUZZ_CHECK(!TensorDescriptor::MacMatches(changed, kToken));
  }

  auto decoded = TensorDescriptor::Decode(bytes);
  if (!decoded.ok()) {
    fuzz::CheckRefusal(decoded.status());
    FUZZ_CHECK(ControlByteProblem(decoded.status().message()).empty());
    return 0;
  }
  const TensorDescriptor& d = *decoded;
  FUZZ_CHECK(d.Encode() == bytes);
  if ((dflags & kFlagMac) != 0) {
    FUZZ_CHECK(d.mac == bytes.substr(covered, kMacBytes));
    FUZZ_CHECK(d.Encode(key) == bytes);
  }
  FUZZ_CHECK(ControlByteProblem(d.key).empty() && ControlByteProblem(d.remote).empty());
  // The stream server opens a descriptor as a local one only (stream_server.cc).
  TensorDescriptor local = d;
  local.remote.clear();
  local.producer_instance = 0;
  local.boot_id.clear();
  local.mac.clear();
  auto again = TensorDescriptor::Decode(local.Encode());
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->remote.empty() && again->mac.empty());
  FUZZ_CHECK(again->segment == d.segment && again->slot == d.slot && again->key == d.key &&
             again->offset == d.offset && again->length == d.length);
  FUZZ_CHECK(!TensorDescriptor::MacMatches(local.Encode(), kToken));
  return 0;
}
