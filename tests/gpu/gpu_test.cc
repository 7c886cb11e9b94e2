// GPU registration and copies: device names, the none backend, the no-device path, the pin
// budget, arenas mapped writable only for a GPU; and, where a device exists, registration of
// a populated arena, an asynchronous copy that equals the host bytes, and unregistration.
// Tests that need a device skip with the reason the runtime gave.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "common/units.h"
#include "expert_arena/arena.h"
#include "expert_arena/gpu.h"
#include "gpu/gpu.h"
#include "gpu/runtime.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "test_util.h"

namespace expert_arena {
namespace {

constexpr GpuBackend kBackends[] = {GpuBackend::kCuda, GpuBackend::kHip};

// The permissions ("r--s", "rw-s", ...) of the mapping that holds `address`.
std::string MappingPermissions(const void* address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  auto target = reinterpret_cast<uintptr_t>(address);
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms;
    in >> range >> perms;
    size_t dash = range.find('-');
    uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (target >= lo && target < hi) return perms;
  }
  return "";
}

// ---- device names ------------------------------------------------------------------------

TEST(GpuDeviceTest, ParsesEveryForm) {
  struct Case {
    const char* text;
    GpuBackend backend;
    int index;
  };
  for (const Case& c : {Case{"", GpuBackend::kNone, 0}, Case{"none", GpuBackend::kNone, 0},
                        Case{"cuda", GpuBackend::kCuda, 0}, Case{"cuda:0", GpuBackend::kCuda, 0},
                        Case{"cuda:3", GpuBackend::kCuda, 3}, Case{"hip", GpuBackend::kHip, 0},
                        Case{"hip:12", GpuBackend::kHip, 12}}) {
    ASSERT_OK_AND_ASSIGN(GpuDevice d, ParseGpuDevice(c.text));
    EXPECT_EQ(d.backend, c.backend) << c.text;
    EXPECT_EQ(d.index, c.index) << c.text;
  }
  ASSERT_OK_AND_ASSIGN(GpuDevice d, ParseGpuDevice("hip:2"));
  EXPECT_EQ(d.ToString(), "hip:2");
  EXPECT_EQ(GpuDevice{}.ToString(), "none");
}

TEST(GpuDeviceTest, RefusesBadNames) {
  for (const char* text : {"CUDA", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda:+1", "cuda: 1",
                           "cuda:99999", "rocm", "hip:0:1", ":0", "nvidia:0"}) {
    auto d = ParseGpuDevice(text);
    ASSERT_FALSE(d.ok()) << text;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(d.status().message().find(text), std::string::npos) << d.status().message();
  }
  gpu::RegisterOptions options;
  options.device = GpuDevice{GpuBackend::kCuda, -1};  // built by hand, naming no device
  std::vector<std::byte> bytes(4096);
  auto r = gpu::RegisterHostRange(bytes, options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

// ---- the none backend ---------------------------------------------------------------------

TEST(GpuNoneTest, RegistersNothing) {
  ASSERT_OK_AND_ASSIGN(platform::Mapping m, platform::Mapping::MapAnonymous(4 * kMiB, kHugePageBytes));
  for (const char* name : {"none", ""}) {
    gpu::RegisterOptions options;
    ASSERT_OK_AND_ASSIGN(options.device, ParseGpuDevice(name));
    ASSERT_OK_AND_ASSIGN(auto registration, gpu::RegisterHostRange(m.bytes(), options));
    EXPECT_EQ(registration->report().backend, "none");
    EXPECT_EQ(registration->report().registered_bytes, 0u);
    EXPECT_EQ(registration->report().note, "no GPU asked for");
  }
  EXPECT_TRUE(GpuBackendBuilt(GpuBackend::kNone));
  EXPECT_EQ(gpu::ProcessRegisteredBytes(), 0u);
}

TEST(GpuNoneTest, CopiesNeedADevice) {
  std::vector<std::byte> host(64);
  auto copy = CopyToDeviceAsync(GpuDevice{}, host, host.data(), nullptr);
  ASSERT_FALSE(copy.ok());
  EXPECT_EQ(copy.status().code(), StatusCode::kInvalidArgument);
  auto buffer = DeviceBuffer::Allocate(GpuDevice{}, 64);
  ASSERT_FALSE(buffer.ok());
  HostToDeviceCopy batch[] = {{host, host.data()}};
  EXPECT_FALSE(CopyBatchToDeviceAsync(GpuDevice{}, batch, nullptr).ok());
  CopyEvent empty;
  EXPECT_FALSE(empty.Wait().ok());
  EXPECT_FALSE(empty.Ready().ok());
}

// ---- no device, no driver, backend not built ---------------------------------------------

TEST(GpuNoDeviceTest, SkipsWithOneLineSayingWhy) {
  int checked = 0;
  for (GpuBackend backend : kBackends) {
    const std::string name = GpuBackendName(backend);
    ASSERT_OK_AND_ASSIGN(platform::Mapping m,
                         platform::Mapping::MapAnonymous(4 * kMiB, kHugePageBytes));
    gpu::RegisterOptions options;
    options.device = GpuDevice{backend, 0};
    if (!GpuBackendBuilt(backend)) {
      ++checked;
      auto r = gpu::RegisterHostRange(m.bytes(), options);
      ASSERT_FALSE(r.ok()) << name;
      EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
      EXPECT_NE(r.status().message().find("this build has no " + name + " backend"),
                std::string::npos)
          << r.status().message();
      continue;
    }
    auto count = GpuDeviceCount(backend);
    if (count.ok()) continue;  // a device exists: the device tests cover this backend
    ++checked;
    ASSERT_OK_AND_ASSIGN(auto registration, gpu::RegisterHostRange(m.bytes(), options));
    const gpu::RegistrationReport& report = registration->report();
    EXPECT_EQ(report.backend, name);
    EXPECT_EQ(report.registered_bytes, 0u);
    EXPECT_EQ(report.note, name + ": no usable device: " + count.status().message());
    EXPECT_EQ(report.note.find('\n'), std::string::npos);
    // The runtime's error name and number are in the line, e.g. "cudaErrorInsufficientDriver
    // (35): ..." without a driver, "hipErrorNoDevice (100): ..." without a device.
    EXPECT_NE(report.note.find(name + "Error"), std::string::npos) << report.note;
    EXPECT_NE(report.note.find(" ("), std::string::npos) << report.note;
    EXPECT_EQ(gpu::ProcessRegisteredBytes(), 0u);
    // The copy helpers say the same instead of crashing.
    auto buffer = DeviceBuffer::Allocate(GpuDevice{backend, 0}, 64);
    EXPECT_FALSE(buffer.ok());
  }
  if (checked == 0) GTEST_SKIP() << "every backend is built and has a device";
}

// An arena that asks for a GPU the machine lacks still opens (the start line says why), and
// fails when the engine requires the GPU.
TEST(GpuNoDeviceTest, ArenaReportsSkipAndRequiredFails) {
  GpuBackend backend = GpuBackend::kNone;
  for (GpuBackend b : kBackends) {
    if (GpuBackendBuilt(b) && !GpuDeviceCount(b).ok()) backend = b;
  }
  if (backend == GpuBackend::kNone) GTEST_SKIP() << "no built backend without a device";
  const std::string name = GpuBackendName(backend);
  testing::ScopedDataFile model(3 * kMiB + 123, 7);
  ArenaOptions options;
  options.gpu = GpuDevice{backend, 0};
  options.progress = false;
  ASSERT_OK_AND_ASSIGN(
      Arena arena, Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, options));
  EXPECT_EQ(arena.report().gpu_registered_bytes, 0u);
  EXPECT_EQ(arena.report().gpu_note.rfind(name + ": no usable device: ", 0), 0u)
      << arena.report().gpu_note;
  EXPECT_NE(arena.report().StartLine().find("gpu: " + name + ": no usable device"),
            std::string::npos);

  options.gpu_required = true;
  auto required = Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, options);
  ASSERT_FALSE(required.ok());
  EXPECT_NE(required.status().message().find("GPU registration required but not done: " + name +
                                             ": no usable device"),
            std::string::npos)
      << required.status().ToString();
}

// A typo in the GPU name, or a GPU that is required but cannot be had, fails before the
// model is read or the shared file is created.
TEST(GpuNoDeviceTest, BadNameOrMissingRequiredGpuFailsBeforeLoading) {
  testing::ScopedDataFile model(kMiB, 10);
  testing::ScopedPath path("gpu-early");
  ArenaOptions options;
  options.shared_path = path.path();
  options.progress = false;
  options.gpu = GpuDevice{GpuBackend::kCuda, -1};  // built by hand, naming no device
  auto bad = Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, options);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(platform::StatPath(path.path()).ok()) << "the arena file was created";
  EXPECT_FALSE(Arena::AttachExisting(path.path(), options).ok());

