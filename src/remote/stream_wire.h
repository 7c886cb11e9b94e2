// What crosses the wire for a tensor stream across hosts (docs/cross-host.md). First the
// front door (front_door.h: plain TCP, the token proved by HMAC, UCX worker addresses
// exchanged); then active messages only; the consumer never gets an rkey, so it reads nothing
// the producer did not choose to send:
//   consumer -> producer  kStreamHelloId: StreamHello (the front door's ticket)
//   producer -> consumer  kStreamWelcomeId: StreamWelcome (+ a refusal's text)
//   consumer -> producer  kStreamOpenId: StreamOpen, then the encoded descriptor
//   producer -> consumer  kStreamDataId: header StreamData, data = the block's bytes (status
//                         kOk) or a refusal's text
//   producer -> consumer  kStreamDoneId: StreamDone (+ text), once the data send completed: kOk,
//                         or kRefused when the key was aborted meanwhile
//   consumer -> producer  kStreamReleaseId: StreamRelease (spend the share, or give it back)
// A producer whose welcome carries kStreamFeatureOpenMany (a uint32 after StreamWelcome; an
// older consumer ignores it) also takes a batch of opens in one message, and answers it with one
// "done" for the batch once every data send of it completed:
//   consumer -> producer  kStreamOpenManyId: StreamOpenMany, then `count` records, each a
//                         StreamOpen and its descriptor (at most kStreamMaxOpenManyBytes in all)
//   producer -> consumer  kStreamDoneManyId: StreamDoneMany (kOk for the records' requests that
//                         were served; a batch with a key aborted mid-transfer gets one
//                         StreamDone per request instead, as single opens do)
// A producer whose welcome carries kStreamFeatureChunks sends a block of more than
// kStreamChunkBytes to an open that asked for it (StreamOpen::flags kStreamOpenChunks) as
// chunks, each hashed on its own, so that hashing, sending, receiving and checking overlap
// instead of taking turns (a refusal is still one kStreamDataId message; "done" as before):
//   producer -> consumer  kStreamChunkId: header StreamChunk, data = the chunk's bytes
// Fixed-size little-endian structs; every length is checked against the message's size.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace expert_arena::remote {

inline constexpr uint64_t kStreamMagic = 0x4d414552'54534145ull;  // "EASTREAM"
inline constexpr uint32_t kStreamVersion = 2;  // 2: the front door; a ticket in the hello
inline constexpr uint32_t kStreamHelloId = 0x4551;
inline constexpr uint32_t kStreamWelcomeId = 0x4552;
inline constexpr uint32_t kStreamOpenId = 0x4553;
inline constexpr uint32_t kStreamDataId = 0x4554;
inline constexpr uint32_t kStreamDoneId = 0x4555;
inline constexpr uint32_t kStreamReleaseId = 0x4556;
inline constexpr uint32_t kStreamOpenManyId = 0x4557;
inline constexpr uint32_t kStreamDoneManyId = 0x4558;
inline constexpr uint32_t kStreamChunkId = 0x4559;
inline constexpr uint32_t kStreamFeatureOpenMany = 1u << 0;
inline constexpr uint32_t kStreamFeatureChunks = 1u << 1;
inline constexpr uint32_t kStreamOpenChunks = 1u << 0;  // StreamOpen::flags
// The producer's chunk size. A consumer takes any chunk size from kStreamMinChunkBytes to the
// block's length, the same for every chunk of a block.
inline constexpr uint64_t kStreamChunkBytes = 4u << 20;
inline constexpr uint64_t kStreamMinChunkBytes = 64u << 10;
// A batch message stays well under UCX's eager limits (the server takes no rendezvous open).
inline constexpr uint32_t kStreamMaxOpenManyBytes = 16u << 10;
// A block up to this size is sent eager (UCP_AM_SEND_FLAG_EAGER), whatever UCX's threshold.
inline constexpr uint64_t kStreamEagerMaxBytes = 256u << 10;
inline constexpr uint32_t kStreamMaxTokenBytes = 256;
inline constexpr uint32_t kStreamMaxDescriptorBytes = 4096;
inline constexpr uint32_t kStreamMaxTextBytes = 1024;

enum class StreamStatus : uint32_t { kOk = 0, kRefused = 1 };

struct StreamHello {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved;
  uint8_t ticket[16];  // the front door's DoorAdmit::ticket
};

struct StreamWelcome {
  uint64_t magic;
  uint32_t version;
  uint32_t status;  // StreamStatus
  uint64_t instance_id;
};

