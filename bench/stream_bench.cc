// stream_bench: tensor streaming vs a per-tensor file transport, on the field's three edge
// shapes (32 x 64 KiB, 4 x 2 MiB, 1 x 64 MiB), plus raw memcpy and allocator latency.
//
// One round = the producer puts every tensor of the shape and sends the descriptors over a
// FIFO; a consumer in ANOTHER process (this binary re-executed) opens each, copies its bytes
// out (what a host-to-device copy reads), releases it, and acknowledges the round. The file
// transport does the same with one file per tensor: write a temporary file, rename it, send
// its name; the consumer opens, reads, closes and unlinks it. Both use the same FIFOs, so the
// channel's cost is in both. Reported: the median round per shape and the ratio.
//
// Raw memcpy: the stream round makes one copy of the bytes (the put) and "+ copy out" a second
// one, so "stream vs memcpy" is one memcpy's time / the round's and "stream + copy vs 2
// memcpy" two memcpys' / the copy-out round's. "put alone" is the round's puts (and an Abort
// that frees them) without channel or consumer.
//
// Allocator: with 10k live blocks of 4-64 KiB held, the median of Reserve + drop (free) of one
// more block, timed pair by pair.
//
// Growth: the stall a producer sees when the stream needs a new segment (fallocate, 2 MiB
// pages, populate), with grow-ahead off and on: 8 MiB puts into 128 MiB segments until six
// segments exist, back to back and with 2 ms of "engine work" between puts.
//
// Puts while segments are made (--only-lock-latency): one thread puts 64 KiB tensors back to
// back (each aborted again, so the stream never fills) and records every put's latency, alone
// and while a second thread puts 160 MiB tensors, each needing a dedicated segment of its own
// (fallocate, populate: milliseconds); the small puts' count, p50, p99.9, slowest and the time
// they spent stalled (puts over 1 ms, summed), both ways, alternating. A segment made under
// the producer's lock shows as small puts stalled for the whole making.
//
// Usage: flock /tmp/expert-arena-bench.lock build/bin/stream_bench [--dir /dev/shm] [--rounds N]
//            [--copy-threads N] [--non-temporal-from BYTES|never]
//            [--skip-growth | --only-growth | --only-lock-latency]
//   --copy-threads and --non-temporal-from set the producer's StreamOptions of the same names
//   (default 0: the library's automatic choice).
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pages/page_backing.h"
#include "common/units.h"
#include "expert_arena/stream.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using expert_arena::ConsumerOptions;
using expert_arena::StreamConsumer;
using expert_arena::StreamOptions;
using expert_arena::StreamProducer;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
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

void SendBatch(int fd, const std::vector<std::string>& messages) {
  std::string out;
  uint32_t count = static_cast<uint32_t>(messages.size());
  out.append(reinterpret_cast<const char*>(&count), 4);
  for (const auto& m : messages) {
    uint32_t len = static_cast<uint32_t>(m.size());
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += m;
  }
  WriteAll(fd, out.data(), out.size());
}

bool ReceiveBatch(int fd, std::vector<std::string>* messages) {
  uint32_t count = 0;
  if (!ReadAll(fd, &count, 4)) return false;
  messages->resize(count);
  for (auto& m : *messages) {
    uint32_t len = 0;
    if (!ReadAll(fd, &len, 4)) return false;
    m.resize(len);
    if (!ReadAll(fd, m.data(), len)) return false;
  }
  return true;
}

