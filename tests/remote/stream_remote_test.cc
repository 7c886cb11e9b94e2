// Tensor streams across hosts (StreamOptions::listen, docs/cross-host.md) over real UCX.
// Loopback: a producer and a consumer whose stream directories differ (so the consumer cannot
// see the segment and fetches it), in this process, over 127.0.0.1. Two hosts: network
// namespaces joined by a veth pair, each with its own mount namespace (its own /dev/shm and
// sysfs), the producer and the consumer in child processes there. UCX_TLS=tcp everywhere:
// every namespace has this machine's boot id, and UCX would otherwise take shared memory.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <span>
#include <sstream>
#include <map>
#include <optional>
#include <thread>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "expert_arena/expert_arena.h"
#include "host_device_runtime.h"
#include "remote/peer_client.h"
#include "remote/stream_wire.h"
#include "stream/stream_remote.h"
#include "stream/stream_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::CheckPattern;
using testing::FillPattern;

const bool kTcpOnly = [] {
  setenv("UCX_TLS", "tcp", 1);
  return true;
}();

bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

#define SKIP_OR_FAIL(why)        \
  do {                           \
    if (InCi()) FAIL() << (why); \
    GTEST_SKIP() << (why);       \
  } while (0)

int Sh(const std::string& command, std::string* out = nullptr, double timeout = 120) {
  auto child = testing::SpawnProgram("/bin/sh", {"-c", command + " 2>&1"});
  int code = child.Wait(timeout);
  if (out != nullptr) *out = child.Output();
  return code;
}

// The dtypes a stream carries in the field, with an element size each (the library does not
// interpret them; the bytes must come back bit-exact whatever they are).
const std::vector<std::pair<std::string, size_t>> kDtypes = {
    {"f64", 8}, {"f32", 4}, {"f16", 2}, {"bf16", 2}, {"f8_e4m3", 1}, {"f8_e5m2", 1}, {"i64", 8},
    {"i32", 4}, {"i16", 2}, {"i8", 1},  {"u8", 1},   {"bool", 1},    {"q4_k", 1}};

// Bytes of a tensor of `dtype`: the pattern of its key, plus the NaNs, infinities, negative
// zeros and denormals of its size, so nothing on the way may normalize them.
std::vector<std::byte> TensorBytes(const std::string& key, size_t elements, size_t element) {
  std::vector<std::byte> bytes(elements * element);
  FillPattern(bytes, key);
  const uint8_t specials[][8] = {{0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x7f},   // NaN f64
                                 {0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80},   // -denormal
                                 {0x00, 0x00, 0x80, 0xff, 0x01, 0x80, 0xc0, 0x7f}};  // -inf f32..
  for (size_t i = 0; i < 3 && (i + 1) * element <= bytes.size(); ++i)
    std::memcpy(bytes.data() + i * element, specials[i], element);
  return bytes;
}

class StreamLoopbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!remote::RemoteBuilt()) SKIP_OR_FAIL("built without UCX (libucx-dev)");
  }
  StreamOptions Producer(const std::string& token = "", double lease = 60) {
    StreamOptions o = here_.Producer("xs");
    o.segment_bytes = 16ull << 20;
    o.max_segments = 4;
    o.listen = "127.0.0.1:0";
    o.listen_token = token;
    o.remote_lease_seconds = lease;
    return o;
  }
  ConsumerOptions Consumer(const std::string& token = "") {
    ConsumerOptions o = there_.Consumer();  // another directory: the segment is not there
    o.remote_token = token;
    o.remote_allow_no_token = token.empty();  // loopback, no token: asked for by name
    o.remote_timeout_seconds = 20;
    return o;
  }
  // Puts one u8 tensor of each size (key PREFIX-i, TensorBytes' bytes, kept in *tensors):
  // their descriptors, empty when a put failed (the test then fails on the count).
  static std::vector<std::string> PutEach(StreamProducer& p, const std::string& prefix,
                                          const std::vector<size_t>& sizes,
                                          std::vector<std::vector<std::byte>>* tensors) {
    std::vector<std::string> descs;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::string key = prefix + "-" + std::to_string(i);
      tensors->push_back(TensorBytes(key, sizes[i], 1));
      auto d = p.Put(key, tensors->back(), {.dtype = "u8"});
      if (!d.ok()) {
        ADD_FAILURE() << key << ": " << d.status().ToString();
        return {};
      }
      descs.push_back(*d);
    }
    return descs;
  }
  // Blocks the producer still holds, after settling.
  static size_t Live(StreamProducer& p) {
    auto pending = p.Pending();
    return pending.ok() ? pending->size() : 999;
  }
  static uint32_t RemoteHolders(StreamProducer& p) {
    uint32_t n = 0;
    auto pending = p.Pending();
    if (pending.ok())
      for (const auto& b : *pending) n += b.remote_holders;
    return n;
  }
  // Waits (bounded: a hang fails the test instead) until `pred` holds.
  template <typename Pred>
  static bool Eventually(Pred pred, double seconds = 30) {
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return pred();
  }
  testing::StreamDirs here_;
  testing::StreamDirs there_;
};

TEST_F(StreamLoopbackTest, EveryDtypeBitExactAndReleaseCrossesTheWire) {
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  ASSERT_FALSE(producer->remote_address().empty());
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok()) << consumer.status().ToString();
  // Sizes around UCX's eager/rendezvous switch, and one larger than a segment (dedicated).
  const std::vector<size_t> elements = {1, 1000, 70000, 5u << 20};
  for (size_t n : elements) {
    for (const auto& [dtype, size] : kDtypes) {
      if (n == (5u << 20) && size != 4) continue;  // one 20 MiB tensor is enough
      const std::string key = dtype + "-" + std::to_string(n);
      auto bytes = TensorBytes(key, n, size);
      auto desc = producer->Put(key, bytes, {.dtype = dtype, .shape = {n}});
      ASSERT_TRUE(desc.ok()) << desc.status().ToString();
      auto d = TensorDescriptor::Decode(*desc);
      ASSERT_TRUE(d.ok());
      EXPECT_EQ(d->remote, producer->remote_address());
      auto t = consumer->Open(*desc);
      ASSERT_TRUE(t.ok()) << key << ": " << t.status().ToString();
      EXPECT_TRUE(t->remote());
      EXPECT_EQ(t->descriptor().dtype, dtype);
      ASSERT_EQ(t->bytes().size(), bytes.size());
      EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0) << key;
      EXPECT_EQ(RemoteHolders(*producer), 1u) << key;
      t->Release();
      // The release crossed the wire: the block (readers = 1) is freed at the producer.
      EXPECT_TRUE(Eventually([&] { return Live(*producer) == 0; })) << key;
    }
  }
  EXPECT_EQ(producer->Stats()->live_blocks, 0u);
}

TEST_F(StreamLoopbackTest, SameHostConsumerKeepsTheZeroCopyPath) {
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto consumer = StreamConsumer::Create(here_.Consumer());  // the producer's directory
  ASSERT_TRUE(consumer.ok());
  auto bytes = TensorBytes("local", 4096, 4);
  auto desc = producer->Put("local", bytes, {.dtype = "f32"});
  ASSERT_TRUE(desc.ok());
  auto t = consumer->Open(*desc);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_FALSE(t->remote());
  EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0);
  EXPECT_EQ(RemoteHolders(*producer), 0u);
}

