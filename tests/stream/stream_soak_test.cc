// Soak (label "soak"): 100k+ tensors of random sizes from 1 KiB to 64 MiB through a producer
// in this process and two consumer processes, with random aborts and one consumer SIGKILLed
// mid-run. Ends with zero live blocks, zero leaked bytes and zero files left.
//
// Bounded for CI: EA_STREAM_SOAK_SECONDS (default 60) and EA_STREAM_SOAK_TENSORS (default
// 100000), whichever comes first. /dev/shm use stays under 2 GiB (24 segments of 64 MiB).
// Only a stamp of each tensor (its first, middle and last 8 bytes) is written and checked:
// the soak exercises allocation, release, abort and death, not memcpy bandwidth.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <unordered_map>

#include "expert_arena/stream.h"
#include "stream_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::Child;
using testing::SpawnRole;
using testing::StreamDirs;

double EnvOr(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atof(v) : fallback;
}

uint64_t Stamp(const std::string& key) {
  uint64_t h = 1469598103934665603ull;
  for (char c : key) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h | 1;
}

void WriteStamp(std::span<std::byte> b, uint64_t s) {
  std::memcpy(b.data(), &s, 8);
  std::memcpy(b.data() + (b.size() / 2 & ~size_t{7}), &s, 8);
  std::memcpy(b.data() + b.size() - 8, &s, 8);
}

bool CheckStamp(std::span<const std::byte> b, uint64_t s) {
  uint64_t x, y, z;
  std::memcpy(&x, b.data(), 8);
  std::memcpy(&y, b.data() + (b.size() / 2 & ~size_t{7}), 8);
  std::memcpy(&z, b.data() + b.size() - 8, 8);
  return x == s && y == s && z == s;
}

bool ReadAll(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t got = read(fd, p, n);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool WriteAll(int fd, const void* buf, size_t n) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t put = write(fd, p, n);
    if (put <= 0) return false;
    p += put;
    n -= static_cast<size_t>(put);
  }
  return true;
}

