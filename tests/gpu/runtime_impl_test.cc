// RuntimeImpl<Api> (runtime_impl.h) over a fake runtime API, so that what runs past SetDevice
// (the error messages and codes, the current-device guard, the last-error slot, events) is
// checked on every machine, with or without a GPU or a CUDA/HIP toolkit. The real backends
// differ from FakeApi only in names and in calling the runtime.
#include "gpu/runtime_impl.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "test_util.h"

namespace expert_arena::gpu {
namespace {

// The numbers are CUDA's, so that messages read like the real ones.
enum class FakeError : int {
  kSuccess = 0,
  kInvalidValue = 1,
  kMemoryAllocation = 2,
  kInsufficientDriver = 35,
  kNoDevice = 100,
  kInvalidDevice = 101,
  kNotReady = 600,
  kLaunchFailure = 719,
};

// One fake GPU runtime: what the runtime would hold per process and thread (one thread here).
struct FakeState {
  int device_count = 2;
  int current_device = 0;
  // The calls told to fail, by name (FakeApi's k...Call names), and with which error.
  std::map<std::string, FakeError> fail;
  // The runtime's sticky last error, returned and cleared by GetLastError as in CUDA and HIP.
  FakeError last_error = FakeError::kSuccess;
  // Every call but GetLastError, with the device current when it ran.
  struct Call {
    std::string name;
    int device;
  };
  std::vector<Call> calls;
  unsigned host_register_flags = 0;
  std::set<void*> live_events;
  std::set<void*> live_streams;
  uintptr_t next_handle = 0x1000;
};

// Exactly the members RuntimeImpl uses (see the list at the top of runtime_impl.h). Static, as
// the real runtimes' calls are, so the state lives in the test fixture and `state` points at it.
struct FakeApi {
  using Error = FakeError;
  struct DeviceProp {
    char name[32];
    size_t totalGlobalMem;
    int pciDomainID;
    int pciBusID;
    int pciDeviceID;
  };
  static constexpr Error kSuccess = FakeError::kSuccess;
  static constexpr Error kNotReady = FakeError::kNotReady;
  static constexpr Error kNoDevice = FakeError::kNoDevice;
  static constexpr GpuBackend kBackend = GpuBackend::kCuda;
  static constexpr const char* kName = "fake";
  static constexpr unsigned kHostRegisterPortable = 0x1;  // CUDA's values
  static constexpr unsigned kHostRegisterMapped = 0x2;
  static constexpr unsigned kHostRegisterReadOnly = 0x8;

  static constexpr const char* kSetDeviceCall = "fakeSetDevice";
  static constexpr const char* kGetDevicePropertiesCall = "fakeGetDeviceProperties";
  static constexpr const char* kHostRegisterCall = "fakeHostRegister";
  static constexpr const char* kHostUnregisterCall = "fakeHostUnregister";
  static constexpr const char* kMallocCall = "fakeMalloc";
  static constexpr const char* kFreeCall = "fakeFree";
  static constexpr const char* kMallocHostCall = "fakeMallocHost";
  static constexpr const char* kFreeHostCall = "fakeFreeHost";
  static constexpr const char* kMemcpyAsyncCall = "fakeMemcpyAsync";
  static constexpr const char* kMemcpyCall = "fakeMemcpy";
  static constexpr const char* kHostGetDevicePointerCall = "fakeHostGetDevicePointer";
  static constexpr const char* kEventCreateWithFlagsCall = "fakeEventCreateWithFlags";
  static constexpr const char* kEventRecordCall = "fakeEventRecord";
  static constexpr const char* kEventSynchronizeCall = "fakeEventSynchronize";
  static constexpr const char* kEventQueryCall = "fakeEventQuery";
  static constexpr const char* kStreamCreateWithFlagsCall = "fakeStreamCreateWithFlags";
  static constexpr const char* kStreamSynchronizeCall = "fakeStreamSynchronize";

  static inline FakeState* state = nullptr;

