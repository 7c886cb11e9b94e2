// Chunked registration of a host range with a GPU runtime, the process-wide pin budget, and
// the report that tells whether the pages really are pinned.
//
// Why chunks: with 4 KiB pages a driver builds one page list per registration, and large
// single registrations are refused (or take the driver's locks for seconds); 1 GiB chunks
// register reliably and let `threads` threads work at once (bench/gpu_check.sh measures
// whether that is faster on a given driver). A copy that spans two chunks is still DMA:
// the runtime looks up each page's registration, not the call that made it.
//
// Why VmPin is reported and not trusted: VmPin (/proc/self/status) counts pages a driver
// accounted in mm->pinned_vm. NVIDIA's driver takes page references without that
// accounting (os_lock_user_pages in open-gpu-kernel-modules), so VmPin can stay 0 while
// the pages are held; ROCm's hipHostRegister may not pin at all (pages tracked through HMM,
// still movable by compaction: VmPin 0 in the field, see docs/gpu.md). The note says which.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "common/units.h"
#include "gpu/gpu.h"
#include "gpu/runtime.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

namespace expert_arena::gpu {
namespace {

// Bytes registered by this process through RegisterHostRange, all registrations together;
// the pin budget is checked against it.
std::atomic<uint64_t> g_registered_bytes{0};

class SkippedRegistration final : public Registration {
 public:
  explicit SkippedRegistration(RegistrationReport report) : report_(std::move(report)) {}
  const RegistrationReport& report() const override { return report_; }

 private:
  RegistrationReport report_;
};

struct Chunk {
  std::byte* data = nullptr;
  size_t bytes = 0;
};

// Runs fn(chunk_index) for every chunk on up to `threads` threads; stops handing out chunks
// after the first failure and returns it (with the chunk's index).
struct ChunkFailure {
  size_t index = 0;
  Status status;
};
template <typename Fn>
std::optional<ChunkFailure> ForEachChunk(size_t chunks, int threads, Fn fn) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::optional<ChunkFailure> first;
  auto work = [&] {
    while (!failed.load(std::memory_order_relaxed)) {
      size_t i = next.fetch_add(1);
      if (i >= chunks) return;
      Status s = fn(i);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = ChunkFailure{i, s};
        failed = true;
      }
    }
  };
  size_t n = std::min<size_t>(chunks, static_cast<size_t>(std::max(threads, 1)));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  return first;
}

class RuntimeRegistration final : public Registration {
 public:
  RuntimeRegistration(const Runtime& runtime, int device, std::vector<Chunk> chunks, int threads,
                      bool read_only, uint64_t budget_bytes,
                      std::shared_ptr<spdlog::logger> logger)
      : runtime_(runtime),
        device_(device),
        chunks_(std::move(chunks)),
        registered_(chunks_.size(), 0),
        threads_(threads),
        read_only_(read_only),
        budget_bytes_(budget_bytes),
        logger_(std::move(logger)) {}

  ~RuntimeRegistration() override {
    Unregister();
    ReleasePinBudget(budget_bytes_);
  }

  // Registers every chunk; on failure unregisters those that were and returns the error.
  Status Register() {
    auto failure = ForEachChunk(chunks_.size(), threads_, [&](size_t i) {
      Status s = runtime_.HostRegister(device_, chunks_[i].data, chunks_[i].bytes, read_only_);
      if (s.ok()) registered_[i] = 1;
      return s;
    });
    if (!failure) return Status::Ok();
    Unregister();
    const Chunk& c = chunks_[failure->index];
    return Status(failure->status.code(),
                  report_.device + ": registering chunk " + std::to_string(failure->index + 1) +
                      " of " + std::to_string(chunks_.size()) + " (" + FormatBytes(c.bytes) +
                      " at offset " +
                      std::to_string(static_cast<uint64_t>(c.data - chunks_.front().data)) +
                      ") failed: " + failure->status.message());
  }

  const RegistrationReport& report() const override { return report_; }
  RegistrationReport& mutable_report() { return report_; }

 private:
  void Unregister() {
    auto failure = ForEachChunk(chunks_.size(), threads_, [&](size_t i) {
      if (!registered_[i]) return Status::Ok();
      Status s = runtime_.HostUnregister(device_, chunks_[i].data);
      registered_[i] = 0;
      return s;
    });
    // A failure stops the other threads; unregister what is left on this one.
    if (failure) {
      for (size_t i = 0; i < chunks_.size(); ++i) {
        if (registered_[i]) (void)runtime_.HostUnregister(device_, chunks_[i].data);
        registered_[i] = 0;
      }
      logger_->warn("expert-arena: {}: unregistering chunk {}: {}", report_.device,
                    failure->index + 1, failure->status.message());
    }
  }

  const Runtime& runtime_;
  const int device_;
  std::vector<Chunk> chunks_;
  std::vector<char> registered_;  // one slot per chunk, each written by one thread at a time
  const int threads_;
  const bool read_only_;
  const uint64_t budget_bytes_;
  std::shared_ptr<spdlog::logger> logger_;
  RegistrationReport report_;
};

std::unique_ptr<Registration> Skip(RegistrationReport report, std::string note) {
  report.note = std::move(note);
  report.registered_bytes = 0;
  return std::make_unique<SkippedRegistration>(std::move(report));
}

std::string PinNote(const RegistrationReport& r, GpuBackend backend) {
  uint64_t delta = r.vmpin_after > r.vmpin_before ? r.vmpin_after - r.vmpin_before : 0;
  std::string note = "VmPin +" + FormatBytes(delta);
  // Drivers that account pins count every registered page: allow a little slack for other
  // threads of the process pinning or unpinning meanwhile.
  if (delta >= r.registered_bytes - r.registered_bytes / 16) return note + ": pinned";
  if (backend == GpuBackend::kHip) {
    return note + ": hipHostRegister did not pin these pages (ROCm tracks them through HMM; "
                  "compaction can still move 4 KiB pages, so keep the arena on 2 MiB pages)";
  }
  return note + ": this driver does not count its pins in VmPin (pinning not confirmed)";
}

}  // namespace

