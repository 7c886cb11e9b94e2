// Chunked registration against a runtime that records every call and injects faults, so
// that chunking, threads, rollback, unregistration, the budget and the report are checked on
// every machine (the device tests in gpu_test.cc check the real runtimes where a GPU exists).
#include <map>
#include <mutex>

#include "common/units.h"
#include "expert_arena/gpu.h"
#include "gpu/gpu.h"
#include "gpu/runtime.h"
#include "platform/mapping.h"
#include "test_util.h"

namespace expert_arena::gpu {
namespace {

// Registers nothing for real: keeps the live registrations like a driver does (overlaps are
// refused, as cudaHostRegister refuses memory already registered) and fails where told.
class FaultyRuntime final : public Runtime {
 public:
  explicit FaultyRuntime(GpuBackend backend) : backend_(backend) {}

  GpuBackend backend() const override { return backend_; }
  const char* name() const override { return GpuBackendName(backend_); }
  Result<int> DeviceCount() const override { return 1; }
  Result<std::string> Describe(int) const override { return std::string("faulty runtime"); }
  bool CanRegisterReadOnly(int) const override { return read_only_supported; }

  Status HostRegister(int, void* data, size_t bytes, bool read_only) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto begin = reinterpret_cast<uintptr_t>(data);
    if (data == fail_register_at) return Status(StatusCode::kIoError, "injected register fault");
    for (const auto& [b, n] : live_) {
      if (begin < b + n && b < begin + bytes) {
        return Status(StatusCode::kInvalidArgument, "already registered");
      }
    }
    live_[begin] = bytes;
    if (read_only) ++read_only_registrations_;
    return Status::Ok();
  }

  Status HostUnregister(int, void* data) const override {
    std::lock_guard<std::mutex> lock(mu_);
    ++unregister_calls_;
    auto it = live_.find(reinterpret_cast<uintptr_t>(data));
    if (it == live_.end()) return Status(StatusCode::kInvalidArgument, "not registered");
    live_.erase(it);
    if (data == fail_unregister_at) return Status(StatusCode::kIoError, "injected unregister fault");
    return Status::Ok();
  }

  Result<void*> DeviceAlloc(int, size_t) const override { return Unsupported("fake"); }
  Status DeviceFree(int, void*) const override { return Unsupported("fake"); }
  Result<void*> HostAlloc(int, size_t) const override { return Unsupported("fake"); }
  Status HostFree(int, void*) const override { return Unsupported("fake"); }
  Status CopyToDeviceAsync(int, void*, const void*, size_t, void*) const override {
    return Unsupported("fake");
  }
  Status CopyToHostSync(int, void*, const void*, size_t) const override {
    return Unsupported("fake");
  }
  Result<void*> EventRecord(int, void*) const override { return Unsupported("fake"); }
  Status EventWait(int, void*) const override { return Unsupported("fake"); }
  Result<bool> EventReady(int, void*) const override { return Unsupported("fake"); }
  void EventDestroy(int, void*) const override {}
  Result<void*> StreamCreate(int) const override { return Unsupported("fake"); }
  Status StreamSynchronize(int, void*) const override { return Unsupported("fake"); }
  void StreamDestroy(int, void*) const override {}

  // The live registrations, offset from `base` -> bytes.
  std::map<uint64_t, uint64_t> Live(const std::byte* base) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::map<uint64_t, uint64_t> out;
    for (const auto& [b, n] : live_) out[b - reinterpret_cast<uintptr_t>(base)] = n;
    return out;
  }
  int unregister_calls() const { return unregister_calls_; }
  int read_only_registrations() const { return read_only_registrations_; }

  bool read_only_supported = true;
  void* fail_register_at = nullptr;
  void* fail_unregister_at = nullptr;

 private:
  GpuBackend backend_;
  mutable std::mutex mu_;
  mutable std::map<uintptr_t, uint64_t> live_;
  mutable int unregister_calls_ = 0;
  mutable int read_only_registrations_ = 0;
};

class RegistrationFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = platform::Mapping::MapAnonymous(64 * kMiB, kHugePageBytes);
    ASSERT_OK(m);
    mapping_ = std::move(*m);
    options_.chunk_bytes = 7 * kMiB;  // rounded up to 8 MiB: 8 chunks
    options_.threads = 3;
  }
  void TearDown() override { EXPECT_EQ(ProcessRegisteredBytes(), 0u); }

  FaultyRuntime runtime_{GpuBackend::kCuda};
  GpuDevice device_{GpuBackend::kCuda, 0};
  platform::Mapping mapping_;
  RegisterOptions options_;
};

TEST_F(RegistrationFaultTest, ChunksCoverTheRangeOnceAndAreUnregistered) {
  {
    ASSERT_OK_AND_ASSIGN(auto reg, RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_));
    const RegistrationReport& r = reg->report();
    EXPECT_EQ(r.registered_bytes, 64 * kMiB);
    EXPECT_EQ(r.chunk_bytes, 8 * kMiB);
    EXPECT_EQ(r.chunks, 8u);
    EXPECT_EQ(r.threads, 3);
    EXPECT_EQ(r.device, "cuda:0");
    EXPECT_EQ(r.note.rfind("cuda:0: registered 64.0 MiB in ", 0), 0u) << r.note;
    EXPECT_NE(r.note.find("8 chunks of 8.0 MiB, 3 threads"), std::string::npos) << r.note;
    auto live = runtime_.Live(mapping_.data());
    ASSERT_EQ(live.size(), 8u);
    uint64_t expect = 0;
    for (const auto& [offset, bytes] : live) {
      EXPECT_EQ(offset, expect);
      EXPECT_EQ(bytes, 8 * kMiB);
      expect += bytes;
    }
    EXPECT_EQ(ProcessRegisteredBytes(), 64 * kMiB);
    // The same pages again: refused by the "driver", nothing left behind by the attempt.
    auto again = RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_);
    ASSERT_FALSE(again.ok());
    EXPECT_NE(again.status().message().find("already registered"), std::string::npos);
    EXPECT_EQ(runtime_.Live(mapping_.data()).size(), 8u);
    EXPECT_EQ(ProcessRegisteredBytes(), 64 * kMiB);
    EXPECT_EQ(runtime_.unregister_calls(), 0);
  }
  EXPECT_TRUE(runtime_.Live(mapping_.data()).empty());
  EXPECT_EQ(runtime_.unregister_calls(), 8);
}

TEST_F(RegistrationFaultTest, AFailingChunkRollsBackTheOthers) {
  runtime_.fail_register_at = mapping_.data() + 32 * kMiB;  // chunk 5 of 8
  for (int threads : {1, 2, 8}) {
    options_.threads = threads;
    auto reg = RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_);
    ASSERT_FALSE(reg.ok());
    EXPECT_EQ(reg.status().code(), StatusCode::kIoError);
    EXPECT_NE(reg.status().message().find("cuda:0: registering chunk 5 of 8 (8.0 MiB at offset "
                                          "33554432) failed: injected register fault"),
              std::string::npos)
        << reg.status().message();
    EXPECT_TRUE(runtime_.Live(mapping_.data()).empty()) << threads << " threads";
    EXPECT_EQ(ProcessRegisteredBytes(), 0u);
  }
}

TEST_F(RegistrationFaultTest, AFailingUnregisterStillUnregistersTheRest) {
  runtime_.fail_unregister_at = mapping_.data() + 16 * kMiB;
  {
    ASSERT_OK_AND_ASSIGN(auto reg, RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_));
    EXPECT_EQ(runtime_.Live(mapping_.data()).size(), 8u);
  }  // the destructor logs the failure and goes on
  EXPECT_TRUE(runtime_.Live(mapping_.data()).empty());
}

