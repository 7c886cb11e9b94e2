// The CUDA runtime behind gpu::Runtime: the CUDA names for RuntimeImpl (runtime_impl.h), which
// holds the logic shared with HIP. Host API only (cuda_runtime_api.h): no kernels, so this
// file is compiled by the C++ compiler and linked with libcudart.
//
// With no driver (or an old one) every call fails with cudaErrorInsufficientDriver (35);
// with no device, cudaErrorNoDevice (100). Both are kUnsupported here: the caller turns
// them into one "no usable device" line.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "gpu/runtime.h"
#include "gpu/runtime_impl.h"

namespace expert_arena::gpu {
namespace {

// The CUDA types, codes, call names and calls that RuntimeImpl is written over.
struct CudaApi {
  using Error = cudaError_t;
  using DeviceProp = cudaDeviceProp;
  static constexpr Error kSuccess = cudaSuccess;
  static constexpr Error kNotReady = cudaErrorNotReady;
  static constexpr Error kNoDevice = cudaErrorNoDevice;
  static constexpr GpuBackend kBackend = GpuBackend::kCuda;
  static constexpr const char* kName = "cuda";
  static constexpr unsigned kHostRegisterPortable = cudaHostRegisterPortable;
  static constexpr unsigned kHostRegisterMapped = cudaHostRegisterMapped;
  static constexpr unsigned kHostRegisterReadOnly = cudaHostRegisterReadOnly;

  static constexpr const char* kSetDeviceCall = "cudaSetDevice";
  static constexpr const char* kGetDevicePropertiesCall = "cudaGetDeviceProperties";
  static constexpr const char* kHostRegisterCall = "cudaHostRegister";
  static constexpr const char* kHostUnregisterCall = "cudaHostUnregister";
  static constexpr const char* kMallocCall = "cudaMalloc";
  static constexpr const char* kFreeCall = "cudaFree";
  static constexpr const char* kMallocHostCall = "cudaMallocHost";
  static constexpr const char* kFreeHostCall = "cudaFreeHost";
  static constexpr const char* kMemcpyAsyncCall = "cudaMemcpyAsync";
  static constexpr const char* kMemcpyCall = "cudaMemcpy";
  static constexpr const char* kHostGetDevicePointerCall = "cudaHostGetDevicePointer";
  static constexpr const char* kEventCreateWithFlagsCall = "cudaEventCreateWithFlags";
  static constexpr const char* kEventRecordCall = "cudaEventRecord";
  static constexpr const char* kEventSynchronizeCall = "cudaEventSynchronize";
  static constexpr const char* kEventQueryCall = "cudaEventQuery";
  static constexpr const char* kStreamCreateWithFlagsCall = "cudaStreamCreateWithFlags";
  static constexpr const char* kStreamSynchronizeCall = "cudaStreamSynchronize";

  static StatusCode CodeFor(Error e) {
    switch (e) {
      case cudaErrorInsufficientDriver:
      case cudaErrorNoDevice:
      case cudaErrorInvalidDevice:
      case cudaErrorNotSupported:
      case cudaErrorSystemDriverMismatch:
      case cudaErrorCompatNotSupportedOnDevice:
      case cudaErrorDevicesUnavailable:
        return StatusCode::kUnsupported;
      case cudaErrorMemoryAllocation:
        return StatusCode::kNoSpace;
      case cudaErrorInvalidValue:
        return StatusCode::kInvalidArgument;
      default:
        return StatusCode::kIoError;
    }
  }

  // "NVIDIA H200, 139.8 GiB, driver 13.0"
  static std::string DeviceLine(const DeviceProp& prop, const char* memory, int driver) {
    return std::string(prop.name) + ", " + memory + ", driver " + std::to_string(driver / 1000) +
           "." + std::to_string((driver % 1000) / 10);
  }

  static bool CanRegisterReadOnly(int device) {
    int supported = 0;
    if (cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterReadOnlySupported, device) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return supported != 0;
  }

  static const char* GetErrorName(Error e) { return cudaGetErrorName(e); }
  static const char* GetErrorString(Error e) { return cudaGetErrorString(e); }
  static Error GetLastError() { return cudaGetLastError(); }
  static Error GetDevice(int* device) { return cudaGetDevice(device); }
  static Error SetDevice(int device) { return cudaSetDevice(device); }
  static Error GetDeviceCount(int* count) { return cudaGetDeviceCount(count); }
  static Error GetDeviceProperties(DeviceProp* prop, int device) {
    return cudaGetDeviceProperties(prop, device);
  }
  static Error DriverGetVersion(int* version) { return cudaDriverGetVersion(version); }

  static Error HostRegister(void* data, size_t bytes, unsigned flags) {
    return cudaHostRegister(data, bytes, flags);
  }
  static Error HostUnregister(void* data) { return cudaHostUnregister(data); }
  static Error Malloc(void** data, size_t bytes) { return cudaMalloc(data, bytes); }
  static Error Free(void* data) { return cudaFree(data); }
  static Error MallocHost(void** data, size_t bytes) { return cudaMallocHost(data, bytes); }
  static Error FreeHost(void* data) { return cudaFreeHost(data); }
  static Error MemcpyHostToDeviceAsync(void* dst, const void* src, size_t bytes, void* stream) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice,
                           static_cast<cudaStream_t>(stream));
  }
  static Error MemcpyDeviceToHost(void* dst, const void* src, size_t bytes) {
    return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  static Error MemcpyDeviceToDevice(void* dst, const void* src, size_t bytes) {
    return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  }
  static Error HostGetDevicePointer(void** mapped, void* host) {
    return cudaHostGetDevicePointer(mapped, host, 0);
  }

  static Error EventCreateDisableTiming(void** event) {
    cudaEvent_t created = nullptr;
    Error e = cudaEventCreateWithFlags(&created, cudaEventDisableTiming);
    *event = created;
    return e;
  }
  static Error EventRecord(void* event, void* stream) {
    return cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream));
  }
  static Error EventSynchronize(void* event) {
    return cudaEventSynchronize(static_cast<cudaEvent_t>(event));
  }
  static Error EventQuery(void* event) { return cudaEventQuery(static_cast<cudaEvent_t>(event)); }
  static Error EventDestroy(void* event) {
    return cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }

  static Error StreamCreateNonBlocking(void** stream) {
    cudaStream_t created = nullptr;
    Error e = cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking);
    *stream = created;
    return e;
  }
  static Error StreamSynchronize(void* stream) {
    return cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  }
  static Error StreamDestroy(void* stream) {
    return cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  }
};

}  // namespace

const Runtime& CudaRuntime() {
  static const RuntimeImpl<CudaApi> runtime;
  return runtime;
}

}  // namespace expert_arena::gpu
