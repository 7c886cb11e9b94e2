// Fuzz target: the front door's message parsers (src/remote/front_door.cc), what `serve` and a
// listening producer apply to the bytes of a peer that has not proved anything yet.
//
// Input: u8 flags | the message bytes. Flag 1 writes the right magic (and flag 2 the right
// version) over the first bytes, as a peer that read the protocol would, so the fuzzer reaches
// the field checks.
//
// Checks: every parser takes exactly its message's size and nothing else; an accepted message
// has the magic, the version, a known service or status, and a worker address size within
// 1..kMaxWorkerAddressBytes where one is announced (the server allocates that much only after
// the proof held); a refusal says what is wrong and holds no control byte.
#include <cstring>
#include <string>

#include "common/escape.h"
#include "fuzz_util.h"
#include "remote/front_door.h"

using namespace expert_arena;
using namespace expert_arena::remote;

namespace {

template <typename T>
void CheckRefusalOrSize(const Result<T>& r, size_t size) {
  if (!r.ok()) {
    fuzz::CheckRefusal(r.status());
    FUZZ_CHECK(ControlByteProblem(r.status().message()).empty());
    return;
  }
  FUZZ_CHECK(size == sizeof(T));
  FUZZ_CHECK(r->magic == kDoorMagic);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t flags = data[0];
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((flags & 1) && bytes.size() >= 8) std::memcpy(bytes.data(), &kDoorMagic, 8);
  if ((flags & 2) && bytes.size() >= 12) std::memcpy(bytes.data() + 8, &kDoorVersion, 4);
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size());

  auto hello = ParseDoorHello(in);
  CheckRefusalOrSize(hello, in.size());
  if (hello.ok()) {
    FUZZ_CHECK(hello->version == kDoorVersion);
    FUZZ_CHECK(hello->service == static_cast<uint32_t>(DoorService::kPeerFill) ||
               hello->service == static_cast<uint32_t>(DoorService::kStream));
  }
  auto challenge = ParseDoorChallenge(in);
  CheckRefusalOrSize(challenge, in.size());
  if (challenge.ok()) {
    FUZZ_CHECK(challenge->version == kDoorVersion);
    FUZZ_CHECK(challenge->status <= static_cast<uint32_t>(DoorStatus::kWrongVersion));
    FUZZ_CHECK(std::string(DoorStatusText(challenge->status)).size() > 0);
  }
  auto proof = ParseDoorProof(in);
  CheckRefusalOrSize(proof, in.size());
  if (proof.ok()) {
    FUZZ_CHECK(proof->address_bytes >= 1 && proof->address_bytes <= kMaxWorkerAddressBytes);
    FUZZ_CHECK(proof->reserved == 0);
  }
  auto admit = ParseDoorAdmit(in);
  CheckRefusalOrSize(admit, in.size());
  if (admit.ok()) {
    FUZZ_CHECK(admit->status <= static_cast<uint32_t>(DoorStatus::kWrongVersion));
    if (admit->status == static_cast<uint32_t>(DoorStatus::kOk)) {
      FUZZ_CHECK(admit->address_bytes >= 1 && admit->address_bytes <= kMaxWorkerAddressBytes);
    } else {
      FUZZ_CHECK(admit->address_bytes == 0);
    }
  }
  return 0;
}