// The view of a remote tensor is registered with the GPU the consumer asked for; where the
// driver refuses, the open still serves the bytes (staged copies) and says so in the log, as
// for a local segment, instead of dropping the failure.
TEST_F(StreamLoopbackTest, RemoteViewRegisteredWithTheGpuOrAWarningWhenRefused) {
  testing::ScopedHostDevice device;
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  std::ostringstream logged;
  ConsumerOptions co = Consumer();
  co.gpu = GpuDevice{GpuBackend::kCuda, 0};
  co.logger = std::make_shared<spdlog::logger>(
      "remote-registration-test", std::make_shared<spdlog::sinks::ostream_sink_mt>(logged));
  auto consumer = StreamConsumer::Create(co);
  ASSERT_TRUE(consumer.ok()) << consumer.status().ToString();
  auto bytes = TensorBytes("registered", 1 << 20, 4);
  auto desc = producer->Put("registered", bytes, {.dtype = "f32"});
  ASSERT_TRUE(desc.ok()) << desc.status().ToString();
  {
    auto t = consumer->Open(*desc);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_TRUE(t->remote());
    EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0);
    EXPECT_GT(device.runtime().registered_bytes(), 0u);
    EXPECT_EQ(logged.str().find("GPU registration"), std::string::npos) << logged.str();
  }
  device.runtime().refuse_registrations = true;
  auto refused = producer->Put("refused", bytes, {.dtype = "f32"});
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  auto t = consumer->Open(*refused);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0);
  EXPECT_NE(logged.str().find("GPU registration of the remote view of key \"refused\" failed"),
            std::string::npos)
      << logged.str();
}

TEST_F(StreamLoopbackTest, AbortBeforeOpenIsRefused) {
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok());
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  auto bytes = TensorBytes("gone", 1 << 16, 2);
  auto desc = producer->Put("gone", bytes, {.dtype = "bf16"});
  ASSERT_TRUE(desc.ok());
  ASSERT_TRUE(producer->Abort("gone").ok());
  auto t = consumer->Open(*desc);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("\"gone\" was aborted by the producer"), std::string::npos)
      << t.status().ToString();
  EXPECT_EQ(Live(*producer), 0u);
}

TEST_F(StreamLoopbackTest, AbortDuringTheTransferFailsTheOpen) {
  // The server stops right after it started sending the bytes, until the file goes. Set
  // before the producer starts: its network process takes the environment then.
  const std::string pause = there_.spill() + "/paused";
  setenv("EXPERT_ARENA_TEST_STREAM_PAUSE_FILE", pause.c_str(), 1);
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok());
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  auto bytes = TensorBytes("inflight", 8 << 20, 1);
  auto desc = producer->Put("inflight", bytes, {.dtype = "u8"});
  ASSERT_TRUE(desc.ok());
  std::optional<Result<StreamTensor>> opened;
  std::thread open([&] { opened.emplace(consumer->Open(*desc)); });
  const bool paused = testing::WaitForFile(pause, 60);
  unsetenv("EXPERT_ARENA_TEST_STREAM_PAUSE_FILE");
  EXPECT_TRUE(paused);
  auto marked = producer->Abort("inflight");
  ASSERT_TRUE(marked.ok());
  EXPECT_EQ(*marked, 1u);
  std::filesystem::remove(pause);
  open.join();
  ASSERT_TRUE(opened.has_value());
  ASSERT_FALSE(opened->ok());
  EXPECT_NE(opened->status().message().find("aborted by the producer during the transfer"),
            std::string::npos)
      << opened->status().ToString();
  EXPECT_TRUE(Eventually([&] { return Live(*producer) == 0; }));
}

// A batch goes as few messages (each under kStreamMaxOpenManyBytes) to a producer that takes
// them, and a message per open to one that does not: a producer of an earlier release (made
// here by a test hook read when it starts: it has no handler for batches, so a batch sent to it
// would go unanswered and the open time out), and from a consumer of an earlier release (a
// hook read when it connects: it sends single opens, which the producer answers one by one).
// Each bit-exact.
enum class Older { kNeither, kProducer, kConsumer };
class OpenManyTest : public StreamLoopbackTest, public ::testing::WithParamInterface<Older> {};

TEST_P(OpenManyTest, FetchesABatchBitExact) {
  const Older older = GetParam();
  if (older == Older::kProducer) setenv("EXPERT_ARENA_TEST_STREAM_NO_FEATURES", "1", 1);
  auto producer = StreamProducer::Create(Producer());
  unsetenv("EXPERT_ARENA_TEST_STREAM_NO_FEATURES");
  ASSERT_TRUE(producer.ok());
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  // The consumer connects at its first remote open.
  if (older == Older::kConsumer) setenv("EXPERT_ARENA_TEST_STREAM_NO_FEATURES", "1", 1);
  // Eager and rendezvous sizes in one batch, and more descriptors than one message holds; and
  // one block over kStreamChunkBytes, which goes in chunks (the last one short) where both
  // sides take them.
  std::vector<size_t> sizes(100, 64 << 10);
  sizes.push_back(300 << 10);
  sizes.push_back(4 << 20);
  sizes.push_back((9 << 20) + 3);
  std::vector<std::vector<std::byte>> tensors;
  std::vector<std::string> descs = PutEach(*producer, "batch", sizes, &tensors);
  ASSERT_EQ(descs.size(), sizes.size());
  std::vector<std::string_view> views(descs.begin(), descs.end());
  auto opened = consumer->OpenMany(views);
  unsetenv("EXPERT_ARENA_TEST_STREAM_NO_FEATURES");
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  ASSERT_EQ(opened->size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE((*opened)[i].remote());
    ASSERT_EQ((*opened)[i].bytes().size(), tensors[i].size());
    EXPECT_EQ(std::memcmp((*opened)[i].bytes().data(), tensors[i].data(), tensors[i].size()), 0)
        << i;
  }
  EXPECT_EQ(RemoteHolders(*producer), tensors.size());
  opened->clear();  // every release crosses the wire
  EXPECT_TRUE(Eventually([&] { return Live(*producer) == 0; }));
}

INSTANTIATE_TEST_SUITE_P(Versions, OpenManyTest,
                         ::testing::Values(Older::kNeither, Older::kProducer, Older::kConsumer),
                         [](const auto& info) {
                           return info.param == Older::kNeither    ? "Current"
                                  : info.param == Older::kProducer ? "OlderProducer"
                                                                   : "OlderConsumer";
                         });

TEST_F(StreamLoopbackTest, AProducerLyingAboutItsBytesIsRefusedByName) {
  // The server made hostile by a test hook (read when the producer starts), at an eager and a
  // rendezvous size and one sent in chunks (4 + 4 + 2 MiB): each lie is refused by name and
  // nothing is handed over. A damaged block's hold is given back at once; after a lie about
  // its length (or a chunk that does not fit) the consumer drops the connection, and the
  // producer ends the hold once the consumer is gone.
  for (const size_t size : {size_t{1000}, size_t{3} << 20, size_t{10} << 20}) {
    const std::string n = std::to_string(size);
    const bool chunked = size > (4u << 20);
    const std::string of = ") for a block of " + n;
    std::vector<std::pair<std::string, std::string>> lies = {
        {"xxh3", "the " + n + " bytes received do not match the producer's xxh3 (damaged in transit)"},
        {"short", "the producer sent " + std::to_string(size - 1) + " bytes (its header says " + n + of},
        {"long", "the producer sent " + n + " bytes (its header says " + std::to_string(size + 1) + of},
    };
    if (chunked) {
      lies[1].second = "the producer sent 2097151 bytes (its header says 2097152) for the chunk "
                       "at offset 8388608 of a block of " + n;
      lies[2].second = "the producer sent a chunk of a block of " + std::to_string(size + 1) +
                       " bytes for a block of " + n;
      lies.emplace_back("twice", "the producer sent the chunk at offset 0 of a block of " + n +
                                     " twice");
    }
    for (const auto& [lie, said] : lies) {
      setenv("EXPERT_ARENA_TEST_STREAM_DAMAGE", lie.c_str(), 1);
      auto producer = StreamProducer::Create(Producer());
      unsetenv("EXPERT_ARENA_TEST_STREAM_DAMAGE");
      ASSERT_TRUE(producer.ok()) << producer.status().ToString();
      auto bytes = TensorBytes(lie, size, 1);
      auto desc = producer->Put("lied", bytes, {.dtype = "u8"});
      ASSERT_TRUE(desc.ok());
      {
        auto consumer = StreamConsumer::Create(Consumer());
        ASSERT_TRUE(consumer.ok());
        auto t = consumer->Open(*desc);
        ASSERT_FALSE(t.ok()) << lie << " " << size;
        EXPECT_EQ(t.status().code(), StatusCode::kCorrupt)
            << lie << " " << size << ": " << t.status().ToString();
        EXPECT_NE(t.status().message().find(said), std::string::npos)
            << lie << " " << size << ": " << t.status().ToString();
        if (lie == "xxh3") {
          EXPECT_TRUE(Eventually([&] { return RemoteHolders(*producer) == 0; })) << size;
          EXPECT_EQ(Live(*producer), 1u) << "given back unspent: the block is still readable";
        }
      }
      EXPECT_TRUE(Eventually([&] { return RemoteHolders(*producer) == 0; })) << lie << " " << size;
    }
  }
}

