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
// Raw memcpy: the arena round makes exactly two copies of the bytes (in, then out), so its
// ceiling is two memcpys of the same size; "vs memcpy" is that ceiling's time / the round's.
//
// Allocator: with 10k live blocks of 4-64 KiB held, the median of Reserve + drop (free) of one
// more block, timed pair by pair.
//
// Usage: flock /tmp/expert-arena-bench.lock build/bin/stream_bench [--dir /dev/shm] [--rounds N]
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "expert_arena/stream.h"

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

struct Shape {
  const char* name;
  int count;
  uint64_t bytes;
  int rounds;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 6 && std::string(argv[1]) == "--consumer") {
    return RunConsumer(argv[2], argv[3], argv[4], argv[5]);
  }
  std::string dir = "/dev/shm";
  int rounds_scale = 1;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--dir") dir = argv[i + 1];
    if (std::string(argv[i]) == "--rounds") rounds_scale = std::max(1, std::atoi(argv[i + 1]));
  }
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
  auto producer = StreamProducer::Create(o);
  if (!producer.ok()) {
    std::fprintf(stderr, "%s\n", producer.status().ToString().c_str());
    return 1;
  }
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
  auto stream_round = [&](const Shape& shape, Peer& peer) -> bool {
    std::vector<std::string> batch;
    for (int t = 0; t < shape.count; ++t) {
      std::string key = "k" + std::to_string(seq++);
      auto d = producer->Put(key, std::span(source.data(), shape.bytes), {"u8", {shape.bytes}});
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
  for (const Shape& shape : shapes) {
    std::vector<double> view_t, copy_t, file_t, memcpy_t, put_t;
    std::vector<std::byte> dest(shape.bytes * shape.count);
    std::memset(dest.data(), 0, dest.size());
    for (int r = 0; r < shape.rounds + 3; ++r) {
      auto t0 = Clock::now();
      if (!stream_round(shape, view_peer)) return 1;
      auto t1 = Clock::now();
      if (!stream_round(shape, copy_peer)) return 1;
      auto t2 = Clock::now();
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
      // The producer's copies into a segment alone: reserve every block of the round, memcpy
      // into each, then drop them all (no publish, no consumer).
      {
        std::vector<expert_arena::Reservation> held;
        for (int t = 0; t < shape.count; ++t) {
          auto res = producer->Reserve("put-only", shape.bytes);
          if (!res.ok()) return 1;
          std::memcpy(res->bytes().data(), source.data(), shape.bytes);
          held.push_back(std::move(res).value());
        }
      }
      auto t5 = Clock::now();
      if (r < 3) continue;  // warm-up
      put_t.push_back(Seconds(t4, t5));
      view_t.push_back(Seconds(t0, t1));
      copy_t.push_back(Seconds(t1, t2));
      file_t.push_back(Seconds(t2, t3));
      memcpy_t.push_back(Seconds(t3, t4));
    }
    double v = Median(view_t), c = Median(copy_t), f = Median(file_t), m = Median(memcpy_t);
    double pu = Median(put_t);
    std::printf(
        "| %s | %.0f us | %.0f us | %.0f us | %.1fx | %.1fx | %.0f us | %.0f us | %.2fx | %.2fx "
        "|\n",
        shape.name, v * 1e6, c * 1e6, f * 1e6, f / v, f / c, m * 1e6, pu * 1e6, m / v, 2 * m / c);
  }

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
    auto stats = producer->Stats();
    std::printf("\nreserve + free with %llu live blocks: median %.3f us, p99 %.3f us\n",
                static_cast<unsigned long long>(stats.live_blocks), Median(t) * 1e6, [&] {
                  std::sort(t.begin(), t.end());
                  return t[t.size() * 99 / 100] * 1e6;
                }());
  }
  Stop(view_peer);
  Stop(copy_peer);
  Stop(file_peer);
  return 0;
}
