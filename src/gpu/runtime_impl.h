// gpu::Runtime written once for both GPU runtimes. CUDA and HIP have the same host API under
// different names, so every method body, the current-device guard and the error messages live
// here, over an `Api` struct that each backend defines next to its runtime header:
// cuda_runtime.cc (CudaApi) and hip_runtime.cc (HipApi). This header includes neither
// runtime's headers, so the two still never meet in one translation unit.
//
// What an Api provides (static members only; the backend files show them all):
//   Error, kSuccess, kNotReady, kNoDevice        the runtime's error type and the codes used here
//   kBackend, kName                              GpuBackend::kCuda, "cuda"
//   k...Call                                     the runtime call named in each error message
//   CodeFor(Error)                               the runtime's errors as StatusCodes
//   GetErrorName, GetErrorString, GetLastError   as in the runtime
//   GetDevice, SetDevice, GetDeviceCount, GetDeviceProperties (DeviceProp), DriverGetVersion
//   DeviceLine(prop, memory, driver)             Describe's text
//   CanRegisterReadOnly(device)
//   kHostRegisterPortable, kHostRegisterMapped, kHostRegisterReadOnly (0 when the runtime has
//   no such flag)
//   HostRegister, HostUnregister, Malloc, Free, MallocHost, FreeHost
//   HostGetDevicePointer, MemcpyHostToDeviceAsync, MemcpyDeviceToHost, MemcpyDeviceToDevice,
//   EventCreateDisableTiming, EventRecord,
//   EventSynchronize, EventQuery, EventDestroy, StreamCreateNonBlocking, StreamSynchronize,
//   StreamDestroy                                thin wrappers; events and streams as void*
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

#include "expert_arena/status.h"
#include "gpu/runtime.h"

namespace expert_arena::gpu {

// Macros rather than a function taking the message: the message is only built on failure,
// and these calls sit on the copy and registration paths. Undefined at the end of this file.
#define EA_GPU_RETURN_IF_ERROR(call, what)                       \
  do {                                                           \
    Error ea_e_ = (call);                                        \
    if (ea_e_ != Api::kSuccess) return ErrorStatus(ea_e_, what); \
  } while (0)

#define EA_GPU_ON_DEVICE(device)          \
  ScopedDevice ea_scoped_device_(device); \
  EA_RETURN_IF_ERROR(ea_scoped_device_.status())

// Thread-safety: stateless; see Runtime.
template <class Api>
class RuntimeImpl final : public Runtime {
 public:
  using Error = typename Api::Error;

  GpuBackend backend() const override { return Api::kBackend; }
  const char* name() const override { return Api::kName; }

  Result<int> DeviceCount() const override {
    int count = 0;
    EA_GPU_RETURN_IF_ERROR(Api::GetDeviceCount(&count), "");
    if (count <= 0) return ErrorStatus(Api::kNoDevice, "");
    return count;
  }

  Result<std::string> Describe(int device) const override {
    typename Api::DeviceProp prop{};
    EA_GPU_RETURN_IF_ERROR(Api::GetDeviceProperties(&prop, device), Api::kGetDevicePropertiesCall);
    int driver = 0;
    (void)Api::DriverGetVersion(&driver);
    (void)Api::GetLastError();
    char memory[32];
    std::snprintf(memory, sizeof memory, "%.1f GiB",
                  static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024 * 1024));
    return Api::DeviceLine(prop, memory, driver);
  }

  Result<std::string> PciBusId(int device) const override {
    typename Api::DeviceProp prop{};
    EA_GPU_RETURN_IF_ERROR(Api::GetDeviceProperties(&prop, device), Api::kGetDevicePropertiesCall);
    char id[32];
    std::snprintf(id, sizeof id, "%04x:%02x:%02x.0", static_cast<unsigned>(prop.pciDomainID),
                  static_cast<unsigned>(prop.pciBusID), static_cast<unsigned>(prop.pciDeviceID));
    return std::string(id);
  }

