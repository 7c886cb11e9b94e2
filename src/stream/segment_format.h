// The layout of a stream segment file, shared by producers, consumers, sweeps and tools.
//
//   [0, 256)           SegmentHeader: magic, version, sizes, owner, release epoch
//   [4096, +64*16)     ReaderEntry[64]: one per consumer process mapping the segment
//   [8192, +slots*64)  BlockSlot[slots]: the release state of every block
//   [data_offset, ...) data: 2 MiB-aligned in the file (data_offset is a multiple of 2 MiB)
//
// Locks (one-byte OFD locks, platform/ofd_lock.h): byte 0 is held exclusively by the owner
// (the producer) for the life of the segment, so a sweep that can take it knows the owner is
// gone, whatever pid was reused; byte 1+i is held exclusively by the consumer that uses
// reader entry i, so the owner can tell a dead reader's holds from a live one's.
//
// A block's state is two words two processes touch (std::atomic_ref, lock-free asserted):
//   control = state (8 bits) | pending releases (24 bits) | low 32 bits of the generation
//   holders = one bit per reader entry holding a view
// A reader sets its holder bit and then checks control; the owner moves control to
// kReclaiming and then checks holders. Both sequentially consistent, so at least one of them
// sees the other: a block is never reused under a view (a Dekker handshake).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "common/units.h"

namespace expert_arena::stream {

inline constexpr char kSegmentMagic[8] = {'E', 'A', 'S', 'T', 'R', 'S', 'E', 'G'};
inline constexpr uint32_t kSegmentVersion = 1;
inline constexpr std::string_view kSegmentPrefix = "ea-stream-";

inline constexpr uint64_t kOwnerLockByte = 0;
inline constexpr uint64_t kReaderLockBase = 1;
inline constexpr uint32_t kMaxReaders = 64;

inline constexpr uint64_t kReadersOffset = 4096;
inline constexpr uint64_t kSlotsOffset = 8192;
inline constexpr uint64_t kHeaderRegionBytes = kHugePageBytes;

enum class SegmentKind : uint32_t { kRegular = 0, kDedicated = 1, kSpill = 2 };

struct SegmentHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_struct_bytes;  // sizeof(SegmentHeader) of the writer
  uint64_t file_bytes;
  uint64_t data_offset;
  uint64_t data_bytes;
  uint64_t readers_offset;
  uint64_t slots_offset;
  uint32_t reader_entries;
  uint32_t reader_entry_bytes;
  uint32_t slot_count;
  uint32_t slot_bytes;
  uint32_t kind;  // SegmentKind
  uint32_t owner_pid;
  uint64_t owner_start_time;  // clock ticks since boot (/proc/<pid>/stat), for messages
  uint32_t owner_uid;
  uint32_t reserved0;
  uint64_t created_unix_ns;
  char logical_name[64];   // NUL-terminated
  uint64_t release_epoch;  // atomic: bumped by a reader whenever it releases a hold
  // The inode of the owner's PID namespace (/proc/self/ns/pid): owner_pid means a process of
  // that namespace only. 0: not recorded (a segment written before it was).
  uint64_t owner_pid_namespace;
  uint64_t owner_closed;   // atomic: 1 once the owner closed the stream (zero in older files)
  uint64_t reserved[8];
};
static_assert(sizeof(SegmentHeader) == 256);
static_assert(offsetof(SegmentHeader, release_epoch) % 8 == 0);
static_assert(offsetof(SegmentHeader, owner_closed) % 8 == 0);
static_assert(std::is_trivially_copyable_v<SegmentHeader>);

struct ReaderEntry {
  uint64_t owner;       // atomic: 0 free, else the reader's pid
  uint64_t start_time;  // of that pid, for messages
};
static_assert(sizeof(ReaderEntry) == 16);
static_assert(kReadersOffset + kMaxReaders * sizeof(ReaderEntry) <= kSlotsOffset);

struct BlockSlot {
  uint64_t control;     // atomic, see ControlWord
  uint64_t holders;     // atomic bit mask of reader entries holding a view
  uint64_t generation;  // bumped each time the slot gets a new block
  uint64_t offset;      // of the block's bytes in the file
  uint64_t length;      // tensor bytes (the block may be longer, rounded to the alignment)
  uint64_t reserved[3];
};
static_assert(sizeof(BlockSlot) == 64);
static_assert(std::is_trivially_copyable_v<BlockSlot>);
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);

inline constexpr uint32_t kMaxSlots =
    static_cast<uint32_t>((kHeaderRegionBytes - kSlotsOffset) / sizeof(BlockSlot));

enum class BlockState : uint8_t {
  kFree = 0,
  kWriting = 1,     // reserved by the producer, bytes being written
  kPublished = 2,   // readable until `pending` reaches zero
  kAborted = 3,     // its key was aborted: freed once no reader holds it
  kReclaiming = 4,  // the owner is deciding whether to free it
};