uint64_t ReservePinBudget(uint64_t want, uint64_t budget, uint64_t granule) {
  uint64_t used = g_registered_bytes.load();
  for (;;) {
    uint64_t take = want;
    if (budget != 0) {
      uint64_t left = used >= budget ? 0 : budget - used;
      if (left < want) take = granule == 0 ? left : left / granule * granule;
    }
    if (take == 0) return 0;
    if (g_registered_bytes.compare_exchange_weak(used, used + take)) return take;
  }
}

void ReleasePinBudget(uint64_t bytes) { g_registered_bytes.fetch_sub(bytes); }

uint64_t ProcessRegisteredBytes() { return g_registered_bytes.load(); }

const void* PinBudgetAddress() { return &g_registered_bytes; }

Result<std::unique_ptr<Registration>> RegisterHostRange(std::span<std::byte> range,
                                                        const RegisterOptions& options) {
  // Parsed back from its name: a device an engine built by hand (a negative index, a backend
  // cast from anything) is refused here as a mistyped name would be.
  EA_ASSIGN_OR_RETURN(GpuDevice device, ParseGpuDevice(options.device.ToString()));
  if (device.backend == GpuBackend::kNone) {
    RegistrationReport report;
    report.requested_bytes = range.size();
    return Skip(report, "no GPU asked for");
  }
  const Runtime* runtime = RuntimeFor(device.backend);
  if (runtime == nullptr) return Unsupported(WhyDeviceUnusable(device));
  if (std::string why = WhyDeviceUnusable(device); !why.empty()) {
    RegistrationReport report;
    report.requested_bytes = range.size();
    report.backend = GpuBackendName(device.backend);
    report.device = device.ToString();
    return Skip(report, why);
  }
  return RegisterHostRangeOn(*runtime, device, range, options);
}

Result<std::unique_ptr<Registration>> RegisterHostRangeOn(const Runtime& runtime,
                                                          const GpuDevice& device,
                                                          std::span<std::byte> range,
                                                          const RegisterOptions& options) {
  RegistrationReport report;
  report.requested_bytes = range.size();
  report.backend = GpuBackendName(device.backend);
  report.device = device.ToString();
  const uint64_t page = platform::BasePageSize();
  if (reinterpret_cast<uintptr_t>(range.data()) % page != 0 || range.size() % page != 0) {
    return InvalidArgument(report.device + ": the range to register is not page-aligned");
  }
  if (options.threads < 1 || options.threads > 64) {
    return InvalidArgument("registration threads " + std::to_string(options.threads) +
                           ": expected 1 to 64");
  }
  if (range.empty()) return Skip(report, report.device + ": nothing to register");
  if (options.read_only && !runtime.CanRegisterReadOnly(device.index)) {
    return Skip(report, report.device +
                            ": not registered: the range is mapped read-only and this device "
                            "cannot register read-only memory; map it writable");
  }

  // The budget: whole 2 MiB multiples of what is left, the rest is skipped and reported.
  const uint64_t reserved =
      ReservePinBudget(range.size(), options.pin_budget_bytes, kHugePageBytes);
  if (reserved == 0) {
    return Skip(report, report.device + ": not registered: pin budget " +
                            FormatBytes(options.pin_budget_bytes) + " used up (" +
                            FormatBytes(ProcessRegisteredBytes()) +
                            " registered by this process)");
  }

  uint64_t chunk = AlignUp(std::max<uint64_t>(options.chunk_bytes, kHugePageBytes),
                           kHugePageBytes)
                       .value_or(kGiB);
  std::vector<Chunk> chunks;
  for (uint64_t off = 0; off < reserved; off += chunk) {
    chunks.push_back({range.data() + off, static_cast<size_t>(std::min(chunk, reserved - off))});
  }
  report.chunk_bytes = chunk;
  report.chunks = chunks.size();
  report.threads = static_cast<int>(std::min<size_t>(chunks.size(), options.threads));
  auto logger = ResolveLogger(options.logger);

  report.vmpin_before = platform::PinnedBytes().ok() ? *platform::PinnedBytes() : 0;
  auto start = std::chrono::steady_clock::now();
  auto registration = std::make_unique<RuntimeRegistration>(
      runtime, device.index, std::move(chunks), report.threads, options.read_only, reserved,
      logger);
  registration->mutable_report() = report;
  EA_RETURN_IF_ERROR(registration->Register());
  RegistrationReport& r = registration->mutable_report();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.registered_bytes = reserved;
  r.vmpin_after = platform::PinnedBytes().ok() ? *platform::PinnedBytes() : 0;

  char buf[256];
  std::snprintf(buf, sizeof buf, "registered %s in %.2f s (%zu chunk%s of %s, %d thread%s%s)",
                FormatBytes(reserved).c_str(), r.seconds, r.chunks, r.chunks == 1 ? "" : "s",
                FormatBytes(chunk).c_str(), r.threads, r.threads == 1 ? "" : "s",
                options.read_only ? ", read-only" : "");
  r.note = r.device + ": " + buf;
  if (reserved < range.size()) {
    r.note += "; " + FormatBytes(range.size() - reserved) + " not registered: pin budget " +
              FormatBytes(options.pin_budget_bytes);
  }
  r.note += "; " + PinNote(r, device.backend);
  return std::unique_ptr<Registration>(std::move(registration));
}

}  // namespace expert_arena::gpu