// This process' anonymous memory on transparent huge pages, in KiB.
uint64_t AnonHugeKiB() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("AnonHugePages:", 0) == 0) return std::stoull(line.substr(14));
  return 0;
}

TEST_F(StreamLoopbackTest, SmallRemoteTensorsAreNotEachAHugePage) {
  // A remote tensor lands in memory of its own: a huge page for one of 1 MiB and more, base
  // pages under that (a 64 KiB tensor on a 2 MiB page held 32x its size).
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes((std::istreambuf_iterator<char>(thp)), std::istreambuf_iterator<char>());
  if (modes.find("[never]") != std::string::npos || modes.empty())
    GTEST_SKIP() << "transparent huge pages are off here";
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok());
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  std::vector<std::vector<std::byte>> small;
  std::vector<std::string> descs =
      PutEach(*producer, "small", std::vector<size_t>(16, 64 << 10), &small);
  ASSERT_EQ(descs.size(), 16u);
  std::vector<std::string_view> views(descs.begin(), descs.end());
  const uint64_t before = AnonHugeKiB();
  auto opened = consumer->OpenMany(views);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  for (size_t i = 0; i < small.size(); ++i)
    EXPECT_EQ(std::memcmp((*opened)[i].bytes().data(), small[i].data(), small[i].size()), 0);
  const uint64_t after_small = AnonHugeKiB();
  EXPECT_LT(after_small, before + 2048) << "16 tensors of 64 KiB took huge pages";
  // One of 4 MiB still gets them (where the kernel has free 2 MiB blocks: it says so).
  auto big_bytes = TensorBytes("big", 4 << 20, 1);
  auto big_desc = producer->Put("big", big_bytes, {.dtype = "u8"});
  ASSERT_TRUE(big_desc.ok());
  auto big = consumer->Open(*big_desc);
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_EQ(std::memcmp(big->bytes().data(), big_bytes.data(), big_bytes.size()), 0);
  if (AnonHugeKiB() < after_small + 2048) {
    std::printf("note: the 4 MiB tensor got no huge page (fragmented memory?)\n");
  }
}

TEST_F(StreamLoopbackTest, ReleasedMemoryIsReusedButNeverUnderAHeldView) {
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok());
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  auto put = [&](const std::string& key, size_t bytes) {
    auto tensor = TensorBytes(key, bytes, 1);
    auto d = producer->Put(key, tensor, {.dtype = "u8"});
    EXPECT_TRUE(d.ok()) << key;
    return std::make_pair(d.ok() ? *d : std::string(), tensor);
  };
  auto [first_desc, first_bytes] = put("held", 64 << 10);
  auto held = consumer->Open(first_desc);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  const std::byte* held_at = held->bytes().data();
  // More tensors of the same size arrive and go while the first is held: none lands on it.
  for (int i = 0; i < 8; ++i) {
    auto [desc, bytes] = put("more-" + std::to_string(i), 64 << 10);
    auto t = consumer->Open(desc);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_NE(t->bytes().data(), held_at) << i;
    EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0) << i;
    t->Release();
    ASSERT_EQ(std::memcmp(held->bytes().data(), first_bytes.data(), first_bytes.size()), 0)
        << "the held view changed after tensor " << i;
  }
  // Once released, its memory takes the next tensor of that size (the only one pooled while
  // another view is held), which arrives bit-exact over the old bytes.
  auto [other_desc, other_bytes] = put("other", 64 << 10);
  auto other = consumer->Open(other_desc);
  ASSERT_TRUE(other.ok());
  const std::byte* other_at = other->bytes().data();
  held->Release();
  auto [next_desc, next_bytes] = put("next", 64 << 10);
  auto next = consumer->Open(next_desc);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->bytes().data(), held_at);
  EXPECT_NE(next->bytes().data(), other_at);
  EXPECT_EQ(std::memcmp(next->bytes().data(), next_bytes.data(), next_bytes.size()), 0);
  EXPECT_EQ(std::memcmp(other->bytes().data(), other_bytes.data(), other_bytes.size()), 0);
  next->Release();
  other->Release();
  EXPECT_TRUE(Eventually([&] { return Live(*producer) == 0; }));
}

TEST_F(StreamLoopbackTest, OpenManyFailureGivesRemoteHoldsBackUnspent) {
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok());
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  auto a = TensorBytes("a", 1000, 4);
  auto da = producer->Put("a", a, {.dtype = "f32"});
  auto db = producer->Put("b", a, {.dtype = "f32"});
  ASSERT_TRUE(da.ok() && db.ok());
  ASSERT_TRUE(producer->Abort("b").ok());
  std::vector<std::string_view> both = {*da, *db};
  auto many = consumer->OpenMany(both);
  ASSERT_FALSE(many.ok());
  // "a" was given back unspent: it opens again, and its hold was ended at the producer.
  EXPECT_TRUE(Eventually([&] { return RemoteHolders(*producer) == 0; }));
  auto again = consumer->Open(*da);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(std::memcmp(again->bytes().data(), a.data(), a.size()), 0);
}

TEST_F(StreamLoopbackTest, WrongOrMissingTokenIsRefusedBeforeAnyByte) {
  auto producer = StreamProducer::Create(Producer("s3cret"));
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto bytes = TensorBytes("t", 1000, 4);
  auto desc = producer->Put("t", bytes, {.dtype = "f32"});
  ASSERT_TRUE(desc.ok());
  for (const std::string token : {"", "wrong!"}) {
    auto consumer = StreamConsumer::Create(Consumer(token));
    ASSERT_TRUE(consumer.ok());
    auto t = consumer->Open(*desc);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kPermission) << t.status().ToString();
    EXPECT_NE(t.status().message().find("token"), std::string::npos) << t.status().ToString();
  }
  EXPECT_EQ(RemoteHolders(*producer), 0u);
  auto good = StreamConsumer::Create(Consumer("s3cret"));
  ASSERT_TRUE(good.ok());
  auto t = good->Open(*desc);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0);
}

TEST_F(StreamLoopbackTest, LeaseExpiryFreesAHeldBlock) {
  auto producer = StreamProducer::Create(Producer("", 0.5));
  ASSERT_TRUE(producer.ok());
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  auto bytes = TensorBytes("leased", 1 << 20, 1);
  auto desc = producer->Put("leased", bytes, {.dtype = "u8"});
  ASSERT_TRUE(desc.ok());
  auto t = consumer->Open(*desc);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // Held past its lease: the producer spends the share and frees the block, while the
  // consumer's own copy stays readable.
  EXPECT_TRUE(Eventually([&] { return Live(*producer) == 0; }));
  EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0);
  t->Release();  // a no-op at the producer now
  EXPECT_EQ(Live(*producer), 0u);
}

