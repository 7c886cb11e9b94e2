#include "platform/guarded_copy.h"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/units.h"
#include "platform/mapping.h"

namespace expert_arena::platform {
namespace {

// A guarded copy in progress: its thread, the range it reads, where its SIGBUS goes back to.
// Only the thread named by `tid` writes the other fields, before it publishes `tid`, and only
// that thread's handler reads them (a fault's signal goes to the thread that faulted).
struct GuardSlot {
  std::atomic<pid_t> tid{0};
  const std::byte* lo = nullptr;
  const std::byte* hi = nullptr;
  sigjmp_buf* env = nullptr;
};

GuardSlot g_slots[kGuardedThreads];
struct sigaction g_previous;
std::once_flag g_install_once;
int g_install_errno = 0;

pid_t ThreadId() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// Async-signal-safe: atomics, system calls and siglongjmp only.
void OnSigbus(int sig, siginfo_t* info, void* context) {
  if (info != nullptr && info->si_code > 0) {  // a fault's, not one sent with kill
    const pid_t tid = ThreadId();
    const auto* addr = static_cast<const std::byte*>(info->si_addr);
    for (GuardSlot& slot : g_slots) {
      if (slot.tid.load(std::memory_order_acquire) != tid) continue;
      if (addr >= slot.lo && addr < slot.hi) siglongjmp(*slot.env, 1);
      break;
    }
  }
  // Not a guarded copy's: the handler that was there before.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL &&
      g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default action (a fault's SIGBUS cannot be ignored): the process ends as it would have.
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(SIGBUS, &fallback, nullptr);
  ::raise(SIGBUS);
}

Status InstallHandler() {
  std::call_once(g_install_once, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    // SA_NODEFER: the handler runs with the interrupted mask, so siglongjmp needs not restore
    // one (sigsetjmp without a sigprocmask per copy).
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (::sigaction(SIGBUS, &action, &g_previous) != 0) g_install_errno = errno;
  });
  if (g_install_errno != 0) {
    return ErrnoStatus(g_install_errno, "installing the SIGBUS handler of guarded copies", "");
  }
  return Status::Ok();
}

// A free slot, taken (tid -1 until the copy publishes its own); waited for when every slot is.
GuardSlot& TakeSlot() {
  for (;;) {
    for (GuardSlot& slot : g_slots) {
      pid_t free = 0;
      if (slot.tid.load(std::memory_order_relaxed) == 0 &&
          slot.tid.compare_exchange_strong(free, -1, std::memory_order_acquire)) {
        return slot;
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace

Result<uint64_t> CopyOutOfMapping(const std::byte* base, uint64_t size,
                                  std::span<const CopyRun> runs, const std::string& what) {
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].offset > size || runs[i].bytes > size - runs[i].offset) {
      return InvalidArgument("run " + std::to_string(i) + " reads " +
                             std::to_string(runs[i].bytes) + " bytes at offset " +
                             std::to_string(runs[i].offset) + " of " + what + ", which has " +
                             std::to_string(size));
    }
  }
  EA_RETURN_IF_ERROR(InstallHandler());
  const pid_t tid = ThreadId();
  GuardSlot& slot = TakeSlot();
  sigjmp_buf env;
  slot.lo = base;
  slot.hi = base + size;
  slot.env = &env;
  // volatile: read again after a siglongjmp back into this frame.
  volatile size_t at = 0;
  volatile uint64_t total = 0;
  if (sigsetjmp(env, 0) != 0) {
    slot.tid.store(0, std::memory_order_release);
    const size_t i = at;
    return Corrupt(what + " lost pages under the copy (truncated by its owner): run " +
                   std::to_string(i) + " (" + std::to_string(runs[i].bytes) +
                   " bytes at offset " + std::to_string(runs[i].offset) +
                   ") reads past its end; " + std::to_string(total) + " bytes were copied");
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  slot.tid.store(tid, std::memory_order_release);
  while (at < runs.size()) {
    const CopyRun& run = runs[at];
    std::memcpy(run.to, base + run.offset, run.bytes);
    total = total + run.bytes;
    at = at + 1;
  }
  slot.tid.store(0, std::memory_order_release);
  return static_cast<uint64_t>(total);
}

struct MappedFileSource::State {
  std::string what;
  UniqueFd fd;
  uint64_t size = 0;
  double watch_seconds = 1.0;
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  std::shared_ptr<Mapping> mapping;  // under mu; reset once the file is removed
  bool stop = false;                  // under mu
  bool populated = false;             // under mu
  std::thread thread;

  std::shared_ptr<Mapping> Held() const {
    std::lock_guard<std::mutex> lock(mu);
    return mapping;
  }

  // The thread: the pages mapped in (64 MiB at a time, at nice 10), then the file watched.
  void Run() {
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(ThreadId()), 10);
    constexpr uint64_t kPiece = 64 * kMiB;
    for (uint64_t offset = 0; offset < size; offset += kPiece) {
      std::shared_ptr<Mapping> held = Held();
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) break;
      }
      // MADV_POPULATE_READ fails (EFAULT) on a truncated file where a touch would raise
      // SIGBUS; without it (before 5.14) the copies fault the pages in themselves.
      if (!held || !FaultInChecked(held->data() + offset, std::min(kPiece, size - offset), what)
                       .ok()) {
        break;
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    populated = true;
    cv.notify_all();
    const auto period = std::chrono::duration<double>(watch_seconds);
    while (!stop) {
      cv.wait_for(lock, period, [&] { return stop; });
      if (stop) break;
      struct stat st {};
      if (::fstat(fd.get(), &st) == 0 && st.st_nlink == 0) {
        // Removed: its memory is freed once no copy holds the mapping.
        mapping.reset();
        break;
      }
    }
  }
};

MappedFileSource::MappedFileSource(std::unique_ptr<State> state) : state_(std::move(state)) {}

MappedFileSource::~MappedFileSource() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (state_->thread.joinable()) state_->thread.join();
}

Result<std::shared_ptr<MappedFileSource>> MappedFileSource::Open(int fd, const std::string& what,
                                                                 double watch_seconds) {
  auto state = std::make_unique<State>();
  state->what = what;
  state->watch_seconds = watch_seconds > 0 ? watch_seconds : 1.0;
  state->fd = UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0), what);
  if (!state->fd.valid()) return ErrnoStatus(errno, "duplicating the descriptor of", what);
  struct stat st {};
  if (::fstat(state->fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat", what);
  if (!S_ISREG(st.st_mode) || st.st_size <= 0) {
    return InvalidArgument(what + " is not a regular file of at least one byte");
  }
  state->size = static_cast<uint64_t>(st.st_size);
  EA_ASSIGN_OR_RETURN(Mapping mapping,
                      Mapping::MapFile(state->fd, state->size, /*writable=*/false, 2 * kMiB));
  state->mapping = std::make_shared<Mapping>(std::move(mapping));
  std::shared_ptr<MappedFileSource> source(new MappedFileSource(std::move(state)));
  State* s = source->state_.get();
  s->thread = std::thread([s] { s->Run(); });
  return source;
}

Result<uint64_t> MappedFileSource::Copy(std::span<const CopyRun> runs) const {
  std::shared_ptr<Mapping> held = state_->Held();
  if (!held) return NotFound(state_->what + " was removed: its mapping was let go");
  return CopyOutOfMapping(held->data(), state_->size, runs, state_->what);
}

uint64_t MappedFileSource::size() const { return state_->size; }

bool MappedFileSource::mapped() const { return state_->Held() != nullptr; }

bool MappedFileSource::WaitPopulated(double seconds) const {
  std::unique_lock<std::mutex> lock(state_->mu);
  return state_->cv.wait_for(lock, std::chrono::duration<double>(seconds),
                             [&] { return state_->populated; });
}

}  // namespace expert_arena::platform
