#include "load/loader.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "common/ready_front.h"
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
#include "platform/page_cache_stat.h"

namespace expert_arena::load {
namespace {

constexpr uint64_t kDefaultChunkBytes = 4 * kMiB;
constexpr uint64_t kDefaultDirectChunkBytes = 16 * kMiB;
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

constexpr uint64_t kDefaultHotBlockBytes = 128 * kKiB;
// Page-cache residency is asked per granule of this size when cachestat works.
constexpr uint64_t kResidencyGranule = 2 * kMiB;

// Fills access.resident (and page_bytes) for the file: one entry per 2 MiB granule, set when
// at least half of it is cached, by cachestat; else one per page by mincore; empty if neither
// works.
void FillResidency(const platform::UniqueFd& fd, uint64_t size, SourceAccess& access) {
  std::vector<uint8_t> granules((size + kResidencyGranule - 1) / kResidencyGranule, 0);
  bool stat_works = true;
  for (uint64_t g = 0; g < granules.size() && stat_works; ++g) {
    const uint64_t offset = g * kResidencyGranule;
    const uint64_t bytes = std::min(kResidencyGranule, size - offset);
    auto pages = platform::CachedPages(fd, offset, bytes);
    if (!pages.ok()) {
      stat_works = false;
      break;
    }
    granules[g] = *pages * access.page_bytes * 2 >= bytes ? 1 : 0;
  }
  if (stat_works) {
    access.resident = std::move(granules);
    access.page_bytes = kResidencyGranule;
    return;
  }
  auto resident = platform::PageCacheResidency(fd, size);
  if (resident.ok()) access.resident = std::move(*resident);
}

struct OpenSources {
  std::vector<platform::UniqueFd> buffered;
  std::vector<platform::UniqueFd> direct;  // invalid where O_DIRECT is not possible
  std::vector<SourceAccess> access;
  std::vector<platform::Mapping> mapped;  // read-only, for hot copies; empty where none
};

Result<OpenSources> OpenAndCheck(const format::ArenaTable& table, std::span<std::byte> data,
                                 bool direct_io, bool hot_copy) {
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
    platform::Mapping mapped;
    if (hot_copy && st.size > 0) {
      // 2 MiB-aligned, so that large page-cache folios can be mapped whole. No mapping, no
      // hot copies of this source: its cached pieces are read.
      auto mapping = platform::Mapping::MapFile(fd, st.size, false, kHugePageBytes);
      if (mapping.ok()) mapped = std::move(*mapping);
    }
    if (direct.valid() || mapped.data() != nullptr) FillResidency(fd, st.size, access);
    out.buffered.push_back(std::move(fd));
    out.mapped.push_back(std::move(mapped));
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
  EA_ASSIGN_OR_RETURN(OpenSources sources,
                      OpenAndCheck(table, request.data, request.direct_io, request.hot_copy));
  const uint64_t direct_chunk_bytes = std::clamp<uint64_t>(
      request.direct_chunk_bytes ? request.direct_chunk_bytes : kDefaultDirectChunkBytes,
      chunk_bytes, 256 * kMiB);
  const ReadPlan plan =
      PlanReads(table, sources.access, reinterpret_cast<uintptr_t>(request.data.data()),
                chunk_bytes, direct_chunk_bytes);
  if (request.after_plan_for_testing) request.after_plan_for_testing();

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
        result.note = ring.status().message();
        if (request.logger != nullptr) {
          request.logger->info("expert-arena: {}; reading with a pread thread pool", result.note);
        }
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
  job.ready_front = request.ready_front;
  job.ready_base = request.ready_base;
  job.hot_block_bytes = std::clamp<uint64_t>(
      request.hot_block_bytes ? request.hot_block_bytes : kDefaultHotBlockBytes, 4 * kKiB,
      chunk_bytes);
  uint32_t widest_alignment = 0;
  for (size_t s = 0; s < table.sources.size(); ++s) {
    job.mapped.push_back(sources.mapped[s].data());
    job.buffered.push_back(&sources.buffered[s]);
    job.direct.push_back(sources.direct[s].valid() ? &sources.direct[s] : nullptr);
    job.direct_alignment.push_back(sources.access[s].direct.offset);
    widest_alignment = std::max(widest_alignment, sources.access[s].direct.offset);
  }
  if (plan.bounce_bytes > 0) {
    job.bounce_buffer_bytes = plan.largest_piece + 2ull * widest_alignment;
  }
  job.Prepare();
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    if (job.Hot(i)) result.hot_bytes += plan.pieces[i].bytes;
  }
  Status read;
  {
    ProgressLine progress(request.progress, plan.total_bytes, &job.bytes_done,
                          request.logger_is_engines ? request.logger : nullptr);
    if (!rings.empty()) {
      result.reader = "io_uring";
      read = RunUringReaders(job, rings, queue_depth);
    } else {
      result.reader = "pread";
      read = RunPreadReaders(job, threads);
    }
  }
  result.ready_wait_seconds = static_cast<double>(job.ready_wait_nanos.load()) / 1e9;
  if (!read.ok()) return read;
  EA_ASSIGN_OR_RETURN(std::vector<uint64_t> checksums, hasher.Finish(table));
  for (size_t t = 0; t < table.tensors.size(); ++t) table.tensors[t].checksum = checksums[t];

  sources.mapped.clear();  // unmapped inside the timing
  result.bytes_read = plan.total_bytes;
  // Batches of tiny tensors planned direct were read buffered (ReadJob::ReadBatch).
  result.direct_bytes = plan.direct_bytes - job.batched_direct_bytes.load();
  result.bounce_bytes = plan.bounce_bytes - job.batched_bounce_bytes.load();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (request.logger != nullptr) {
    request.logger->debug(
        "expert-arena: read {} in {:.2f} s with {} ({} threads, {} with O_DIRECT of which {} "
        "through bounce buffers, {} direct reads redone buffered, {} copied from the page "
        "cache and hashed while hot)",
        FormatBytes(result.bytes_read), result.seconds, result.reader, threads,
        FormatBytes(result.direct_bytes), FormatBytes(result.bounce_bytes),
        job.direct_fallbacks.load(), FormatBytes(result.hot_bytes));
  }
  return result;
}

}  // namespace expert_arena::load
