// The CUDA runtime behind gpu::Runtime. Host API only (cuda_runtime_api.h): no kernels, so
// this file is compiled by the C++ compiler and linked with libcudart.
//
// With no driver (or an old one) every call fails with cudaErrorInsufficientDriver (35);
// with no device, cudaErrorNoDevice (100). Both are kUnsupported here: the caller turns
// them into one "no usable device" line.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "gpu/runtime.h"

namespace expert_arena::gpu {
namespace {

StatusCode CodeFor(cudaError_t e) {
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

// "cudaHostRegister: cudaErrorInvalidValue (1): invalid argument" (no "call: " when call is
// empty). Clears the runtime's
// last-error slot so that an engine polling cudaGetLastError() does not see our failure.
Status CudaError(cudaError_t e, const std::string& call) {
  (void)cudaGetLastError();
  return Status(CodeFor(e), (call.empty() ? "" : call + ": ") + cudaGetErrorName(e) + " (" +
                                std::to_string(static_cast<int>(e)) + "): " +
                                cudaGetErrorString(e));
}

#define EA_CUDA_RETURN_IF_ERROR(call, what)          \
  do {                                               \
    cudaError_t ea_e_ = (call);                      \
    if (ea_e_ != cudaSuccess) return CudaError(ea_e_, what); \
  } while (0)

// Makes `device` current on this thread for the scope, then restores the previous one.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == device) {
      status_ = Status::Ok();
      return;
    }
    (void)cudaGetLastError();
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
      status_ = CudaError(e, "cudaSetDevice(" + std::to_string(device) + ")");
      return;
    }
    previous_ = current;
  }
  ~ScopedDevice() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const Status& status() const { return status_; }

 private:
  Status status_;
  int previous_ = -1;
};

#define EA_CUDA_ON_DEVICE(device)              \
  ScopedDevice ea_scoped_device_(device);      \
  EA_RETURN_IF_ERROR(ea_scoped_device_.status())

class CudaRuntimeImpl final : public Runtime {
 public:
  GpuBackend backend() const override { return GpuBackend::kCuda; }
  const char* name() const override { return "cuda"; }

  Result<int> DeviceCount() const override {
    int count = 0;
    EA_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "");
    if (count <= 0) return CudaError(cudaErrorNoDevice, "");
    return count;
  }

  Result<std::string> Describe(int device) const override {
    cudaDeviceProp prop{};
    EA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    int driver = 0;
    (void)cudaDriverGetVersion(&driver);
    (void)cudaGetLastError();
    char memory[32];
    std::snprintf(memory, sizeof memory, "%.1f GiB",
                  static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024 * 1024));
    return std::string(prop.name) + ", " + memory + ", driver " + std::to_string(driver / 1000) +
           "." + std::to_string((driver % 1000) / 10);
  }

  bool CanRegisterReadOnly(int device) const override {
    int supported = 0;
    if (cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterReadOnlySupported, device) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return supported != 0;
  }

  Status HostRegister(int device, void* data, size_t bytes, bool read_only) const override {
    EA_CUDA_ON_DEVICE(device);
    // Portable: the pages count as pinned for every device of the process, not only the one
    // that registered them (an engine may copy to several GPUs).
    unsigned flags = cudaHostRegisterPortable;
    if (read_only) flags |= cudaHostRegisterReadOnly;
    EA_CUDA_RETURN_IF_ERROR(cudaHostRegister(data, bytes, flags),
                            read_only ? "cudaHostRegister(ReadOnly)" : "cudaHostRegister");
    return Status::Ok();
  }

  Status HostUnregister(int device, void* data) const override {
    EA_CUDA_ON_DEVICE(device);
    EA_CUDA_RETURN_IF_ERROR(cudaHostUnregister(data), "cudaHostUnregister");
    return Status::Ok();
  }

  Result<void*> DeviceAlloc(int device, size_t bytes) const override {
    EA_CUDA_ON_DEVICE(device);
    void* p = nullptr;
    EA_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes), "cudaMalloc(" + std::to_string(bytes) + ")");
    return p;
  }

  Status DeviceFree(int device, void* data) const override {
    EA_CUDA_ON_DEVICE(device);
    EA_CUDA_RETURN_IF_ERROR(cudaFree(data), "cudaFree");
    return Status::Ok();
  }

  Result<void*> HostAlloc(int device, size_t bytes) const override {
    EA_CUDA_ON_DEVICE(device);
    void* p = nullptr;
    EA_CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, bytes),
                            "cudaMallocHost(" + std::to_string(bytes) + ")");
    return p;
  }

  Status HostFree(int device, void* data) const override {
    EA_CUDA_ON_DEVICE(device);
    EA_CUDA_RETURN_IF_ERROR(cudaFreeHost(data), "cudaFreeHost");
    return Status::Ok();
  }

  Status CopyToDeviceAsync(int device, void* dst, const void* src, size_t bytes,
                           void* stream) const override {
    EA_CUDA_ON_DEVICE(device);
    EA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice,
                                            static_cast<cudaStream_t>(stream)),
                            "cudaMemcpyAsync(host to device, " + std::to_string(bytes) + " B)");
    return Status::Ok();
  }

  Status CopyToHostSync(int device, void* dst, const void* src, size_t bytes) const override {
    EA_CUDA_ON_DEVICE(device);
    EA_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost),
                            "cudaMemcpy(device to host, " + std::to_string(bytes) + " B)");
    return Status::Ok();
  }

  Result<void*> EventRecord(int device, void* stream) const override {
    EA_CUDA_ON_DEVICE(device);
    cudaEvent_t event = nullptr;
    EA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                            "cudaEventCreateWithFlags");
    cudaError_t e = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) {
      Status s = CudaError(e, "cudaEventRecord");
      (void)cudaEventDestroy(event);
      return s;
    }
    return static_cast<void*>(event);
  }

  Status EventWait(int device, void* event) const override {
    EA_CUDA_ON_DEVICE(device);
    EA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(static_cast<cudaEvent_t>(event)),
                            "cudaEventSynchronize");
    return Status::Ok();
  }

  Result<bool> EventReady(int device, void* event) const override {
    EA_CUDA_ON_DEVICE(device);
    cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    return CudaError(e, "cudaEventQuery");
  }

  void EventDestroy(int device, void* event) const override {
    ScopedDevice on(device);
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
    (void)cudaGetLastError();
  }

  Result<void*> StreamCreate(int device) const override {
    EA_CUDA_ON_DEVICE(device);
    cudaStream_t stream = nullptr;
    EA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                            "cudaStreamCreateWithFlags");
    return static_cast<void*>(stream);
  }

  Status StreamSynchronize(int device, void* stream) const override {
    EA_CUDA_ON_DEVICE(device);
    EA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                            "cudaStreamSynchronize");
    return Status::Ok();
  }

  void StreamDestroy(int device, void* stream) const override {
    ScopedDevice on(device);
    (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
    (void)cudaGetLastError();
  }
};

}  // namespace

const Runtime& CudaRuntime() {
  static const CudaRuntimeImpl runtime;
  return runtime;
}

}  // namespace expert_arena::gpu