TEST_F(StreamLoopbackTest, DescriptorOfADeadOrRestartedProducerIsRefused) {
  std::string desc;
  std::string address;
  {
    auto producer = StreamProducer::Create(Producer());
    ASSERT_TRUE(producer.ok());
    address = producer->remote_address();
    auto bytes = TensorBytes("old", 1000, 4);
    auto d = producer->Put("old", bytes, {.dtype = "f32"});
    ASSERT_TRUE(d.ok());
    desc = *d;
  }
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  auto dead = consumer->Open(desc);
  ASSERT_FALSE(dead.ok());
  EXPECT_NE(dead.status().message().find("cannot reach"), std::string::npos)
      << dead.status().ToString();
  // A new producer on the same port: another instance, refused without a byte read.
  StreamOptions o = Producer();
  o.listen = address;
  auto restarted = StreamProducer::Create(o);
  ASSERT_TRUE(restarted.ok()) << restarted.status().ToString();
  auto bytes = TensorBytes("old", 1000, 4);
  ASSERT_TRUE(restarted->Put("old", bytes, {.dtype = "f32"}).ok());
  auto stale = consumer->Open(desc);
  ASSERT_FALSE(stale.ok());
  EXPECT_NE(stale.status().message().find("another instance"), std::string::npos)
      << stale.status().ToString();
}

TEST_F(StreamLoopbackTest, ConsumerReconnectsToAProducerRestartedOnTheSameAddress) {
  // The old producer's connection lingers on the port (FIN_WAIT/TIME_WAIT): without
  // UCX_TCP_CM_REUSEADDR=y UCX refuses to listen there again ("Device is busy"), as it would
  // for an operator's producer restarted on a fixed port (docs/cross-host.md).
  setenv("UCX_TCP_CM_REUSEADDR", "y", 1);
  struct Unset {
    ~Unset() { unsetenv("UCX_TCP_CM_REUSEADDR"); }
  } unset;
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  std::string address;
  std::string old_desc;
  auto bytes = TensorBytes("k", 5000, 4);
  {
    auto first = StreamProducer::Create(Producer());
    ASSERT_TRUE(first.ok());
    address = first->remote_address();
    auto d = first->Put("k", bytes, {.dtype = "f32"});
    auto again = first->Put("k2", bytes, {.dtype = "f32"});
    ASSERT_TRUE(d.ok() && again.ok());
    old_desc = *again;
    auto t = consumer->Open(*d);  // the consumer now keeps a connection to it
    ASSERT_TRUE(t.ok()) << t.status().ToString();
  }
  StreamOptions o = Producer();
  o.listen = address;
  auto second = StreamProducer::Create(o);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  auto d = second->Put("k", bytes, {.dtype = "f32"});
  ASSERT_TRUE(d.ok());
  auto t = consumer->Open(*d);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0);
  auto stale = consumer->Open(old_desc);
  ASSERT_FALSE(stale.ok());
  EXPECT_NE(stale.status().message().find("another instance"), std::string::npos)
      << stale.status().ToString();
}

TEST_F(StreamLoopbackTest, ListensOnlyOnTheAddressGiven) {
  auto producer = StreamProducer::Create(Producer());  // 127.0.0.1
  ASSERT_TRUE(producer.ok());
  auto desc = producer->Put("k", TensorBytes("k", 100, 1), {});
  ASSERT_TRUE(desc.ok());
  // The same port on another loopback address of this host: nothing listens there.
  auto d = TensorDescriptor::Decode(*desc);
  ASSERT_TRUE(d.ok());
  const std::string port = d->remote.substr(d->remote.rfind(':'));
  d->remote = "127.0.0.2" + port;
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  auto t = consumer->Open(d->Encode());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("cannot reach"), std::string::npos)
      << t.status().ToString();
}

// Bytes of an attacker to ADDR:PORT on loopback, on a connection of their own, then closed.
void SendRaw(const std::string& address, const std::string& bytes) {
  const uint16_t port = static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to), 0);
  (void)send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  close(fd);
}

// The 109-byte packet that killed a process holding a listening producer inside UCX's
// connection manager (tcp_sockcm_ep.c:825), a header claiming 2^64-1 bytes, 200 zero bytes and
// 4 KiB of 0xff: this test process holds the producer, so it would die with it.
TEST_F(StreamLoopbackTest, KillerPacketsLeaveTheProducerAliveAndServing) {
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  const std::string address = producer->remote_address();
  std::string sockcm(9, '\0');
  const uint64_t six = 6;
  std::memcpy(sockcm.data(), &six, 8);
  sockcm += std::string(100, 'A');
  std::string huge(8, '\xff');
  huge += std::string(64, 'B');
  for (const std::string& packet :
       {sockcm, huge, std::string(200, '\0'), std::string(4096, '\xff')}) {
    SendRaw(address, packet);
  }
  auto consumer = StreamConsumer::Create(Consumer());
  ASSERT_TRUE(consumer.ok());
  auto bytes = TensorBytes("after", 1 << 20, 1);
  auto desc = producer->Put("after", bytes, {.dtype = "u8"});
  ASSERT_TRUE(desc.ok());
  auto t = consumer->Open(*desc);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(t->remote());
  EXPECT_EQ(std::memcmp(t->bytes().data(), bytes.data(), bytes.size()), 0);
  t->Release();
  auto stats = producer->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(stats->remote_dropped, 4u);
}

// A descriptor that names a peer which accepts TCP and never answers (a stopped producer, the
// wrong service): the open fails at the deadline with an error, and this process lives (it
// aborted inside UCX before the front door).
TEST_F(StreamLoopbackTest, SilentProducerIsAnErrorNotAnAbort) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &at.sin_addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  socklen_t length = sizeof at;
  getsockname(fd, reinterpret_cast<sockaddr*>(&at), &length);
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok());
  auto desc = producer->Put("silent", TensorBytes("silent", 4096, 1), {.dtype = "u8"});
  ASSERT_TRUE(desc.ok());
  auto d = TensorDescriptor::Decode(*desc);
  ASSERT_TRUE(d.ok());
  d->remote = "127.0.0.1:" + std::to_string(ntohs(at.sin_port));
  ConsumerOptions o = Consumer();
  o.remote_timeout_seconds = 2;
  auto consumer = StreamConsumer::Create(o);
  ASSERT_TRUE(consumer.ok());
  const auto start = std::chrono::steady_clock::now();
  auto t = consumer->Open(d->Encode());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kTimedOut) << t.status().ToString();
  EXPECT_NE(t.status().message().find("did not answer"), std::string::npos)
      << t.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  close(fd);
  // The genuine descriptor still opens.
  auto genuine = consumer->Open(*desc);
  ASSERT_TRUE(genuine.ok()) << genuine.status().ToString();
  genuine->Release();
}

// An open whose descriptor names another address (and another host's boot id, which made the
// server's own consumer treat it as remote) is refused at once: the server never connects out
// to an address a peer named. The peer here is the library's own connection, sending what a
// hostile consumer would.
TEST_F(StreamLoopbackTest, ForgedOpenNamingAnotherAddressIsRefusedWithoutConnectingOut) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &at.sin_addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  socklen_t length = sizeof at;
  getsockname(fd, reinterpret_cast<sockaddr*>(&at), &length);
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok());
  auto bytes = TensorBytes("forged", 4096, 1);
  auto desc = producer->Put("forged", bytes, {.dtype = "u8"});
  ASSERT_TRUE(desc.ok());
  auto d = TensorDescriptor::Decode(*desc);
  ASSERT_TRUE(d.ok());
  TensorDescriptor forged = *d;
  forged.remote = "127.0.0.1:" + std::to_string(ntohs(at.sin_port));
  forged.boot_id = "00000000-0000-0000-0000-000000000000";
  remote::StreamPeerOptions po;
  po.address = producer->remote_address();
  po.timeout_seconds = 10;
  po.allow_no_token = true;  // the producer has none (loopback)
  auto peer = remote::ConnectStreamPeer(po);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  std::vector<std::byte> into(d->length);
  const auto start = std::chrono::steady_clock::now();
  auto held = (*peer)->Fetch(forged.Encode(), d->producer_instance, into);
  ASSERT_FALSE(held.ok());
  EXPECT_NE(held.status().message().find("names producer"), std::string::npos)
      << held.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_LT(accept4(fd, nullptr, nullptr, SOCK_CLOEXEC), 0) << "the server connected out";
  close(fd);
  // The same connection still serves the genuine descriptor.
  auto genuine = (*peer)->Fetch(*desc, d->producer_instance, into);
  ASSERT_TRUE(genuine.ok()) << genuine.status().ToString();
  EXPECT_EQ(std::memcmp(into.data(), bytes.data(), bytes.size()), 0);
  (*peer)->Release(*genuine, true);
}

