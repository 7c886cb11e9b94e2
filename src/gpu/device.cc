// Device names ("cuda:1"), which backends this build has, and whether a device is usable.
#include <array>
#include <atomic>
#include <charconv>
#include <string>

#include "expert_arena/gpu.h"
#include "gpu/runtime.h"
#include "platform/numa.h"

namespace expert_arena {

const char* GpuBackendName(GpuBackend backend) {
  switch (backend) {
    case GpuBackend::kNone: return "none";
    case GpuBackend::kCuda: return "cuda";
    case GpuBackend::kHip: return "hip";
  }
  return "unknown";
}

std::string GpuDevice::ToString() const {
  if (backend == GpuBackend::kNone) return "none";
  return std::string(GpuBackendName(backend)) + ":" + std::to_string(index);
}

Result<GpuDevice> ParseGpuDevice(std::string_view spec) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("GPU device \"" + std::string(spec) + "\": " + why +
                           " (expected none, cuda, cuda:N, hip or hip:N)");
  };
  GpuDevice device;
  if (spec.empty() || spec == "none") return device;
  std::string_view name = spec;
  std::string_view index;
  if (size_t colon = spec.find(':'); colon != std::string_view::npos) {
    name = spec.substr(0, colon);
    index = spec.substr(colon + 1);
    if (index.empty()) return bad("no device index after ':'");
  }
  if (name == "cuda") {
    device.backend = GpuBackend::kCuda;
  } else if (name == "hip") {
    device.backend = GpuBackend::kHip;
  } else {
    return bad("unknown backend \"" + std::string(name) + "\"");
  }
  if (!index.empty()) {
    int value = -1;
    auto [end, err] = std::from_chars(index.data(), index.data() + index.size(), value, 10);
    if (err != std::errc() || end != index.data() + index.size() || value < 0 ||
        index.front() == '+' || index.size() > 4) {
      return bad("device index \"" + std::string(index) + "\" is not a number from 0 to 9999");
    }
    device.index = value;
  }
  return device;
}

bool GpuBackendBuilt(GpuBackend backend) {
  return backend == GpuBackend::kNone || gpu::RuntimeFor(backend) != nullptr;
}

const char* GpuBackendBuildNote(GpuBackend backend) {
  if (!GpuBackendBuilt(backend)) return "";
  switch (backend) {
#ifdef EXPERT_ARENA_CUDA_BUILD_NOTE
    case GpuBackend::kCuda:
      return EXPERT_ARENA_CUDA_BUILD_NOTE;
#endif
#ifdef EXPERT_ARENA_HIP_BUILD_NOTE
    case GpuBackend::kHip:
      return EXPERT_ARENA_HIP_BUILD_NOTE;
#endif
    default:
      return "";
  }
}

Result<int> GpuDeviceCount(GpuBackend backend) {
  if (backend == GpuBackend::kNone) return InvalidArgument("GpuDeviceCount of backend none");
  const gpu::Runtime* runtime = gpu::RuntimeFor(backend);
  if (runtime == nullptr) {
    return Unsupported(std::string("this build of expert-arena has no ") + GpuBackendName(backend) +
                       " backend");
  }
  return runtime->DeviceCount();
}

namespace gpu {

namespace {
std::array<std::atomic<const Runtime*>, 3> runtime_for_testing{};  // by GpuBackend
}  // namespace

void SetRuntimeForTesting(GpuBackend backend, const Runtime* runtime) {
  runtime_for_testing.at(static_cast<size_t>(backend)).store(runtime, std::memory_order_release);
}

const Runtime* RuntimeFor(GpuBackend backend) {
  if (const Runtime* r =
          runtime_for_testing.at(static_cast<size_t>(backend)).load(std::memory_order_acquire)) {
    return r;
  }
  switch (backend) {
    case GpuBackend::kCuda:
#if defined(EXPERT_ARENA_WITH_CUDA)
      return &CudaRuntime();
#else
      return nullptr;
#endif
    case GpuBackend::kHip:
#if defined(EXPERT_ARENA_WITH_HIP)
      return &HipRuntime();
#else
      return nullptr;
#endif
    case GpuBackend::kNone:
      return nullptr;
  }
  return nullptr;
}

std::string WhyDeviceUnusable(const GpuDevice& device) {
  if (device.backend == GpuBackend::kNone) return "";
  const char* name = GpuBackendName(device.backend);
  const Runtime* runtime = RuntimeFor(device.backend);
  if (runtime == nullptr) {
    std::string option = device.backend == GpuBackend::kCuda ? "EXPERT_ARENA_CUDA" : "EXPERT_ARENA_HIP";
    return std::string(name) + ": this build has no " + name + " backend (configure with -D" +
           option + "=ON)";
  }
  auto count = runtime->DeviceCount();
  if (!count.ok()) return std::string(name) + ": no usable device: " + count.status().message();
  if (device.index >= *count) {
    return device.ToString() + ": no such device (" + name + " sees " + std::to_string(*count) +
           (*count == 1 ? " device)" : " devices)");
  }
  return "";
}

int NumaNodeOfDevice(const GpuDevice& device) {
  if (device.backend == GpuBackend::kNone || !WhyDeviceUnusable(device).empty()) return -1;
  auto bus = RuntimeFor(device.backend)->PciBusId(device.index);
  if (!bus.ok()) return -1;
  return platform::NodeOfPciDevice(*bus);
}

}  // namespace gpu
}  // namespace expert_arena
