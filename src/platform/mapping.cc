#include "platform/mapping.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "common/units.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

namespace expert_arena::platform {
namespace {

// Reserves length + alignment bytes of address space and returns an aligned address inside
// it, with the slack before and after unmapped again.
Result<std::byte*> ReserveAligned(uint64_t length, uint64_t alignment, const std::string& what) {
  auto span = AlignUp(length, BasePageSize());
  if (!span || *span > UINT64_MAX - alignment) {
    return InvalidArgument("map " + what + ": length " + std::to_string(length) + " overflows");
  }
  uint64_t reserve = *span + alignment;
  void* base =
      ::mmap(nullptr, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return ErrnoStatus(errno, "reserve address space for", what);
  auto start = reinterpret_cast<uintptr_t>(base);
  uintptr_t aligned = (start + alignment - 1) & ~(static_cast<uintptr_t>(alignment) - 1);
  if (aligned > start) ::munmap(base, aligned - start);
  uintptr_t end = start + reserve;
  uintptr_t used_end = aligned + *span;
  if (end > used_end) ::munmap(reinterpret_cast<void*>(used_end), end - used_end);
  return reinterpret_cast<std::byte*>(aligned);
}

}  // namespace

Mapping::Mapping(Mapping&& other) noexcept
    : data_(other.data_),
      size_(other.size_),
      writable_(other.writable_),
      alignment_(other.alignment_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = other.data_;
    size_ = other.size_;
    writable_ = other.writable_;
    alignment_ = other.alignment_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void Mapping::Reset() {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

Result<Mapping> Mapping::MapFile(const UniqueFd& fd, uint64_t length, bool writable,
                                 uint64_t alignment) {
  if (!IsPowerOfTwo(alignment) || alignment < BasePageSize()) {
    return InvalidArgument("map " + fd.path() + ": bad alignment " + std::to_string(alignment));
  }
  EA_ASSIGN_OR_RETURN(std::byte * where, ReserveAligned(length, alignment, fd.path()));
  int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* got = ::mmap(where, length, prot, MAP_SHARED | MAP_FIXED, fd.get(), 0);
  if (got == MAP_FAILED) {
    int err = errno;
    ::munmap(where, length);
    return ErrnoStatus(err, "mmap", fd.path());
  }
  return Mapping(static_cast<std::byte*>(got), length, writable, alignment);
}

Result<Mapping> Mapping::MapFileCopyOnWrite(const UniqueFd& fd, uint64_t length, uint64_t alignment,
                                            bool no_reserve) {
  if (!IsPowerOfTwo(alignment) || alignment < BasePageSize()) {
    return InvalidArgument("map " + fd.path() + ": bad alignment " + std::to_string(alignment));
  }
  EA_ASSIGN_OR_RETURN(std::byte * where, ReserveAligned(length, alignment, fd.path()));
  int flags = MAP_PRIVATE | MAP_FIXED | (no_reserve ? MAP_NORESERVE : 0);
  void* got = ::mmap(where, length, PROT_READ | PROT_WRITE, flags, fd.get(), 0);
  if (got == MAP_FAILED) {
    int err = errno;
    ::munmap(where, length);
    return ErrnoStatus(err, "mmap (copy-on-write)", fd.path());
  }
  return Mapping(static_cast<std::byte*>(got), length, true, alignment);
}

Result<Mapping> Mapping::MapAnonymous(uint64_t length, uint64_t alignment) {
  EA_ASSIGN_OR_RETURN(std::byte * where, ReserveAligned(length, alignment, "anonymous memory"));
  void* got =
      ::mmap(where, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (got == MAP_FAILED) {
    int err = errno;
    ::munmap(where, length);
    return ErrnoStatus(err, "mmap", "anonymous memory");
  }
  return Mapping(static_cast<std::byte*>(got), length, true, alignment);
}

Status Mapping::MakeReadOnly() {
  if (data_ == nullptr || !writable_) return Status::Ok();
  if (::mprotect(data_, size_, PROT_READ) != 0) return ErrnoStatus(errno, "mprotect", "mapping");
  writable_ = false;
  return Status::Ok();
}

Status Mapping::MakeWritable() {
  if (data_ == nullptr || writable_) return Status::Ok();
  if (::mprotect(data_, size_, PROT_READ | PROT_WRITE) != 0) {
    return ErrnoStatus(errno, "mprotect", "mapping");
  }
  writable_ = true;
  return Status::Ok();
}

const char* AdviceName(Advice advice) {
  switch (advice) {
    case Advice::kPopulateRead:
      return "MADV_POPULATE_READ";
    case Advice::kPopulateWrite:
      return "MADV_POPULATE_WRITE";
    case Advice::kHugePage:
      return "MADV_HUGEPAGE";
    case Advice::kNoHugePage:
      return "MADV_NOHUGEPAGE";
    case Advice::kCollapse:
      return "MADV_COLLAPSE";
    case Advice::kDontNeed:
      return "MADV_DONTNEED";
  }
  return "madvise";
}

Status AdviseRange(void* data, uint64_t length, Advice advice, const std::string& what) {
  int flag = 0;
  switch (advice) {
    case Advice::kPopulateRead:
      flag = MADV_POPULATE_READ;
      break;
    case Advice::kPopulateWrite:
      flag = MADV_POPULATE_WRITE;
      break;
    case Advice::kHugePage:
      flag = MADV_HUGEPAGE;
      break;
    case Advice::kNoHugePage:
      flag = MADV_NOHUGEPAGE;
      break;
    case Advice::kCollapse:
      flag = MADV_COLLAPSE;
      break;
    case Advice::kDontNeed:
      flag = MADV_DONTNEED;
      break;
  }
  while (::madvise(data, length, flag) != 0) {
    // MADV_POPULATE_* returns EINTR when a signal arrives mid-way; the rest is still wanted.
    if (errno == EINTR) continue;
    return ErrnoStatus(errno, AdviceName(advice), what);
  }
  return Status::Ok();
}

uint64_t BasePageSize() {
  static const uint64_t size = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace expert_arena::platform