  GpuBackend missing = GpuBackend::kNone;
  for (GpuBackend b : kBackends) {
    if (!gpu::WhyDeviceUnusable(GpuDevice{b, 0}).empty()) missing = b;
  }
  if (missing == GpuBackend::kNone) GTEST_SKIP() << "every backend is built and has a device";
  options.gpu = GpuDevice{missing, 0};
  options.gpu_required = true;
  auto required = Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, options);
  ASSERT_FALSE(required.ok());
  EXPECT_EQ(required.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(required.status().message().find("GPU registration required but not done"),
            std::string::npos);
  EXPECT_FALSE(platform::StatPath(path.path()).ok()) << "the arena file was created";
}

TEST(GpuNoDeviceTest, BackendNotBuiltIsAnErrorOnlyWhenRequired) {
  GpuBackend missing = GpuBackend::kNone;
  for (GpuBackend b : kBackends) {
    if (!GpuBackendBuilt(b)) missing = b;
  }
  if (missing == GpuBackend::kNone) GTEST_SKIP() << "both CUDA and HIP backends are built";
  testing::ScopedDataFile model(kMiB, 8);
  ArenaOptions options;
  options.gpu = GpuDevice{missing, 0};
  options.progress = false;
  ASSERT_OK_AND_ASSIGN(
      Arena arena, Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, options));
  EXPECT_NE(arena.report().gpu_note.find("this build has no"), std::string::npos);
  options.gpu_required = true;
  EXPECT_FALSE(Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, options).ok());
}

