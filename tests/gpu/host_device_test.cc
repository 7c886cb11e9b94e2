// The GPU paths of the arena and of tensor streaming, run against a runtime whose "device" is
// host memory (tests/host_device_runtime.h), so that they are checked on every machine: what
// is registered and unregistered, that copies read the registered pages, that a release gated
// on a copy waits for it. gpu_test.cc checks the real runtimes where a GPU exists.
#include <cstring>
#include <vector>

#include "common/units.h"
#include "expert_arena/arena.h"
#include "expert_arena/gpu.h"
#include "expert_arena/stream.h"
#include "host_device_runtime.h"
#include "stream/stream_test_util.h"
#include "test_util.h"

namespace expert_arena::testing {
namespace {

constexpr GpuDevice kDevice{GpuBackend::kCuda, 0};

std::vector<std::byte> CopyThroughTheDevice(std::span<const std::byte> src) {
  auto buffer = DeviceBuffer::Allocate(kDevice, src.size());
  EXPECT_TRUE(buffer.ok()) << buffer.status().ToString();
  if (!buffer.ok()) return {};
  auto copied = CopyToDeviceAsync(kDevice, src, buffer->data(), nullptr);
  EXPECT_TRUE(copied.ok()) << copied.status().ToString();
  if (!copied.ok()) return {};
  EXPECT_OK(copied->Wait());
  std::vector<std::byte> back(src.size());
  EXPECT_OK(CopyToHost(kDevice, buffer->data(), back));
  return back;
}

// A shared arena opened with a GPU registers its whole mapping once, copies from it read
// the registered pages, and closing it unregisters (ScopedHostDevice checks at the end).
TEST(HostDeviceTest, SharedArenaRegistersItsMappingAndCopiesFromIt) {
  ScopedHostDevice device;
  ScopedDataFile model(6 * kMiB + 123, 7);
  ScopedPath path("arena");
  ArenaOptions options;
  options.shared_path = path.path();
  options.gpu = GpuDevice{GpuBackend::kCuda, 0};
  options.progress = false;
  ModelSpec spec;
  spec.files = {model.path()};
  spec.format = ModelFormat::kRaw;
  {
    ASSERT_OK_AND_ASSIGN(Arena arena, Arena::Open(spec, options));
    const ArenaReport& r = arena.report();
    EXPECT_GE(r.gpu_registered_bytes, r.data_bytes) << r.gpu_note;
    EXPECT_EQ(device.runtime().registered_bytes(), r.gpu_registered_bytes);
    EXPECT_EQ(device.runtime().unpopulated_pages(), 0u);  // populated before registering
    EXPECT_NE(r.StartLine().find("gpu: cuda:0"), std::string::npos) << r.StartLine();
    TensorView t = arena.tensor(0);
    std::vector<std::byte> back = CopyThroughTheDevice(t.bytes);
    ASSERT_EQ(back.size(), t.bytes.size());
    EXPECT_EQ(std::memcmp(back.data(), t.bytes.data(), back.size()), 0);
    EXPECT_EQ(device.runtime().copies_from_registered(), 1);  // DMA from the arena's pages
    // A second engine in this process maps the same file again: its own registration.
    ASSERT_OK_AND_ASSIGN(Arena again, Arena::Open(spec, options));
    EXPECT_EQ(again.report().role, ArenaRole::kAttached);
    EXPECT_EQ(device.runtime().registrations(), 2u);  // one chunk each
    EXPECT_GE(again.report().gpu_registered_bytes, again.report().data_bytes);
  }
  EXPECT_EQ(device.runtime().registrations(), 0u);
}

// The pin budget bounds what the arena registers: the part beyond it is skipped and said,
// never an error; copies from the unregistered part still arrive whole (the runtime stages
// them).
TEST(HostDeviceTest, ArenaRegistersUpToThePinBudgetAndSaysSo) {
  ScopedHostDevice device;
  ScopedDataFile model(6 * kMiB, 8);
  ScopedPath path("arena");
  ArenaOptions options;
  options.shared_path = path.path();
  options.gpu = GpuDevice{GpuBackend::kCuda, 0};
  options.progress = false;
  options.pin_budget_bytes = 2 * kMiB;
  options.gpu_required = true;  // a budget cut is not a failed registration
  ModelSpec spec;
  spec.files = {model.path()};
  spec.format = ModelFormat::kRaw;
  ASSERT_OK_AND_ASSIGN(Arena arena, Arena::Open(spec, options));
  const ArenaReport& r = arena.report();
  EXPECT_EQ(r.gpu_registered_bytes, 2 * kMiB);
  EXPECT_EQ(device.runtime().registered_bytes(), 2 * kMiB);
  EXPECT_NE(r.gpu_note.find("budget"), std::string::npos) << r.gpu_note;
  TensorView t = arena.tensor(0);
  std::vector<std::byte> back = CopyThroughTheDevice(t.bytes);
  ASSERT_EQ(back.size(), t.bytes.size());
  EXPECT_EQ(std::memcmp(back.data(), t.bytes.data(), back.size()), 0);
}

// A producer pins each regular segment it grows and never a dedicated one-shot segment (a
// tensor larger than a segment); the consumer pins the segments it maps; all of it is
// unregistered when they go.
TEST(HostDeviceTest, StreamPinsRegularSegmentsNotDedicatedOnes) {
  ScopedHostDevice device;
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.gpu = GpuDevice{GpuBackend::kCuda, 0};
  o.grow_ahead = false;
  {
    ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
    std::vector<std::byte> small(64 * kKiB, std::byte{1});
    std::vector<std::byte> large(o.segment_bytes + kMiB, std::byte{2});
    ASSERT_OK_AND_ASSIGN(std::string d_small, producer.Put("small", small, {"u8", {small.size()}}));
    StreamStats s = producer.Stats().value();
    EXPECT_EQ(s.segments, 1u);
    EXPECT_GE(s.pinned_bytes, o.segment_bytes);
    const uint64_t pinned_one = s.pinned_bytes;
    EXPECT_EQ(device.runtime().registered_bytes(), pinned_one);
    EXPECT_EQ(device.runtime().unpopulated_pages(), 0u);  // populated before registering
    ASSERT_OK_AND_ASSIGN(std::string d_large, producer.Put("large", large, {"u8", {large.size()}}));
    s = producer.Stats().value();
    EXPECT_EQ(s.dedicated_segments, 1u);
    EXPECT_EQ(s.pinned_bytes, pinned_one);  // the dedicated segment is not pinned
    EXPECT_EQ(device.runtime().registered_bytes(), pinned_one);

    ConsumerOptions co = dirs.Consumer();
    co.gpu = GpuDevice{GpuBackend::kCuda, 0};
    ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(co));
    {
      ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d_small));
      std::vector<std::byte> back = CopyThroughTheDevice(t.bytes());
      EXPECT_EQ(back, small);
      EXPECT_GE(consumer.Stats().pinned_bytes, o.segment_bytes);
      // bytes() only: the consumer's shared mapping is registered, no copy-on-write one yet.
      EXPECT_EQ(device.runtime().registrations(), 2u);
      ASSERT_OK_AND_ASSIGN(auto mine, t.private_bytes());
      EXPECT_EQ(CopyThroughTheDevice(mine), small);
      ASSERT_OK_AND_ASSIGN(auto big, consumer.Open(d_large));
      EXPECT_EQ(CopyThroughTheDevice(big.bytes()), large);
      ASSERT_OK(big.private_bytes().status());  // a one-shot segment's: never registered
    }
    // The one regular segment: the producer's mapping, and the consumer's two (its shared
    // mapping, and the copy-on-write mapping its Python views point into, registered
    // read-only by the first private_bytes()): three ranges, none of the dedicated segment.
    EXPECT_EQ(device.runtime().registrations(), 3u);
    EXPECT_EQ(device.runtime().unpopulated_pages(), 0u);
  }
  EXPECT_EQ(device.runtime().registrations(), 0u);
}

