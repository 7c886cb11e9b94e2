// gpu_check: what registering an arena with one GPU costs and gives (bench/gpu_check.sh
// builds and runs it; see docs/gpu.md).
//
// On a 4 KiB-page backing (a file in --dir-4k, /dev/shm by default, MADV_NOHUGEPAGE) and a
// 2 MiB-page backing (a file in --dir-2m: a tmpfs huge=always or hugetlbfs mount; by default
// /dev/shm with MADV_HUGEPAGE + MADV_COLLAPSE) of the same size ("anonymous" for either
// directory: private anonymous memory, when no tmpfs is large enough), through the library's
// own RegisterHostRange:
//   - registration seconds per GiB, serial (1 thread) and parallel (--threads), in chunks of
//     --chunk-mib; each twice, alternating, best kept; unregistration seconds per GiB;
//   - VmPin growth (whether the driver accounts its pins);
//   - host-to-device GB/s from the registered range.
// Then H2D GB/s from runtime-pinned memory (cudaMallocHost / hipHostMalloc) and from pageable
// memory with the same copy size and total, the ratio registered / runtime-pinned (target
// >= 0.95), and a correctness check: a tensor of a real shared arena registered with the
// device, copied with CopyToDeviceAsync and read back, equals the host bytes.
//
// Exit status: 0 measured and every check passed, or no device ("no CUDA device: <reason>;
// nothing measured"); 1 a check failed or an error; 2 bad usage. --dry-run does the host side
// only, at 64 MiB (backings, page sizes, the table), and never calls the device; --probe
// only says whether the device is usable (exit 0) or not (exit 3).
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "pages/page_backing.h"
#include "common/units.h"
#include "expert_arena/arena.h"
#include "expert_arena/gpu.h"
#include "gpu/gpu.h"
#include "gpu/runtime.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/meminfo.h"
#include "platform/system_info.h"

using namespace expert_arena;

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
double Gib(uint64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kGiB); }

struct Config {
  std::string device = "cuda:0";
  uint64_t size_gib = 0;  // 0: 8 GiB or what fits
  std::string dir_4k = "/dev/shm";
  std::string dir_2m;  // empty: dir_4k, collapsed
  uint64_t chunk_mib = 1024;
  int threads = 2;
  uint64_t copy_mib = 1024;
  bool dry_run = false;
  bool probe = false;
};

// Why `device` cannot be measured, or "" when it can.
std::string NoDeviceReason(const GpuDevice& device) {
  if (!GpuBackendBuilt(device.backend)) {
    return std::string("this build has no ") + GpuBackendName(device.backend) +
           " backend (configure with -DEXPERT_ARENA_" +
           (device.backend == GpuBackend::kCuda ? "CUDA" : "HIP") + "=ON)";
  }
  auto count = GpuDeviceCount(device.backend);
  if (!count.ok()) return count.status().message();
  if (device.index >= *count) {
    return device.ToString() + " is not present (" + std::to_string(*count) + " devices)";
  }
  return "";
}

std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// A file-backed range on one page size; the file is unlinked at once, so nothing is left
// behind however the program ends.
struct Backing {
  std::string label;
  std::string path;
  platform::UniqueFd fd;
  platform::Mapping mapping;
  uint64_t huge_bytes = 0;
  std::string note;
};

constexpr const char* kAnonymous = "anonymous";

// Private anonymous memory, for a machine whose tmpfs is too small (a container's 64 MiB
// /dev/shm) and where the script cannot mount one.
Result<Backing> MakeAnonymousBacking(uint64_t bytes, bool huge) {
  Backing b;
  EA_ASSIGN_OR_RETURN(b.mapping, platform::Mapping::MapAnonymous(bytes, kHugePageBytes));
  if (huge) {
    double collapse_seconds = 0;
    pages::HugeDecision d =
        pages::ApplyHugePages(HugePages::kOn, pages::PageSource::kAnonymous, b.mapping.data(),
                              bytes, "anonymous backing", &collapse_seconds);
    b.note = "anonymous memory" + (d.note.empty() ? "" : ", " + d.note);
  } else {
    EA_RETURN_IF_ERROR(
        platform::AdviseRange(b.mapping.data(), bytes, platform::Advice::kNoHugePage, "anonymous"));
    b.note = "anonymous memory, MADV_NOHUGEPAGE";
  }
  EA_RETURN_IF_ERROR(platform::AdviseRange(b.mapping.data(), bytes,
                                           platform::Advice::kPopulateWrite, "anonymous"));
  for (uint64_t off = 0; off < bytes; off += 4096) b.mapping.data()[off] = std::byte{0x5a};
  auto huge_bytes = platform::HugeBytesInRange(b.mapping.data(), bytes);
  b.huge_bytes = huge_bytes.ok() ? *huge_bytes : 0;
  b.label = std::string(huge ? "2 MiB" : "4 KiB") + " pages (anonymous)";
  return b;
}

