// xstream_bench: a cross-host stream round (StreamOptions::listen, docs/cross-host.md) at
// stream_bench's three shapes (32 x 64 KiB, 4 x 2 MiB, 1 x 64 MiB). Run by
// bench/xstream_bench.sh with the producer in one network namespace and the consumer in
// another (a veth pair, UCX_TLS=tcp), next to ucx_perftest on the same link.
//
// One round = the producer puts every tensor of the shape and writes the descriptors to a FIFO;
// the consumer opens them all (OpenMany: the bytes come over UCX into its memory, xxh3 checked),
// releases them (each release crosses the wire) and acknowledges on a second FIFO. The
// producer times the round from its first put to the acknowledgement. Reported per shape: the
// median round, and the payload's bytes over it in MiB/s (as ucx_perftest's MB/s column, 2^20);
// the medians of the round's parts: the puts (producer), the OpenMany (consumer: requests out,
// bytes in, xxh3 checked) and the releases (consumer), the consumer's two sent back with its
// acknowledgement.
//
// Usage: xstream_bench produce --listen ADDR:PORT --fifo DIR [--rounds N] [--dir D] [--only I]
//        xstream_bench consume --fifo DIR [--dir D]
// (DIR holds the two FIFOs, made by the script; the producer prints one JSON line per shape.)
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/stream.h"