// A descriptor rewritten on its way (another producer address, another block) is refused by a
// consumer that holds the token, which stays alive and opens the genuine one.
TEST_F(StreamLoopbackTest, RewrittenDescriptorIsRefused) {
  auto producer = StreamProducer::Create(Producer("tok"));
  ASSERT_TRUE(producer.ok());
  auto consumer = StreamConsumer::Create(Consumer("tok"));
  ASSERT_TRUE(consumer.ok());
  auto bytes = TensorBytes("signed", 1 << 20, 1);
  auto desc = producer->Put("signed", bytes, {.dtype = "u8"});
  ASSERT_TRUE(desc.ok());
  auto d = TensorDescriptor::Decode(*desc);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->mac.size(), 32u);
  // Another address (one that accepts TCP: the attacker's), then another length, then the
  // MAC taken away: each refused before anything connects.
  std::vector<std::string> forged;
  TensorDescriptor other = *d;
  other.remote = "127.0.0.1:1";
  forged.push_back(other.Encode());
  other = *d;
  other.length /= 2;
  forged.push_back(other.Encode());
  other = *d;
  other.mac.clear();
  forged.push_back(other.Encode());
  for (const std::string& f : forged) {
    auto t = consumer->Open(f);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kPermission) << t.status().ToString();
    EXPECT_NE(t.status().message().find("MAC"), std::string::npos) << t.status().ToString();
  }
  // A consumer without the token sends the rewritten one on: the producer refuses it.
  auto untrusting = StreamConsumer::Create(Consumer(""));
  ASSERT_TRUE(untrusting.ok());
  other = *d;
  other.length /= 2;
  auto t = untrusting->Open(other.Encode());
  ASSERT_FALSE(t.ok());
  // Lengths no memory can hold, one whose rounding up would wrap around: refused by name,
  // nothing mapped or received.
  for (const uint64_t length : {UINT64_MAX, UINT64_MAX - 4096, uint64_t{1} << 62}) {
    other = *d;
    other.offset = 0;
    other.length = length;
    auto huge = untrusting->Open(other.Encode());
    ASSERT_FALSE(huge.ok()) << length;
    EXPECT_NE(huge.status().message().find("signed"), std::string::npos)
        << huge.status().ToString();
  }
  auto genuine = consumer->Open(*desc);
  ASSERT_TRUE(genuine.ok()) << genuine.status().ToString();
  EXPECT_EQ(std::memcmp(genuine->bytes().data(), bytes.data(), bytes.size()), 0);
  genuine->Release();
}

// A consumer process that takes a block's transfer and is stopped (SIGSTOP) loses its hold
// within the lease: the producer's block comes back. (On loopback the send may complete before
// the stop lands; then the lease after the send ends the hold, as it does for a send the
// reader never finishes.)
EA_CHILD_ROLE(stopped_reader) {
  if (args.size() != 2) return 2;
  ConsumerOptions o;
  o.directory = args[1];
  o.spill_directory = args[1];
  o.remote_timeout_seconds = 120;
  o.remote_allow_no_token = true;  // the producer has none (loopback)
  auto consumer = StreamConsumer::Create(o);
  if (!consumer.ok()) return 3;
  auto messages = testing::ReadMessages(args[0]);
  if (messages.empty()) return 4;
  auto t = consumer->Open(messages[0]);
  std::printf("%s\n", t.ok() ? "OPENED" : t.status().ToString().c_str());
  return 0;
}

TEST_F(StreamLoopbackTest, ConsumerStoppedMidTransferLosesItsHoldWithinTheLease) {
  // tcp, as across hosts: the bytes go through a socket a stopped reader does not drain (on
  // one host UCX would take shared memory, where the sender may finish alone).
  setenv("UCX_TLS", "tcp", 1);
  // The server pauses right after the send started; the reader is stopped then, mid-transfer.
  // Set before the producer starts: its network process takes the environment then.
  const std::string pause = there_.spill() + "/paused";
  setenv("EXPERT_ARENA_TEST_STREAM_PAUSE_FILE", pause.c_str(), 1);
  auto producer = StreamProducer::Create(Producer("", /*lease=*/2));
  ASSERT_TRUE(producer.ok());
  auto bytes = TensorBytes("stopped", 40 << 20, 1);
  auto desc = producer->Put("stopped", bytes, {.dtype = "u8"});
  ASSERT_TRUE(desc.ok());
  const std::string descs = there_.spill() + "/descs";
  testing::WriteMessages(descs, {*desc});
  auto reader = testing::SpawnRole("stopped_reader", {descs, there_.spill()});
  const bool paused = testing::WaitForFile(pause, 60);
  unsetenv("EXPERT_ARENA_TEST_STREAM_PAUSE_FILE");
  unsetenv("UCX_TLS");
  ASSERT_TRUE(paused);
  reader.Kill(SIGSTOP);
  EXPECT_EQ(RemoteHolders(*producer), 1u);
  std::filesystem::remove(pause);
  // Lease 2 s: the hold ends (and the block goes) well before the reader's connection would.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(Eventually([&] { return Live(*producer) == 0; }, 15));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(12));
  reader.Kill(SIGKILL);
  reader.Wait(10);
}

// The network processes (expert-arena-net) whose parent is this process.
std::vector<pid_t> NetProcesses() {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t open = stat.find('(');
    size_t close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    const std::string comm = stat.substr(open + 1, close - open - 1);
    std::istringstream rest(stat.substr(close + 1));
    std::string state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == getpid() && comm.rfind("expert-arena-ne", 0) == 0 && state != "Z")
      out.push_back(std::stoi(name));
  }
  return out;
}

// A consumer on the producer's host: opens each descriptor of a file (zero copy, in the
// producer's directory), checks its bytes and releases it, a few milliseconds apart; touches
// args[3] after the first. Exits 0 when every one read right.
EA_CHILD_ROLE(local_reader) {
  if (args.size() != 4) return 2;
  ConsumerOptions o;
  o.directory = args[1];
  o.spill_directory = args[2];
  auto consumer = StreamConsumer::Create(o);
  if (!consumer.ok()) return 3;
  auto messages = testing::ReadMessages(args[0]);
  if (messages.empty()) return 4;
  for (size_t i = 0; i < messages.size(); ++i) {
    auto t = consumer->Open(messages[i]);
    if (!t.ok()) {
      std::printf("open %zu: %s\n", i, t.status().ToString().c_str());
      return 5;
    }
    if (t->remote() || !CheckPattern(t->bytes(), t->descriptor().key)) return 6;
    t->Release();
    if (i == 0) testing::TouchFile(args[3]);
    std::this_thread::sleep_for(std::chrono::milliseconds(15));
  }
  return 0;
}

