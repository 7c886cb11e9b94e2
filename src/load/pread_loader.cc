#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "format/arena_format.h"
#include "load/loader.h"
#include "platform/file.h"

namespace expert_arena::load {
namespace {

constexpr uint64_t kChunkBytes = 8ull << 20;

unsigned WorkerCount() { return std::clamp(std::thread::hardware_concurrency(), 2u, 16u); }

struct Chunk {
  uint32_t source;
  uint64_t source_offset;
  uint64_t arena_offset;
  uint64_t bytes;
};

// Runs fn(i) for i in [0, n) on the worker threads.
template <typename Fn>
void ParallelFor(size_t n, Fn fn) {
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  unsigned workers = std::min<size_t>(WorkerCount(), std::max<size_t>(n, 1));
  for (unsigned w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace

void ComputeChecksums(std::span<const std::byte> data, format::ArenaTable& table) {
  ParallelFor(table.tensors.size(), [&](size_t i) {
    auto& t = table.tensors[i];
    t.checksum = format::Checksum(data.subspan(t.arena_offset, t.bytes));
  });
}

int64_t FirstBadChecksum(std::span<const std::byte> data, const format::ArenaTable& table) {
  std::atomic<int64_t> first{-1};
  std::mutex mu;
  ParallelFor(table.tensors.size(), [&](size_t i) {
    const auto& t = table.tensors[i];
    if (format::Checksum(data.subspan(t.arena_offset, t.bytes)) != t.checksum) {
      std::lock_guard lock(mu);
      int64_t cur = first.load();
      if (cur < 0 || static_cast<int64_t>(i) < cur) first = static_cast<int64_t>(i);
    }
  });
  return first.load();
}

Result<LoadResult> LoadTensors(const LoadRequest& request, format::ArenaTable& table) {
  auto start = std::chrono::steady_clock::now();
  std::vector<platform::UniqueFd> fds;
  for (const auto& source : table.sources) {
    EA_ASSIGN_OR_RETURN(auto fd, platform::OpenFile(source.path, {.no_follow = false}));
    EA_ASSIGN_OR_RETURN(auto st, platform::StatFd(fd));
    if (st.size != source.size) {
      return Corrupt(source.path + ": changed size since it was planned (" +
                     std::to_string(source.size) + " -> " + std::to_string(st.size) + " bytes)");
    }
    fds.push_back(std::move(fd));
  }
  std::vector<Chunk> chunks;
  for (const auto& t : table.tensors) {
    if (t.arena_offset > request.data.size() || t.bytes > request.data.size() - t.arena_offset) {
      return Internal("tensor " + t.name + " does not fit the data region");
    }
    for (uint64_t done = 0; done < t.bytes; done += kChunkBytes) {
      chunks.push_back({t.source_index, t.source_offset + done, t.arena_offset + done,
                        std::min(kChunkBytes, t.bytes - done)});
    }
  }
  std::mutex mu;
  Status first_error;
  std::atomic<uint64_t> bytes{0};
  ParallelFor(chunks.size(), [&](size_t i) {
    const Chunk& c = chunks[i];
    Status s = platform::ReadFull(fds[c.source], c.source_offset,
                                  request.data.subspan(c.arena_offset, c.bytes));
    if (!s.ok()) {
      std::lock_guard lock(mu);
      if (first_error.ok()) first_error = s;
      return;
    }
    bytes += c.bytes;
  });
  if (!first_error.ok()) return first_error;
  ComputeChecksums(request.data, table);
  LoadResult result;
  result.bytes_read = bytes.load();
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.reader = "pread";
  return result;
}

}  // namespace expert_arena::load
