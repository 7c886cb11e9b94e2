#include "load/loader.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "common/units.h"
#include "format/arena_format.h"
#include "load/progress.h"
#include "load/read_plan.h"
#include "load/readers.h"
#include "load/tensor_hasher.h"
#include "platform/file.h"
#include "platform/file_cache.h"
#include "platform/io_ring.h"
#include "platform/mapping.h"

namespace expert_arena::load {
namespace {

constexpr uint64_t kDefaultChunkBytes = 4 * kMiB;
constexpr unsigned kDefaultQueueDepth = 16;

unsigned DefaultThreads() { return std::clamp(std::thread::hardware_concurrency(), 2u, 8u); }

// Runs fn(i) for i in [0, n) on worker threads.
template <typename Fn>
void ParallelFor(size_t n, Fn fn) {
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  unsigned workers = std::min<size_t>(DefaultThreads(), std::max<size_t>(n, 1));
  for (unsigned w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
    });
  }
  for (auto& t : threads) t.join();
}

struct OpenSources {
  std::vector<platform::UniqueFd> buffered;
  std::vector<platform::UniqueFd> direct;  // invalid where O_DIRECT is not possible
  std::vector<SourceAccess> access;
};

Result<OpenSources> OpenAndCheck(const format::ArenaTable& table, std::span<std::byte> data,
                                 bool direct_io) {
  OpenSources out;
  for (const format::SourceRecord& source : table.sources) {
    // Followed: model caches link to their blobs.
    EA_ASSIGN_OR_RETURN(auto fd, platform::OpenFile(source.path, {.no_follow = false}));
    EA_ASSIGN_OR_RETURN(auto st, platform::StatFd(fd));
    if (st.size != source.size) {
      return Corrupt(source.path + ": changed size since it was planned (" +
                     std::to_string(source.size) + " -> " + std::to_string(st.size) + " bytes)");
    }
    SourceAccess access;
    access.page_bytes = platform::BasePageSize();
    platform::UniqueFd direct;
    if (direct_io) {
      // tmpfs and some FUSE filesystems refuse O_DIRECT at open (EINVAL): buffered it is.
      auto opened = platform::OpenFile(source.path, {.no_follow = false, .direct = true});
      if (opened.ok()) {
        access.direct = platform::QueryDirectIoAlignment(*opened);
        if (access.direct.memory != 0) direct = std::move(*opened);
      }
    }
    if (direct.valid()) {
      auto resident = platform::PageCacheResidency(fd, st.size);
      if (resident.ok()) access.resident = std::move(*resident);
    }
    out.buffered.push_back(std::move(fd));
    out.direct.push_back(std::move(direct));
    out.access.push_back(std::move(access));
  }
  for (const format::TensorRecord& t : table.tensors) {
    if (t.source_index >= table.sources.size()) {
      return Internal("tensor " + t.name + " names source " + std::to_string(t.source_index) +
                      " of " + std::to_string(table.sources.size()));
    }
    const format::SourceRecord& source = table.sources[t.source_index];
    if (t.source_offset > source.size || t.bytes > source.size - t.source_offset) {
      return Corrupt(source.path + ": tensor " + t.name + " (" + std::to_string(t.bytes) +
                     " bytes at " + std::to_string(t.source_offset) + ") is not inside the file");
    }
    if (t.arena_offset > data.size() || t.bytes > data.size() - t.arena_offset) {
      return Internal("tensor " + t.name + " does not fit the data region");
    }
  }
  return out;
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
  const auto start = std::chrono::steady_clock::now();
  if (request.reader != "auto" && request.reader != "io_uring" && request.reader != "pread") {
    return InvalidArgument("reader must be auto, io_uring or pread, not " + request.reader);
  }
  const uint64_t chunk_bytes = std::clamp<uint64_t>(
      request.chunk_bytes ? request.chunk_bytes : kDefaultChunkBytes, 64 * kKiB, 256 * kMiB);
  const unsigned queue_depth =
      std::clamp(request.queue_depth ? request.queue_depth : kDefaultQueueDepth, 1u, 256u);
  const unsigned threads =
      std::clamp(request.threads ? request.threads : DefaultThreads(), 1u, 64u);
  EA_ASSIGN_OR_RETURN(OpenSources sources, OpenAndCheck(table, request.data, request.direct_io));
  const ReadPlan plan = PlanReads(table, sources.access,
                                  reinterpret_cast<uintptr_t>(request.data.data()), chunk_bytes);

  LoadResult result;
  // Rings are made before any read, so a refusal falls back to pread with nothing half done.
  std::vector<platform::IoRing> rings;
  if (request.reader != "pread") {
    for (unsigned i = 0; i < threads; ++i) {
      auto ring = platform::IoRing::Create(queue_depth);
      if (!ring.ok()) {
        if (request.reader == "io_uring") {
          return Unsupported("reader io_uring: " + ring.status().message());
        }
        result.note = ring.status().message() + "; reading with a pread thread pool";
        if (request.logger != nullptr) request.logger->info("expert-arena: {}", result.note);
        rings.clear();
        break;
      }
      rings.push_back(std::move(*ring));
    }
  }

  TensorHasher hasher(plan, request.data);
  ReadJob job;
  job.plan = &plan;
  job.data = request.data;
  job.hasher = &hasher;
  uint32_t widest_alignment = 0;
  for (size_t s = 0; s < table.sources.size(); ++s) {
    job.buffered.push_back(&sources.buffered[s]);
    job.direct.push_back(sources.direct[s].valid() ? &sources.direct[s] : nullptr);
    job.direct_alignment.push_back(sources.access[s].direct.offset);
    widest_alignment = std::max(widest_alignment, sources.access[s].direct.offset);
  }
  if (plan.bounce_bytes > 0) job.bounce_buffer_bytes = chunk_bytes + 2ull * widest_alignment;
  Status read;
  {
    ProgressLine progress(request.progress, plan.total_bytes, &job.bytes_done);
    if (!rings.empty()) {
      result.reader = "io_uring";
      read = RunUringReaders(job, rings, queue_depth);
    } else {
      result.reader = "pread";
      read = RunPreadReaders(job, threads);
    }
  }
  if (!read.ok()) return read;
  EA_ASSIGN_OR_RETURN(std::vector<uint64_t> checksums, hasher.Finish(table));
  for (size_t t = 0; t < table.tensors.size(); ++t) table.tensors[t].checksum = checksums[t];

  result.bytes_read = plan.total_bytes;
  result.direct_bytes = plan.direct_bytes;
  result.bounce_bytes = plan.bounce_bytes;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (request.logger != nullptr) {
    request.logger->debug(
        "expert-arena: read {} in {:.2f} s with {} ({} threads, {} with O_DIRECT of which {} "
        "through bounce buffers, {} direct reads redone buffered)",
        FormatBytes(result.bytes_read), result.seconds, result.reader, threads,
        FormatBytes(result.direct_bytes), FormatBytes(plan.bounce_bytes),
        job.direct_fallbacks.load());
  }
  return result;
}

}  // namespace expert_arena::load