// The network process SIGKILLed (as a UCX abort would end it) while a consumer on this host
// reads and a remote consumer holds a block: the local one never notices, the held block comes
// back, remote opens fail cleanly until the process is restarted, then succeed again (the
// same address, the same instance: descriptors made before still open).
TEST_F(StreamLoopbackTest, NetworkProcessKilledLocalReadersReadOnRemoteOpensFailUntilRestart) {
  setenv("EXPERT_ARENA_NET_RESTART_SECONDS", "2", 1);  // a known outage
  struct Unset {
    ~Unset() { unsetenv("EXPERT_ARENA_NET_RESTART_SECONDS"); }
  } unset;
  auto producer = StreamProducer::Create(Producer());
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  const std::vector<pid_t> before = NetProcesses();
  ASSERT_EQ(before.size(), 1u);
  std::vector<std::string> locals;
  for (int i = 0; i < 150; ++i) {
    const std::string key = "local-" + std::to_string(i);
    std::vector<std::byte> bytes(64 << 10);
    FillPattern(bytes, key);
    auto d = producer->Put(key, bytes, {.dtype = "u8"});
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    locals.push_back(*d);
  }
  auto put = [&](const std::string& key) {
    std::vector<std::byte> bytes(1 << 20);
    FillPattern(bytes, key);
    return producer->Put(key, bytes, {.dtype = "u8"});
  };
  auto held = put("held");
  auto during = put("during");
  auto after = put("after");
  ASSERT_TRUE(held.ok() && during.ok() && after.ok());
  ConsumerOptions co = Consumer();
  co.remote_timeout_seconds = 5;
  auto consumer = StreamConsumer::Create(co);
  ASSERT_TRUE(consumer.ok());
  auto holding = consumer->Open(*held);
  ASSERT_TRUE(holding.ok()) << holding.status().ToString();
  EXPECT_EQ(RemoteHolders(*producer), 1u);

  const std::string descs = there_.spill() + "/locals";
  const std::string started = there_.spill() + "/started";
  testing::WriteMessages(descs, locals);
  auto reader = testing::SpawnRole("local_reader", {descs, here_.shm(), here_.spill(), started});
  ASSERT_TRUE(testing::WaitForFile(started, 30));
  ASSERT_EQ(kill(before[0], SIGKILL), 0);

  // The outage: a clean error (not an abort, not a hang), before the restart.
  const auto killed = std::chrono::steady_clock::now();
  auto refused = consumer->Open(*during);
  ASSERT_FALSE(refused.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - killed, std::chrono::seconds(2));
  std::printf("during the outage: %s\n", refused.status().ToString().c_str());
  EXPECT_EQ(producer->Stats()->remote_restarts, 0u);
  // The share the killed process held for the remote consumer is spent: the block comes back.
  EXPECT_TRUE(Eventually([&] {
    auto pending = producer->Pending();
    if (!pending.ok()) return false;
    for (const auto& b : *pending)
      if (b.key == "held") return false;
    return true;
  }));
  EXPECT_TRUE(CheckPattern(holding->bytes(), "held"));  // the consumer's own copy

  EXPECT_TRUE(Eventually([&] { return producer->Stats()->remote_restarts == 1; }));
  const std::vector<pid_t> now = NetProcesses();
  ASSERT_EQ(now.size(), 1u);
  EXPECT_NE(now[0], before[0]);
  auto reopened = consumer->Open(*after);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_TRUE(reopened->remote());
  EXPECT_TRUE(CheckPattern(reopened->bytes(), "after"));
  reopened->Release();

  EXPECT_EQ(reader.Wait(60), 0) << reader.Output();
  EXPECT_EQ(Live(*producer), 1u);  // "during", never opened
}

TEST_F(StreamLoopbackTest, ListenIsOffByDefaultAndNeedsAnAddress) {
  StreamOptions o = here_.Producer("xs");
  auto producer = StreamProducer::Create(o);
  ASSERT_TRUE(producer.ok());
  EXPECT_TRUE(producer->remote_address().empty());
  auto desc = producer->Put("k", TensorBytes("k", 10, 1), {});
  ASSERT_TRUE(desc.ok());
  EXPECT_TRUE(TensorDescriptor::Decode(*desc)->remote.empty());
  o.listen_token = "t";
  EXPECT_FALSE(StreamProducer::Create(o).ok());
  o.listen = "no-such-host.invalid:1";
  EXPECT_FALSE(StreamProducer::Create(o).ok());
}

// A consumer's batch of opens as the server parses it: well-formed, and every malformation a
// hostile consumer can send dropped whole (no record of it served, nothing read past the end).
TEST(StreamWireTest, AChunkFitsItsBlockOnlyOnTheGrid) {
  using remote::ChunkFits;
  using remote::StreamChunk;
  constexpr uint64_t kTotal = (10u << 20) + 5;  // chunks of 4 MiB: 4, 4 and 2 MiB + 5
  constexpr uint64_t kC = 4u << 20;
  const StreamChunk first{1, 9, kTotal, 0, kC, kC, 0};
  EXPECT_TRUE(ChunkFits(first, kTotal, nullptr));
  EXPECT_TRUE(ChunkFits({1, 9, kTotal, kC, kC, kC, 0}, kTotal, &first));
  EXPECT_TRUE(ChunkFits({1, 9, kTotal, 2 * kC, kTotal - 2 * kC, kC, 0}, kTotal, &first));
  EXPECT_TRUE(ChunkFits({1, 9, 1u << 20, 0, 1u << 20, 1u << 20, 0}, 1u << 20, nullptr))
      << "one chunk of the whole block";
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  const std::vector<std::pair<const char*, StreamChunk>> bad = {
      {"another block's total", {1, 9, kTotal + 1, 0, kC, kC, 0}},
      {"a chunk size of 0 (no division by it)", {1, 9, kTotal, 0, kC, 0, 0}},
      {"a chunk size under the minimum", {1, 9, kTotal, 0, 4096, 4096, 0}},
      {"a chunk size over the block", {1, 9, kTotal, 0, kTotal, kTotal + 1, 0}},
      {"an offset off the grid", {1, 9, kTotal, 1, kC, kC, 0}},
      {"an offset past the block", {1, 9, kTotal, 3 * kC, 1, kC, 0}},
      {"an offset that wraps", {1, 9, kTotal, max - kC + 1, kC, kC, 0}},
      {"a length short of the grid", {1, 9, kTotal, kC, kC - 1, kC, 0}},
      {"a length past the block", {1, 9, kTotal, 2 * kC, kC, kC, 0}},
      {"a length that wraps", {1, 9, kTotal, kC, max, kC, 0}},
  };
  for (const auto& [why, h] : bad) EXPECT_FALSE(ChunkFits(h, kTotal, nullptr)) << why;
  EXPECT_FALSE(ChunkFits({1, 10, kTotal, kC, kC, kC, 0}, kTotal, &first)) << "another hold";
  EXPECT_FALSE(ChunkFits({1, 9, kTotal, 2 * (1u << 20), 1u << 20, 1u << 20, 0}, kTotal, &first))
      << "another chunk size than the first chunk's";
}