// The consumer process: argv = self --consumer MODE DIR IN OUT
int RunConsumer(const std::string& mode, const std::string& dir, const std::string& in_path,
                const std::string& out_path) {
  int in = open(in_path.c_str(), O_RDONLY | O_CLOEXEC);
  int out = open(out_path.c_str(), O_WRONLY | O_CLOEXEC);
  if (in < 0 || out < 0) return 3;
  std::vector<std::byte> dest(64 << 20);
  std::memset(dest.data(), 1, dest.size());
  ConsumerOptions o;
  o.directory = dir;
  o.spill_directory = dir;
  auto consumer = StreamConsumer::Create(o);
  if (!consumer.ok()) return 4;
  std::vector<std::string> batch;
  volatile uint64_t sink = 0;
  while (ReceiveBatch(in, &batch)) {
    size_t at = 0;
    for (const auto& m : batch) {
      if (mode == "view" || mode == "copy") {
        auto t = consumer->Open(m);
        if (!t.ok()) {
          std::fprintf(stderr, "open: %s\n", t.status().ToString().c_str());
          return 5;
        }
        if (mode == "copy") {
          std::memcpy(dest.data() + at, t->bytes().data(), t->bytes().size());
          at += t->bytes().size();
        } else {
          // The view is what a device copy reads from: check it is there, copy nothing.
          sink = sink + static_cast<uint8_t>(t->bytes()[t->bytes().size() - 1]);
        }
      } else {
        int fd = open(m.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) return 6;
        struct stat st {};
        fstat(fd, &st);
        size_t n = static_cast<size_t>(st.st_size);
        if (!ReadAll(fd, dest.data() + at, n)) return 7;
        at += n;
        close(fd);
        unlink(m.c_str());
      }
    }
    char ack = 'k';
    WriteAll(out, &ack, 1);
  }
  return 0;
}

struct Peer {
  pid_t pid = -1;
  int to = -1;
  int from = -1;
};

Peer SpawnConsumer(const std::string& mode, const std::string& dir, const std::string& tag) {
  std::string in = "/tmp/ea-bench-stream-" + std::to_string(getpid()) + "-" + tag + "-in";
  std::string out = "/tmp/ea-bench-stream-" + std::to_string(getpid()) + "-" + tag + "-out";
  mkfifo(in.c_str(), 0600);
  mkfifo(out.c_str(), 0600);
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  self[n > 0 ? n : 0] = '\0';
  std::vector<std::string> args = {self, "--consumer", mode, dir, in, out};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  Peer p;
  posix_spawn(&p.pid, self, nullptr, nullptr, argv.data(), environ);
  p.to = open(in.c_str(), O_WRONLY | O_CLOEXEC);
  p.from = open(out.c_str(), O_RDONLY | O_CLOEXEC);
  unlink(in.c_str());
  unlink(out.c_str());
  return p;
}

