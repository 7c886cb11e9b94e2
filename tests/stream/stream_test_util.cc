#include "stream_test_util.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "expert_arena/stream.h"
#include "platform/file.h"
#include "stream/segment_format.h"
#include "test_util.h"

namespace expert_arena::testing {

StreamDirs::StreamDirs() {
  std::string a = ArenaTestDir() + "/ea-test-stream-XXXXXX";
  std::string b = "/tmp/ea-test-spill-XXXXXX";
  shm_ = mkdtemp(a.data()) ? a : "";
  spill_ = mkdtemp(b.data()) ? b : "";
}

StreamDirs::~StreamDirs() {
  std::error_code ec;
  std::filesystem::remove_all(shm_, ec);
  std::filesystem::remove_all(spill_, ec);
}

std::vector<std::string> StreamDirs::remaining() const {
  std::vector<std::string> out;
  for (const auto& d : {shm_, spill_}) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(d, ec)) {
      out.push_back(e.path().string());
    }
  }
  return out;
}

StreamOptions StreamDirs::Producer(const std::string& logical) const {
  StreamOptions o;
  o.directory = shm_;
  o.spill_directory = spill_;
  o.logical_name = logical;
  o.segment_bytes = 8ull << 20;
  o.max_segments = 4;
  o.huge = HugePages::kOff;
  return o;
}

ConsumerOptions StreamDirs::Consumer() const {
  ConsumerOptions o;
  o.directory = shm_;
  o.spill_directory = spill_;
  return o;
}

static uint64_t Mix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint64_t Seed(const std::string& key, uint64_t size) {
  uint64_t h = 1469598103934665603ull ^ size;
  for (char c : key) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

void FillPattern(std::span<std::byte> out, const std::string& key) {
  uint64_t x = Seed(key, out.size());
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    uint64_t v = Mix(x);
    std::memcpy(out.data() + i, &v, 8);
  }
  for (; i < out.size(); ++i) out[i] = static_cast<std::byte>(Mix(x));
}

bool CheckPattern(std::span<const std::byte> bytes, const std::string& key) {
  std::vector<std::byte> want(bytes.size());
  FillPattern(want, key);
  // An empty tensor has no data pointer (memcmp must not see null, even for 0 bytes).
  return bytes.empty() || std::memcmp(want.data(), bytes.data(), bytes.size()) == 0;
}

void WriteMessages(const std::string& path, const std::vector<std::string>& messages) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    for (const auto& m : messages) {
      uint32_t n = static_cast<uint32_t>(m.size());
      out.write(reinterpret_cast<const char*>(&n), 4);
      out.write(m.data(), n);
    }
  }
  std::rename(tmp.c_str(), path.c_str());
}

std::vector<std::string> ReadMessages(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::string> out;
  uint32_t n = 0;
  while (in.read(reinterpret_cast<char*>(&n), 4)) {
    std::string m(n, '\0');
    in.read(m.data(), n);
    out.push_back(std::move(m));
  }
  return out;
}

bool WaitForFile(const std::string& path, double seconds) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (access(path.c_str(), F_OK) != 0) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

void TouchFile(const std::string& path) { std::ofstream(path) << "x"; }

bool PrintableAscii(std::string_view text, bool allow_newlines) {
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\n' && allow_newlines) continue;
    if (byte < 0x20 || byte > 0x7e) return false;
  }
  return true;
}

void WriteLogicalName(const std::string& path, const std::string& name) {
  char field[sizeof(stream::SegmentHeader::logical_name)] = {};
  std::memcpy(field, name.data(), std::min(name.size(), sizeof field));
  auto fd = platform::OpenFile(path, {.write = true, .no_follow = true});
  ASSERT_OK(fd.status());
  // Through a shared mapping of the whole file: hugetlbfs has no write(2).
  struct stat st;
  ASSERT_EQ(fstat(fd->get(), &st), 0);
  void* base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED,
                    fd->get(), 0);
  ASSERT_NE(base, MAP_FAILED) << std::strerror(errno);
  std::memcpy(static_cast<char*>(base) + offsetof(stream::SegmentHeader, logical_name), field,
              sizeof field);
  munmap(base, static_cast<size_t>(st.st_size));
}

// args: shm spill logical ready-file — creates a producer, puts one tensor, then sleeps until
// killed (SIGKILL in the test).
EA_CHILD_ROLE(stream_produce_and_hang) {
  StreamOptions o;
  o.directory = args[0];
  o.spill_directory = args[1];
  o.logical_name = args[2];
  o.segment_bytes = 4ull << 20;
  o.huge = HugePages::kOff;
  auto producer = StreamProducer::Create(o);
  if (!producer.ok()) return 3;
  std::vector<std::byte> data(5000);
  auto d = producer->Put("x", data, {});
  if (!d.ok()) return 4;
  WriteMessages(args[3] + ".desc", {*d});
  TouchFile(args[3]);
  std::this_thread::sleep_for(std::chrono::seconds(120));
  return 0;
}

}  // namespace expert_arena::testing