inline constexpr uint32_t kMaxPending = (1u << 24) - 1;

struct ControlWord {
  static uint64_t Make(BlockState state, uint32_t pending, uint64_t generation) {
    return (static_cast<uint64_t>(state) << 56) |
           (static_cast<uint64_t>(pending & kMaxPending) << 32) | (generation & 0xffffffffu);
  }
  static BlockState State(uint64_t c) { return static_cast<BlockState>(c >> 56); }
  static uint32_t Pending(uint64_t c) { return static_cast<uint32_t>(c >> 32) & kMaxPending; }
  static uint32_t Generation(uint64_t c) { return static_cast<uint32_t>(c); }
};

inline const char* BlockStateName(BlockState s) {
  switch (s) {
    case BlockState::kFree:
      return "free";
    case BlockState::kWriting:
      return "writing";
    case BlockState::kPublished:
      return "published";
    case BlockState::kAborted:
      return "aborted";
    case BlockState::kReclaiming:
      return "reclaiming";
  }
  return "unknown";
}

inline std::atomic_ref<uint64_t> AtomicWord(uint64_t& word) {
  return std::atomic_ref<uint64_t>(word);
}

// Pointers into a mapped segment; valid while the mapping lives. The header fields were
// checked by ValidateHeader before a view is made.
struct SegmentView {
  std::byte* base = nullptr;
  SegmentHeader* header = nullptr;
  ReaderEntry* readers = nullptr;
  BlockSlot* slots = nullptr;
  uint32_t slot_count = 0;

  static SegmentView Of(std::byte* base) {
    SegmentView v;
    v.base = base;
    v.header = reinterpret_cast<SegmentHeader*>(base);
    v.readers = reinterpret_cast<ReaderEntry*>(base + v.header->readers_offset);
    v.slots = reinterpret_cast<BlockSlot*>(base + v.header->slots_offset);
    v.slot_count = v.header->slot_count;
    return v;
  }
  std::atomic_ref<uint64_t> epoch() const { return AtomicWord(header->release_epoch); }
  std::atomic_ref<uint64_t> closed() const { return AtomicWord(header->owner_closed); }
};

// The lease of a reader entry: a consumer holds the OFD lock on byte 1+entry while it maps the
// segment, so whoever takes that lock (the owner's dead-reader check, or a new consumer taking
// the entry over) knows the reader is gone, and calls this with the lock held. For every block
// the dead reader held (its holder bit set) it spends that reader's share, when the block is
// still published and waiting for releases, then clears the bit; then it bumps the epoch so
// the owner rescans. A reader that opened a block once holds one share (the usual case: one
// Open per consumer process); a second Open of the same block in the same process took a
// second share that stays until the block's key is aborted. Returns the blocks released.
uint64_t SpendDeadReaderHolds(const SegmentView& view, uint32_t entry);

// Why `header` (the first bytes of a file of `file_bytes`) is not a segment this build can
// use, or "" when it is. Every size and offset is checked against the real file size.
std::string ValidateHeader(const SegmentHeader& header, uint64_t file_bytes);

// Why a descriptor's block (slot, [offset, offset + length)) cannot be read from a segment
// with `slot_count` block slots, data from `data_offset` and a mapping of `file_bytes`, or ""
// when it can: the slot is in the block table and the bytes lie in [data_offset, file_bytes).
// The consumer applies it to every descriptor a peer sends before it touches the block.
std::string ValidateBlockReference(uint64_t slot, uint64_t offset, uint64_t length,
                                   uint32_t slot_count, uint64_t data_offset, uint64_t file_bytes);

// What a descriptor carries at most (descriptor.cc): bytes of each text field (segment name,
// dtype, key) and dimensions of the shape. The producer refuses more before it reserves.
inline constexpr size_t kMaxDescriptorText = 1024;
inline constexpr size_t kMaxDescriptorDims = 16;

// Why `key` cannot own stream blocks, or "": it must not be empty (the producer finds a key's
// blocks by exact match, and the empty key would be the one a caller forgot to set), hold a
// control byte (below 0x20, or 0x7f: consumers print keys in their messages and a peer's key
// must not drive the operator's terminal), nor be longer than a descriptor carries. Any other
// bytes are the caller's: keys are matched exactly, never by prefix or suffix. The problem
// never quotes the key; callers quote it with QuoteForMessage (common/escape.h).
std::string StreamKeyProblem(std::string_view key);
// Why `dtype` cannot travel in a descriptor, or "": a control byte, or too long. The library
// does not interpret dtypes, so any other string (the empty one included) is fine.
std::string DtypeProblem(std::string_view dtype);

// Segment names: "ea-stream-<logical>-<pid>-<starttime>-<random>-<seq>". A valid name is a
// single path component of [A-Za-z0-9_.-], starting with the prefix and at most 200 bytes.
bool IsValidSegmentName(std::string_view name);
bool IsValidLogicalName(std::string_view name);

}  // namespace expert_arena::stream