Result<Backing> MakeBacking(const std::string& dir, uint64_t bytes, bool huge,
                            const std::string& tag) {
  if (dir == kAnonymous) return MakeAnonymousBacking(bytes, huge);
  Backing b;
  b.path = dir + "/ea-gpu-check-" + std::to_string(getpid()) + "-" + tag;
  EA_ASSIGN_OR_RETURN(platform::FilesystemInfo fs, platform::StatFilesystem(dir));
  platform::OpenOptions open;
  open.write = true;
  open.create = true;
  EA_ASSIGN_OR_RETURN(b.fd, platform::OpenFile(b.path, open));
  EA_RETURN_IF_ERROR(platform::UnlinkPath(b.path));
  const bool hugetlbfs = fs.kind == platform::FsKind::kHugetlbfs;
  if (hugetlbfs && !huge) return InvalidArgument(dir + " is hugetlbfs: no 4 KiB pages there");
  EA_RETURN_IF_ERROR(platform::AllocateFile(b.fd, bytes));
  uint64_t alignment = hugetlbfs ? std::max(fs.block_bytes, kHugePageBytes) : kHugePageBytes;
  EA_ASSIGN_OR_RETURN(b.mapping, platform::Mapping::MapFile(b.fd, bytes, true, alignment));
  std::string fs_name = hugetlbfs                             ? "hugetlbfs"
                        : fs.kind == platform::FsKind::kTmpfs ? "tmpfs huge=" + fs.tmpfs_huge
                                                              : std::string("other fs");
  if (huge) {
    double collapse_seconds = 0;
    pages::HugeDecision d =
        pages::ApplyHugePages(HugePages::kOn, pages::PageSourceFor(fs.kind, fs.tmpfs_huge),
                              b.mapping.data(), bytes, b.path, &collapse_seconds);
    b.note = fs_name + (d.note.empty() ? "" : ", " + d.note);
  } else {
    EA_RETURN_IF_ERROR(
        platform::AdviseRange(b.mapping.data(), bytes, platform::Advice::kNoHugePage, b.path));
    b.note = fs_name + ", MADV_NOHUGEPAGE";
  }
  EA_RETURN_IF_ERROR(
      platform::AdviseRange(b.mapping.data(), bytes, platform::Advice::kPopulateWrite, b.path));
  // Bytes that are not all zero, so a copy moves real data.
  for (uint64_t off = 0; off < bytes; off += 4096) b.mapping.data()[off] = std::byte{0x5a};
  auto huge_bytes = platform::HugeBytesInRange(b.mapping.data(), bytes);
  b.huge_bytes = huge_bytes.ok() ? *huge_bytes : 0;
  b.label = std::string(huge ? "2 MiB" : "4 KiB") + " pages (" +
            (dir == "/dev/shm" ? dir : fs_name) + ")";
  b.note = dir + ": " + b.note;
  return b;
}

struct RegistrationFigures {
  double serial_s_per_gib = 0;
  double parallel_s_per_gib = 0;
  double unregister_s_per_gib = 0;
  uint64_t vmpin_delta = 0;
  std::string pin_note;
  double h2d_gbps = 0;
};

// Registers and unregisters `range` once; seconds of each.
Result<std::pair<double, double>> RegisterOnce(std::span<std::byte> range, const Config& c,
                                               int threads, RegistrationFigures* figures) {
  gpu::RegisterOptions options;
  EA_ASSIGN_OR_RETURN(options.device, ParseGpuDevice(c.device));
  options.chunk_bytes = c.chunk_mib * kMiB;
  options.threads = threads;
  EA_ASSIGN_OR_RETURN(auto registration, gpu::RegisterHostRange(range, options));
  const gpu::RegistrationReport& r = registration->report();
  if (r.registered_bytes != range.size()) return Internal("not registered: " + r.note);
  figures->vmpin_delta = r.vmpin_after > r.vmpin_before ? r.vmpin_after - r.vmpin_before : 0;
  figures->pin_note = r.note.substr(r.note.find("VmPin"));
  double registered = r.seconds;
  auto start = Clock::now();
  registration.reset();
  return std::make_pair(registered, Since(start));
}