struct StreamOpen {
  uint64_t request;
  uint64_t instance_id;  // the descriptor's producer instance
  uint32_t descriptor_bytes;
  uint32_t flags;  // kStreamOpen*; 0 from consumers before kStreamFeatureChunks
};

struct StreamData {
  uint64_t request;
  uint32_t status;  // StreamStatus
  uint32_t reserved;
  uint64_t hold;    // the producer's id of this consumer's hold (kOk)
  uint64_t length;  // of the data that follows: the block (kOk) or the text
  uint64_t xxh3;    // of the block's bytes (kOk)
};

struct StreamDone {
  uint64_t request;
  uint32_t status;
  uint32_t text_bytes;  // the refusal's text follows
};

struct StreamRelease {
  uint64_t hold;
  uint32_t spend;  // 1: a release (the share is spent); 0: given back unread
  uint32_t reserved;
};

// Chunk `offset / chunk_bytes` of a block of `total` bytes: `length` bytes at `offset`, where
// offset is a multiple of chunk_bytes and length is min(chunk_bytes, total - offset).
struct StreamChunk {
  uint64_t request;
  uint64_t hold;  // the producer's id of this consumer's hold, the same in every chunk
  uint64_t total;
  uint64_t offset;
  uint64_t length;
  uint64_t chunk_bytes;
  uint64_t xxh3;  // of this chunk's bytes
};

struct StreamOpenMany {
  uint32_t count;
  uint32_t reserved;
};

struct StreamDoneMany {
  uint64_t first_request;  // the batch's first record's request
  uint32_t count;          // its records: requests first_request .. first_request + count - 1
  uint32_t status;         // kOk
};

struct StreamOpenRecord {
  StreamOpen open;
  std::string_view descriptor;  // into the message
};

// The records of a kStreamOpenManyId message, or false when it is malformed in any way (a
// count that the bytes do not hold, a descriptor past the end or over the limit, bytes left
// over, requests not consecutive): the server drops such a message whole.
inline bool ParseOpenMany(std::span<const std::byte> message, std::vector<StreamOpenRecord>* out) {
  out->clear();
  StreamOpenMany head{};
  if (message.size() < sizeof head || message.size() > kStreamMaxOpenManyBytes) return false;
  std::memcpy(&head, message.data(), sizeof head);
  size_t at = sizeof head;
  if (head.count == 0 || head.count > (message.size() - at) / sizeof(StreamOpen)) return false;
  for (uint32_t i = 0; i < head.count; ++i) {
    StreamOpenRecord r{};
    if (message.size() - at < sizeof r.open) return false;
    std::memcpy(&r.open, message.data() + at, sizeof r.open);
    at += sizeof r.open;
    if (r.open.descriptor_bytes > kStreamMaxDescriptorBytes ||
        r.open.descriptor_bytes > message.size() - at)
      return false;
    if (i > 0 && r.open.request != out->front().open.request + i) return false;
    r.descriptor = std::string_view(reinterpret_cast<const char*>(message.data() + at),
                                    r.open.descriptor_bytes);
    at += r.open.descriptor_bytes;
    out->push_back(r);
  }
  return at == message.size();
}

// Whether chunk `h` fits a block of `total` bytes, given the first chunk that arrived for it
// (null for the first): its own total, a chunk size from kStreamMinChunkBytes to total, an
// offset on that grid inside the block, the length the grid gives it, and the first chunk's
// size and hold. Which chunk it is, h.offset / h.chunk_bytes, is for the caller to find unseen.
inline bool ChunkFits(const StreamChunk& h, uint64_t total, const StreamChunk* first) {
  return h.total == total && h.chunk_bytes >= kStreamMinChunkBytes && h.chunk_bytes <= total &&
         h.offset < total && h.offset % h.chunk_bytes == 0 &&
         h.length == std::min(h.chunk_bytes, total - h.offset) &&
         (first == nullptr || (h.chunk_bytes == first->chunk_bytes && h.hold == first->hold));
}

static_assert(sizeof(StreamHello) == 32 && sizeof(StreamWelcome) == 24);
static_assert(sizeof(StreamOpen) == 24 && sizeof(StreamData) == 40);
static_assert(sizeof(StreamDone) == 16 && sizeof(StreamRelease) == 16);
static_assert(sizeof(StreamOpenMany) == 8 && sizeof(StreamDoneMany) == 16);
static_assert(sizeof(StreamChunk) == 56 && std::is_trivially_copyable_v<StreamChunk>);
static_assert(std::is_trivially_copyable_v<StreamData>);

}  // namespace expert_arena::remote
