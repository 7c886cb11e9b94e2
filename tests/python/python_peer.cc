// The C++ side of the Python package's multi-process tests (tests/python/*.py), one role per
// run, each a real process the tests start:
//
//   python_peer produce DIR       puts one tensor per dtype of kCases into a StreamProducer in
//                                 DIR; prints "<key> <dtype> <shape,..> <xxh3> <descriptor hex>"
//                                 per tensor, then "ready"; exits when stdin closes.
//   python_peer consume DIR       reads descriptor hex lines from stdin; for each prints
//                                 "<key> <dtype> <shape,..> <xxh3 of the bytes>" and releases.
//   python_peer slow-load SECONDS ARENA MODEL...
//                                 loads ARENA but sleeps SECONDS just before publishing (holding
//                                 the FILL lock), after printing "publishing" on stdout.
//
// Exit codes: 0 success, 1 a library error (printed), 2 bad usage.
#include <xxhash.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "arena/test_hooks.h"
#include "expert_arena/arena.h"
#include "expert_arena/stream.h"

namespace expert_arena {
namespace {

struct Case {
  const char* dtype;
  size_t item;
  std::vector<uint64_t> shape;
};

// Every dtype name the Python package maps, with odd shapes so a transposition shows.
const Case kCases[] = {
    {"f64", 8, {3, 5}},  {"f32", 4, {7, 3, 2}}, {"f16", 2, {9, 4}},      {"bf16", 2, {4, 11}},
    {"i64", 8, {6}},     {"i32", 4, {2, 2, 5}}, {"i16", 2, {13}},        {"i8", 1, {3, 17}},
    {"u64", 8, {5}},     {"u32", 4, {4, 6}},    {"u16", 2, {10}},        {"u8", 1, {257}},
    {"bool", 1, {12}},   {"c64", 8, {3, 3}},    {"f8_e4m3", 1, {8, 8}},  {"f8_e5m2", 1, {16}},
    {"f32", 4, {1024, 1024}},  // 4 MiB: the copy threads' path
};

std::string Hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string Unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) {
    // Appended, not "," + std::to_string(): g++ 12 -O3 false -Wrestrict (GCC PR 105651).
    if (i) s += ',';
    s += std::to_string(shape[i]);
  }
  return s.empty() ? "-" : s;
}

std::string Xxh(const void* data, size_t n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(data, n)));
  return buf;
}

int Produce(const std::string& dir) {
  StreamOptions options;
  options.directory = dir;
  options.logical_name = "cxxpeer";
  options.segment_bytes = 8u << 20;
  options.max_segments = 4;
  options.sweep_at_start = false;
  auto producer = StreamProducer::Create(options);
  if (!producer.ok()) {
    std::fprintf(stderr, "python_peer: %s\n", producer.status().ToString().c_str());
    return 1;
  }
  uint64_t state = 0x1234567;
  int index = 0;
  for (const Case& c : kCases) {
    uint64_t count = 1;
    for (uint64_t d : c.shape) count *= d;
    std::vector<uint8_t> bytes(count * c.item);
    for (uint8_t& b : bytes) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      b = static_cast<uint8_t>(state >> 56);
    }
    // bool holds 0 or 1 only; NaN patterns of floats are fine: the comparison is of bytes.
    if (std::string(c.dtype) == "bool") {
      for (uint8_t& b : bytes) b &= 1;
    }
    std::string key = std::string("cxx-") + c.dtype + "-" + std::to_string(index++);
    auto d = producer->Put(key, std::as_bytes(std::span(bytes)), {c.dtype, c.shape});
    if (!d.ok()) {
      std::fprintf(stderr, "python_peer: %s\n", d.status().ToString().c_str());
      return 1;
    }
    std::printf("%s %s %s %s %s\n", key.c_str(), c.dtype, ShapeText(c.shape).c_str(),
                Xxh(bytes.data(), bytes.size()).c_str(), Hex(*d).c_str());
  }
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  return 0;
}

int Consume(const std::string& dir) {
  ConsumerOptions options;
  options.directory = dir;
  auto consumer = StreamConsumer::Create(options);
  if (!consumer.ok()) {
    std::fprintf(stderr, "python_peer: %s\n", consumer.status().ToString().c_str());
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    auto t = consumer->Open(Unhex(line));
    if (!t.ok()) {
      std::printf("error %s\n", t.status().ToString().c_str());
      std::fflush(stdout);
      continue;
    }
    const TensorDescriptor& d = t->descriptor();
    std::printf("%s %s %s %s\n", d.key.c_str(), d.dtype.c_str(), ShapeText(d.shape).c_str(),
                Xxh(t->bytes().data(), t->bytes().size()).c_str());
    std::fflush(stdout);
    t->Release();
  }
  return 0;
}

int SlowLoad(double seconds, const std::string& arena_path, std::vector<std::string> models) {
  arena::test_hooks::SetBeforePublish([seconds] {
    std::printf("publishing\n");
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  });
  ArenaOptions options;
  options.shared_path = arena_path;
  options.progress = false;
  auto arena = Arena::Open({.files = std::move(models)}, options);
  if (!arena.ok()) {
    std::fprintf(stderr, "python_peer: %s\n", arena.status().ToString().c_str());
    return 1;
  }
  std::printf("published %s\n", ArenaRoleName(arena->role()));
  return 0;
}

}  // namespace
}  // namespace expert_arena

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 2 && args[0] == "produce") return expert_arena::Produce(args[1]);
  if (args.size() == 2 && args[0] == "consume") return expert_arena::Consume(args[1]);
  if (args.size() >= 4 && args[0] == "slow-load") {
    return expert_arena::SlowLoad(std::stod(args[1]), args[2],
                                  std::vector<std::string>(args.begin() + 3, args.end()));
  }
  std::fprintf(stderr,
               "usage: python_peer produce DIR | consume DIR | slow-load SECONDS ARENA MODEL...\n");
  return 2;
}
