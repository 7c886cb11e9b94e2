// One GPU runtime's calls (CUDA or HIP) behind one interface, so that chunked registration,
// the pin budget and the copy helpers are written once. Each backend lives in its own
// translation unit (cuda_runtime.cc, hip_runtime.cc), compiled only when CMake enables it:
// the CUDA and HIP headers never meet in one file. Both instantiate one implementation,
// RuntimeImpl<Api> (runtime_impl.h).
//
// Every call returns a Status whose message names the runtime call and the runtime's error
// name, number and text ("cudaHostRegister: cudaErrorInvalidValue (1): invalid argument").
// Calls that act on a device take its index and make it current on the calling thread for
// the call only (ScopedDevice), so a caller's current device is never changed under it.
//
// Thread-safety: the runtimes are stateless singletons; every method may be called from
// any thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include <memory>
#include <span>
#include <string>

#include "expert_arena/gpu.h"
#include "expert_arena/status.h"
#include "gpu/gpu.h"

namespace expert_arena::gpu {

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual GpuBackend backend() const = 0;
  virtual const char* name() const = 0;  // "cuda", "hip"

  // Devices visible; an error (the runtime's) when there is no usable driver or device.
  virtual Result<int> DeviceCount() const = 0;
  // "NVIDIA H200, 139.8 GiB, driver 13.0" (for reports); the error when the device is absent.
  virtual Result<std::string> Describe(int device) const = 0;
  // The device's PCI address as sysfs names it ("0000:3b:00.0"), from its properties; for the
  // NUMA node a replica is chosen by (docs/numa.md). Unsupported where a runtime has none.
  virtual Result<std::string> PciBusId(int /*device*/) const {
    return Unsupported(std::string(name()) + ": no PCI address");
  }
  // Whether `device` can register memory mapped PROT_READ (cudaHostRegisterReadOnly).
  virtual bool CanRegisterReadOnly(int device) const = 0;

  virtual Status HostRegister(int device, void* data, size_t bytes, bool read_only) const = 0;
  virtual Status HostUnregister(int device, void* data) const = 0;

  virtual Result<void*> DeviceAlloc(int device, size_t bytes) const = 0;
  virtual Status DeviceFree(int device, void* data) const = 0;
  // Page-locked host memory from the runtime (cudaMallocHost), for comparisons.
  virtual Result<void*> HostAlloc(int device, size_t bytes) const = 0;
  virtual Status HostFree(int device, void* data) const = 0;

  virtual Status CopyToDeviceAsync(int device, void* dst, const void* src, size_t bytes,
                                   void* stream) const = 0;
  virtual Status CopyToHostSync(int device, void* dst, const void* src, size_t bytes) const = 0;

  // The device's address of registered host memory (cudaHostGetDevicePointer): where the GPU
  // reads it in place, as vLLM's UVA weight offloading does. Unsupported where a runtime has
  // no such mapping.
  virtual Result<void*> HostDevicePointer(int /*device*/, void* /*host*/) const {
    return Unsupported(std::string(name()) + ": no device pointers for host memory");
  }
  // A copy between two device addresses (a mapped host range is one), synchronous.
  virtual Status CopyOnDeviceSync(int /*device*/, void* /*dst*/, const void* /*src*/,
                                  size_t /*bytes*/) const {
    return Unsupported(std::string(name()) + ": no device-to-device copy");
  }

  // Events (disable-timing events: cheapest to record and query).
  virtual Result<void*> EventRecord(int device, void* stream) const = 0;
  virtual Status EventWait(int device, void* event) const = 0;
  // True when done, false when not yet.
  virtual Result<bool> EventReady(int device, void* event) const = 0;
  virtual void EventDestroy(int device, void* event) const = 0;

  virtual Result<void*> StreamCreate(int device) const = 0;
  virtual Status StreamSynchronize(int device, void* stream) const = 0;
  virtual void StreamDestroy(int device, void* stream) const = 0;
};

// The runtime of `backend`, or null when the backend is not built in (or kNone).
const Runtime* RuntimeFor(GpuBackend backend);

// Tests only: makes RuntimeFor(backend) return `runtime` (null: the built-in one again), so
// that everything above the runtime — the arena's and the stream's registration, copies,
// events, deferred releases — runs against a runtime whose "device" is host memory on
// machines without a GPU (tests/host_device_runtime.h). Not for production: set it before
// anything uses the backend and clear it after everything that did is gone.
void SetRuntimeForTesting(GpuBackend backend, const Runtime* runtime);

#if defined(EXPERT_ARENA_WITH_CUDA)
const Runtime& CudaRuntime();  // cuda_runtime.cc
#endif
#if defined(EXPERT_ARENA_WITH_HIP)
const Runtime& HipRuntime();  // hip_runtime.cc
#endif

// RegisterHostRange once the device is known to be usable: checks the range and options,
// the read-only case, the pin budget, then registers in chunks on `runtime`. Exposed so that
// tests can pass a runtime that injects faults (a chunk that fails, an unregister that fails).
Result<std::unique_ptr<Registration>> RegisterHostRangeOn(const Runtime& runtime,
                                                          const GpuDevice& device,
                                                          std::span<std::byte> range,
                                                          const RegisterOptions& options);

// The one-line reason a device cannot be used ("cuda: no usable device: ..."), or "" when
// `device` is usable. Used for the skip line of a registration and by the check program.
std::string WhyDeviceUnusable(const GpuDevice& device);

// The NUMA node of the device's PCI slot (/sys/bus/pci/devices/<address>/numa_node); -1 when
// there is no such device, no runtime, or the host does not say (one node).
int NumaNodeOfDevice(const GpuDevice& device);

}  // namespace expert_arena::gpu
