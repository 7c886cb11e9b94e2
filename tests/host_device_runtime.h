// A GPU runtime whose "device" is host memory, for the tests of everything above the runtime
// on machines without a GPU (this project's CI has none): the arena's and the stream's
// registration, copies to the device, events, releases gated on a copy. It behaves like a
// driver where the library could go wrong:
// - HostRegister refuses a range that overlaps one already registered (cudaHostRegister
//   does), HostUnregister refuses a pointer that does not start a registration, and the
//   destructor of ScopedHostDevice fails the test when a registration is left behind;
// - HostRegister counts the pages of the range this process has not mapped yet (the present
//   bit of /proc/self/pagemap): a real driver faults them in itself while pinning, one 4 KiB
//   page at a time, so the library populates ranges before registering them (docs/gpu.md), and
//   a test checks that none were left;
// - copies are done at once (memcpy), and each records whether its source lay inside a
//   registered range (what would be DMA from pinned pages on a real device);
// - events can be held back (hold_events) to stand for a copy still running, and released
//   later (FinishEvents), so that a release gated on a copy can be seen waiting.
//
// Thread-safety: every method may be called from any thread (one mutex).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "gpu/runtime.h"

namespace expert_arena::testing {

class HostDeviceRuntime final : public gpu::Runtime {
 public:
  explicit HostDeviceRuntime(GpuBackend backend) : backend_(backend) {}

  GpuBackend backend() const override { return backend_; }
  const char* name() const override { return GpuBackendName(backend_); }
  Result<int> DeviceCount() const override { return 1; }
  Result<std::string> Describe(int device) const override {
    if (device != 0) return Status(StatusCode::kNotFound, "host device: no device " + Index(device));
    return std::string("host-memory test device");
  }
  bool CanRegisterReadOnly(int) const override { return true; }

  // Every HostRegister fails while set (a driver out of pinnable memory).
  bool refuse_registrations = false;

  Status HostRegister(int device, void* data, size_t bytes, bool) const override {
    std::lock_guard lock(mu_);
    EA_RETURN_IF_ERROR(CheckDevice(device));
    if (refuse_registrations) {
      return Status(StatusCode::kIoError, "host device: registration refused (as told)");
    }
    auto begin = reinterpret_cast<uintptr_t>(data);
    for (const auto& [b, n] : registered_) {
      if (begin < b + n && b < begin + bytes) {
        return Status(StatusCode::kInvalidArgument, "host device: range already registered");
      }
    }
    registered_[begin] = bytes;
    registered_bytes_ += bytes;
    ++register_calls_;
    unpopulated_pages_ += NotPresentPages(begin, bytes);
    return Status::Ok();
  }
  Status HostUnregister(int device, void* data) const override {
    std::lock_guard lock(mu_);
    EA_RETURN_IF_ERROR(CheckDevice(device));
    auto it = registered_.find(reinterpret_cast<uintptr_t>(data));
    if (it == registered_.end()) {
      return Status(StatusCode::kInvalidArgument, "host device: pointer not registered");
    }
    registered_bytes_ -= it->second;
    registered_.erase(it);
    return Status::Ok();
  }

  Result<void*> DeviceAlloc(int device, size_t bytes) const override {
    std::lock_guard lock(mu_);
    EA_RETURN_IF_ERROR(CheckDevice(device));
    void* p = std::malloc(bytes == 0 ? 1 : bytes);
    allocations_.insert(p);
    return p;
  }
  Status DeviceFree(int, void* data) const override {
    std::lock_guard lock(mu_);
    if (allocations_.erase(data) == 0) {
      return Status(StatusCode::kInvalidArgument, "host device: not a device allocation");
    }
    std::free(data);
    return Status::Ok();
  }
  Result<void*> HostAlloc(int device, size_t bytes) const override {
    return DeviceAlloc(device, bytes);
  }
  Status HostFree(int device, void* data) const override { return DeviceFree(device, data); }

  Status CopyToDeviceAsync(int device, void* dst, const void* src, size_t bytes,
                           void*) const override {
    std::lock_guard lock(mu_);
    EA_RETURN_IF_ERROR(CheckDevice(device));
    std::memcpy(dst, src, bytes);
    ++copies_;
    if (InsideRegistered(reinterpret_cast<uintptr_t>(src), bytes)) ++copies_from_registered_;
    return Status::Ok();
  }
  Status CopyToHostSync(int device, void* dst, const void* src, size_t bytes) const override {
    std::lock_guard lock(mu_);
    EA_RETURN_IF_ERROR(CheckDevice(device));
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }

  Result<void*> EventRecord(int device, void*) const override {
    std::lock_guard lock(mu_);
    EA_RETURN_IF_ERROR(CheckDevice(device));
    auto* event = new bool(!hold_events);
    events_.insert(event);
    return static_cast<void*>(event);
  }
  Status EventWait(int, void* event) const override {
    std::lock_guard lock(mu_);
    if (!events_.contains(static_cast<bool*>(event))) {
      return Status(StatusCode::kInvalidArgument, "host device: not an event");
    }
    *static_cast<bool*>(event) = true;  // waiting lets the "copy" finish
    return Status::Ok();
  }
  Result<bool> EventReady(int, void* event) const override {
    std::lock_guard lock(mu_);
    if (!events_.contains(static_cast<bool*>(event))) {
      return Status(StatusCode::kInvalidArgument, "host device: not an event");
    }
    return *static_cast<bool*>(event);
  }
  void EventDestroy(int, void* event) const override {
    std::lock_guard lock(mu_);
    if (events_.erase(static_cast<bool*>(event)) != 0) delete static_cast<bool*>(event);
  }

  Result<void*> StreamCreate(int device) const override {
    std::lock_guard lock(mu_);
    EA_RETURN_IF_ERROR(CheckDevice(device));
    auto* stream = new int(0);
    streams_.insert(stream);
    return static_cast<void*>(stream);
  }
  Status StreamSynchronize(int, void*) const override { return Status::Ok(); }
  void StreamDestroy(int, void* stream) const override {
    std::lock_guard lock(mu_);
    if (streams_.erase(static_cast<int*>(stream)) != 0) delete static_cast<int*>(stream);
  }

  // Every event recorded so far (and from now on, unless hold_events is set again) is done.
  void FinishEvents() {
    std::lock_guard lock(mu_);
    hold_events = false;
    for (bool* e : events_) *e = true;
  }

  uint64_t registered_bytes() const {
    std::lock_guard lock(mu_);
    return registered_bytes_;
  }
  size_t registrations() const {
    std::lock_guard lock(mu_);
    return registered_.size();
  }
  // Pages that were not resident when their range was registered (should stay 0).
  uint64_t unpopulated_pages() const {
    std::lock_guard lock(mu_);
    return unpopulated_pages_;
  }
  int register_calls() const {
    std::lock_guard lock(mu_);
    return register_calls_;
  }
  int copies() const {
    std::lock_guard lock(mu_);
    return copies_;
  }
  int copies_from_registered() const {
    std::lock_guard lock(mu_);
    return copies_from_registered_;
  }
  size_t live_allocations() const {
    std::lock_guard lock(mu_);
    return allocations_.size() + events_.size() + streams_.size();
  }

  // Set before the copies whose events should stay "running".
  bool hold_events = false;

 private:
  static std::string Index(int device) { return std::to_string(device); }
  // Pages of [begin, begin + bytes) without a present page-table entry in this process
  // (bit 63 of each 8-byte /proc/self/pagemap entry; readable without privileges).
  static uint64_t NotPresentPages(uintptr_t begin, size_t bytes) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t first = begin / page, count = (bytes + page - 1) / page;
    std::vector<uint64_t> entries(count);
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    const auto want = static_cast<ssize_t>(count * sizeof(uint64_t));
    ssize_t got = pread(fd, entries.data(), static_cast<size_t>(want),
                        static_cast<off_t>(first * sizeof(uint64_t)));
    close(fd);
    if (got != want) return 0;
    uint64_t missing = 0;
    for (uint64_t e : entries) missing += (e >> 63) == 0;
    return missing;
  }
  Status CheckDevice(int device) const {
    if (device == 0) return Status::Ok();
    return Status(StatusCode::kNotFound, "host device: no device " + Index(device));
  }
  bool InsideRegistered(uintptr_t begin, size_t bytes) const {
    for (const auto& [b, n] : registered_) {
      if (begin >= b && begin + bytes <= b + n) return true;
    }
    return false;
  }

  const GpuBackend backend_;
  mutable std::mutex mu_;
  mutable std::map<uintptr_t, size_t> registered_;
  mutable uint64_t registered_bytes_ = 0;
  mutable int register_calls_ = 0;
  mutable uint64_t unpopulated_pages_ = 0;
  mutable int copies_ = 0;
  mutable int copies_from_registered_ = 0;
  mutable std::set<void*> allocations_;
  mutable std::set<bool*> events_;
  mutable std::set<int*> streams_;
};

// Installs a HostDeviceRuntime as the runtime of `backend` for the scope; at the end checks
// that the library unregistered every range and freed every buffer, event and stream.
class ScopedHostDevice {
 public:
  explicit ScopedHostDevice(GpuBackend backend = GpuBackend::kCuda)
      : backend_(backend), runtime_(backend) {
    gpu::SetRuntimeForTesting(backend_, &runtime_);
  }
  ~ScopedHostDevice() {
    gpu::SetRuntimeForTesting(backend_, nullptr);
    EXPECT_EQ(runtime_.registrations(), 0u) << "a registration was left behind";
    EXPECT_EQ(runtime_.live_allocations(), 0u) << "a buffer, event or stream was left behind";
  }
  ScopedHostDevice(const ScopedHostDevice&) = delete;
  ScopedHostDevice& operator=(const ScopedHostDevice&) = delete;

  HostDeviceRuntime& runtime() { return runtime_; }

 private:
  GpuBackend backend_;
  HostDeviceRuntime runtime_;
};

}  // namespace expert_arena::testing