// ---- mapping permissions ------------------------------------------------------------------

// cudaHostRegister of a PROT_READ range needs cudaHostRegisterReadOnly (unsupported on some
// GPUs), so an arena that is to be registered stays writable; every other one is read-only.
TEST(GpuArenaMappingTest, WritableOnlyWhenAGpuIsAsked) {
  testing::ScopedDataFile model(5 * kMiB, 9);
  testing::ScopedPath path("gpu-writable");
  ArenaOptions plain;
  plain.shared_path = path.path();
  plain.progress = false;
  ASSERT_OK_AND_ASSIGN(Arena loaded,
                       Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, plain));
  ASSERT_EQ(loaded.role(), ArenaRole::kLoaded);
  EXPECT_EQ(MappingPermissions(loaded.data().data()).substr(0, 3), "r--");

  ArenaOptions with_gpu = plain;
  with_gpu.gpu = GpuDevice{GpuBackend::kCuda, 0};  // registered or skipped, the mapping is writable either way
  ASSERT_OK_AND_ASSIGN(
      Arena attached,
      Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, with_gpu));
  ASSERT_EQ(attached.role(), ArenaRole::kAttached);
  EXPECT_EQ(MappingPermissions(attached.data().data()).substr(0, 3), "rw-");
  EXPECT_EQ(MappingPermissions(loaded.data().data()).substr(0, 3), "r--");

  ArenaOptions private_gpu;
  private_gpu.gpu = GpuDevice{GpuBackend::kHip, 0};
  private_gpu.progress = false;
  ASSERT_OK_AND_ASSIGN(
      Arena priv, Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, private_gpu));
  EXPECT_EQ(MappingPermissions(priv.data().data()).substr(0, 3), "rw-");
  ArenaOptions private_plain;
  private_plain.progress = false;
  ASSERT_OK_AND_ASSIGN(
      Arena priv2,
      Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, private_plain));
  EXPECT_EQ(MappingPermissions(priv2.data().data()).substr(0, 3), "r--");
}