  // As CudaApi::CodeFor, for the errors the fake has.
  static StatusCode CodeFor(Error e) {
    switch (e) {
      case FakeError::kInsufficientDriver:
      case FakeError::kNoDevice:
      case FakeError::kInvalidDevice:
        return StatusCode::kUnsupported;
      case FakeError::kMemoryAllocation:
        return StatusCode::kNoSpace;
      case FakeError::kInvalidValue:
        return StatusCode::kInvalidArgument;
      default:
        return StatusCode::kIoError;
    }
  }
  static const char* GetErrorName(Error e) {
    switch (e) {
      case FakeError::kSuccess:
        return "fakeSuccess";
      case FakeError::kInvalidValue:
        return "fakeErrorInvalidValue";
      case FakeError::kMemoryAllocation:
        return "fakeErrorMemoryAllocation";
      case FakeError::kInsufficientDriver:
        return "fakeErrorInsufficientDriver";
      case FakeError::kNoDevice:
        return "fakeErrorNoDevice";
      case FakeError::kInvalidDevice:
        return "fakeErrorInvalidDevice";
      case FakeError::kNotReady:
        return "fakeErrorNotReady";
      case FakeError::kLaunchFailure:
        return "fakeErrorLaunchFailure";
    }
    return "fakeErrorUnknown";
  }
  static const char* GetErrorString(Error e) {
    return e == FakeError::kSuccess ? "no error" : "fake error text";
  }
  static std::string DeviceLine(const DeviceProp& prop, const char* memory, int driver) {
    return std::string(prop.name) + ", " + memory + ", driver " + std::to_string(driver);
  }
  static bool CanRegisterReadOnly(int /*device*/) { return true; }

  static Error GetLastError() {
    Error e = state->last_error;
    state->last_error = kSuccess;
    return e;
  }
  static Error GetDevice(int* device) {
    Error e = Run("fakeGetDevice");
    if (e == kSuccess) *device = state->current_device;
    return e;
  }
  static Error SetDevice(int device) {
    Error e = Run(kSetDeviceCall);
    if (e == kSuccess && (device < 0 || device >= state->device_count)) {
      e = Fail(FakeError::kInvalidDevice);
    }
    if (e == kSuccess) state->current_device = device;
    return e;
  }
  static Error GetDeviceCount(int* count) {
    *count = state->device_count;
    return Run("fakeGetDeviceCount");
  }
  static Error GetDeviceProperties(DeviceProp* prop, int /*device*/) {
    *prop = DeviceProp{"Fake GPU", size_t{3} << 29, 0, 0x3b, 2};  // 1.5 GiB
    return Run(kGetDevicePropertiesCall);
  }
  static Error DriverGetVersion(int* version) {
    Error e = Run("fakeDriverGetVersion");
    if (e == kSuccess) *version = 12040;
    return e;
  }

  static Error HostRegister(void* /*data*/, size_t /*bytes*/, unsigned flags) {
    state->host_register_flags = flags;
    return Run(kHostRegisterCall);
  }
  static Error HostUnregister(void* /*data*/) { return Run(kHostUnregisterCall); }
  static Error Malloc(void** data, size_t /*bytes*/) { return Create(kMallocCall, data); }
  static Error Free(void* /*data*/) { return Run(kFreeCall); }
  static Error MallocHost(void** data, size_t /*bytes*/) { return Create(kMallocHostCall, data); }
  static Error FreeHost(void* /*data*/) { return Run(kFreeHostCall); }
  static Error MemcpyHostToDeviceAsync(void*, const void*, size_t, void* /*stream*/) {
    return Run(kMemcpyAsyncCall);
  }
  static Error MemcpyDeviceToHost(void*, const void*, size_t) { return Run(kMemcpyCall); }
  static Error MemcpyDeviceToDevice(void*, const void*, size_t) { return Run(kMemcpyCall); }
  static Error HostGetDevicePointer(void** mapped, void* host) {
    Error e = Run(kHostGetDevicePointerCall);
    if (e == kSuccess) *mapped = host;  // as on a device that uses the host's addresses
    return e;
  }