// args: shm spill fifo. Reads descriptors until "END" (or EOF), checks stamps, releases;
// every 7th release is gated on a predicate that becomes true on the next poll.
EA_CHILD_ROLE(stream_soak_consumer) {
  ConsumerOptions o;
  o.directory = args[0];
  o.spill_directory = args[1];
  auto consumer = StreamConsumer::Create(o);
  if (!consumer.ok()) return 3;
  int fd = open(args[2].c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 4;
  uint64_t ok = 0, bad = 0, refused = 0, n = 0;
  for (;;) {
    uint32_t len = 0;
    if (!ReadAll(fd, &len, 4)) break;
    std::string m(len, '\0');
    if (!ReadAll(fd, m.data(), len)) break;
    if (m == "END") break;
    auto t = consumer->Open(m);
    if (!t.ok()) {
      ++refused;
      continue;
    }
    if (CheckStamp(t->bytes(), Stamp(t->descriptor().key))) {
      ++ok;
    } else {
      ++bad;
      std::fprintf(stderr, "bad stamp for %s\n", t->descriptor().key.c_str());
    }
    if (++n % 7 == 0) {
      auto polls = std::make_shared<int>(0);
      t->ReleaseWhen([polls] { return ++*polls > 1; });
    }
    consumer->PollReleases();
  }
  while (consumer->PollReleases() > 0) {
  }
  std::printf("ok %llu bad %llu refused %llu\n", static_cast<unsigned long long>(ok),
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(refused));
  return bad == 0 ? 0 : 1;
}

TEST(StreamSoak, RandomSizesAbortsAndAKilledConsumer) {
  const double seconds = EnvOr("EA_STREAM_SOAK_SECONDS", 60);
  const uint64_t target = static_cast<uint64_t>(EnvOr("EA_STREAM_SOAK_TENSORS", 100000));
  signal(SIGPIPE, SIG_IGN);
  StreamDirs dirs;
  StreamOptions o = dirs.Producer("soak");
  o.segment_bytes = 64ull << 20;
  o.max_segments = 24;
  o.huge = HugePages::kOff;
  std::string fifo[2] = {dirs.spill() + "-fifo0", dirs.spill() + "-fifo1"};
  uint64_t sent = 0, aborts = 0, spilled = 0;
  std::string outcome;
  {
    ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
    std::vector<Child> consumers;
    int fds[2];
    for (int i = 0; i < 2; ++i) {
      ASSERT_EQ(mkfifo(fifo[i].c_str(), 0600), 0);
      consumers.push_back(SpawnRole("stream_soak_consumer", {dirs.shm(), dirs.spill(), fifo[i]}));
      fds[i] = open(fifo[i].c_str(), O_WRONLY | O_CLOEXEC);
      ASSERT_GE(fds[i], 0);
    }
    std::mt19937_64 rng(42);
    std::vector<std::string> keys_of_killed;
    bool killed = false;
    auto start = std::chrono::steady_clock::now();
    auto elapsed = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    for (uint64_t i = 0; i < target && elapsed() < seconds; ++i) {
      // Log-uniform sizes from 1 KiB to 64 MiB.
      double e = 10.0 + 16.0 * std::uniform_real_distribution<double>(0, 1)(rng);
      uint64_t size = std::min<uint64_t>(static_cast<uint64_t>(std::exp2(e)), 64ull << 20);
      std::string key = "req_" + std::to_string(i / 3) + "_" + std::to_string(i % 3);
      ASSERT_OK_AND_ASSIGN(auto r, producer.Reserve(key, size));
      spilled += r.spilled() ? 1 : 0;
      WriteStamp(r.bytes(), Stamp(key));
      ASSERT_OK_AND_ASSIGN(std::string d, r.Publish({"u8", {size}}));
      int to = killed ? 0 : static_cast<int>(rng() % 2);
      uint32_t len = static_cast<uint32_t>(d.size());
      if (WriteAll(fds[to], &len, 4) && WriteAll(fds[to], d.data(), len)) ++sent;
      if (to == 1) keys_of_killed.push_back(key);
      if (rng() % 20 == 0) {
        ASSERT_OK(producer.Abort(key));
        ++aborts;
      }
      if (!killed && (i >= target * 2 / 5 || elapsed() > seconds * 0.4)) {
        consumers[1].Kill(SIGKILL);
        consumers[1].Wait(10);
        close(fds[1]);
        killed = true;
        // The request path of a real engine aborts what it sent to a dead peer.
        for (const auto& k : keys_of_killed) ASSERT_OK(producer.Abort(k));
      }
    }
    std::string end = "END";
    uint32_t len = 3;
    WriteAll(fds[0], &len, 4);
    WriteAll(fds[0], end.data(), 3);
    close(fds[0]);
    ASSERT_EQ(consumers[0].Wait(120), 0) << consumers[0].Output();
    outcome = consumers[0].Output();
    for (const auto& k : keys_of_killed) ASSERT_OK(producer.Abort(k));
    ASSERT_OK(producer.Reclaim());
    StreamStats s = producer.Stats().value();
    std::printf(
        "soak: %llu tensors in %.1f s (%llu spilled, %llu aborted keys), consumer 0: %s"
        "segments %llu, fragmentation warnings %llu, dead readers cleared %llu\n",
        static_cast<unsigned long long>(sent), elapsed(), static_cast<unsigned long long>(spilled),
        static_cast<unsigned long long>(aborts), outcome.c_str(),
        static_cast<unsigned long long>(s.segments),
        static_cast<unsigned long long>(s.fragmentation_failures),
        static_cast<unsigned long long>(s.dead_readers_cleared));
    EXPECT_EQ(s.live_blocks, 0u);
    EXPECT_EQ(s.free_bytes, s.total_bytes);  // zero leaked bytes
    EXPECT_EQ(s.spill_files, 0u);
    EXPECT_EQ(s.dedicated_segments, 0u);
    EXPECT_TRUE(killed);
    if (target >= 100000 && seconds >= 60) {
      EXPECT_GE(sent, 100000u);
    }
  }
  unlink(fifo[0].c_str());
  unlink(fifo[1].c_str());
  EXPECT_TRUE(dirs.remaining().empty());  // zero files left
}

}  // namespace
}  // namespace expert_arena