// A GPU-mode engine, the loader as well as one that attaches, maps the header and table
// read-only and only the data writable: a stray write through a pointer into the mapping faults
// in that engine instead of damaging the table every engine reads. No device is needed: the
// mapping is made whether the registration happens or is skipped.
TEST(GpuArenaMappingTest, TheHeaderIsReadOnlyInAGpuModeEngine) {
  testing::ScopedDataFile model(5 * kMiB, 10);
  testing::ScopedPath path("gpu-header");
  ArenaOptions options;
  options.shared_path = path.path();
  options.progress = false;
  options.gpu = GpuDevice{GpuBackend::kCuda, 0};
  const ModelSpec spec{.files = {model.path()}, .format = ModelFormat::kRaw};
  ASSERT_OK_AND_ASSIGN(Arena loaded, Arena::Open(spec, options));
  ASSERT_EQ(loaded.role(), ArenaRole::kLoaded);
  ASSERT_OK_AND_ASSIGN(Arena attached, Arena::Open(spec, options));
  ASSERT_EQ(attached.role(), ArenaRole::kAttached);
  ASSERT_OK_AND_ASSIGN(Arena by_path, Arena::AttachExisting(path.path(), options));
  for (const Arena* arena : {&loaded, &attached, &by_path}) {
    SCOPED_TRACE(ArenaRoleName(arena->role()));
    const std::byte* data = arena->data().data();
    const std::byte* header = data - kHugePageBytes;  // the header region's first page
    EXPECT_EQ(MappingPermissions(data).substr(0, 3), "rw-");
    EXPECT_EQ(MappingPermissions(data - 1).substr(0, 3), "r--");
    EXPECT_EQ(MappingPermissions(header).substr(0, 3), "r--");
    EXPECT_EQ(std::memcmp(header, "EXPARENA", 8), 0);
  }
}

// ---- the pin budget -----------------------------------------------------------------------

TEST(GpuPinBudgetTest, ReservesWholeGranulesUpToTheBudget) {
  ASSERT_EQ(gpu::ProcessRegisteredBytes(), 0u);
  EXPECT_EQ(gpu::ReservePinBudget(8 * kMiB, 11 * kMiB, 2 * kMiB), 8 * kMiB);
  // 3 MiB left: one whole 2 MiB granule of the next 8 MiB.
  EXPECT_EQ(gpu::ReservePinBudget(8 * kMiB, 11 * kMiB, 2 * kMiB), 2 * kMiB);
  EXPECT_EQ(gpu::ReservePinBudget(8 * kMiB, 11 * kMiB, 2 * kMiB), 0u);
  EXPECT_EQ(gpu::ProcessRegisteredBytes(), 10 * kMiB);
  // No budget: everything, and it still counts for a later bounded caller.
  EXPECT_EQ(gpu::ReservePinBudget(5 * kMiB, 0, 2 * kMiB), 5 * kMiB);
  EXPECT_EQ(gpu::ReservePinBudget(kMiB, 12 * kMiB, 4096), 0u);
  gpu::ReleasePinBudget(5 * kMiB);
  gpu::ReleasePinBudget(2 * kMiB);  // 8 MiB held: 3 MiB of 11 left, one granule of it
  EXPECT_EQ(gpu::ReservePinBudget(4 * kMiB, 11 * kMiB, 2 * kMiB), 2 * kMiB);
  gpu::ReleasePinBudget(10 * kMiB);
  EXPECT_EQ(gpu::ProcessRegisteredBytes(), 0u);
}