  bool CanRegisterReadOnly(int device) const override { return Api::CanRegisterReadOnly(device); }

  Status HostRegister(int device, void* data, size_t bytes, bool read_only) const override {
    EA_GPU_ON_DEVICE(device);
    // Portable: the pages count as pinned for every device of the process, not only the one
    // that registered them (an engine may copy to several GPUs). Mapped: kernels may read them
    // in place, through the pointer cudaHostGetDevicePointer gives, as vLLM's UVA weight
    // offloading does (get_accelerator_view_from_cpu_tensor).
    unsigned flags = Api::kHostRegisterPortable | Api::kHostRegisterMapped;
    if (read_only) flags |= Api::kHostRegisterReadOnly;
    EA_GPU_RETURN_IF_ERROR(Api::HostRegister(data, bytes, flags),
                           read_only ? std::string(Api::kHostRegisterCall) + "(ReadOnly)"
                                     : std::string(Api::kHostRegisterCall));
    return Status::Ok();
  }

  Status HostUnregister(int device, void* data) const override {
    EA_GPU_ON_DEVICE(device);
    EA_GPU_RETURN_IF_ERROR(Api::HostUnregister(data), Api::kHostUnregisterCall);
    return Status::Ok();
  }

  Result<void*> DeviceAlloc(int device, size_t bytes) const override {
    EA_GPU_ON_DEVICE(device);
    void* p = nullptr;
    EA_GPU_RETURN_IF_ERROR(Api::Malloc(&p, bytes),
                           std::string(Api::kMallocCall) + "(" + std::to_string(bytes) + ")");
    return p;
  }

  Status DeviceFree(int device, void* data) const override {
    EA_GPU_ON_DEVICE(device);
    EA_GPU_RETURN_IF_ERROR(Api::Free(data), Api::kFreeCall);
    return Status::Ok();
  }

  Result<void*> HostAlloc(int device, size_t bytes) const override {
    EA_GPU_ON_DEVICE(device);
    void* p = nullptr;
    EA_GPU_RETURN_IF_ERROR(Api::MallocHost(&p, bytes),
                           std::string(Api::kMallocHostCall) + "(" + std::to_string(bytes) + ")");
    return p;
  }

  Status HostFree(int device, void* data) const override {
    EA_GPU_ON_DEVICE(device);
    EA_GPU_RETURN_IF_ERROR(Api::FreeHost(data), Api::kFreeHostCall);
    return Status::Ok();
  }

  Status CopyToDeviceAsync(int device, void* dst, const void* src, size_t bytes,
                           void* stream) const override {
    EA_GPU_ON_DEVICE(device);
    EA_GPU_RETURN_IF_ERROR(
        Api::MemcpyHostToDeviceAsync(dst, src, bytes, stream),
        std::string(Api::kMemcpyAsyncCall) + "(host to device, " + std::to_string(bytes) + " B)");
    return Status::Ok();
  }

  Status CopyToHostSync(int device, void* dst, const void* src, size_t bytes) const override {
    EA_GPU_ON_DEVICE(device);
    EA_GPU_RETURN_IF_ERROR(
        Api::MemcpyDeviceToHost(dst, src, bytes),
        std::string(Api::kMemcpyCall) + "(device to host, " + std::to_string(bytes) + " B)");
    return Status::Ok();
  }

  Result<void*> HostDevicePointer(int device, void* host) const override {
    EA_GPU_ON_DEVICE(device);
    void* mapped = nullptr;
    EA_GPU_RETURN_IF_ERROR(Api::HostGetDevicePointer(&mapped, host),
                           Api::kHostGetDevicePointerCall);
    return mapped;
  }

  Status CopyOnDeviceSync(int device, void* dst, const void* src, size_t bytes) const override {
    EA_GPU_ON_DEVICE(device);
    EA_GPU_RETURN_IF_ERROR(
        Api::MemcpyDeviceToDevice(dst, src, bytes),
        std::string(Api::kMemcpyCall) + "(device to device, " + std::to_string(bytes) + " B)");
    return Status::Ok();
  }

