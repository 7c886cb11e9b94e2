// The engine's hot-path helpers of expert_arena/gpu.h: device buffers, asynchronous copies
// of arena bytes on the caller's stream, and the events that say when they are done.
#include <string>

#include "expert_arena/gpu.h"
#include "gpu/runtime.h"

namespace expert_arena {
namespace {

Result<const gpu::Runtime*> RuntimeOf(const GpuDevice& device, const char* what) {
  if (device.backend == GpuBackend::kNone) {
    return InvalidArgument(std::string(what) + ": no GPU device (backend none)");
  }
  const gpu::Runtime* runtime = gpu::RuntimeFor(device.backend);
  if (runtime == nullptr) {
    return Unsupported(std::string(what) + ": " + gpu::WhyDeviceUnusable(device));
  }
  return runtime;
}

}  // namespace

// ---- DeviceBuffer -------------------------------------------------------------------------

Result<DeviceBuffer> DeviceBuffer::Allocate(const GpuDevice& device, size_t bytes) {
  EA_ASSIGN_OR_RETURN(const gpu::Runtime* runtime, RuntimeOf(device, "device allocation"));
  if (bytes == 0) return InvalidArgument("device allocation of 0 bytes");
  auto data = runtime->DeviceAlloc(device.index, bytes);
  if (!data.ok()) return data.status().WithContext(device.ToString());
  DeviceBuffer buffer;
  buffer.device_ = device;
  buffer.data_ = *data;
  buffer.size_ = bytes;
  return buffer;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(other.device_), data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = other.device_;
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

void DeviceBuffer::Reset() {
  if (data_ != nullptr) {
    if (const gpu::Runtime* runtime = gpu::RuntimeFor(device_.backend)) {
      (void)runtime->DeviceFree(device_.index, data_);
    }
  }
  data_ = nullptr;
  size_ = 0;
}

// ---- CopyEvent ----------------------------------------------------------------------------

CopyEvent::CopyEvent(CopyEvent&& other) noexcept : device_(other.device_), event_(other.event_) {
  other.event_ = nullptr;
}

CopyEvent& CopyEvent::operator=(CopyEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) gpu::RuntimeFor(device_.backend)->EventDestroy(device_.index, event_);
    device_ = other.device_;
    event_ = other.event_;
    other.event_ = nullptr;
  }
  return *this;
}

CopyEvent::~CopyEvent() {
  // The runtime keeps the recorded work going; destroying the event only drops our handle.
  if (event_ != nullptr) gpu::RuntimeFor(device_.backend)->EventDestroy(device_.index, event_);
}

Status CopyEvent::Wait() const {
  if (event_ == nullptr) return InvalidArgument("CopyEvent::Wait on an empty event");
  Status s = gpu::RuntimeFor(device_.backend)->EventWait(device_.index, event_);
  return s.ok() ? s : s.WithContext(device_.ToString() + ": waiting for a copy");
}

Result<bool> CopyEvent::Ready() const {
  if (event_ == nullptr) return InvalidArgument("CopyEvent::Ready on an empty event");
  auto ready = gpu::RuntimeFor(device_.backend)->EventReady(device_.index, event_);
  if (!ready.ok()) return ready.status().WithContext(device_.ToString() + ": polling a copy");
  return *ready;
}

// ---- Copies -------------------------------------------------------------------------------

Result<CopyEvent> CopyToDeviceAsync(const GpuDevice& device, std::span<const std::byte> src,
                                    void* dst, void* stream) {
  EA_ASSIGN_OR_RETURN(const gpu::Runtime* runtime, RuntimeOf(device, "copy to device"));
  if (dst == nullptr && !src.empty()) return InvalidArgument("copy to device: null destination");
  if (!src.empty()) {
    Status s = runtime->CopyToDeviceAsync(device.index, dst, src.data(), src.size(), stream);
    if (!s.ok()) return s.WithContext(device.ToString());
  }
  auto event = runtime->EventRecord(device.index, stream);
  if (!event.ok()) return event.status().WithContext(device.ToString());
  CopyEvent copy;
  copy.device_ = device;
  copy.event_ = *event;
  return copy;
}

Result<CopyEvent> CopyBatchToDeviceAsync(const GpuDevice& device,
                                         std::span<const HostToDeviceCopy> copies, void* stream) {
  EA_ASSIGN_OR_RETURN(const gpu::Runtime* runtime, RuntimeOf(device, "copy to device"));
  for (size_t i = 0; i < copies.size(); ++i) {
    const HostToDeviceCopy& c = copies[i];
    if (c.src.empty()) continue;
    Status s = c.dst == nullptr
                   ? InvalidArgument("null destination")
                   : runtime->CopyToDeviceAsync(device.index, c.dst, c.src.data(), c.src.size(),
                                                stream);
    if (!s.ok()) {
      return s.WithContext(device.ToString() + ": copy " + std::to_string(i) + " of " +
                           std::to_string(copies.size()));
    }
  }
  auto event = runtime->EventRecord(device.index, stream);
  if (!event.ok()) return event.status().WithContext(device.ToString());
  CopyEvent copy;
  copy.device_ = device;
  copy.event_ = *event;
  return copy;
}

Result<CopyEvent> CopyToDeviceAsync(const GpuDevice& device, const TensorView& tensor, void* dst,
                                    void* stream) {
  auto copy = CopyToDeviceAsync(device, tensor.bytes, dst, stream);
  if (!copy.ok()) return copy.status().WithContext("tensor " + std::string(tensor.name));
  return copy;
}

Status CopyToHost(const GpuDevice& device, const void* src, std::span<std::byte> dst) {
  EA_ASSIGN_OR_RETURN(const gpu::Runtime* runtime, RuntimeOf(device, "copy to host"));
  if (dst.empty()) return Status::Ok();
  Status s = runtime->CopyToHostSync(device.index, dst.data(), src, dst.size());
  return s.ok() ? s : s.WithContext(device.ToString());
}

}  // namespace expert_arena