  static Error EventCreateDisableTiming(void** event) {
    Error e = Create(kEventCreateWithFlagsCall, event);
    if (e == kSuccess) state->live_events.insert(*event);
    return e;
  }
  static Error EventRecord(void* /*event*/, void* /*stream*/) { return Run(kEventRecordCall); }
  static Error EventSynchronize(void* /*event*/) { return Run(kEventSynchronizeCall); }
  static Error EventQuery(void* /*event*/) { return Run(kEventQueryCall); }
  static Error EventDestroy(void* event) {
    state->live_events.erase(event);
    return Run("fakeEventDestroy");
  }
  static Error StreamCreateNonBlocking(void** stream) {
    Error e = Create(kStreamCreateWithFlagsCall, stream);
    if (e == kSuccess) state->live_streams.insert(*stream);
    return e;
  }
  static Error StreamSynchronize(void* /*stream*/) { return Run(kStreamSynchronizeCall); }
  static Error StreamDestroy(void* stream) {
    state->live_streams.erase(stream);
    return Run("fakeStreamDestroy");
  }

 private:
  // Records the call; fails it, setting the last error as the runtimes do, when told to.
  static Error Run(const char* name) {
    state->calls.push_back({name, state->current_device});
    auto it = state->fail.find(name);
    return it == state->fail.end() ? kSuccess : Fail(it->second);
  }
  static Error Fail(Error e) {
    state->last_error = e;
    return e;
  }
  // A call that hands out a new handle (distinct, never dereferenced) on success.
  static Error Create(const char* name, void** handle) {
    Error e = Run(name);
    if (e == kSuccess) *handle = reinterpret_cast<void*>(state->next_handle += 0x100);
    return e;
  }
};

using FakeRuntime = RuntimeImpl<FakeApi>;

class RuntimeImplTest : public ::testing::Test {
 protected:
  void SetUp() override { FakeApi::state = &fake_; }
  void TearDown() override { FakeApi::state = nullptr; }

  // How many times `name` ran, and the device current at its last run (-1: never ran).
  int Count(const std::string& name) const {
    int n = 0;
    for (const auto& call : fake_.calls) n += call.name == name;
    return n;
  }
  int DeviceAt(const std::string& name) const {
    int device = -1;
    for (const auto& call : fake_.calls) {
      if (call.name == name) device = call.device;
    }
    return device;
  }

