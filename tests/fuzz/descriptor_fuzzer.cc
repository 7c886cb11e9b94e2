// Fuzz target: TensorDescriptor::Decode (src/stream/descriptor.cc), what a consumer applies to
// the bytes a peer sent before it maps anything.
//
// Input: u8 flags | the descriptor bytes. Flag 1 patches the total-length field and the
// trailing xxh3 so they match, as a hostile peer would, so the fuzzer reaches the field checks.
//
// Checks: an accepted descriptor names a plain segment file name, its key is not empty, its
// key, dtype and segment name hold no control byte (consumers and applications print them),
// its offset + length does not overflow, and it is canonical: Encode() gives back exactly the
// bytes that were decoded. A refusal's message holds no control byte either: it quotes the
// peer's strings escaped.
#include <xxhash.h>

#include <cstring>
#include <string>

#include "common/escape.h"
#include "expert_arena/stream.h"
#include "fuzz_util.h"
#include "stream/segment_format.h"

using namespace expert_arena;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t flags = data[0];
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((flags & 1) && bytes.size() >= 16) {
    uint32_t total = static_cast<uint32_t>(bytes.size());
    std::memcpy(bytes.data() + 8, &total, sizeof total);
    uint64_t hash = XXH3_64bits(bytes.data(), bytes.size() - 8);
    std::memcpy(bytes.data() + bytes.size() - 8, &hash, sizeof hash);
  }
  auto decoded = TensorDescriptor::Decode(bytes);
  if (!decoded.ok()) {
    fuzz::CheckRefusal(decoded.status());
    FUZZ_CHECK(ControlByteProblem(decoded.status().message()).empty());
    return 0;
  }
  const TensorDescriptor& d = *decoded;
  FUZZ_CHECK(stream::IsValidSegmentName(d.segment));
  FUZZ_CHECK(!d.key.empty());
  FUZZ_CHECK(ControlByteProblem(d.key).empty() && ControlByteProblem(d.dtype).empty() &&
             ControlByteProblem(d.segment).empty());
  FUZZ_CHECK(d.segment.find('/') == std::string::npos && d.segment.find("..") == std::string::npos);
  FUZZ_CHECK(d.offset <= UINT64_MAX - d.length);
  FUZZ_CHECK(d.Encode() == bytes);
  auto again = TensorDescriptor::Decode(d.Encode());
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->segment == d.segment && again->spilled == d.spilled && again->slot == d.slot &&
             again->generation == d.generation && again->offset == d.offset &&
             again->length == d.length && again->dtype == d.dtype && again->shape == d.shape &&
             again->key == d.key && again->remote == d.remote &&
             again->producer_instance == d.producer_instance && again->boot_id == d.boot_id);
  FUZZ_CHECK(ControlByteProblem(d.remote).empty() && ControlByteProblem(d.boot_id).empty());
  return 0;
}