void Stop(Peer& p) {
  close(p.to);
  close(p.from);
  waitpid(p.pid, nullptr, 0);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One segment-sized file on 2 MiB pages made the way CreateSegment made it before (fallocate
// every 4 KiB page, then MADV_COLLAPSE copies them into 2 MiB pages) or the way it does now
// (size only; the collapse allocates one small page per 2 MiB and fills the rest; then
// fallocate), as CreateSegment does through pages::ApplyHugePages. Returns seconds,
// and the share on 2 MiB pages in *huge_share; -1 on an error.
double MakeHugeFile(const std::string& dir, uint64_t bytes, bool sparse, double* huge_share) {
  using namespace expert_arena;
  std::string path = dir + "/ea-bench-grow-" + std::to_string(getpid());
  auto t0 = Clock::now();
  auto fd = platform::OpenFile(path, {.write = true, .create = true, .exclusive = true});
  if (!fd.ok()) return -1;
  (void)platform::UnlinkPath(path);
  if (!(sparse ? platform::ExtendFile(*fd, bytes) : platform::AllocateFile(*fd, bytes)).ok()) {
    return -1;
  }
  auto m = platform::Mapping::MapFile(*fd, bytes, true, kHugePageBytes);
  if (!m.ok()) return -1;
  (void)platform::AdviseRange(m->data(), bytes, platform::Advice::kHugePage, path);
  if (!pages::CollapseParallel(m->data(), bytes, path, false, 0, sparse ? &*fd : nullptr).ok()) {
    return -1;
  }
  if (sparse && !platform::AllocateFile(*fd, bytes).ok()) return -1;
  (void)platform::AdviseRange(m->data(), bytes, platform::Advice::kPopulateWrite, path);
  double seconds = Seconds(t0, Clock::now());
  auto huge = platform::HugeBytesInRange(m->data(), bytes);
  *huge_share = huge.ok() ? static_cast<double>(*huge) / static_cast<double>(bytes) : 0;
  return seconds;
}

struct Shape {
  const char* name;
  int count;
  uint64_t bytes;
  int rounds;
};

// The growth sections (see the file comment); `o` is the main producer's options.
int RunGrowth(const std::string& dir, const StreamOptions& o,
              const std::vector<std::byte>& source) {
  uint64_t seq = 0;
  // The growth stall: 8 MiB puts (held, so the stream must grow) into 128 MiB segments up to
  // six segments, timed put by put. "Growing puts" are the puts that waited for a segment.
  std::printf(
      "\ngrowth (8 MiB puts into 128 MiB segments until 6 exist; put = reserve + copy + "
      "publish):\n\n| grow ahead | work between puts | segments made | puts | "
      "median put | slowest put | sum of puts over 5 ms |\n|---|---|---|---|---|---|---|\n");
  // The first producer of the process grew slowly in every run (collapses of 0.2-0.3 s instead
  // of 0.01-0.03 s, whatever its settings: zeroing 2 MiB pages the VM's host had taken back
  // through free page reporting, see docs/streaming.md), so a first pass is made and not reported.
  for (int pass = 0; pass < 2; ++pass) {
    for (int gap_ms : {0, 2}) {
      for (bool ahead : {false, true}) {
        if (pass == 0 && (gap_ms != 0 || ahead)) continue;
        StreamOptions g = o;
        g.logical_name = "benchgrow";
        g.segment_bytes = 128ull << 20;
        g.max_segments = 6;
        g.grow_ahead = ahead;
        g.logger = nullptr;
        auto p = StreamProducer::Create(g);
        if (!p.ok()) {
          std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
          return 1;
        }
        std::vector<double> t;
        std::vector<std::string> held;
        const uint64_t n = 8ull << 20;
        while (true) {
          auto st = p->Stats().value();
          if (st.segments >= 6 && st.free_bytes < n) break;
          auto t0 = Clock::now();
          // Appended, not "g" + std::to_string(): g++ 12 -O3 false -Wrestrict (GCC PR 105651).
          std::string key = "g";
          key += std::to_string(seq++);
          auto d = p->Put(key, std::span(source.data(), n), {"u8", {n}});
          t.push_back(Seconds(t0, Clock::now()));
          if (!d.ok()) return 1;
          held.push_back(std::move(d).value());
          if (gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
        }
        auto st = p->Stats().value();
        double slow = 0;
        for (double x : t) slow += x > 5e-3 ? x : 0;
        double worst = *std::max_element(t.begin(), t.end());
        if (pass == 0) continue;
        std::printf("| %s | %d ms | %llu (%llu ahead) | %zu | %.2f ms | %.1f ms | %.1f ms |\n",
                    ahead ? "on" : "off", gap_ms, static_cast<unsigned long long>(st.segments - 1),
                    static_cast<unsigned long long>(st.segments_grown_ahead), t.size(),
                    Median(t) * 1e3, worst * 1e3, slow * 1e3);
      }
    }
  }
  // Making one 130 MiB segment file on 2 MiB pages, both ways, alternating (plain tmpfs only:
  // elsewhere the filesystem gives the pages and nothing is collapsed).
  std::vector<double> dense_t, sparse_t;
  double dense_huge = 0, sparse_huge = 0;
  for (int r = 0; r < 10; ++r) {
    bool sparse_first = r % 2 == 0;
    for (bool sparse : {sparse_first, !sparse_first}) {
      double share = 0;
      double t = MakeHugeFile(dir, 130ull << 20, sparse, &share);
      if (t < 0) break;
      (sparse ? sparse_t : dense_t).push_back(t);
      (sparse ? sparse_huge : dense_huge) = share;
    }
  }
  if (!dense_t.empty() && !sparse_t.empty()) {
    std::printf(
        "\nmaking a 130 MiB segment file on 2 MiB pages (10 each, alternating): fallocate + "
        "collapse median %.1f ms (max %.1f, %.0f%% on 2 MiB pages); sized only + collapse "
        "(one page per 2 MiB) + fallocate median %.1f ms (max %.1f, %.0f%%)\n",
        Median(dense_t) * 1e3, *std::max_element(dense_t.begin(), dense_t.end()) * 1e3,
        dense_huge * 100, Median(sparse_t) * 1e3,
        *std::max_element(sparse_t.begin(), sparse_t.end()) * 1e3, sparse_huge * 100);
  }
  return 0;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

int RunLockLatency(const StreamOptions& o,
                   const std::vector<std::byte>& source) {
  StreamOptions l = o;
  l.logical_name = "benchlock";
  l.segment_bytes = 64ull << 20;
  l.max_segments = 8;
  l.grow_ahead = false;
  l.logger = nullptr;
  auto p = StreamProducer::Create(l);
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    return 1;
  }
  const uint64_t small = 64 << 10;
  const uint64_t big = 160ull << 20;
  std::vector<std::byte> big_source(big);
  for (size_t i = 0; i < big; i += source.size()) {
    std::memcpy(big_source.data() + i, source.data(), std::min(source.size(), big - i));
  }
  // The small puts of one window of `seconds`, with `grow` making dedicated segments meanwhile.
  auto window = [&](bool grow, double seconds, uint64_t* made) {
    std::vector<double> t;
    std::atomic<bool> done{false};
    std::thread grower;
    if (grow) {
      grower = std::thread([&] {
        uint64_t n = 0;
        while (!done.load()) {
          std::string key = "big";
          key += std::to_string(n++);
          auto d = p->Put(key, big_source, {"u8", {big}});
          if (!d.ok()) break;
          (void)p->Abort(key);
          ++*made;
        }
      });
    }
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    uint64_t seq = 0;
    while (Clock::now() < end) {
      std::string key = "s";
      key += std::to_string(seq++);
      auto t0 = Clock::now();
      auto d = p->Put(key, std::span(source.data(), small), {"u8", {small}});
      t.push_back(Seconds(t0, Clock::now()));
      if (!d.ok()) break;
      (void)p->Abort(key);
    }
    done = true;
    if (grower.joinable()) grower.join();
    return t;
  };
  std::vector<double> alone, growing;
  uint64_t made = 0;
  (void)window(true, 0.5, &made);  // warm: the first segments of a process are slow to fault
  made = 0;
  for (int r = 0; r < 6; ++r) {
    for (bool grow : {r % 2 == 0, r % 2 != 0}) {
      auto t = window(grow, 1.0, &made);
      (grow ? growing : alone).insert((grow ? growing : alone).end(), t.begin(), t.end());
    }
  }
  std::printf(
      "\nputs of 64 KiB while 160 MiB puts make dedicated segments (6 x 1 s windows each, "
      "alternating):\n\n| small puts | count | p50 | p99.9 | slowest | stalled (puts over 1 "
      "ms, summed) |\n|---|---|---|---|---|---|\n");
  auto stalled = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x > 1e-3 ? x : 0;
    return sum;
  };
  for (auto* v : {&alone, &growing}) {
    std::printf("| %s | %zu | %.1f us | %.1f us | %.2f ms | %.1f ms |\n",
                v == &alone ? "alone" : "while segments are made", v->size(),
                Percentile(*v, 0.5) * 1e6, Percentile(*v, 0.999) * 1e6,
                *std::max_element(v->begin(), v->end()) * 1e3, stalled(*v) * 1e3);
  }
  std::printf("\n%llu dedicated segments made; small puts made while segments are made / "
              "alone: %.2f\n",
              static_cast<unsigned long long>(made),
              static_cast<double>(growing.size()) / std::max<size_t>(1, alone.size()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 6 && std::string(argv[1]) == "--consumer") {
    return RunConsumer(argv[2], argv[3], argv[4], argv[5]);
  }
  std::string dir = "/dev/shm";
  int rounds_scale = 1;
  uint32_t copy_threads = 0;
  uint64_t non_temporal_from = 0;
  bool growth = true;
  bool only_growth = false;
  bool only_lock_latency = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--skip-growth") growth = false;
    if (a == "--only-growth") only_growth = true;
    if (a == "--only-lock-latency") only_lock_latency = true;
    if (i + 1 >= argc) continue;
    if (a == "--dir") dir = argv[i + 1];
    if (a == "--rounds") rounds_scale = std::max(1, std::atoi(argv[i + 1]));
    if (a == "--copy-threads") copy_threads = static_cast<uint32_t>(std::atoi(argv[i + 1]));
    if (a == "--non-temporal-from") {
      non_temporal_from = std::string(argv[i + 1]) == "never"
                              ? UINT64_MAX
                              : std::strtoull(argv[i + 1], nullptr, 10);
    }
  }
  std::printf(
      "stream_bench: copy_threads %u, non_temporal_copy_from %s (0: automatic)\n\n", copy_threads,
      non_temporal_from == UINT64_MAX ? "never" : std::to_string(non_temporal_from).c_str());
  std::vector<Shape> shapes = {{"32 x 64 KiB", 32, 64 << 10, 300 * rounds_scale},
                               {"4 x 2 MiB", 4, 2 << 20, 200 * rounds_scale},
                               {"1 x 64 MiB", 1, 64 << 20, 40 * rounds_scale}};
  std::vector<std::byte> source(64 << 20);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < source.size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(source.data() + i, &v, 8);
  }

  StreamOptions o;
  o.directory = dir;
  o.spill_directory = dir;
  o.logical_name = "bench";
  o.segment_bytes = 128ull << 20;
  o.max_segments = 2;
  o.copy_threads = copy_threads;
  o.non_temporal_copy_from = non_temporal_from;
  if (only_lock_latency) return RunLockLatency(o, source);
  auto producer = StreamProducer::Create(o);
  if (!producer.ok()) {
    std::fprintf(stderr, "%s\n", producer.status().ToString().c_str());
    return 1;
  }
  // The same rounds with the put's copy done differently (same consumer, same source):
  // ordinary stores (a plain memcpy, what Put did before streaming stores), and two copy
  // threads. Interleaved with the rounds above, so the machine's noise hits all alike.
  StreamOptions plain_o = o;
  plain_o.logical_name = "benchplain";
  plain_o.non_temporal_copy_from = UINT64_MAX;
  StreamOptions two_o = o;
  two_o.logical_name = "benchtwo";
  two_o.copy_threads = 2;
  auto plain_producer = StreamProducer::Create(plain_o);
  auto two_producer = StreamProducer::Create(two_o);
  if (!plain_producer.ok() || !two_producer.ok()) return 1;
  if (only_growth) return RunGrowth(dir, o, source);
  Peer view_peer = SpawnConsumer("view", dir, "view");
  Peer copy_peer = SpawnConsumer("copy", dir, "copy");
  Peer file_peer = SpawnConsumer("file", dir, "file");

  std::printf(
      "| shape | stream, zero-copy view | stream + copy out | file transport | "
      "file / stream | file / (stream + copy) | memcpy | put alone | stream vs memcpy | "
      "stream + copy vs 2 memcpy |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  uint64_t seq = 0;
  char ack;
  double channel_us = 0;
  auto stream_round = [&](const Shape& shape, Peer& peer, StreamProducer* with = nullptr) -> bool {
    StreamProducer* put_to = with != nullptr ? with : &*producer;
    std::vector<std::string> batch;
    for (int t = 0; t < shape.count; ++t) {
      std::string key = "k";  // appended: g++ 12 -O3 false -Wrestrict (GCC PR 105651)
      key += std::to_string(seq++);
      auto d = put_to->Put(key, std::span(source.data(), shape.bytes), {"u8", {shape.bytes}});
      if (!d.ok()) {
        std::fprintf(stderr, "%s\n", d.status().ToString().c_str());
        return false;
      }
      batch.push_back(std::move(d).value());
    }
    SendBatch(peer.to, batch);
    return ReadAll(peer.from, &ack, 1);
  };
  {
    // The channel alone (an empty batch and its acknowledgement): both transports pay it.
    std::vector<double> t;
    for (int r = 0; r < 300; ++r) {
      auto t0 = Clock::now();
      SendBatch(view_peer.to, {});
      ReadAll(view_peer.from, &ack, 1);
      t.push_back(Seconds(t0, Clock::now()));
    }
    channel_us = Median(t) * 1e6;
  }
  std::vector<std::string> variant_rows;
  for (const Shape& shape : shapes) {
    std::vector<double> view_t, copy_t, file_t, memcpy_t, put_t, plain_t, two_t;
    std::vector<std::byte> dest(shape.bytes * shape.count);
    std::memset(dest.data(), 0, dest.size());
    for (int r = 0; r < shape.rounds + 3; ++r) {
      auto t0 = Clock::now();
      if (!stream_round(shape, view_peer)) return 1;
      auto t1 = Clock::now();
      if (!stream_round(shape, copy_peer)) return 1;
      auto t1b = Clock::now();
      if (!stream_round(shape, view_peer, &*plain_producer)) return 1;
      auto tp = Clock::now();
      if (!stream_round(shape, view_peer, &*two_producer)) return 1;
      auto t2 = Clock::now();
      if (r >= 3) {
        plain_t.push_back(Seconds(t1b, tp));
        two_t.push_back(Seconds(tp, t2));
      }
      std::vector<std::string> batch;
      for (int t = 0; t < shape.count; ++t) {
        std::string final_path =
            dir + "/ea-bench-file-" + std::to_string(getpid()) + "-" + std::to_string(seq++);
        std::string tmp = final_path + ".tmp";
        int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        WriteAll(fd, source.data(), shape.bytes);
        close(fd);
        rename(tmp.c_str(), final_path.c_str());
        batch.push_back(final_path);
      }
      SendBatch(file_peer.to, batch);
      ReadAll(file_peer.from, &ack, 1);
      auto t3 = Clock::now();
      // Raw memcpy of the shape's bytes, once (the put the stream round makes).
      for (int t = 0; t < shape.count; ++t) {
        std::memcpy(dest.data() + t * shape.bytes, source.data(), shape.bytes);
      }
      auto t4 = Clock::now();
      // The producer's puts alone (the library's copy into a segment and the publish), then an
      // Abort of their key that frees them (no channel, no consumer).
      {
        for (int t = 0; t < shape.count; ++t) {
          auto d = producer->Put("put-only", std::span(source.data(), shape.bytes),
                                 {"u8", {shape.bytes}});
          if (!d.ok()) return 1;
        }
        if (!producer->Abort("put-only").ok()) return 1;
      }
      auto t5 = Clock::now();
      if (r < 3) continue;  // warm-up
      put_t.push_back(Seconds(t4, t5));
      view_t.push_back(Seconds(t0, t1));
      copy_t.push_back(Seconds(t1, t1b));
      file_t.push_back(Seconds(t2, t3));
      memcpy_t.push_back(Seconds(t3, t4));
    }
    double v = Median(view_t), c = Median(copy_t), f = Median(file_t), m = Median(memcpy_t);
    double pu = Median(put_t);
    char row[256];
    std::snprintf(row, sizeof row, "| %s | %.0f us, %.1fx | %.0f us, %.1fx | %.0f us, %.1fx |",
                  shape.name, v * 1e6, f / v, Median(plain_t) * 1e6, f / Median(plain_t),
                  Median(two_t) * 1e6, f / Median(two_t));
    variant_rows.push_back(row);
    std::printf(
        "| %s | %.0f us | %.0f us | %.0f us | %.1fx | %.1fx | %.0f us | %.0f us | %.2fx | %.2fx "
        "|\n",
        shape.name, v * 1e6, c * 1e6, f * 1e6, f / v, f / c, m * 1e6, pu * 1e6, m / v, 2 * m / c);
  }

  std::printf(
      "\nThe zero-copy view round by how Put copies (same rounds; ratio = file transport / "
      "round):\n\n| shape | this run's options | ordinary stores (non_temporal_copy_from "
      "never) | copy_threads 2 |\n|---|---|---|---|\n");
  for (const auto& row : variant_rows) std::printf("%s\n", row.c_str());
  std::printf("\nchannel round trip (FIFO, empty batch, in every round above): median %.0f us\n",
              channel_us);

  // The transport work alone (the field's A/B measured its managers without a channel):
  // producer and consumer in this process, same operations, no FIFO.
  {
    ConsumerOptions co;
    co.directory = dir;
    co.spill_directory = dir;
    auto local = StreamConsumer::Create(co);
    if (!local.ok()) return 1;
    std::printf("\nIn one process (no channel):\n\n");
    std::printf(
        "| shape | stream put + view + release | file write + rename + read + unlink | "
        "file / stream |\n|---|---|---|---|\n");
    std::vector<std::byte> dest(64 << 20);
    std::memset(dest.data(), 0, dest.size());
    for (const Shape& shape : shapes) {
      std::vector<double> st, ft, put_only;
      for (int r = 0; r < shape.rounds + 3; ++r) {
        auto t0 = Clock::now();
        std::vector<std::string> batch;
        for (int t = 0; t < shape.count; ++t) {
          auto d = producer->Put("k" + std::to_string(seq++), std::span(source.data(), shape.bytes),
                                 {"u8", {shape.bytes}});
          if (!d.ok()) return 1;
          batch.push_back(std::move(d).value());
        }
        auto tp = Clock::now();
        for (const auto& d : batch) {
          auto v = local->Open(d);
          if (!v.ok()) return 1;
        }
        auto t1 = Clock::now();
        if (r >= 3) put_only.push_back(Seconds(t0, tp));
        batch.clear();
        for (int t = 0; t < shape.count; ++t) {
          std::string final_path =
              dir + "/ea-bench-file-" + std::to_string(getpid()) + "-" + std::to_string(seq++);
          std::string tmp = final_path + ".tmp";
          int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
          WriteAll(fd, source.data(), shape.bytes);
          close(fd);
          rename(tmp.c_str(), final_path.c_str());
          batch.push_back(final_path);
        }
        for (const auto& path : batch) {
          int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
          ReadAll(fd, dest.data(), shape.bytes);
          close(fd);
          unlink(path.c_str());
        }
        auto t2 = Clock::now();
        if (r < 3) continue;
        st.push_back(Seconds(t0, t1));
        ft.push_back(Seconds(t1, t2));
      }
      double a = Median(st), f = Median(ft);
      std::printf("| %s | %.0f us (puts %.0f us) | %.0f us | %.1fx |\n", shape.name, a * 1e6,
                  Median(put_only) * 1e6, f * 1e6, f / a);
    }
  }

  // Allocator latency with 10k live blocks (their own producer: 10k x up to 64 KiB).
  {
    o.segment_bytes = 256ull << 20;
    o.max_segments = 4;
    o.logical_name = "benchalloc";
    auto alloc_producer = StreamProducer::Create(o);
    if (!alloc_producer.ok()) return 1;
    auto* producer = &*alloc_producer;
    std::vector<expert_arena::Reservation> live;
    std::uniform_int_distribution<uint64_t> size(4096, 65536);
    for (int i = 0; i < 10000; ++i) {
      auto r = producer->Reserve("live" + std::to_string(i), size(rng));
      if (!r.ok()) return 1;
      live.push_back(std::move(r).value());
    }
    std::vector<double> t;
    const std::string key = "probe";
    for (int i = 0; i < 100000; ++i) {
      uint64_t n = size(rng);
      auto t0 = Clock::now();
      {
        auto r = producer->Reserve(key, n);
        if (!r.ok()) return 1;
      }
      t.push_back(Seconds(t0, Clock::now()));
    }
    auto stats = producer->Stats().value();
    std::printf("\nreserve + free with %llu live blocks: median %.3f us, p99 %.3f us\n",
                static_cast<unsigned long long>(stats.live_blocks), Median(t) * 1e6, [&] {
                  std::sort(t.begin(), t.end());
                  return t[t.size() * 99 / 100] * 1e6;
                }());
  }
  Stop(view_peer);
  Stop(copy_peer);
  Stop(file_peer);

  return growth ? RunGrowth(dir, o, source) : 0;
}