namespace {

using Clock = std::chrono::steady_clock;
using expert_arena::ConsumerOptions;
using expert_arena::StreamConsumer;
using expert_arena::StreamOptions;
using expert_arena::StreamProducer;

struct Shape {
  const char* name;
  uint32_t count;
  uint64_t bytes;
};
constexpr Shape kShapes[] = {
    {"32 x 64 KiB", 32, 64 << 10}, {"4 x 2 MiB", 4, 2 << 20}, {"1 x 64 MiB", 1, 64 << 20}};

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool SendMessage(int fd, const std::string& m) {
  uint32_t n = static_cast<uint32_t>(m.size());
  return WriteAll(fd, &n, sizeof n) && WriteAll(fd, m.data(), m.size());
}

bool ReadMessage(int fd, std::string* m) {
  uint32_t n = 0;
  if (!ReadAll(fd, &n, sizeof n) || n > (1u << 20)) return false;
  m->resize(n);
  return ReadAll(fd, m->data(), n);
}

std::string Arg(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 2; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return fallback;
}

// The token both roles share: a remote open without one is refused (docs/cross-host.md).
constexpr const char* kBenchToken = "xstream-bench-token";

int Produce(int argc, char** argv) {
  const std::string fifo = Arg(argc, argv, "--fifo", "");
  const int rounds = std::stoi(Arg(argc, argv, "--rounds", "20"));
  StreamOptions o;
  o.directory = Arg(argc, argv, "--dir", "/dev/shm");
  o.logical_name = "xbench";
  o.segment_bytes = 256ull << 20;
  o.max_segments = 4;
  o.listen = Arg(argc, argv, "--listen", "");
  o.listen_token = kBenchToken;  // both sides share it, as a deployment must
  auto producer = StreamProducer::Create(o);
  if (!producer.ok()) {
    std::fprintf(stderr, "%s\n", producer.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "listening on %s\n", producer->remote_address().c_str());
  int out = open((fifo + "/descs").c_str(), O_WRONLY);
  int ack = open((fifo + "/acks").c_str(), O_RDONLY);
  if (out < 0 || ack < 0) return 1;
  std::vector<std::byte> payload(64 << 20);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = std::byte(i * 131 + (i >> 12));
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // --only N: that shape alone (0, 1, 2 as in kShapes), for a profile of one shape.
  const int only = std::stoi(Arg(argc, argv, "--only", "-1"));
  for (const Shape& shape : kShapes) {
    if (only >= 0 && &shape != &kShapes[only % 3]) continue;
    std::vector<double> times, puts, opens, releases;
    for (int r = 0; r < rounds + 2; ++r) {  // two warm-up rounds
      auto start = Clock::now();
      std::vector<std::string> descs;
      for (uint32_t t = 0; t < shape.count; ++t) {
        // Appended piece by piece: "r" + std::to_string(...) draws a bogus -Wrestrict from
        // g++ 12 at -O3 (GCC PR 105651).
        std::string key = "r";
        key += std::to_string(r);
        key += '-';
        key += std::to_string(t);
        auto d = producer->Put(key, std::span(payload).first(shape.bytes), {.dtype = "bf16"});
        if (!d.ok()) {
          std::fprintf(stderr, "%s\n", d.status().ToString().c_str());
          return 1;
        }
        descs.push_back(*d);
      }
      const double put = std::chrono::duration<double>(Clock::now() - start).count();
      if (!SendMessage(out, std::to_string(descs.size()))) return 1;
      for (const auto& d : descs)
        if (!SendMessage(out, d)) return 1;
      std::string reply;
      double open = 0, release = 0;
      if (!ReadMessage(ack, &reply) || std::sscanf(reply.c_str(), "ok %lf %lf", &open, &release) != 2) {
        std::fprintf(stderr, "consumer: %s\n", reply.c_str());
        return 1;
      }
      if (r >= 2) {
        times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
        puts.push_back(put);
        opens.push_back(open);
        releases.push_back(release);
      }
    }
    const double round = median(times);
    const double bytes = static_cast<double>(shape.count) * static_cast<double>(shape.bytes);
    std::printf(
        "{\"shape\": \"%s\", \"rounds\": %d, \"median_round_ms\": %.3f, \"mib_per_s\": %.1f, "
        "\"median_put_ms\": %.3f, \"median_open_ms\": %.3f, \"open_mib_per_s\": %.1f, "
        "\"median_release_ms\": %.3f}\n",
        shape.name, rounds, round * 1e3, bytes / round / 1048576.0, median(puts) * 1e3,
        median(opens) * 1e3, bytes / median(opens) / 1048576.0, median(releases) * 1e3);
    std::fflush(stdout);
  }
  SendMessage(out, "0");
  return 0;
}

int Consume(int argc, char** argv) {
  const std::string fifo = Arg(argc, argv, "--fifo", "");
  ConsumerOptions o;
  o.directory = Arg(argc, argv, "--dir", "/dev/shm");
  o.remote_token = kBenchToken;
  auto consumer = StreamConsumer::Create(o);
  if (!consumer.ok()) return 1;
  int in = open((fifo + "/descs").c_str(), O_RDONLY);
  int ack = open((fifo + "/acks").c_str(), O_WRONLY);
  if (in < 0 || ack < 0) return 1;
  for (;;) {
    std::string count;
    if (!ReadMessage(in, &count)) return 1;
    const int n = std::stoi(count);
    if (n == 0) return 0;
    std::vector<std::string> descs(n);
    for (auto& d : descs)
      if (!ReadMessage(in, &d)) return 1;
    std::vector<std::string_view> views(descs.begin(), descs.end());
    const auto start = Clock::now();
    auto opened = consumer->OpenMany(views);
    const auto fetched = Clock::now();
    if (!opened.ok()) {
      SendMessage(ack, opened.status().ToString());
      return 1;
    }
    for (auto& t : *opened) {
      if (!t.remote()) {
        SendMessage(ack, "a local open: the consumer sees the producer's segments");
        return 1;
      }
      t.Release();
    }
    const double open = std::chrono::duration<double>(fetched - start).count();
    const double release = std::chrono::duration<double>(Clock::now() - fetched).count();
    if (!SendMessage(ack, "ok " + std::to_string(open) + " " + std::to_string(release))) return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "produce") == 0) return Produce(argc, argv);
  if (argc >= 2 && std::strcmp(argv[1], "consume") == 0) return Consume(argc, argv);
  std::fprintf(stderr, "usage: xstream_bench produce|consume ... (see bench/xstream_bench.sh)\n");
  return 2;
}