// A release gated on a device copy keeps the block held (the producer cannot reuse its
// bytes) until the copy's event is done, then returns it.
TEST(HostDeviceTest, ReleaseAfterHoldsTheBlockUntilTheCopyIsDone) {
  ScopedHostDevice device;
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.gpu = GpuDevice{GpuBackend::kCuda, 0};
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  ConsumerOptions co = dirs.Consumer();
  co.gpu = GpuDevice{GpuBackend::kCuda, 0};
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(co));
  std::vector<std::byte> bytes(256 * kKiB, std::byte{3});
  ASSERT_OK_AND_ASSIGN(std::string d, producer.Put("k", bytes, {"u8", {bytes.size()}}));
  ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, DeviceBuffer::Allocate(kDevice, bytes.size()));
  {
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
    device.runtime().hold_events = true;  // the copy is still running
    ASSERT_OK_AND_ASSIGN(CopyEvent copied,
                         CopyToDeviceAsync(kDevice, t.bytes(), buffer.data(), nullptr));
    t.ReleaseAfter(std::move(copied));
  }
  EXPECT_EQ(consumer.PollReleases(), 1u);
  EXPECT_EQ(producer.Stats()->live_blocks, 1u);  // still held for the copy
  device.runtime().FinishEvents();
  EXPECT_EQ(consumer.PollReleases(), 0u);
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
}

}  // namespace
}  // namespace expert_arena::testing
