// Memory mappings placed at 2 MiB-aligned addresses, and the madvise calls made on them.
//
// A tmpfs or hugetlbfs file can only be backed by 2 MiB pages where the file offset and
// the virtual address agree modulo 2 MiB, so every mapping here is placed at an address
// aligned to `alignment` (reserve a larger PROT_NONE range, then MAP_FIXED inside it).
//
// Thread-safety: a Mapping is a move-only owner; the bytes it maps may be used from any
// thread. The destructor unmaps; callers unregister from the GPU before that.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "expert_arena/status.h"
#include "platform/file.h"

namespace expert_arena::platform {

class Mapping {
 public:
  Mapping() = default;
  ~Mapping() { Reset(); }
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool writable() const { return writable_; }
  std::span<std::byte> bytes() const { return {data_, size_}; }
  void Reset();

  // Maps [0, length) of fd MAP_SHARED at an address aligned to `alignment` (a power of
  // two, at least the page size). length must not exceed the file's size.
  static Result<Mapping> MapFile(const UniqueFd& fd, uint64_t length, bool writable,
                                 uint64_t alignment);
  // Maps [0, length) of fd MAP_PRIVATE, PROT_READ | PROT_WRITE, at an aligned address and
  // without populating it: reads see the file's pages (no memory of its own), a write copies
  // the page it touches into this process only and never reaches the file or other mappings.
  // fd needs only read access. `no_reserve` adds MAP_NORESERVE, which hugetlbfs needs so that
  // the mapping does not reserve a huge page per page of the file up front (a write then takes
  // a free huge page from the pool, and is SIGBUS when the pool has none).
  static Result<Mapping> MapFileCopyOnWrite(const UniqueFd& fd, uint64_t length, uint64_t alignment,
                                            bool no_reserve);
  // Private anonymous memory at an aligned address.
  static Result<Mapping> MapAnonymous(uint64_t length, uint64_t alignment);

  // mprotect the whole mapping read-only (after a load is published).
  Status MakeReadOnly();
  // mprotect it readable and writable again.
  Status MakeWritable();
  // mprotect [offset, offset + length) of a mapping read-only, the rest as it is (writable()
  // still says what the rest is). offset and length are multiples of the mapping's page size
  // (a hugetlbfs mapping's huge page); EINVAL otherwise.
  Status ProtectReadOnly(uint64_t offset, uint64_t length);

  // The alignment the mapping was placed at (0 when unknown).
  uint64_t alignment() const { return alignment_; }

 private:
  Mapping(std::byte* data, uint64_t size, bool writable, uint64_t alignment)
      : data_(data), size_(size), writable_(writable), alignment_(alignment) {}
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  bool writable_ = false;
  uint64_t alignment_ = 0;
};

enum class Advice {
  kPopulateRead,   // MADV_POPULATE_READ (5.14): fault the range in, read-only
  kPopulateWrite,  // MADV_POPULATE_WRITE (5.14): fault it in writable, allocating
  kHugePage,       // MADV_HUGEPAGE
  kNoHugePage,     // MADV_NOHUGEPAGE
  kCollapse,       // MADV_COLLAPSE (6.1): make the range whole 2 MiB pages now
  kDontNeed,       // MADV_DONTNEED
};

const char* AdviceName(Advice advice);

// madvise(2) on [data, data+length). `what` names the mapping for the message.
// kPopulateRead/kPopulateWrite on a kernel without them (before 5.14, kernel_features.h) fault
// the range in by touching it (PopulateByTouch): the range must then be wholly backed (an
// allocated file within its size, or anonymous memory), as a touch of a page the file cannot
// back raises SIGBUS where MADV_POPULATE_* returns an error. kCollapse on a kernel without it
// (before 6.1) is kUnsupported without a call.
Status AdviseRange(void* data, uint64_t length, Advice advice, const std::string& what);

// MADV_POPULATE_READ of a file mapping used as a guard: it fails (EFAULT) where the file was
// truncated under the mapping, where a touch would raise SIGBUS. kUnsupported on a kernel
// without it: the caller reads the file instead.
Status FaultInChecked(void* data, uint64_t length, const std::string& what);

// The fallback for MADV_POPULATE_*: one byte of each 2 MiB of the range touched first (a
// range on 2 MiB pages is then mapped in one fault per page), then every base page that
// /proc/self/pagemap does not show present, on up to 8 threads in 64 MiB pieces. A write
// touch is an atomic OR of zero, so it changes no byte and may race with writers. The range
// must be wholly backed (see AdviseRange). Returns the seconds it took.
double PopulateByTouch(void* data, uint64_t length, bool write, unsigned threads = 0);

// The system's base page size.
uint64_t BasePageSize();

}  // namespace expert_arena::platform
