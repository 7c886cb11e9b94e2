// Fuzz target: the client's side of the front door (src/remote/front_door.cc: ReadDoorChallenge,
// ReadDoorAdmit, ReadDoorEntry, CheckWorkerAddress), what a consumer or `load --from-peer`
// makes of a server's answers before its UCX sees any byte of them.
//
// Input: u8 flags | 80 bytes of challenge | 32 bytes of admit | the worker address (the rest).
// Flag 1 writes the right magic and version over both messages; flag 2 writes the server's
// right proof (for the token of flag 4: "t0ken", else the empty one), so the fuzzer reaches
// the admit; flag 8 makes the admit an admission announcing exactly the bytes that follow, so
// it reaches the worker address check.
//
// Checks: a challenge is taken only with the server's proof for this token and this hello;
// an admit only with status ok and a worker address size within bounds; an entry only with a
// worker address of that size that CheckWorkerAddress takes, whose version UCX 1.13 packs (a
// version UCX asserts on never reaches it); every refusal says what is wrong, with no control
// byte.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>

#include "common/escape.h"
#include "fuzz_util.h"
#include "remote/front_door.h"

using namespace expert_arena;
using namespace expert_arena::remote;

namespace {

void CheckRefused(const Status& s) {
  fuzz::CheckRefusal(s);
  FUZZ_CHECK(ControlByteProblem(s.message()).empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 + sizeof(DoorChallenge) + sizeof(DoorAdmit)) return 0;
  const uint8_t flags = data[0];
  std::string challenge(reinterpret_cast<const char*>(data + 1), sizeof(DoorChallenge));
  std::string admit(reinterpret_cast<const char*>(data + 1 + sizeof(DoorChallenge)),
                    sizeof(DoorAdmit));
  const size_t head = 1 + sizeof(DoorChallenge) + sizeof(DoorAdmit);
  std::span<const std::byte> address(reinterpret_cast<const std::byte*>(data + head),
                                     size - head);
  const std::string token = (flags & 4) ? "t0ken" : "";
  // A fixed hello: the fuzzer cannot guess its nonce, flag 2 plays a server that read it.
  DoorHello hello{kDoorMagic, kDoorVersion, static_cast<uint32_t>(DoorService::kStream), {}};
  for (size_t i = 0; i < kDoorNonceBytes; ++i) hello.nonce[i] = static_cast<uint8_t>(i * 7 + 1);
  if (flags & 1) {
    std::memcpy(challenge.data(), &kDoorMagic, 8);
    std::memcpy(challenge.data() + 8, &kDoorVersion, 4);
    std::memcpy(admit.data(), &kDoorMagic, 8);
  }
  if (flags & 2) {
    DoorChallenge c;
    std::memcpy(&c, challenge.data(), sizeof c);
    auto proof = DoorProofOf(token, true, hello.service, hello.nonce, c.nonce);
    std::memcpy(challenge.data() + offsetof(DoorChallenge, proof), proof.data(), proof.size());
  }
  if (flags & 8) {
    const uint32_t ok = static_cast<uint32_t>(DoorStatus::kOk);
    const uint32_t bytes = static_cast<uint32_t>(std::min<size_t>(address.size(), UINT32_MAX));
    std::memcpy(admit.data() + offsetof(DoorAdmit, status), &ok, 4);
    std::memcpy(admit.data() + offsetof(DoorAdmit, address_bytes), &bytes, 4);
  }
  const std::string what = "the stream producer at 127.0.0.1:1";

  Status shape = CheckWorkerAddress(address, what);
  if (shape.ok()) {
    FUZZ_CHECK(address.size() >= 2 && address.size() <= kMaxWorkerAddressBytes);
    const uint8_t version = static_cast<uint8_t>(address[0]) & 0x0f;
    FUZZ_CHECK(version == 0 || version == 1);
  } else {
    CheckRefused(shape);
  }

  auto c = ReadDoorChallenge(
      hello, {reinterpret_cast<const std::byte*>(challenge.data()), challenge.size()}, token,
      what);
  if (!c.ok()) {
    CheckRefused(c.status());
    return 0;
  }
  FUZZ_CHECK(c->status == static_cast<uint32_t>(DoorStatus::kOk));
  auto expected = DoorProofOf(token, true, hello.service, hello.nonce, c->nonce);
  FUZZ_CHECK(std::memcmp(expected.data(), c->proof, expected.size()) == 0);

  auto a = ReadDoorAdmit({reinterpret_cast<const std::byte*>(admit.data()), admit.size()}, what);
  if (!a.ok()) {
    CheckRefused(a.status());
    return 0;
  }
  FUZZ_CHECK(a->status == static_cast<uint32_t>(DoorStatus::kOk));
  FUZZ_CHECK(a->address_bytes >= 1 && a->address_bytes <= kMaxWorkerAddressBytes);

  auto entry = ReadDoorEntry(*a, address, what);
  if (!entry.ok()) {
    CheckRefused(entry.status());
    return 0;
  }
  FUZZ_CHECK(shape.ok());
  FUZZ_CHECK(entry->worker_address.size() == a->address_bytes);
  FUZZ_CHECK(std::memcmp(entry->worker_address.data(), address.data(), address.size()) == 0);
  FUZZ_CHECK(std::memcmp(entry->ticket.data(), a->ticket, kDoorTicketBytes) == 0);
  return 0;
}
