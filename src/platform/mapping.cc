#include "platform/mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>
#include <vector>

#include "common/units.h"
#include "platform/kernel_features.h"
#include "platform/linux_uapi.h"

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

constexpr uint64_t kTouchPiece = 64 * kMiB;

void TouchByte(uintptr_t at, bool write) {
  auto* p = reinterpret_cast<unsigned char*>(at);
  if (write) {
    // A write fault that leaves the byte as it was, whoever else writes it meanwhile.
    __atomic_fetch_or(p, static_cast<unsigned char>(0), __ATOMIC_RELAXED);
  } else {
    (void)*reinterpret_cast<volatile const unsigned char*>(p);
  }
}

// One piece of PopulateByTouch: [begin, end), both base-page aligned.
void TouchPiece(int pagemap_fd, uintptr_t begin, uintptr_t end, bool write,
                std::vector<uint64_t>* entries) {
  const uint64_t page = BasePageSize();
  // One fault per 2 MiB first: where the file (or THP) gives 2 MiB pages, the fault maps the
  // whole page and the pagemap below shows its 512 base pages present.
  TouchByte(begin, write);
  for (uintptr_t at = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1); at < end;
       at += kHugePageBytes) {
    TouchByte(at, write);
  }
  const size_t pages = (end - begin) / page;
  entries->resize(pages);
  const auto want = static_cast<ssize_t>(pages * sizeof(uint64_t));
  if (pagemap_fd < 0 || ::pread(pagemap_fd, entries->data(), static_cast<size_t>(want),
                                static_cast<off_t>(begin / page * sizeof(uint64_t))) != want) {
    for (uintptr_t at = begin; at < end; at += page) TouchByte(at, write);
    return;
  }
  constexpr uint64_t kPresent = 1ull << 63;
  // Each absent page faulted in one by one: a fallocated tmpfs page is not up to date until
  // first written, so a read fault maps no neighbours with it (no fault-around) and is no
  // cheaper than the write (bench/populate_bench).
  for (size_t i = 0; i < pages; ++i) {
    if (((*entries)[i] & kPresent) == 0) TouchByte(begin + i * page, write);
  }
}

}  // namespace

double PopulateByTouch(void* data, uint64_t length, bool write, unsigned threads) {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t page = BasePageSize();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + length + page - 1) / page * page;
  if (length == 0 || end <= begin) return 0;
  // pagemap is readable by the process itself (PFNs hidden without CAP_SYS_ADMIN, the
  // present bit kept, since 4.2). Without it every base page is touched.
  UniqueFd pagemap(::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC), "/proc/self/pagemap");
  const size_t pieces = (end - begin + kTouchPiece - 1) / kTouchPiece;
  unsigned workers =
      threads != 0 ? threads : std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 8);
  workers = static_cast<unsigned>(std::min<size_t>(workers, pieces));
  std::atomic<size_t> next{0};
  auto work = [&] {
    std::vector<uint64_t> entries;
    for (size_t i; (i = next.fetch_add(1)) < pieces;) {
      const uintptr_t from = begin + i * kTouchPiece;
      TouchPiece(pagemap.get(), from, std::min<uintptr_t>(end, from + kTouchPiece), write,
                 &entries);
    }
  };
  if (workers <= 1) {
    work();
  } else {
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < workers; ++w) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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

Status Mapping::ProtectReadOnly(uint64_t offset, uint64_t length) {
  if (data_ == nullptr || length == 0) return Status::Ok();
  if (offset > size_ || length > size_ - offset) {
    return InvalidArgument("mprotect of a range past the end of the mapping");
  }
  if (::mprotect(data_ + offset, length, PROT_READ) != 0) {
    return ErrnoStatus(errno, "mprotect", "mapping");
  }
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
  if (advice == Advice::kPopulateRead || advice == Advice::kPopulateWrite) {
    if (!Kernel().has(KernelFeature::kPopulate)) {
      const double seconds = PopulateByTouch(data, length, advice == Advice::kPopulateWrite);
      CountFallback(KernelFeature::kPopulate, seconds, length);
      return Status::Ok();
    }
  }
  if (advice == Advice::kCollapse && !Kernel().has(KernelFeature::kCollapse)) {
    return Unsupported(std::string("MADV_COLLAPSE ") + what + ": not in this kernel (" +
                       Kernel().get(KernelFeature::kCollapse).answer + "; Linux 6.1+)");
  }
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
  // Advice that frees nothing goes to the kernel by its system call number, not through libc's
  // madvise: UCX, loaded in an engine that streams from or fills from other hosts, rewrites that
  // function in place as it starts (UCX_MEM_MMAP_HOOK_MODE=bistro), and a thread inside it
  // meanwhile can crash (an engine did, at address 0, with the Python package's collapse
  // thread). MADV_DONTNEED still goes through libc: UCX's memory events must hear of it.
  const auto call = [&] {
    if (advice == Advice::kDontNeed) return ::madvise(data, length, flag);
    return static_cast<int>(::syscall(SYS_madvise, data, length, flag));
  };
  while (call() != 0) {
    // MADV_POPULATE_* returns EINTR when a signal arrives mid-way; the rest is still wanted.
    if (errno == EINTR) continue;
    return ErrnoStatus(errno, AdviceName(advice), what);
  }
  return Status::Ok();
}

Status FaultInChecked(void* data, uint64_t length, const std::string& what) {
  if (!Kernel().has(KernelFeature::kPopulate)) {
    return Unsupported(std::string("MADV_POPULATE_READ ") + what + ": not in this kernel (" +
                       Kernel().get(KernelFeature::kPopulate).answer + "; Linux 5.14+)");
  }
  return AdviseRange(data, length, Advice::kPopulateRead, what);
}

uint64_t BasePageSize() {
  static const uint64_t size = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace expert_arena::platform