// Copies `total` bytes to `dst` in pieces of `piece` bytes read from `src` (wrapping around
// src_bytes), on one stream; GB/s (10^9 bytes per second), best of two passes.
Result<double> CopyRate(const gpu::Runtime& runtime, int device, const std::byte* src,
                        uint64_t src_bytes, uint64_t total, uint64_t piece, void* dst,
                        void* stream) {
  double best = 0;
  for (int pass = 0; pass < 2; ++pass) {
    auto start = Clock::now();
    uint64_t off = 0;
    uint64_t done = 0;
    while (done < total) {
      if (off >= src_bytes) off = 0;
      uint64_t n = std::min({piece, src_bytes - off, total - done});
      EA_RETURN_IF_ERROR(runtime.CopyToDeviceAsync(device, dst, src + off, n, stream));
      off += n;
      done += n;
    }
    EA_RETURN_IF_ERROR(runtime.StreamSynchronize(device, stream));
    best = std::max(best, static_cast<double>(done) / 1e9 / Since(start));
  }
  return best;
}

Result<RegistrationFigures> MeasureBacking(Backing& b, const Config& c, const gpu::Runtime& rt,
                                           int device, uint64_t piece, void* dst, void* stream) {
  RegistrationFigures f;
  std::span<std::byte> range = b.mapping.bytes();
  const double gib = Gib(range.size());
  double serial = 1e30, parallel = 1e30, unregister = 1e30;
  for (int round = 0; round < 2; ++round) {
    for (int threads : {1, c.threads}) {
      EA_ASSIGN_OR_RETURN(auto seconds, RegisterOnce(range, c, threads, &f));
      (threads == 1 ? serial : parallel) =
          std::min(threads == 1 ? serial : parallel, seconds.first);
      unregister = std::min(unregister, seconds.second);
    }
  }
  f.serial_s_per_gib = serial / gib;
  f.parallel_s_per_gib = parallel / gib;
  f.unregister_s_per_gib = unregister / gib;
  gpu::RegisterOptions options;
  EA_ASSIGN_OR_RETURN(options.device, ParseGpuDevice(c.device));
  options.chunk_bytes = c.chunk_mib * kMiB;
  options.threads = c.threads;
  EA_ASSIGN_OR_RETURN(auto registration, gpu::RegisterHostRange(range, options));
  EA_ASSIGN_OR_RETURN(f.h2d_gbps, CopyRate(rt, device, range.data(), range.size(), range.size(),
                                           piece, dst, stream));
  return f;
}