TEST(StreamWireTest, OpenManyMessagesParseOnlyWhenWellFormed) {
  using remote::StreamOpen;
  using remote::StreamOpenRecord;
  auto message = [](uint32_t count, const std::vector<std::string>& descriptors,
                    uint64_t first = 7, uint64_t step = 1) {
    std::string m(sizeof(remote::StreamOpenMany), '\0');
    remote::StreamOpenMany head{count, 0};
    std::memcpy(m.data(), &head, sizeof head);
    for (size_t i = 0; i < descriptors.size(); ++i) {
      StreamOpen open{first + i * step, 42, static_cast<uint32_t>(descriptors[i].size()), 0};
      m.append(reinterpret_cast<const char*>(&open), sizeof open);
      m += descriptors[i];
    }
    return m;
  };
  auto parse = [](const std::string& m, std::vector<StreamOpenRecord>* out) {
    return remote::ParseOpenMany(std::as_bytes(std::span(m.data(), m.size())), out);
  };
  std::vector<StreamOpenRecord> records;
  const std::string good = message(3, {"abc", "", std::string(100, 'x')});
  ASSERT_TRUE(parse(good, &records));
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0].open.request, 7u);
  EXPECT_EQ(records[2].open.request, 9u);
  EXPECT_EQ(records[0].descriptor, "abc");
  EXPECT_EQ(records[1].descriptor, "");
  EXPECT_EQ(records[2].descriptor, std::string(100, 'x'));
  const std::vector<std::pair<const char*, std::string>> bad = {
      {"empty", ""},
      {"no record", message(0, {})},
      {"count above the records", message(4, {"abc", "d"})},
      {"count below the records (bytes left over)", message(1, {"abc", "d"})},
      {"a count no message can hold", message(0xffffffffu, {"abc"})},
      {"truncated in a record", good.substr(0, good.size() - 1)},
      {"truncated in a record's head", good.substr(0, sizeof(remote::StreamOpenMany) + 10)},
      {"requests not consecutive", message(2, {"a", "b"}, 7, 2)},
      {"a descriptor over the limit",
       message(1, {std::string(remote::kStreamMaxDescriptorBytes + 1, 'd')})},
      {"over the message limit",
       message(5, std::vector<std::string>(5, std::string(remote::kStreamMaxDescriptorBytes,
                                                          'd')))},
  };
  for (const auto& [what, m] : bad) {
    records.assign(1, {});
    EXPECT_FALSE(parse(m, &records)) << what;
  }
  // A descriptor length pointing past the end.
  std::string past = message(1, {"abcd"});
  StreamOpen open{};
  std::memcpy(&open, past.data() + sizeof(remote::StreamOpenMany), sizeof open);
  open.descriptor_bytes = 4096;
  std::memcpy(past.data() + sizeof(remote::StreamOpenMany), &open, sizeof open);
  EXPECT_FALSE(parse(past, &records));
}

TEST(RemoteDescriptorTest, RemoteFieldsRoundTripAndAHostileAddressIsRefused) {
  TensorDescriptor d;
  d.segment = "ea-stream-xs-1-2-abcd-0";
  d.length = 10;
  d.key = "k";
  d.dtype = "u8";
  d.remote = "[fe80::1%eth0]:4791";
  d.producer_instance = 42;
  d.boot_id = "0123abcd-0123-4567-89ab-0123456789ab";
  auto back = TensorDescriptor::Decode(d.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->remote, d.remote);
  EXPECT_EQ(back->producer_instance, 42u);
  EXPECT_EQ(back->boot_id, d.boot_id);
  for (const std::string bad : {"10.0.0.1:1; rm -rf /", "a/b:1", "x\n:1"}) {
    d.remote = bad;
    auto refused = TensorDescriptor::Decode(d.Encode());
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("is not ADDR:PORT"), std::string::npos)
        << refused.status().ToString();
  }
}

// ---- two hosts -----------------------------------------------------------------------------

// Two hosts on one veth pair, made once for the suite.
class Hosts {
 public:
  std::string Make() {
    if (!remote::RemoteBuilt()) return "built without UCX (libucx-dev)";
    if (geteuid() != 0) return "needs root to make network and mount namespaces";
    if (Sh("command -v ip && command -v nsenter && command -v unshare") != 0)
      return "needs ip (iproute2), nsenter and unshare (util-linux)";
    const std::string pid = std::to_string(getpid());
    run_ = "/run/ea-xs-" + pid;
    subnet_ = "10.214." + std::to_string(20 + getpid() % 200) + ".";
    std::string script = "set -e; mkdir -p " + run_ + "; mount --bind " + run_ + " " + run_ +
                         "; mount --make-private " + run_ + ";";
    made_ = true;
    script += " ip netns add " + Namespace(0) + "; ip netns add " + Namespace(1) +
              "; ip link add " + Veth(0) + " netns " + Namespace(0) + " type veth peer name " +
              Veth(1) + " netns " + Namespace(1) + ";";
    for (int i = 0; i < 2; ++i) {
      script += " ip -n " + Namespace(i) + " addr add " + Address(i) + "/24 dev " + Veth(i) +
                "; ip -n " + Namespace(i) + " link set " + Veth(i) + " up; ip -n " + Namespace(i) +
                " link set lo up; touch " + MountFile(i) + "; nsenter --net=/run/netns/" +
                Namespace(i) + " unshare --mount=" + MountFile(i) +
                " --propagation private sh -c 'mount -t tmpfs -o size=256m tmpfs /dev/shm && "
                "umount -l /sys && mount -t sysfs sysfs /sys';";
    }
    // Until both ends of the pair have their carrier (a veth comes up a moment after "up").
    script += " for i in $(seq 100); do ip -n " + Namespace(0) + " link show " + Veth(0) +
              " | grep -q LOWER_UP && ip -n " + Namespace(1) + " link show " + Veth(1) +
              " | grep -q LOWER_UP && break; sleep 0.1; done";
    std::string out;
    if (Sh(script, &out) != 0) return "cannot make the test network: " + out;
    return "";
  }
  ~Hosts() {
    if (!made_) return;
    std::string script;
    for (int i = 0; i < 2; ++i)
      script += "umount " + MountFile(i) + "; ip netns del " + Namespace(i) + "; ";
    script += "umount " + run_ + "; rm -rf " + run_;
    (void)Sh(script);
  }
  std::string Address(int host) const { return subnet_ + std::to_string(host + 1); }
  // The prefix that runs a command on `host`.
  std::string On(int host) const {
    return "nsenter --net=/run/netns/" + Namespace(host) + " --mount=" + MountFile(host) +
           " -- env UCX_TLS=tcp ";
  }

 private:
  std::string Namespace(int host) const {
    return "ea" + std::to_string(getpid()) + "x" + std::to_string(host);
  }
  std::string Veth(int host) const {
    // Piece by piece: "x" + std::to_string(...) draws a bogus -Wrestrict from g++ 12 at -O3
    // (GCC PR 105651).
    std::string name = "xs";
    name += std::to_string(getpid());
    name += 'v';
    name += std::to_string(host);
    return name;
  }
  std::string MountFile(int host) const { return run_ + "/h" + std::to_string(host) + ".mnt"; }
  bool made_ = false;
  std::string run_;
  std::string subnet_;
};

constexpr uint64_t kBigBytes = 24ull << 20;

