// GPU helpers for an engine's hot path: copy arena tensors to device memory on the engine's
// own stream, and wait for them.
//
//   auto device = expert_arena::ParseGpuDevice("cuda:0");            // Result<GpuDevice>
//   auto buffer = expert_arena::DeviceBuffer::Allocate(*device, view.bytes.size());
//   auto copied = expert_arena::CopyToDeviceAsync(*device, view, buffer->data(), stream);
//   ... enqueue kernels on `stream` that read buffer->data() ...
//   copied->Wait();   // or poll copied->Ready(); the arena must outlive the copy
//
// `stream` is the caller's cudaStream_t (CUDA) or hipStream_t (HIP) passed as void*; null
// is the runtime's default stream. No CUDA or HIP header is needed to use this file, and the
// calling thread's current device is left as it was.
//
// The copy is DMA straight from the arena's pages when the arena is registered with the
// device (ArenaOptions::gpu); otherwise the runtime stages it through pinned buffers
// (correct, slower). Errors carry the runtime call, its error name and code.
//
// Thread-safety: the free functions may be called from any thread. DeviceBuffer and
// CopyEvent are move-only owners; one object is not to be used from two threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "expert_arena/arena.h"
#include "expert_arena/export.h"
#include "expert_arena/gpu_device.h"
#include "expert_arena/status.h"

namespace expert_arena {

// Whether this build of the library has the backend (kNone always).
EXPERT_ARENA_EXPORT bool GpuBackendBuilt(GpuBackend backend);

// What this build's backend was compiled against, for build lines and --json: "cuda 12.9.79
// (PyPI nvidia-cuda-runtime-cu12, /path/to/nvidia/cuda_runtime)", "cuda 12.4.131 (toolkit,
// /usr/local/cuda/lib64)", "hip 5.2.3"; "" when the backend is not built.
EXPERT_ARENA_EXPORT const char* GpuBackendBuildNote(GpuBackend backend);

// Devices the backend's runtime sees. An error when the backend is not built, or when the
// runtime has no usable driver or device (the message carries the runtime's error, e.g.
// "cudaErrorInsufficientDriver (35): ..."); never 0 with OK.
EXPERT_ARENA_EXPORT Result<int> GpuDeviceCount(GpuBackend backend);

class CopyEvent;

// Enqueues a host-to-device copy of `src` to the device pointer `dst` on `stream` of
// `device`, then records an event after it. Returns at once; `src` must stay mapped (the
// arena alive) until the event is ready. `dst` must hold src.size() bytes.
EXPERT_ARENA_EXPORT Result<CopyEvent> CopyToDeviceAsync(const GpuDevice& device,
                                                        std::span<const std::byte> src,
                                                        void* dst, void* stream);
EXPERT_ARENA_EXPORT Result<CopyEvent> CopyToDeviceAsync(const GpuDevice& device,
                                                        const TensorView& tensor, void* dst,
                                                        void* stream);

// One host-to-device copy of a batch: `src.size()` bytes to the device pointer `dst`.
struct HostToDeviceCopy {
  std::span<const std::byte> src;
  void* dst = nullptr;
};

// Enqueues every copy in order on `stream`, then records one event after the last: for an
// engine that moves many experts at once and waits for them together. On an error, the
// copies enqueued before it still run; the error names the failing copy's index.
EXPERT_ARENA_EXPORT Result<CopyEvent> CopyBatchToDeviceAsync(
    const GpuDevice& device, std::span<const HostToDeviceCopy> copies, void* stream);

// Device memory on one device; freed by the destructor.
class EXPERT_ARENA_EXPORT DeviceBuffer {
 public:
  // Allocates `bytes` (> 0) on `device`.
  static Result<DeviceBuffer> Allocate(const GpuDevice& device, size_t bytes);

  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const GpuDevice& device() const { return device_; }
  // Frees now (the destructor does it otherwise). Work that uses the buffer must be done.
  void Reset();

 private:
  GpuDevice device_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

// An event recorded on a stream after a copy: Wait() blocks until the copy is done.
// Destroying it does not wait and does not cancel the copy.
class EXPERT_ARENA_EXPORT CopyEvent {
 public:
  CopyEvent() = default;
  CopyEvent(CopyEvent&& other) noexcept;
  CopyEvent& operator=(CopyEvent&& other) noexcept;
  CopyEvent(const CopyEvent&) = delete;
  CopyEvent& operator=(const CopyEvent&) = delete;
  ~CopyEvent();

  // Blocks until the work before the event is done; the error of that work otherwise.
  Status Wait() const;
  // True when done, false while running; an error when the work failed.
  Result<bool> Ready() const;
  // The runtime's event (cudaEvent_t / hipEvent_t), e.g. for cudaStreamWaitEvent on
  // another stream. Owned by this object.
  void* native() const { return event_; }

 private:
  friend Result<CopyEvent> CopyToDeviceAsync(const GpuDevice&, std::span<const std::byte>,
                                             void*, void*);
  friend Result<CopyEvent> CopyBatchToDeviceAsync(const GpuDevice&,
                                                  std::span<const HostToDeviceCopy>, void*);
  GpuDevice device_;
  void* event_ = nullptr;
};

// Copies `dst.size()` bytes from the device pointer `src` to host memory and waits (checks
// and tests; not for the hot path).
EXPERT_ARENA_EXPORT Status CopyToHost(const GpuDevice& device, const void* src,
                                      std::span<std::byte> dst);

}  // namespace expert_arena