TEST(GpuPinBudgetTest, ThreadsNeverExceedTheBudgetTogether) {
  constexpr uint64_t kBudget = 64 * kMiB;
  std::atomic<uint64_t> got{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) got += gpu::ReservePinBudget(2 * kMiB, kBudget, 2 * kMiB);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(got.load(), kBudget);
  EXPECT_EQ(gpu::ProcessRegisteredBytes(), kBudget);
  gpu::ReleasePinBudget(got.load());
  EXPECT_EQ(gpu::ProcessRegisteredBytes(), 0u);
}

// ---- with a device (skipped otherwise) ----------------------------------------------------

// A usable device of each built backend, or the reasons there is none.
std::vector<GpuDevice> UsableDevices(std::string* why_none) {
  std::vector<GpuDevice> devices;
  for (GpuBackend backend : kBackends) {
    GpuDevice device{backend, 0};
    std::string why = gpu::WhyDeviceUnusable(device);
    if (why.empty()) {
      devices.push_back(device);
    } else {
      *why_none += (why_none->empty() ? "" : "; ") + why;
    }
  }
  return devices;
}

TEST(GpuDeviceRegistrationTest, ChunksRegisterAndUnregister) {
  std::string why;
  auto devices = UsableDevices(&why);
  if (devices.empty()) GTEST_SKIP() << why;
  for (const GpuDevice& device : devices) {
    SCOPED_TRACE(device.ToString());
    testing::ScopedPath path("gpu-chunks");
    platform::OpenOptions open;
    open.write = true;
    open.create = true;
    ASSERT_OK_AND_ASSIGN(platform::UniqueFd fd, platform::OpenFile(path.path(), open));
    ASSERT_OK(platform::AllocateFile(fd, 64 * kMiB));
    ASSERT_OK_AND_ASSIGN(platform::Mapping m,
                         platform::Mapping::MapFile(fd, 64 * kMiB, true, kHugePageBytes));
    ASSERT_OK(platform::AdviseRange(m.data(), m.size(), platform::Advice::kPopulateWrite, "test"));
    gpu::RegisterOptions options;
    options.device = device;
    options.chunk_bytes = 7 * kMiB;  // rounded up to 8 MiB: 8 chunks
    options.threads = 2;
    {
      ASSERT_OK_AND_ASSIGN(auto reg, gpu::RegisterHostRange(m.bytes(), options));
      EXPECT_EQ(reg->report().registered_bytes, 64 * kMiB) << reg->report().note;
      EXPECT_EQ(reg->report().chunks, 8u);
      EXPECT_EQ(reg->report().chunk_bytes, 8 * kMiB);
      EXPECT_EQ(gpu::ProcessRegisteredBytes(), 64 * kMiB);
      // Registering the same pages again fails (already registered) and leaves nothing.
      auto again = gpu::RegisterHostRange(m.bytes(), options);
      EXPECT_FALSE(again.ok());
      EXPECT_EQ(gpu::ProcessRegisteredBytes(), 64 * kMiB);
    }
    // Unregistered: the same range registers again.
    EXPECT_EQ(gpu::ProcessRegisteredBytes(), 0u);
    options.threads = 1;
    ASSERT_OK_AND_ASSIGN(auto reg, gpu::RegisterHostRange(m.bytes(), options));
    EXPECT_EQ(reg->report().registered_bytes, 64 * kMiB);
    reg.reset();
    // The budget: 20 MiB of 64 registered, then nothing for a second range.
    options.pin_budget_bytes = 20 * kMiB;
    ASSERT_OK_AND_ASSIGN(auto part, gpu::RegisterHostRange(m.bytes().first(32 * kMiB), options));
    EXPECT_EQ(part->report().registered_bytes, 20 * kMiB);
    EXPECT_NE(part->report().note.find("not registered: pin budget"), std::string::npos);
    ASSERT_OK_AND_ASSIGN(auto none, gpu::RegisterHostRange(m.bytes().last(32 * kMiB), options));
    EXPECT_EQ(none->report().registered_bytes, 0u);
    EXPECT_NE(none->report().note.find("pin budget"), std::string::npos) << none->report().note;
  }
}