  Result<void*> EventRecord(int device, void* stream) const override {
    EA_GPU_ON_DEVICE(device);
    void* event = nullptr;
    EA_GPU_RETURN_IF_ERROR(Api::EventCreateDisableTiming(&event), Api::kEventCreateWithFlagsCall);
    Error e = Api::EventRecord(event, stream);
    if (e != Api::kSuccess) {
      Status s = ErrorStatus(e, Api::kEventRecordCall);
      (void)Api::EventDestroy(event);
      return s;
    }
    return event;
  }

  Status EventWait(int device, void* event) const override {
    EA_GPU_ON_DEVICE(device);
    EA_GPU_RETURN_IF_ERROR(Api::EventSynchronize(event), Api::kEventSynchronizeCall);
    return Status::Ok();
  }

  Result<bool> EventReady(int device, void* event) const override {
    EA_GPU_ON_DEVICE(device);
    Error e = Api::EventQuery(event);
    if (e == Api::kSuccess) return true;
    if (e == Api::kNotReady) {
      (void)Api::GetLastError();
      return false;
    }
    return ErrorStatus(e, Api::kEventQueryCall);
  }

  void EventDestroy(int device, void* event) const override {
    ScopedDevice on(device);
    (void)Api::EventDestroy(event);
    (void)Api::GetLastError();
  }

  Result<void*> StreamCreate(int device) const override {
    EA_GPU_ON_DEVICE(device);
    void* stream = nullptr;
    EA_GPU_RETURN_IF_ERROR(Api::StreamCreateNonBlocking(&stream), Api::kStreamCreateWithFlagsCall);
    return stream;
  }

  Status StreamSynchronize(int device, void* stream) const override {
    EA_GPU_ON_DEVICE(device);
    EA_GPU_RETURN_IF_ERROR(Api::StreamSynchronize(stream), Api::kStreamSynchronizeCall);
    return Status::Ok();
  }

  void StreamDestroy(int device, void* stream) const override {
    ScopedDevice on(device);
    (void)Api::StreamDestroy(stream);
    (void)Api::GetLastError();
  }

  // "cudaHostRegister: cudaErrorInvalidValue (1): invalid argument" (no "call: " when call is
  // empty). Clears the runtime's last-error slot so that an engine polling
  // cudaGetLastError() / hipGetLastError() does not see our failure.
  static Status ErrorStatus(Error e, const std::string& call) {
    (void)Api::GetLastError();
    return Status(Api::CodeFor(e), (call.empty() ? "" : call + ": ") + Api::GetErrorName(e) + " (" +
                                       std::to_string(static_cast<int>(e)) +
                                       "): " + Api::GetErrorString(e));
  }

 private:
  // Makes `device` current on this thread for the scope, then restores the previous one.
  class ScopedDevice {
   public:
    explicit ScopedDevice(int device) {
      int current = -1;
      if (Api::GetDevice(&current) == Api::kSuccess && current == device) return;
      (void)Api::GetLastError();
      Error e = Api::SetDevice(device);
      if (e != Api::kSuccess) {
        status_ =
            ErrorStatus(e, std::string(Api::kSetDeviceCall) + "(" + std::to_string(device) + ")");
        return;
      }
      previous_ = current;
    }
    ~ScopedDevice() {
      if (previous_ >= 0) (void)Api::SetDevice(previous_);
    }
    ScopedDevice(const ScopedDevice&) = delete;
    ScopedDevice& operator=(const ScopedDevice&) = delete;
    const Status& status() const { return status_; }

   private:
    Status status_;
    int previous_ = -1;
  };
};

#undef EA_GPU_ON_DEVICE
#undef EA_GPU_RETURN_IF_ERROR

}  // namespace expert_arena::gpu