// The producer of the two-host cases: puts one tensor of every dtype, a "held" one and a big
// one, writes their descriptors to CHANNEL/descs, says READY, then reports the remote holders
// and live blocks whenever they change, until CHANNEL/stop exists.
//   args: listen-address channel-directory lease-seconds
EA_CHILD_ROLE(xs_producer) {
  if (args.size() != 3) return 2;
  const std::string dir = "/dev/shm/xs-producer";
  std::filesystem::create_directories(dir);
  StreamOptions o;
  o.directory = dir;
  o.spill_directory = args[1] + "/spill-" + std::to_string(getpid());
  o.logical_name = "xs";
  o.segment_bytes = 32ull << 20;
  o.max_segments = 4;
  o.listen = args[0];
  o.listen_allow_no_token = true;  // the test's own network namespaces
  o.remote_lease_seconds = std::stod(args[2]);
  auto producer = StreamProducer::Create(o);
  if (!producer.ok()) {
    std::printf("ERROR %s\n", producer.status().ToString().c_str());
    return 1;
  }
  std::vector<std::string> messages;
  for (const auto& [dtype, size] : kDtypes) {
    auto bytes = TensorBytes(dtype, 100003, size);
    auto d = producer->Put(dtype, bytes, {.dtype = dtype, .shape = {100003}});
    if (!d.ok()) return 3;
    messages.push_back(dtype);
    messages.push_back(*d);
  }
  for (const std::string key : {"held", "big"}) {
    auto bytes = TensorBytes(key, key == std::string("big") ? kBigBytes : 1 << 20, 1);
    auto d = producer->Put(key, bytes, {.dtype = "u8"});
    if (!d.ok()) return 3;
    messages.push_back(key);
    messages.push_back(*d);
  }
  testing::WriteMessages(args[1] + "/descs", messages);
  std::printf("READY %s\n", producer->remote_address().c_str());
  std::fflush(stdout);
  std::string last;
  while (!std::filesystem::exists(args[1] + "/stop")) {
    auto pending = producer->Pending();
    if (pending.ok()) {
      uint32_t remote = 0;
      for (const auto& b : *pending) remote += b.remote_holders;
      std::string now =
          "HOLDS " + std::to_string(remote) + " LIVE " + std::to_string(pending->size());
      if (now != last) {
        std::printf("%s\n", now.c_str());
        std::fflush(stdout);
        last = now;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(o.spill_directory);
  return 0;
}

// The consumer of the two-host cases. args: channel-directory mode
//   all:  opens every dtype's tensor, checks its bytes, releases it; "OK <n>" when all match
//   hold: opens "held", says HOLDING and waits to be killed
//   big:  says OPENING, opens "big"; prints OK or "ERROR <message>"
EA_CHILD_ROLE(xs_consumer) {
  if (args.size() != 2) return 2;
  const std::string dir = "/dev/shm/xs-consumer";
  std::filesystem::create_directories(dir);
  ConsumerOptions o;
  o.directory = dir;
  o.spill_directory = dir;
  o.remote_timeout_seconds = 60;  // the bound is the producer's death, not this
  o.remote_allow_no_token = true;  // the test's own network namespaces, no token
  auto consumer = StreamConsumer::Create(o);
  if (!consumer.ok()) return 3;
  auto messages = testing::ReadMessages(args[0] + "/descs");
  std::map<std::string, std::string> descs;
  for (size_t i = 0; i + 1 < messages.size(); i += 2) descs[messages[i]] = messages[i + 1];
  const std::string mode = args[1];
  if (mode == "all") {
    int good = 0;
    for (const auto& [dtype, size] : kDtypes) {
      auto t = consumer->Open(descs[dtype]);
      if (!t.ok()) {
        std::printf("ERROR %s: %s\n", dtype.c_str(), t.status().ToString().c_str());
        continue;
      }
      auto want = TensorBytes(dtype, 100003, size);
      if (t->remote() && t->bytes().size() == want.size() &&
          std::memcmp(t->bytes().data(), want.data(), want.size()) == 0)
        ++good;
      else
        std::printf("MISMATCH %s\n", dtype.c_str());
      t->Release();
    }
    std::printf("OK %d\n", good);
  } else if (mode == "hold") {
    auto t = consumer->Open(descs["held"]);
    if (!t.ok()) {
      std::printf("ERROR %s\n", t.status().ToString().c_str());
      return 1;
    }
    std::printf("HOLDING\n");
    std::fflush(stdout);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  } else if (mode == "big") {
    std::printf("OPENING\n");
    std::fflush(stdout);
    auto t = consumer->Open(descs["big"]);
    if (t.ok()) {
      std::printf("OK\n");
    } else {
      std::printf("ERROR %s\n", t.status().ToString().c_str());
    }
  }
  std::fflush(stdout);
  std::filesystem::remove_all(dir);
  return 0;
}

class StreamTwoHostsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    hosts_ = new Hosts();
    skip_ = hosts_->Make();
  }
  static void TearDownTestSuite() { delete hosts_; }
  void SetUp() override {
    if (!skip_.empty()) SKIP_OR_FAIL(skip_);
    channel_ = std::filesystem::temp_directory_path() /
               ("ea-xs-" + std::to_string(getpid()) + "-" + std::to_string(++runs_));
    std::filesystem::create_directories(channel_);
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(channel_, ec);
  }
  // A child role on `host`, under env `extra` ("K=V ...").
  testing::Child On(int host, const std::string& role, const std::vector<std::string>& args,
                    const std::string& extra = "") {
    std::string line = "exec " + hosts_->On(host) + extra + " " +
                       std::filesystem::read_symlink("/proc/self/exe").string() +
                       " --ea-child-role=" + role;
    for (const auto& a : args) line += " '" + a + "'";
    return testing::SpawnProgram("/bin/sh", {"-c", line});
  }
  testing::Child StartProducer(double lease = 60, const std::string& extra = "") {
    auto p =
        On(0, "xs_producer", {hosts_->Address(0) + ":0", channel_, std::to_string(lease)}, extra);
    EXPECT_TRUE(p.WaitForOutput("READY", 60)) << p.Output();
    return p;
  }
  void Stop(testing::Child& producer) {
    testing::TouchFile(channel_ + "/stop");
    EXPECT_EQ(producer.Wait(60), 0) << producer.Output();
  }

  static Hosts* hosts_;
  static std::string skip_;
  static int runs_;
  std::string channel_;
};
Hosts* StreamTwoHostsTest::hosts_ = nullptr;
std::string StreamTwoHostsTest::skip_;
int StreamTwoHostsTest::runs_ = 0;

TEST_F(StreamTwoHostsTest, EveryDtypeBitExactAcrossHosts) {
  auto producer = StartProducer();
  auto consumer = On(1, "xs_consumer", {channel_, "all"});
  EXPECT_EQ(consumer.Wait(120), 0);
  EXPECT_NE(consumer.Output().find("OK " + std::to_string(kDtypes.size())), std::string::npos)
      << consumer.Output();
  // Every release crossed the wire: only "held" and "big" are left.
  EXPECT_TRUE(producer.WaitForOutput("HOLDS 0 LIVE 2", 60)) << producer.Output();
  Stop(producer);
}

TEST_F(StreamTwoHostsTest, KilledConsumerLosesItsHold) {
  auto producer = StartProducer();
  auto consumer = On(1, "xs_consumer", {channel_, "hold"});
  ASSERT_TRUE(consumer.WaitForOutput("HOLDING", 60)) << consumer.Output();
  EXPECT_TRUE(producer.WaitForOutput("HOLDS 1", 60)) << producer.Output();
  consumer.Kill(SIGKILL);
  consumer.Wait(30);
  // Its endpoint fails (the connection reset, or keepalive): the share is spent and "held"
  // freed, long before its 60 s lease.
  EXPECT_TRUE(producer.WaitForOutput("HOLDS 0 LIVE " + std::to_string(kDtypes.size() + 1), 50))
      << producer.Output();
  Stop(producer);
}

TEST_F(StreamTwoHostsTest, KilledProducerFailsAnOpenInFlight) {
  const std::string pause = channel_ + "/paused";
  auto producer = StartProducer(60, "EXPERT_ARENA_TEST_STREAM_PAUSE_FILE=" + pause);
  auto consumer = On(1, "xs_consumer", {channel_, "big"});
  ASSERT_TRUE(consumer.WaitForOutput("OPENING", 60)) << consumer.Output();
  ASSERT_TRUE(testing::WaitForFile(pause, 60)) << producer.Output();
  producer.Kill(SIGKILL);  // mid-transfer: the data send started, not all of it landed
  producer.Wait(30);
  // A clear error, never a hang (the consumer's own bound is 60 s; this waits 50).
  EXPECT_TRUE(consumer.WaitForOutput("ERROR", 50)) << consumer.Output();
  EXPECT_NE(consumer.Output().find("went away"), std::string::npos) << consumer.Output();
  std::printf("%s", consumer.Output().c_str());
  EXPECT_EQ(consumer.Wait(30), 0);
  std::filesystem::remove(pause);
}

}  // namespace
}  // namespace expert_arena