// A shared arena of a random data file (asked for as ModelFormat::kRaw: one u8 tensor),
// registered with the device (required), the tensor copied with the public helper and read
// back.
Status CheckCorrectness(const Config& c, const GpuDevice& device, std::string* line) {
  // A shared arena on the 4 KiB directory; a private arena when that is anonymous memory.
  const bool shared = c.dir_4k != kAnonymous;
  const std::string base =
      (shared ? c.dir_4k : std::string("/tmp")) + "/ea-gpu-check-" + std::to_string(getpid());
  const std::string model_path = base + "-model.bin";
  const std::string arena_path = base + ".arena";
  const uint64_t model_bytes = 64 * kMiB + 12345;  // not a multiple of any page size
  {
    platform::OpenOptions open;
    open.write = true;
    open.create = true;
    EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(model_path, open));
    std::vector<std::byte> bytes(model_bytes);
    std::mt19937_64 rng(42);
    for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
      uint64_t v = rng();
      std::memcpy(&bytes[i], &v, 8);
    }
    EA_RETURN_IF_ERROR(platform::WriteFull(fd, 0, bytes));
  }
  auto cleanup = [&] {
    (void)platform::UnlinkPath(model_path);
    (void)platform::UnlinkPath(arena_path);
  };
  ArenaOptions options;
  if (shared) options.shared_path = arena_path;
  options.gpu = device;
  options.gpu_required = true;
  options.progress = false;
  Status result = [&]() -> Status {
    EA_ASSIGN_OR_RETURN(Arena arena,
                        Arena::Open({.files = {model_path}, .format = ModelFormat::kRaw}, options));
    TensorView view = arena.tensor(0);
    EA_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(device, view.bytes.size()));
    const gpu::Runtime* rt = gpu::RuntimeFor(device.backend);
    EA_ASSIGN_OR_RETURN(void* stream, rt->StreamCreate(device.index));
    auto copy = CopyToDeviceAsync(device, view, buffer.data(), stream);
    Status waited = copy.ok() ? copy->Wait() : copy.status();
    rt->StreamDestroy(device.index, stream);
    EA_RETURN_IF_ERROR(waited);
    std::vector<std::byte> back(view.bytes.size());
    EA_RETURN_IF_ERROR(CopyToHost(device, buffer.data(), back));
    if (std::memcmp(back.data(), view.bytes.data(), back.size()) != 0) {
      size_t i = 0;
      while (back[i] == view.bytes[i]) ++i;
      return Corrupt("device copy of " + std::string(view.name) + " differs from the host " +
                     "bytes at offset " + std::to_string(i));
    }
    // Read in place: the registered pages through their device address (what vLLM's UVA
    // weight offloading hands its kernels), copied on the device and read back.
    EA_ASSIGN_OR_RETURN(void* mapped,
                        rt->HostDevicePointer(device.index, const_cast<std::byte*>(
                                                                view.bytes.data())));
    EA_ASSIGN_OR_RETURN(DeviceBuffer second, DeviceBuffer::Allocate(device, view.bytes.size()));
    EA_RETURN_IF_ERROR(
        rt->CopyOnDeviceSync(device.index, second.data(), mapped, view.bytes.size()));
    std::vector<std::byte> in_place(view.bytes.size());
    EA_RETURN_IF_ERROR(CopyToHost(device, second.data(), in_place));
    if (std::memcmp(in_place.data(), view.bytes.data(), in_place.size()) != 0) {
      return Corrupt("the device's reads of the registered pages through their device address " +
                     std::string("differ from the host bytes"));
    }
    *line = "correctness: a " + FormatBytes(view.bytes.size()) + " tensor of a registered " +
            (shared ? "shared" : "private") + " arena (" +
            FormatBytes(arena.report().gpu_registered_bytes) + " registered), copied to " +
            device.ToString() + " with CopyToDeviceAsync and read back, equals the host bytes: " +
            "ok; read in place through its device address (" +
            (mapped == view.bytes.data() ? "the host's" : "another") + "): ok";
    return Status::Ok();
  }();
  cleanup();
  return result;
}

// 8 GiB, or less when memory or the filesystems are smaller: one backing exists at a time,
// plus the copy buffers.
Result<uint64_t> PlanSize(const Config& c) {
  if (c.dry_run) return 64 * kMiB;
  EA_ASSIGN_OR_RETURN(uint64_t available, platform::AvailableMemoryBytes());
  uint64_t fit = available / 10 * 4;
  for (const std::string& dir : {c.dir_4k, c.dir_2m.empty() ? c.dir_4k : c.dir_2m}) {
    if (dir == kAnonymous) continue;
    EA_ASSIGN_OR_RETURN(platform::FilesystemInfo fs, platform::StatFilesystem(dir));
    fit = std::min(fit, fs.available_bytes / 10 * 9);
  }
  uint64_t want = (c.size_gib == 0 ? 8 : c.size_gib) * kGiB;
  if (c.size_gib != 0 && want > fit) {
    return NoSpace(std::to_string(c.size_gib) + " GiB asked for but only " + FormatBytes(fit) +
                   " fits (40% of MemAvailable, 90% of the directories' free space)");
  }
  uint64_t size = std::min(want, fit) / kGiB * kGiB;
  if (size == 0) return NoSpace("less than 1 GiB fits (" + FormatBytes(fit) + ")");
  return size;
}

