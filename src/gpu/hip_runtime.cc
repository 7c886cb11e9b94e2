// The HIP runtime behind gpu::Runtime. Host API only (hip/hip_runtime_api.h, compiled by the
// C++ compiler with __HIP_PLATFORM_AMD__): no kernels, so no hipcc; linked with libamdhip64.
//
// With no device (or no amdgpu/KFD driver) hipGetDeviceCount fails with hipErrorNoDevice
// (100); kUnsupported here, turned into one "no usable device" line by the caller.
//
// On ROCm hipHostRegister may not pin: the driver tracks the range through HMM (mmu
// notifiers) and the kernel may still move 4 KiB pages, stopping the GPU queues while the
// range is mapped again. VmPin then stays 0; the registration report says so, and the
// arena's 2 MiB pages are what keeps compaction away.
#include <hip/hip_runtime_api.h>

#include <cstdio>
#include <string>

#include "gpu/runtime.h"

namespace expert_arena::gpu {
namespace {

StatusCode CodeFor(hipError_t e) {
  switch (e) {
    case hipErrorInsufficientDriver:
    case hipErrorNoDevice:
    case hipErrorInvalidDevice:
    case hipErrorNotSupported:
      return StatusCode::kUnsupported;
    case hipErrorOutOfMemory:
      return StatusCode::kNoSpace;
    case hipErrorInvalidValue:
      return StatusCode::kInvalidArgument;
    default:
      return StatusCode::kIoError;
  }
}

// "hipHostRegister: hipErrorInvalidValue (1): invalid argument" (no "call: " when call is
// empty). Clears the runtime's
// last-error slot so that an engine polling hipGetLastError() does not see our failure.
Status HipError(hipError_t e, const std::string& call) {
  (void)hipGetLastError();
  return Status(CodeFor(e), (call.empty() ? "" : call + ": ") + hipGetErrorName(e) + " (" +
                                std::to_string(static_cast<int>(e)) + "): " +
                                hipGetErrorString(e));
}

#define EA_HIP_RETURN_IF_ERROR(call, what)          \
  do {                                               \
    hipError_t ea_e_ = (call);                      \
    if (ea_e_ != hipSuccess) return HipError(ea_e_, what); \
  } while (0)

// Makes `device` current on this thread for the scope, then restores the previous one.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    int current = -1;
    if (hipGetDevice(&current) == hipSuccess && current == device) {
      status_ = Status::Ok();
      return;
    }
    (void)hipGetLastError();
    hipError_t e = hipSetDevice(device);
    if (e != hipSuccess) {
      status_ = HipError(e, "hipSetDevice(" + std::to_string(device) + ")");
      return;
    }
    previous_ = current;
  }
  ~ScopedDevice() {
    if (previous_ >= 0) (void)hipSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const Status& status() const { return status_; }

 private:
  Status status_;
  int previous_ = -1;
};

#define EA_HIP_ON_DEVICE(device)              \
  ScopedDevice ea_scoped_device_(device);      \
  EA_RETURN_IF_ERROR(ea_scoped_device_.status())

class HipRuntimeImpl final : public Runtime {
 public:
  GpuBackend backend() const override { return GpuBackend::kHip; }
  const char* name() const override { return "hip"; }

  Result<int> DeviceCount() const override {
    int count = 0;
    EA_HIP_RETURN_IF_ERROR(hipGetDeviceCount(&count), "");
    if (count <= 0) return HipError(hipErrorNoDevice, "");
    return count;
  }

  Result<std::string> Describe(int device) const override {
    hipDeviceProp_t prop{};
    EA_HIP_RETURN_IF_ERROR(hipGetDeviceProperties(&prop, device), "hipGetDeviceProperties");
    int driver = 0;
    (void)hipDriverGetVersion(&driver);
    (void)hipGetLastError();
    char memory[32];
    std::snprintf(memory, sizeof memory, "%.1f GiB",
                  static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024 * 1024));
    return std::string(prop.name) + " (" + prop.gcnArchName + "), " + memory + ", HIP driver " +
           std::to_string(driver);
  }

  bool CanRegisterReadOnly(int /*device*/) const override {
#if defined(hipHostRegisterReadOnly)
    return true;
#else
    return false;  // this HIP has no read-only registration flag
#endif
  }

  Status HostRegister(int device, void* data, size_t bytes, bool read_only) const override {
    EA_HIP_ON_DEVICE(device);
    // Portable: the pages count as pinned for every device of the process, not only the one
    // that registered them (an engine may copy to several GPUs).
    unsigned flags = hipHostRegisterPortable;
#if defined(hipHostRegisterReadOnly)
    if (read_only) flags |= hipHostRegisterReadOnly;
#endif
    EA_HIP_RETURN_IF_ERROR(hipHostRegister(data, bytes, flags),
                            read_only ? "hipHostRegister(ReadOnly)" : "hipHostRegister");
    return Status::Ok();
  }