TEST_F(RegistrationFaultTest, TheBudgetIsSharedByEveryRegistrationOfTheProcess) {
  options_.pin_budget_bytes = 20 * kMiB;
  auto first_half = mapping_.bytes().first(32 * kMiB);
  auto second_half = mapping_.bytes().last(32 * kMiB);
  {
    ASSERT_OK_AND_ASSIGN(auto a, RegisterHostRangeOn(runtime_, device_, first_half, options_));
    EXPECT_EQ(a->report().registered_bytes, 20 * kMiB);
    EXPECT_EQ(a->report().chunks, 3u);  // 8 + 8 + 4 MiB
    EXPECT_NE(a->report().note.find("; 12.0 MiB not registered: pin budget 20.0 MiB"),
              std::string::npos)
        << a->report().note;
    auto live = runtime_.Live(mapping_.data());
    ASSERT_EQ(live.size(), 3u);
    EXPECT_EQ(live.rbegin()->first + live.rbegin()->second, 20 * kMiB);

    ASSERT_OK_AND_ASSIGN(auto b, RegisterHostRangeOn(runtime_, device_, second_half, options_));
    EXPECT_EQ(b->report().registered_bytes, 0u);
    EXPECT_EQ(b->report().note,
              "cuda:0: not registered: pin budget 20.0 MiB used up (20.0 MiB registered by this "
              "process)");
  }
  // The first one gone, its bytes are free for the next.
  ASSERT_OK_AND_ASSIGN(auto c, RegisterHostRangeOn(runtime_, device_, second_half, options_));
  EXPECT_EQ(c->report().registered_bytes, 20 * kMiB);
}

TEST_F(RegistrationFaultTest, ReadOnlyRangesNeedTheDeviceToSupportThem) {
  options_.read_only = true;
  runtime_.read_only_supported = false;
  ASSERT_OK_AND_ASSIGN(auto skipped, RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_));
  EXPECT_EQ(skipped->report().registered_bytes, 0u);
  EXPECT_NE(skipped->report().note.find("mapped read-only and this device cannot register"),
            std::string::npos);
  EXPECT_TRUE(runtime_.Live(mapping_.data()).empty());

  runtime_.read_only_supported = true;
  ASSERT_OK_AND_ASSIGN(auto reg, RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_));
  EXPECT_EQ(reg->report().registered_bytes, 64 * kMiB);
  EXPECT_EQ(runtime_.read_only_registrations(), 8);
  EXPECT_NE(reg->report().note.find(", read-only)"), std::string::npos) << reg->report().note;
}

TEST_F(RegistrationFaultTest, TheNoteSaysWhatVmPinShows) {
  // The fake pins nothing, like a driver that does not account its pins (NVIDIA) or does not
  // pin (ROCm): the note says which reading applies.
  ASSERT_OK_AND_ASSIGN(auto cuda, RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_));
  EXPECT_NE(cuda->report().note.find("; VmPin +0 B: this driver does not count its pins in VmPin"),
            std::string::npos)
      << cuda->report().note;
  cuda.reset();
  FaultyRuntime hip(GpuBackend::kHip);
  ASSERT_OK_AND_ASSIGN(auto reg, RegisterHostRangeOn(hip, GpuDevice{GpuBackend::kHip, 1},
                                                     mapping_.bytes(), options_));
  EXPECT_EQ(reg->report().note.rfind("hip:1: registered", 0), 0u);
  EXPECT_NE(reg->report().note.find("hipHostRegister did not pin these pages"), std::string::npos)
      << reg->report().note;
}

TEST_F(RegistrationFaultTest, RefusesBadRangesAndOptions) {
  auto unaligned = RegisterHostRangeOn(runtime_, device_, mapping_.bytes().subspan(1, 4096), options_);
  ASSERT_FALSE(unaligned.ok());
  EXPECT_EQ(unaligned.status().code(), StatusCode::kInvalidArgument);
  options_.threads = 0;
  EXPECT_FALSE(RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_).ok());
  options_.threads = 1;
  ASSERT_OK_AND_ASSIGN(auto empty, RegisterHostRangeOn(runtime_, device_, {}, options_));
  EXPECT_EQ(empty->report().note, "cuda:0: nothing to register");
  // A chunk size below 2 MiB is raised to 2 MiB.
  options_.chunk_bytes = 4096;
  ASSERT_OK_AND_ASSIGN(auto small, RegisterHostRangeOn(runtime_, device_, mapping_.bytes(), options_));
  EXPECT_EQ(small->report().chunks, 32u);
}

}  // namespace
}  // namespace expert_arena::gpu