TEST(GpuDeviceRegistrationTest, ArenaCopyEqualsHostBytes) {
  std::string why;
  auto devices = UsableDevices(&why);
  if (devices.empty()) GTEST_SKIP() << why;
  for (const GpuDevice& device : devices) {
    SCOPED_TRACE(device.ToString());
    testing::ScopedDataFile model(9 * kMiB + 4321, 11);
    testing::ScopedPath path("gpu-arena");
    ArenaOptions options;
    options.shared_path = path.path();
    options.gpu = device;
    options.gpu_required = true;
    options.progress = false;
    {
      ASSERT_OK_AND_ASSIGN(
          Arena arena,
          Arena::Open({.files = {model.path()}, .format = ModelFormat::kRaw}, options));
      // The data region, not the header (mapped read-only).
      EXPECT_GE(arena.report().gpu_registered_bytes, arena.report().data_bytes);
      EXPECT_EQ(gpu::ProcessRegisteredBytes(), arena.report().gpu_registered_bytes);
      TensorView view = arena.tensor(0);
      ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, DeviceBuffer::Allocate(device, view.bytes.size()));
      const gpu::Runtime* runtime = gpu::RuntimeFor(device.backend);
      ASSERT_OK_AND_ASSIGN(void* stream, runtime->StreamCreate(device.index));
      ASSERT_OK_AND_ASSIGN(CopyEvent copy, CopyToDeviceAsync(device, view, buffer.data(), stream));
      ASSERT_OK(copy.Wait());
      ASSERT_OK_AND_ASSIGN(bool ready, copy.Ready());
      EXPECT_TRUE(ready);
      std::vector<std::byte> back(view.bytes.size());
      ASSERT_OK(CopyToHost(device, buffer.data(), back));
      EXPECT_EQ(std::memcmp(back.data(), view.bytes.data(), back.size()), 0);
      runtime->StreamDestroy(device.index, stream);
      // A batch: the tensor's two halves in swapped places, one event for both.
      {
        const size_t half = view.bytes.size() / 2;
        auto* d = static_cast<std::byte*>(buffer.data());
        HostToDeviceCopy batch[] = {{view.bytes.first(half), d + (view.bytes.size() - half)},
                                    {view.bytes.subspan(half), d}};
        ASSERT_OK_AND_ASSIGN(CopyEvent both, CopyBatchToDeviceAsync(device, batch, nullptr));
        ASSERT_OK(both.Wait());
        ASSERT_OK(CopyToHost(device, buffer.data(), back));
        const size_t second = view.bytes.size() - half;
        EXPECT_EQ(std::memcmp(back.data(), view.bytes.data() + half, second), 0);
        EXPECT_EQ(std::memcmp(back.data() + second, view.bytes.data(), half), 0);
      }
      // The default stream works too.
      ASSERT_OK_AND_ASSIGN(CopyEvent copy2, CopyToDeviceAsync(device, view.bytes.first(4096),
                                                              buffer.data(), nullptr));
      ASSERT_OK(copy2.Wait());
    }
    // The arena is gone: unregistered before it was unmapped.
    EXPECT_EQ(gpu::ProcessRegisteredBytes(), 0u);
  }
}

}  // namespace
}  // namespace expert_arena