  Status HostUnregister(int device, void* data) const override {
    EA_HIP_ON_DEVICE(device);
    EA_HIP_RETURN_IF_ERROR(hipHostUnregister(data), "hipHostUnregister");
    return Status::Ok();
  }

  Result<void*> DeviceAlloc(int device, size_t bytes) const override {
    EA_HIP_ON_DEVICE(device);
    void* p = nullptr;
    EA_HIP_RETURN_IF_ERROR(hipMalloc(&p, bytes), "hipMalloc(" + std::to_string(bytes) + ")");
    return p;
  }

  Status DeviceFree(int device, void* data) const override {
    EA_HIP_ON_DEVICE(device);
    EA_HIP_RETURN_IF_ERROR(hipFree(data), "hipFree");
    return Status::Ok();
  }

  Result<void*> HostAlloc(int device, size_t bytes) const override {
    EA_HIP_ON_DEVICE(device);
    void* p = nullptr;
    EA_HIP_RETURN_IF_ERROR(hipHostMalloc(&p, bytes, 0),
                            "hipHostMalloc(" + std::to_string(bytes) + ")");
    return p;
  }

  Status HostFree(int device, void* data) const override {
    EA_HIP_ON_DEVICE(device);
    EA_HIP_RETURN_IF_ERROR(hipHostFree(data), "hipHostFree");
    return Status::Ok();
  }

  Status CopyToDeviceAsync(int device, void* dst, const void* src, size_t bytes,
                           void* stream) const override {
    EA_HIP_ON_DEVICE(device);
    EA_HIP_RETURN_IF_ERROR(hipMemcpyAsync(dst, src, bytes, hipMemcpyHostToDevice,
                                            static_cast<hipStream_t>(stream)),
                            "hipMemcpyAsync(host to device, " + std::to_string(bytes) + " B)");
    return Status::Ok();
  }

  Status CopyToHostSync(int device, void* dst, const void* src, size_t bytes) const override {
    EA_HIP_ON_DEVICE(device);
    EA_HIP_RETURN_IF_ERROR(hipMemcpy(dst, src, bytes, hipMemcpyDeviceToHost),
                            "hipMemcpy(device to host, " + std::to_string(bytes) + " B)");
    return Status::Ok();
  }

  Result<void*> EventRecord(int device, void* stream) const override {
    EA_HIP_ON_DEVICE(device);
    hipEvent_t event = nullptr;
    EA_HIP_RETURN_IF_ERROR(hipEventCreateWithFlags(&event, hipEventDisableTiming),
                            "hipEventCreateWithFlags");
    hipError_t e = hipEventRecord(event, static_cast<hipStream_t>(stream));
    if (e != hipSuccess) {
      Status s = HipError(e, "hipEventRecord");
      (void)hipEventDestroy(event);
      return s;
    }
    return static_cast<void*>(event);
  }

  Status EventWait(int device, void* event) const override {
    EA_HIP_ON_DEVICE(device);
    EA_HIP_RETURN_IF_ERROR(hipEventSynchronize(static_cast<hipEvent_t>(event)),
                            "hipEventSynchronize");
    return Status::Ok();
  }

  Result<bool> EventReady(int device, void* event) const override {
    EA_HIP_ON_DEVICE(device);
    hipError_t e = hipEventQuery(static_cast<hipEvent_t>(event));
    if (e == hipSuccess) return true;
    if (e == hipErrorNotReady) {
      (void)hipGetLastError();
      return false;
    }
    return HipError(e, "hipEventQuery");
  }

  void EventDestroy(int device, void* event) const override {
    ScopedDevice on(device);
    (void)hipEventDestroy(static_cast<hipEvent_t>(event));
    (void)hipGetLastError();
  }

  Result<void*> StreamCreate(int device) const override {
    EA_HIP_ON_DEVICE(device);
    hipStream_t stream = nullptr;
    EA_HIP_RETURN_IF_ERROR(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking),
                            "hipStreamCreateWithFlags");
    return static_cast<void*>(stream);
  }

  Status StreamSynchronize(int device, void* stream) const override {
    EA_HIP_ON_DEVICE(device);
    EA_HIP_RETURN_IF_ERROR(hipStreamSynchronize(static_cast<hipStream_t>(stream)),
                            "hipStreamSynchronize");
    return Status::Ok();
  }

  void StreamDestroy(int device, void* stream) const override {
    ScopedDevice on(device);
    (void)hipStreamDestroy(static_cast<hipStream_t>(stream));
    (void)hipGetLastError();
  }
};

}  // namespace

const Runtime& HipRuntime() {
  static const HipRuntimeImpl runtime;
  return runtime;
}

}  // namespace expert_arena::gpu