  FakeState fake_;
  const FakeRuntime runtime_{};
};

// "what: fakeErrorX (N): text", as ErrorStatus writes it for both runtimes.
std::string Message(const std::string& what, FakeError e) {
  return (what.empty() ? "" : what + ": ") + FakeApi::GetErrorName(e) + " (" +
         std::to_string(static_cast<int>(e)) + "): " + FakeApi::GetErrorString(e);
}

// Each failing call, from each method that makes it, on a device that is not the caller's:
// the Status names the call with its argument text and carries the error's name, number, text
// and mapped code; the caller's device is back; the last-error slot is empty; nothing created
// by the method is left behind (an event whose record failed is destroyed).
TEST_F(RuntimeImplTest, FailuresNameTheCallAndRestoreState) {
  std::byte host[64];
  void* stream = reinterpret_cast<void*>(uintptr_t{0x50});
  void* event = reinterpret_cast<void*>(uintptr_t{0x60});
  void* device_ptr = reinterpret_cast<void*>(uintptr_t{0x70});
  struct Case {
    const char* call;  // the fake call told to fail
    std::string what;  // what the message names
    std::function<Status(const Runtime&)> run;
  };
  const std::vector<Case> cases = {
      {"fakeSetDevice", "fakeSetDevice(1)",
       [&](const Runtime& r) { return r.DeviceAlloc(1, 4096).status(); }},
      {"fakeHostRegister", "fakeHostRegister",
       [&](const Runtime& r) { return r.HostRegister(1, host, sizeof host, false); }},
      {"fakeHostRegister", "fakeHostRegister(ReadOnly)",
       [&](const Runtime& r) { return r.HostRegister(1, host, sizeof host, true); }},
      {"fakeHostUnregister", "fakeHostUnregister",
       [&](const Runtime& r) { return r.HostUnregister(1, host); }},
      {"fakeMalloc", "fakeMalloc(4096)",
       [&](const Runtime& r) { return r.DeviceAlloc(1, 4096).status(); }},
      {"fakeFree", "fakeFree", [&](const Runtime& r) { return r.DeviceFree(1, device_ptr); }},
      {"fakeMallocHost", "fakeMallocHost(8192)",
       [&](const Runtime& r) { return r.HostAlloc(1, 8192).status(); }},
      {"fakeFreeHost", "fakeFreeHost", [&](const Runtime& r) { return r.HostFree(1, host); }},
      {"fakeMemcpyAsync", "fakeMemcpyAsync(host to device, 1000 B)",
       [&](const Runtime& r) { return r.CopyToDeviceAsync(1, device_ptr, host, 1000, stream); }},
      {"fakeMemcpy", "fakeMemcpy(device to host, 1000 B)",
       [&](const Runtime& r) { return r.CopyToHostSync(1, host, device_ptr, 1000); }},
      {"fakeMemcpy", "fakeMemcpy(device to device, 1000 B)",
       [&](const Runtime& r) { return r.CopyOnDeviceSync(1, device_ptr, device_ptr, 1000); }},
      {"fakeHostGetDevicePointer", "fakeHostGetDevicePointer",
       [&](const Runtime& r) { return r.HostDevicePointer(1, host).status(); }},
      {"fakeEventCreateWithFlags", "fakeEventCreateWithFlags",
       [&](const Runtime& r) { return r.EventRecord(1, stream).status(); }},
      {"fakeEventRecord", "fakeEventRecord",
       [&](const Runtime& r) { return r.EventRecord(1, stream).status(); }},
      {"fakeEventSynchronize", "fakeEventSynchronize",
       [&](const Runtime& r) { return r.EventWait(1, event); }},
      {"fakeEventQuery", "fakeEventQuery",
       [&](const Runtime& r) { return r.EventReady(1, event).status(); }},
      {"fakeStreamCreateWithFlags", "fakeStreamCreateWithFlags",
       [&](const Runtime& r) { return r.StreamCreate(1).status(); }},
      {"fakeStreamSynchronize", "fakeStreamSynchronize",
       [&](const Runtime& r) { return r.StreamSynchronize(1, stream); }},
      {"fakeGetDeviceProperties", "fakeGetDeviceProperties",
       [&](const Runtime& r) { return r.Describe(1).status(); }},
  };
  const std::map<FakeError, StatusCode> codes = {
      {FakeError::kInvalidValue, StatusCode::kInvalidArgument},
      {FakeError::kMemoryAllocation, StatusCode::kNoSpace},
      {FakeError::kInsufficientDriver, StatusCode::kUnsupported},
      {FakeError::kNoDevice, StatusCode::kUnsupported},
      {FakeError::kInvalidDevice, StatusCode::kUnsupported},
      {FakeError::kLaunchFailure, StatusCode::kIoError},
  };
  for (const Case& c : cases) {
    for (const auto& [error, code] : codes) {
      SCOPED_TRACE(c.what + " failing with " + FakeApi::GetErrorName(error));
      fake_ = FakeState{};
      fake_.fail[c.call] = error;
      Status s = c.run(runtime_);
      EXPECT_EQ(s.code(), code);
      EXPECT_EQ(s.message(), Message(c.what, error));
      EXPECT_EQ(fake_.current_device, 0);
      EXPECT_EQ(fake_.last_error, FakeError::kSuccess);
      EXPECT_TRUE(fake_.live_events.empty());
      EXPECT_TRUE(fake_.live_streams.empty());
    }
  }
}

// An out-of-range device is refused by SetDevice itself, before the call it guards.
TEST_F(RuntimeImplTest, AbsentDeviceIsRefusedBeforeTheCall) {
  Result<void*> p = runtime_.DeviceAlloc(7, 4096);
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(p.status().message(), Message("fakeSetDevice(7)", FakeError::kInvalidDevice));
  EXPECT_EQ(Count("fakeMalloc"), 0);
  EXPECT_EQ(fake_.current_device, 0);
  EXPECT_EQ(fake_.last_error, FakeError::kSuccess);
}

// The call runs on the device asked for; the caller's device is current again afterwards.
TEST_F(RuntimeImplTest, RunsOnTheDeviceAndRestoresTheCallers) {
  fake_.current_device = 1;
  ASSERT_OK_AND_ASSIGN(void* p, runtime_.DeviceAlloc(0, 4096));
  EXPECT_EQ(DeviceAt("fakeMalloc"), 0);
  EXPECT_EQ(fake_.current_device, 1);
  EXPECT_OK(runtime_.DeviceFree(0, p));
  EXPECT_EQ(DeviceAt("fakeFree"), 0);
  EXPECT_EQ(fake_.current_device, 1);
  // The void methods too, which have no Status to report a SetDevice failure in.
  runtime_.EventDestroy(0, reinterpret_cast<void*>(uintptr_t{0x60}));
  EXPECT_EQ(DeviceAt("fakeEventDestroy"), 0);
  EXPECT_EQ(fake_.current_device, 1);
  runtime_.StreamDestroy(0, reinterpret_cast<void*>(uintptr_t{0x50}));
  EXPECT_EQ(DeviceAt("fakeStreamDestroy"), 0);
  EXPECT_EQ(fake_.current_device, 1);
  EXPECT_EQ(Count("fakeSetDevice"), 8);  // there and back, four times
}

// When the caller's device cannot be read, the call still runs on the device asked for (there
// is no previous device to restore), and the failed read is not left for the engine to see.
TEST_F(RuntimeImplTest, UnreadableCurrentDeviceStillRunsTheCall) {
  fake_.fail["fakeGetDevice"] = FakeError::kLaunchFailure;
  ASSERT_OK_AND_ASSIGN(void* p, runtime_.DeviceAlloc(1, 4096));
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(DeviceAt("fakeMalloc"), 1);
  EXPECT_EQ(fake_.last_error, FakeError::kSuccess);
}

// SetDevice is not called at all when the device is already current (it is not free: on
// CUDA it may create the primary context).
TEST_F(RuntimeImplTest, CurrentDeviceIsNotSetAgain) {
  fake_.current_device = 1;
  std::byte host[64];
  EXPECT_OK(runtime_.HostRegister(1, host, sizeof host, false));
  EXPECT_OK(runtime_.HostUnregister(1, host));
  ASSERT_OK_AND_ASSIGN(void* stream, runtime_.StreamCreate(1));
  EXPECT_OK(runtime_.StreamSynchronize(1, stream));
  runtime_.StreamDestroy(1, stream);
  EXPECT_EQ(Count("fakeSetDevice"), 0);
  EXPECT_EQ(fake_.current_device, 1);
  EXPECT_TRUE(fake_.live_streams.empty());
}

TEST_F(RuntimeImplTest, HostRegisterPassesPortableMappedAndReadOnlyFlags) {
  std::byte host[64];
  EXPECT_OK(runtime_.HostRegister(0, host, sizeof host, false));
  EXPECT_EQ(fake_.host_register_flags,
            FakeApi::kHostRegisterPortable | FakeApi::kHostRegisterMapped);
  EXPECT_OK(runtime_.HostRegister(0, host, sizeof host, true));
  EXPECT_EQ(fake_.host_register_flags, FakeApi::kHostRegisterPortable |
                                           FakeApi::kHostRegisterMapped |
                                           FakeApi::kHostRegisterReadOnly);
}

TEST_F(RuntimeImplTest, EventRecordReadyWaitDestroy) {
  void* stream = reinterpret_cast<void*>(uintptr_t{0x50});
  ASSERT_OK_AND_ASSIGN(void* event, runtime_.EventRecord(1, stream));
  EXPECT_EQ(fake_.live_events.count(event), 1u);
  EXPECT_EQ(DeviceAt("fakeEventRecord"), 1);

  // "Not ready" is an answer, not an error, and leaves no last error for the engine to see.
  fake_.fail["fakeEventQuery"] = FakeError::kNotReady;
  ASSERT_OK_AND_ASSIGN(bool ready, runtime_.EventReady(1, event));
  EXPECT_FALSE(ready);
  EXPECT_EQ(fake_.last_error, FakeError::kSuccess);
  fake_.fail.clear();
  ASSERT_OK_AND_ASSIGN(ready, runtime_.EventReady(1, event));
  EXPECT_TRUE(ready);

  EXPECT_OK(runtime_.EventWait(1, event));
  runtime_.EventDestroy(1, event);
  EXPECT_TRUE(fake_.live_events.empty());
  EXPECT_EQ(fake_.current_device, 0);
}

// The void destroys cannot report, so they at least leave no last error behind.
TEST_F(RuntimeImplTest, FailedDestroysLeaveNoLastError) {
  fake_.fail["fakeEventDestroy"] = FakeError::kLaunchFailure;
  fake_.fail["fakeStreamDestroy"] = FakeError::kLaunchFailure;
  runtime_.EventDestroy(1, reinterpret_cast<void*>(uintptr_t{0x60}));
  EXPECT_EQ(fake_.last_error, FakeError::kSuccess);
  runtime_.StreamDestroy(1, reinterpret_cast<void*>(uintptr_t{0x50}));
  EXPECT_EQ(fake_.last_error, FakeError::kSuccess);
  EXPECT_EQ(fake_.current_device, 0);
}

TEST_F(RuntimeImplTest, DeviceCount) {
  ASSERT_OK_AND_ASSIGN(int count, runtime_.DeviceCount());
  EXPECT_EQ(count, 2);

  // Zero devices is the runtime's "no device" error (not a count of 0 for callers to check).
  fake_.device_count = 0;
  Result<int> none = runtime_.DeviceCount();
  EXPECT_EQ(none.status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(none.status().message(), Message("", FakeError::kNoDevice));

  // No usable driver: the runtime's error, unprefixed (the caller names the backend).
  fake_.device_count = 2;
  fake_.fail["fakeGetDeviceCount"] = FakeError::kInsufficientDriver;
  Result<int> no_driver = runtime_.DeviceCount();
  EXPECT_EQ(no_driver.status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(no_driver.status().message(), Message("", FakeError::kInsufficientDriver));
  EXPECT_EQ(fake_.last_error, FakeError::kSuccess);
}

TEST_F(RuntimeImplTest, PciBusIdAsSysfsNamesIt) {
  ASSERT_OK_AND_ASSIGN(std::string id, runtime_.PciBusId(1));
  EXPECT_EQ(id, "0000:3b:02.0");
  fake_.fail["fakeGetDeviceProperties"] = FakeError::kInsufficientDriver;
  EXPECT_FALSE(runtime_.PciBusId(1).ok());
}

TEST_F(RuntimeImplTest, Describe) {
  ASSERT_OK_AND_ASSIGN(std::string line, runtime_.Describe(1));
  EXPECT_EQ(line, "Fake GPU, 1.5 GiB, driver 12040");

  // The driver version is decoration: its failure neither fails Describe nor lingers.
  fake_.fail["fakeDriverGetVersion"] = FakeError::kInsufficientDriver;
  ASSERT_OK_AND_ASSIGN(line, runtime_.Describe(1));
  EXPECT_EQ(line, "Fake GPU, 1.5 GiB, driver 0");
  EXPECT_EQ(fake_.last_error, FakeError::kSuccess);
}

}  // namespace
}  // namespace expert_arena::gpu
