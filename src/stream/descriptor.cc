// The wire form of a TensorDescriptor. Little-endian:
//   "EATD" u16 version u16 flags u32 total_bytes
//   u32 slot u64 generation u64 offset u64 length
//   u16 len + segment name, u16 len + dtype, u16 len + key, u16 ndim + u64 dims[ndim]
//   with flag 2 (a producer that listens, docs/cross-host.md): u16 len + "ADDR:PORT",
//   u64 producer instance, u16 len + boot id
//   with flag 4 (a producer with a listen token): 32 bytes of HMAC-SHA256 keyed by the token
//   over everything before it
//   u64 xxh3 of everything before it
// Decode checks every length against the bytes it got and the name against what a segment
// name may be (one path component, no ".."), so a peer cannot make a consumer open a file
// outside its directory; offsets are checked against the segment when it is opened. The key
// must be non-empty and, like the dtype, hold no control byte (stream::StreamKeyProblem), and
// every refusal quotes a peer's string escaped (common/escape.h), never raw.
#include <xxhash.h>

#include <cstring>

#include "common/escape.h"
#include "common/hmac.h"
#include "expert_arena/stream.h"
#include "stream/segment_format.h"

namespace expert_arena {
namespace {

constexpr char kMagic[4] = {'E', 'A', 'T', 'D'};
constexpr uint16_t kVersion = 1;
constexpr uint16_t kFlagSpilled = 1;
constexpr uint16_t kFlagRemote = 2;  // remote address, producer instance, boot id follow
constexpr uint16_t kFlagMac = 4;     // a MAC keyed by the producer's token follows
constexpr size_t kMacBytes = 32;
constexpr size_t kMaxRemoteText = 300;
constexpr size_t kMaxDescriptorBytes = 4096;
constexpr size_t kMaxDims = stream::kMaxDescriptorDims;
constexpr size_t kMaxText = stream::kMaxDescriptorText;

template <typename T>
void Put(std::string& out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out.append(buf, sizeof(T));
}

void PutText(std::string& out, const std::string& s) {
  Put<uint16_t>(out, static_cast<uint16_t>(s.size()));
  out += s;
}

class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  template <typename T>
  bool Get(T* v) {
    if (bytes_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetText(std::string* s) {
    uint16_t n = 0;
    if (!Get(&n) || n > kMaxText || bytes_.size() - pos_ < n) return false;
    s->assign(bytes_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

Status Refuse(const std::string& why) {
  return InvalidArgument("tensor descriptor refused: " + why);
}

}  // namespace

std::string TensorDescriptor::Encode(std::string_view mac_key) const {
  const bool with_mac = !mac_key.empty() || mac.size() == kMacBytes;
  std::string out;
  out.append(kMagic, 4);
  Put<uint16_t>(out, kVersion);
  Put<uint16_t>(out, static_cast<uint16_t>((spilled ? kFlagSpilled : 0) |
                                           (remote.empty() ? 0 : kFlagRemote) |
                                           (with_mac ? kFlagMac : 0)));
  Put<uint32_t>(out, 0);  // total bytes, patched below
  Put<uint32_t>(out, slot);
  Put<uint64_t>(out, generation);
  Put<uint64_t>(out, offset);
  Put<uint64_t>(out, length);
  PutText(out, segment);
  PutText(out, dtype);
  PutText(out, key);
  Put<uint16_t>(out, static_cast<uint16_t>(shape.size()));
  for (uint64_t d : shape) Put<uint64_t>(out, d);
  if (!remote.empty()) {
    PutText(out, remote);
    Put<uint64_t>(out, producer_instance);
    PutText(out, boot_id);
  }
  uint32_t total =
      static_cast<uint32_t>(out.size() + (with_mac ? kMacBytes : 0) + sizeof(uint64_t));
  std::memcpy(out.data() + 8, &total, sizeof total);
  if (!mac_key.empty()) {
    auto m = HmacSha256(mac_key, {reinterpret_cast<const std::byte*>(out.data()),
                                          out.size()});
    out.append(reinterpret_cast<const char*>(m.data()), m.size());
  } else if (with_mac) {
    out += mac;
  }
  Put<uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

bool TensorDescriptor::MacMatches(std::string_view encoded, std::string_view key) {
  if (encoded.size() < 16 + kMacBytes + 8 || key.empty()) return false;
  uint16_t flags = 0;
  std::memcpy(&flags, encoded.data() + 6, sizeof flags);
  if ((flags & kFlagMac) == 0) return false;
  const size_t covered = encoded.size() - kMacBytes - 8;
  auto m = HmacSha256(key, {reinterpret_cast<const std::byte*>(encoded.data()), covered});
  return SameSecret(
      m, {reinterpret_cast<const uint8_t*>(encoded.data()) + covered, kMacBytes});
}

Result<TensorDescriptor> TensorDescriptor::Decode(std::string_view bytes) {
  if (bytes.size() < 16 || bytes.size() > kMaxDescriptorBytes) {
    return Refuse("size " + std::to_string(bytes.size()) + " bytes outside 16.." +
                  std::to_string(kMaxDescriptorBytes));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) return Refuse("bad magic (not \"EATD\")");
  Reader r(bytes.substr(4));
  uint16_t version = 0, flags = 0;
  uint32_t total = 0;
  r.Get(&version);
  r.Get(&flags);
  r.Get(&total);
  if (version != kVersion) {
    return Refuse("version " + std::to_string(version) + ", this build reads " +
                  std::to_string(kVersion));
  }
  if (total != bytes.size()) {
    return Refuse("it says " + std::to_string(total) + " bytes but " +
                  std::to_string(bytes.size()) + " arrived");
  }
  uint64_t stored_hash = 0;
  std::memcpy(&stored_hash, bytes.data() + bytes.size() - 8, 8);
  if (XXH3_64bits(bytes.data(), bytes.size() - 8) != stored_hash) {
    return Refuse("checksum mismatch (damaged in transit)");
  }
  if ((flags & ~(kFlagSpilled | kFlagRemote | kFlagMac)) != 0)
    return Refuse("unknown flags " + std::to_string(flags));
  TensorDescriptor d;
  d.spilled = (flags & kFlagSpilled) != 0;
  const size_t mac_bytes = (flags & kFlagMac) != 0 ? kMacBytes : 0;
  if (bytes.size() < 4 + 8 + mac_bytes + 8) return Refuse("truncated MAC");
  if (mac_bytes != 0) d.mac.assign(bytes.substr(bytes.size() - 8 - kMacBytes, kMacBytes));
  uint16_t ndim = 0;
  Reader body(bytes.substr(4 + 8, bytes.size() - 4 - 8 - mac_bytes - 8));
  if (!body.Get(&d.slot) || !body.Get(&d.generation) || !body.Get(&d.offset) ||
      !body.Get(&d.length) || !body.GetText(&d.segment) || !body.GetText(&d.dtype) ||
      !body.GetText(&d.key) || !body.Get(&ndim) || ndim > kMaxDims) {
    return Refuse("truncated or oversized field");
  }
  d.shape.resize(ndim);
  for (auto& dim : d.shape) {
    if (!body.Get(&dim)) return Refuse("truncated shape");
  }
  if ((flags & kFlagRemote) != 0) {
    if (!body.GetText(&d.remote) || !body.Get(&d.producer_instance) || !body.GetText(&d.boot_id))
      return Refuse("truncated remote fields");
    // An address and a boot id: printable, short, no path or shell characters.
    auto plain = [](const std::string& t, const char* extra) {
      for (char c : t) {
        bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                  std::strchr(extra, c) != nullptr;
        if (!ok || c == '\0') return false;
      }
      return true;
    };
    if (d.remote.empty() || d.remote.size() > kMaxRemoteText || !plain(d.remote, ".:-[]%_"))
      return Refuse("remote address " + QuoteForMessage(d.remote) + " is not ADDR:PORT");
    if (d.boot_id.size() > 64 || !plain(d.boot_id, "-"))
      return Refuse("boot id " + QuoteForMessage(d.boot_id) + " is not a boot id");
  }
  if (body.pos() != bytes.size() - 20 - mac_bytes) return Refuse("trailing bytes after the fields");
  if (!stream::IsValidSegmentName(d.segment)) {
    return Refuse("segment name " + QuoteForMessage(d.segment) +
                  " is not a stream segment name in the directory (one component, "
                  "\"ea-stream-\" prefix, no \"/\" or \"..\")");
  }
  // The consumer prints the key in its messages, and the application may print the key and
  // the dtype: neither may hold a control byte. Refusals quote them escaped, never raw.
  if (std::string problem = stream::StreamKeyProblem(d.key); !problem.empty()) {
    return Refuse("key " + QuoteForMessage(d.key) + " " + problem);
  }
  if (std::string problem = stream::DtypeProblem(d.dtype); !problem.empty()) {
    return Refuse("dtype " + QuoteForMessage(d.dtype) + " " + problem);
  }
  if (d.offset > UINT64_MAX - d.length) return Refuse("offset + length overflows");
  return d;
}

}  // namespace expert_arena
