// The HIP runtime behind gpu::Runtime: the HIP names for RuntimeImpl (runtime_impl.h), which
// holds the logic shared with CUDA. Host API only (hip/hip_runtime_api.h, compiled by the C++
// compiler with __HIP_PLATFORM_AMD__): no kernels, so no hipcc; linked with libamdhip64.
//
// With no device (or no amdgpu/KFD driver) hipGetDeviceCount fails with hipErrorNoDevice
// (100); kUnsupported here, turned into one "no usable device" line by the caller.
//
// On ROCm hipHostRegister may not pin: the driver tracks the range through HMM (mmu
// notifiers) and the kernel may still move 4 KiB pages, stopping the GPU queues while the
// range is mapped again. VmPin then stays 0; the registration report says so, and the
// arena's 2 MiB pages are what keeps compaction away.
#include <hip/hip_runtime_api.h>

#include <cstddef>
#include <string>

#include "gpu/runtime.h"
#include "gpu/runtime_impl.h"

namespace expert_arena::gpu {
namespace {

// The HIP types, codes, call names and calls that RuntimeImpl is written over.
struct HipApi {
  using Error = hipError_t;
  using DeviceProp = hipDeviceProp_t;
  static constexpr Error kSuccess = hipSuccess;
  static constexpr Error kNotReady = hipErrorNotReady;
  static constexpr Error kNoDevice = hipErrorNoDevice;
  static constexpr GpuBackend kBackend = GpuBackend::kHip;
  static constexpr const char* kName = "hip";
  static constexpr unsigned kHostRegisterPortable = hipHostRegisterPortable;
  static constexpr unsigned kHostRegisterMapped = hipHostRegisterMapped;
#if defined(hipHostRegisterReadOnly)
  static constexpr unsigned kHostRegisterReadOnly = hipHostRegisterReadOnly;
#else
  static constexpr unsigned kHostRegisterReadOnly = 0;  // this HIP has no read-only flag
#endif

  static constexpr const char* kSetDeviceCall = "hipSetDevice";
  static constexpr const char* kGetDevicePropertiesCall = "hipGetDeviceProperties";
  static constexpr const char* kHostRegisterCall = "hipHostRegister";
  static constexpr const char* kHostUnregisterCall = "hipHostUnregister";
  static constexpr const char* kMallocCall = "hipMalloc";
  static constexpr const char* kFreeCall = "hipFree";
  static constexpr const char* kMallocHostCall = "hipHostMalloc";
  static constexpr const char* kFreeHostCall = "hipHostFree";
  static constexpr const char* kMemcpyAsyncCall = "hipMemcpyAsync";
  static constexpr const char* kMemcpyCall = "hipMemcpy";
  static constexpr const char* kHostGetDevicePointerCall = "hipHostGetDevicePointer";
  static constexpr const char* kEventCreateWithFlagsCall = "hipEventCreateWithFlags";
  static constexpr const char* kEventRecordCall = "hipEventRecord";
  static constexpr const char* kEventSynchronizeCall = "hipEventSynchronize";
  static constexpr const char* kEventQueryCall = "hipEventQuery";
  static constexpr const char* kStreamCreateWithFlagsCall = "hipStreamCreateWithFlags";
  static constexpr const char* kStreamSynchronizeCall = "hipStreamSynchronize";

  static StatusCode CodeFor(Error e) {
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

  // "<name> (<gcnArchName>), <memory>, HIP driver <hipDriverGetVersion>"
  static std::string DeviceLine(const DeviceProp& prop, const char* memory, int driver) {
    return std::string(prop.name) + " (" + prop.gcnArchName + "), " + memory + ", HIP driver " +
           std::to_string(driver);
  }

  // Known at compile time: whether this HIP has the flag at all.
  static bool CanRegisterReadOnly(int /*device*/) { return kHostRegisterReadOnly != 0; }

  static const char* GetErrorName(Error e) { return hipGetErrorName(e); }
  static const char* GetErrorString(Error e) { return hipGetErrorString(e); }
  static Error GetLastError() { return hipGetLastError(); }
  static Error GetDevice(int* device) { return hipGetDevice(device); }
  static Error SetDevice(int device) { return hipSetDevice(device); }
  static Error GetDeviceCount(int* count) { return hipGetDeviceCount(count); }
  static Error GetDeviceProperties(DeviceProp* prop, int device) {
    return hipGetDeviceProperties(prop, device);
  }
  static Error DriverGetVersion(int* version) { return hipDriverGetVersion(version); }

  static Error HostRegister(void* data, size_t bytes, unsigned flags) {
    return hipHostRegister(data, bytes, flags);
  }
  static Error HostUnregister(void* data) { return hipHostUnregister(data); }
  static Error Malloc(void** data, size_t bytes) { return hipMalloc(data, bytes); }
  static Error Free(void* data) { return hipFree(data); }
  static Error MallocHost(void** data, size_t bytes) { return hipHostMalloc(data, bytes, 0); }
  static Error FreeHost(void* data) { return hipHostFree(data); }
  static Error MemcpyHostToDeviceAsync(void* dst, const void* src, size_t bytes, void* stream) {
    return hipMemcpyAsync(dst, src, bytes, hipMemcpyHostToDevice, static_cast<hipStream_t>(stream));
  }
  static Error MemcpyDeviceToHost(void* dst, const void* src, size_t bytes) {
    return hipMemcpy(dst, src, bytes, hipMemcpyDeviceToHost);
  }
  static Error MemcpyDeviceToDevice(void* dst, const void* src, size_t bytes) {
    return hipMemcpy(dst, src, bytes, hipMemcpyDeviceToDevice);
  }
  static Error HostGetDevicePointer(void** mapped, void* host) {
    return hipHostGetDevicePointer(mapped, host, 0);
  }

  static Error EventCreateDisableTiming(void** event) {
    hipEvent_t created = nullptr;
    Error e = hipEventCreateWithFlags(&created, hipEventDisableTiming);
    *event = created;
    return e;
  }
  static Error EventRecord(void* event, void* stream) {
    return hipEventRecord(static_cast<hipEvent_t>(event), static_cast<hipStream_t>(stream));
  }
  static Error EventSynchronize(void* event) {
    return hipEventSynchronize(static_cast<hipEvent_t>(event));
  }
  static Error EventQuery(void* event) { return hipEventQuery(static_cast<hipEvent_t>(event)); }
  static Error EventDestroy(void* event) { return hipEventDestroy(static_cast<hipEvent_t>(event)); }

  static Error StreamCreateNonBlocking(void** stream) {
    hipStream_t created = nullptr;
    Error e = hipStreamCreateWithFlags(&created, hipStreamNonBlocking);
    *stream = created;
    return e;
  }
  static Error StreamSynchronize(void* stream) {
    return hipStreamSynchronize(static_cast<hipStream_t>(stream));
  }
  static Error StreamDestroy(void* stream) {
    return hipStreamDestroy(static_cast<hipStream_t>(stream));
  }
};

}  // namespace

const Runtime& HipRuntime() {
  static const RuntimeImpl<HipApi> runtime;
  return runtime;
}

}  // namespace expert_arena::gpu