int Fail(const Status& s) {
  std::printf("gpu_check: FAILED: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"Measures GPU registration of arena backings and host-to-device copies"};
  app.add_option("--device", c.device, "cuda[:N] or hip[:N]")->capture_default_str();
  app.add_option("--size-gib", c.size_gib, "bytes per backing (default: 8 GiB or what fits)");
  app.add_option("--dir-4k", c.dir_4k,
                 "directory for the 4 KiB-page file, or \"anonymous\" for private memory")
      ->capture_default_str();
  app.add_option("--dir-2m", c.dir_2m,
                 "directory for the 2 MiB-page file: tmpfs huge=always or hugetlbfs "
                 "(default: --dir-4k with MADV_COLLAPSE), or \"anonymous\"");
  app.add_option("--chunk-mib", c.chunk_mib, "registration chunk")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--threads", c.threads, "threads of the parallel registration")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  app.add_option("--copy-mib", c.copy_mib, "bytes per host-to-device copy")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_flag("--dry-run", c.dry_run, "host side only, 64 MiB, no device call");
  app.add_flag("--probe", c.probe, "only say whether the device is usable (exit 0) or not (3)");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);  // the arena's start line is not part of the table

  auto parsed = ParseGpuDevice(c.device);
  if (!parsed.ok() || parsed->backend == GpuBackend::kNone) {
    std::fprintf(
        stderr, "gpu_check: --device %s: %s\n", c.device.c_str(),
        parsed.ok() ? "a CUDA or HIP device is needed" : parsed.status().message().c_str());
    return 2;
  }
  const GpuDevice device = *parsed;
  const std::string kind = Upper(GpuBackendName(device.backend));
  const std::string why = NoDeviceReason(device);
  const std::string nothing = "no " + kind + " device: " + why + "; nothing measured";
  if (c.probe) {
    std::printf("%s\n", why.empty() ? (device.ToString() + ": usable").c_str() : nothing.c_str());
    return why.empty() ? 0 : 3;
  }
  if (!why.empty() && !c.dry_run) {
    std::printf("%s\n", nothing.c_str());
    return 0;
  }
  const auto start = Clock::now();
  auto size = PlanSize(c);
  if (!size.ok()) return Fail(size.status());
  const uint64_t bytes = *size;
  const uint64_t piece = std::min(c.copy_mib * kMiB, bytes);
  const gpu::Runtime* rt = gpu::RuntimeFor(device.backend);
  const bool measure = !c.dry_run;
  const std::string pinned_name =
      device.backend == GpuBackend::kCuda ? "cudaMallocHost" : "hipHostMalloc";

  std::string description = "dry run, no device call";
  if (measure) {
    auto d = rt->Describe(device.index);
    description = d.ok() ? *d : d.status().message();
  }
  std::printf(
      "gpu_check: %s = %s; %s per backing, registration chunks of %s, parallel = %d "
      "threads, copies of %s\n",
      device.ToString().c_str(), description.c_str(), FormatBytes(bytes).c_str(),
      FormatBytes(c.chunk_mib * kMiB).c_str(), c.threads, FormatBytes(piece).c_str());

  // Device-side resources shared by every copy measurement.
  void* stream = nullptr;
  std::optional<DeviceBuffer> dst;
  if (measure) {
    auto buffer = DeviceBuffer::Allocate(device, piece);
    if (!buffer.ok()) return Fail(buffer.status());
    dst = std::move(*buffer);
    auto s = rt->StreamCreate(device.index);
    if (!s.ok()) return Fail(s.status());
    stream = *s;
  }

  std::printf(
      "| source                             | on 2 MiB pages | register s/GiB 1 thread | "
      "register s/GiB %d threads | unregister s/GiB | VmPin growth | H2D GB/s | vs %s |\n",
      c.threads, pinned_name.c_str());
  std::printf(
      "|------------------------------------|----------------|-------------------------|"
      "--------------------------|------------------|--------------|----------|-----%s|\n",
      std::string(pinned_name.size(), '-').c_str());
  struct Row {
    std::string label, huge, serial, parallel, unreg, vmpin, gbps;
    double rate = 0;
  };
  std::vector<Row> rows;
  std::vector<std::string> notes;
  auto fmt = [](const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, v);
    return std::string(buf);
  };
  bool failed = false;
  for (bool huge : {false, true}) {
    std::string dir = huge && !c.dir_2m.empty() ? c.dir_2m : c.dir_4k;
    auto backing = MakeBacking(dir, bytes, huge, huge ? "2m" : "4k");
    if (!backing.ok()) return Fail(backing.status());
    Row row{backing->label, "", "-", "-", "-", "-", "-"};
    row.huge = fmt("%.0f%%",
                   100.0 * static_cast<double>(backing->huge_bytes) / static_cast<double>(bytes));
    notes.push_back(backing->label + ": " + backing->note);
    if (huge && backing->huge_bytes < bytes / 10 * 9) {
      notes.push_back("the 2 MiB backing is only " + row.huge +
                      " on 2 MiB pages: rerun with --dir-2m on a tmpfs huge=always or "
                      "hugetlbfs mount (bench/gpu_check.sh mounts one when run as root)");
    }
    if (measure) {
      auto f = MeasureBacking(*backing, c, *rt, device.index, piece, dst->data(), stream);
      if (!f.ok()) return Fail(f.status().WithContext(backing->label));
      row.serial = fmt("%.3f", f->serial_s_per_gib);
      row.parallel = fmt("%.3f", f->parallel_s_per_gib);
      row.unreg = fmt("%.3f", f->unregister_s_per_gib);
      row.vmpin = FormatBytes(f->vmpin_delta);
      row.gbps = fmt("%.2f", f->h2d_gbps);
      row.rate = f->h2d_gbps;
      notes.push_back(backing->label + ": " + f->pin_note);
    }
    rows.push_back(row);
  }
  double pinned_rate = 0;
  {
    Row row{pinned_name + " (" + FormatBytes(piece) + ")", "-", "-", "-", "-", "-", "-"};
    if (measure) {
      auto host = rt->HostAlloc(device.index, piece);
      if (!host.ok()) return Fail(host.status());
      std::memset(*host, 0x5a, piece);
      auto rate = CopyRate(*rt, device.index, static_cast<const std::byte*>(*host), piece, bytes,
                           piece, dst->data(), stream);
      (void)rt->HostFree(device.index, *host);
      if (!rate.ok()) return Fail(rate.status());
      pinned_rate = *rate;
      row.gbps = fmt("%.2f", *rate);
      row.rate = *rate;
    }
    rows.push_back(row);
  }
  {
    Row row{"pageable (" + FormatBytes(piece) + " malloc)", "-", "-", "-", "-", "-", "-"};
    if (measure) {
      std::vector<std::byte> pageable(piece, std::byte{0x5a});
      auto rate =
          CopyRate(*rt, device.index, pageable.data(), piece, bytes, piece, dst->data(), stream);
      if (!rate.ok()) return Fail(rate.status());
      row.gbps = fmt("%.2f", *rate);
      row.rate = *rate;
    }
    rows.push_back(row);
  }
  for (const Row& r : rows) {
    std::string ratio = measure && pinned_rate > 0 ? fmt("%.2f", r.rate / pinned_rate) : "-";
    std::printf("| %-34s | %14s | %23s | %24s | %16s | %12s | %8s | %*s |\n", r.label.c_str(),
                r.huge.c_str(), r.serial.c_str(), r.parallel.c_str(), r.unreg.c_str(),
                r.vmpin.c_str(), r.gbps.c_str(), static_cast<int>(pinned_name.size() + 3),
                ratio.c_str());
  }
  for (const std::string& n : notes) std::printf("  %s\n", n.c_str());

  if (measure) {
    std::string verdict = "target: registered >= 0.95 x " + pinned_name + ":";
    for (size_t i = 0; i < 2; ++i) {
      double ratio = rows[i].rate / pinned_rate;
      bool ok = ratio >= 0.95;
      failed |= !ok;
      verdict += fmt(i == 0 ? " 4 KiB %.2f" : ", 2 MiB %.2f", ratio) + (ok ? " ok" : " BELOW");
    }
    std::printf("%s\n", verdict.c_str());
    dst.reset();
    rt->StreamDestroy(device.index, stream);
    std::string line;
    Status s = CheckCorrectness(c, device, &line);
    if (!s.ok()) {
      std::printf("correctness: FAILED: %s\n", s.ToString().c_str());
      failed = true;
    } else {
      std::printf("%s\n", line.c_str());
    }
    std::printf("gpu_check: %s in %.0f s\n", failed ? "FAILED" : "PASS", Since(start));
    return failed ? 1 : 0;
  }
  std::printf("%s\n",
              why.empty()
                  ? ("dry run: " + device.ToString() + " is usable; nothing measured").c_str()
                  : nothing.c_str());
  return 0;
}
