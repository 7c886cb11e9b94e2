// The loader against its ceilings, in one run (docs/loader.md):
//   warm page cache: LoadTensors into an already-populated 2 MiB-page buffer vs
//     (a) a two-thread memcpy of the same bytes from a (pre-faulted) mapping of the model into
//         the same buffer, and
//     (b) `cp model /dev/shm/x` vs `expert-arena load` end to end into /dev/shm;
//   cold cache (drop_caches, as root): LoadTensors vs `dd if=model of=/dev/null bs=4M
//     iflag=direct`.
// Prints a markdown table. Run it through bench/load_bench.sh (which makes the model and holds
// the machine-wide benchmark lock).
//
//   load_bench --model PATH [--runs N] [--reader auto|io_uring|pread] [--chunk-mib N]
//              [--direct-chunk-mib N]
//              [--qd N] [--threads N] [--no-hot-copy] [--hot-block-kib N] [--skip-cold]
//              [--no-direct] (buffered reads only, as on a filesystem without O_DIRECT)
//              [--skip-cp]
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/fast_xxh3.h"
#include "common/units.h"
#include "expert_arena/arena.h"
#include "format/arena_format.h"
#include "load/loader.h"
#include "platform/file.h"
#include "platform/kernel_features.h"
#include "platform/mapping.h"
#include "platform/memory_copy.h"
#include "platform/system_info.h"
#include "source/model_source.h"

using namespace expert_arena;
using Clock = std::chrono::steady_clock;

namespace {

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "load_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

bool DropCaches() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  f << "3\n";
  f.flush();
  return static_cast<bool>(f);
}

double TimeCommand(const std::string& command) {
  auto start = Clock::now();
  int rc = std::system(command.c_str());
  double s = Since(start);
  if (rc != 0) {
    std::fprintf(stderr, "load_bench: '%s' failed (%d)\n", command.c_str(), rc);
    std::exit(1);
  }
  return s;
}

// Copies every tensor from the model mapping to its arena place, on `threads` threads taking
// 4 MiB pieces in order.
double MemcpyTensors(const format::ArenaTable& table, const std::byte* source, std::byte* arena,
                     unsigned threads) {
  struct Piece {
    uint64_t from, to, bytes;
  };
  std::vector<Piece> pieces;
  for (const auto& t : table.tensors) {
    for (uint64_t at = 0; at < t.bytes; at += 4 * kMiB) {
      pieces.push_back(
          {t.source_offset + at, t.arena_offset + at, std::min(4 * kMiB, t.bytes - at)});
    }
  }
  std::atomic<size_t> next{0};
  auto start = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < threads; ++w) {
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
        std::memcpy(arena + pieces[i].to, source + pieces[i].from, pieces[i].bytes);
      }
    });
  }
  for (auto& t : pool) t.join();
  return Since(start);
}

// The same pieces with pread (the kernel's copy from the page cache), no checksums.
double PreadTensors(const format::ArenaTable& table, const platform::UniqueFd& fd, std::byte* arena,
                    unsigned threads) {
  struct Piece {
    uint64_t from, to, bytes;
  };
  std::vector<Piece> pieces;
  for (const auto& t : table.tensors) {
    for (uint64_t at = 0; at < t.bytes; at += 4 * kMiB) {
      pieces.push_back(
          {t.source_offset + at, t.arena_offset + at, std::min(4 * kMiB, t.bytes - at)});
    }
  }
  std::atomic<size_t> next{0};
  auto start = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < threads; ++w) {
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
        Check(platform::ReadFull(fd, pieces[i].from, {arena + pieces[i].to, pieces[i].bytes}),
              "pread");
      }
    });
  }
  for (auto& t : pool) t.join();
  return Since(start);
}

// xxh3 of every tensor already in the buffer, on `threads` threads.
double HashTensors(const format::ArenaTable& table, const std::byte* arena, unsigned threads) {
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> sink{0};
  auto start = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < threads; ++w) {
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < table.tensors.size();) {
        const auto& t = table.tensors[i];
        sink += format::Checksum({arena + t.arena_offset, t.bytes});
      }
    });
  }
  for (auto& t : pool) t.join();
  return Since(start);
}

}  // namespace

// Arena::Open of the whole model into a new file at `arena` (removed after), timed.
double TimeArenaOpen(const std::string& model, const std::string& arena, const std::string& reader,
                     bool pages_alongside_load) {
  ArenaOptions options;
  options.shared_path = arena;
  auto parsed = ParseModelReader(reader);
  if (!parsed.ok()) {
    std::fprintf(stderr, "load_bench: %s\n", parsed.status().message().c_str());
    std::exit(2);
  }
  options.reader = *parsed;
  options.progress = false;
  options.pages_alongside_load = pages_alongside_load;
  auto start = Clock::now();
  double seconds = 0;
  {
    auto a = Arena::Open({.files = {model}, .select_all = true}, options);
    Check(a.ok() ? Status::Ok() : a.status(), "expert-arena load");
    seconds = Since(start);
  }
  (void)platform::UnlinkPath(arena);
  return seconds;
}

// The ceiling of a warm load into an arena file in `dir` (issue: "a minimal loader"):
// fallocate the file (rounded to the backing's page), map it 2 MiB-aligned, populate it
// writable, and copy the model's bytes from a populated read-only mapping of the (cached)
// model on two threads. No header, no checksums, no read-back: only what any loader must do.
// With `collapse` (a tmpfs of 4 KiB pages, a kernel with MADV_COLLAPSE) each thread first makes
// its half 2 MiB pages as the arena does there: one small page allocated per 2 MiB, then
// MADV_COLLAPSE while the pages are empty; the file is allocated whole after.
// With `checksum` the copy is the loader's own (platform::CopyNonTemporal in 16 KiB blocks,
// each block fed to an XXH3 state from the source while it is in L1): what any loader that
// checksums what it publishes pays at least.
// Returns seconds from open to the last byte copied; the file is removed after.
double MinimalLoad(const std::string& model, const std::string& dir, bool collapse,
                   bool checksum = false) {
  const std::string path = dir + "/ea-load-bench-minimal-" + std::to_string(getpid());
  auto start = Clock::now();
  double seconds = 0;
  {
    auto in = platform::OpenFile(model, {.no_follow = false});
    Check(in.ok() ? Status::Ok() : in.status(), "open model");
    auto st = platform::StatFd(*in);
    Check(st.ok() ? Status::Ok() : st.status(), "stat model");
    auto fs = platform::StatFilesystem(dir);
    Check(fs.ok() ? Status::Ok() : fs.status(), "statfs");
    const uint64_t page = std::max<uint64_t>(fs->block_bytes, kHugePageBytes);
    const uint64_t bytes = (st->size + page - 1) / page * page;
    platform::OpenOptions options;
    options.write = true;
    options.create = true;
    auto out = platform::OpenFile(path, options);
    Check(out.ok() ? Status::Ok() : out.status(), "create");
    // hugetlbfs: the file is sized and its pages come with the populate (as the arena does).
    // Collapsing: sized now, allocated whole once the 2 MiB pages exist.
    Check(fs->kind == platform::FsKind::kHugetlbfs || collapse
              ? platform::ExtendFile(*out, bytes)
              : platform::AllocateFile(*out, bytes),
          "allocate");
    auto src = platform::Mapping::MapFile(*in, st->size, false, kHugePageBytes);
    Check(src.ok() ? Status::Ok() : src.status(), "map model");
    auto dst = platform::Mapping::MapFile(*out, bytes, true, page);
    Check(dst.ok() ? Status::Ok() : dst.status(), "map arena");
    const uint64_t half = st->size / 2 / kHugePageBytes * kHugePageBytes;
    auto part = [&](uint64_t from, uint64_t to) {
      const uint64_t end = to == st->size ? bytes : to;
      if (collapse) {
        const uint64_t page = platform::BasePageSize();
        for (uint64_t at = from; at < end; at += kHugePageBytes) {
          Check(platform::AllocateRange(*out, at, page), "allocate a small page");
        }
        Check(platform::AdviseRange(dst->data() + from, end - from, platform::Advice::kCollapse,
                                    path),
              "collapse");
      }
      Check(platform::AdviseRange(dst->data() + from, end - from,
                                  platform::Advice::kPopulateWrite, path),
            "populate arena");
      Check(platform::AdviseRange(src->data() + from, to - from, platform::Advice::kPopulateRead,
                                  model),
            "populate model");
      if (!checksum) {
        std::memcpy(dst->data() + from, src->data() + from, to - from);
        return;
      }
      FastXxh3State* state = FastXxh3Create();
      FastXxh3Reset(state);
      constexpr uint64_t kBlock = 16 * kKiB;
      for (uint64_t at = from; at < to; at += kBlock) {
        const uint64_t n = std::min(kBlock, to - at);
        platform::CopyNonTemporal(dst->data() + at, src->data() + at, n);
        FastXxh3Update(state, src->data() + at, n);
      }
      volatile uint64_t digest = FastXxh3Digest(state);
      (void)digest;
      FastXxh3Free(state);
    };
    std::thread second(part, half, st->size);
    part(0, half);
    second.join();
    if (collapse) Check(platform::AllocateFile(*out, bytes), "allocate");
    seconds = Since(start);
  }
  (void)platform::UnlinkPath(path);
  return seconds;
}

int main(int argc, char** argv) {
  CLI::App app{"expert-arena loader benchmark"};
  std::string model, reader = "auto";
  int runs = 3;
  uint64_t chunk_mib = 0, direct_chunk_mib = 0;
  unsigned qd = 0, threads = 0;
  bool skip_cold = false, skip_cp = false, no_hot_copy = false, no_direct = false;
  uint64_t hot_block_kib = 0;
  app.add_option("--model", model)->required();
  app.add_option("--runs", runs);
  app.add_option("--reader", reader);
  app.add_option("--chunk-mib", chunk_mib);
  app.add_option("--direct-chunk-mib", direct_chunk_mib);
  app.add_option("--qd", qd);
  app.add_option("--threads", threads);
  app.add_flag("--no-hot-copy", no_hot_copy, "read cached pieces, hash them afterwards");
  app.add_flag("--no-direct", no_direct, "no O_DIRECT: buffered reads of uncached data");
  app.add_option("--hot-block-kib", hot_block_kib);
  app.add_flag("--skip-cold", skip_cold);
  app.add_flag("--skip-cp", skip_cp);
  std::vector<std::string> ceiling_dirs;
  bool ceiling_only = false;
  app.add_option("--ceiling-dir", ceiling_dirs,
                 "arena directory (a backing) for the minimal-loader ceiling; repeatable");
  app.add_flag("--ceiling-only", ceiling_only, "only the minimal-loader comparison");
  CLI11_PARSE(app, argc, argv);

  if (!ceiling_dirs.empty()) {
    // Warm: the model is read once first. Per backing, best of `runs` of each, alternating.
    (void)TimeCommand("cat " + model + " > /dev/null");
    std::printf(
        "| backing (arena directory) | minimal loader s (best of %d) | minimal loader + XXH3 s | "
        "Arena::Open s (best of %d) | minimal / ours | (minimal + XXH3) / ours |\n"
        "|---|---|---|---|---|---|\n",
        runs, runs);
    for (const std::string& dir : ceiling_dirs) {
      auto fs = platform::StatFilesystem(dir);
      std::string kind = fs.ok() ? platform::FsKindName(fs->kind) : "?";
      if (fs.ok() && fs->kind == platform::FsKind::kTmpfs) kind += " huge=" + fs->tmpfs_huge;
      // A tmpfs of 4 KiB pages: the arena makes 2 MiB pages there (MADV_COLLAPSE), so the
      // minimal loader that does the same is the ceiling; the one that does not is shown too.
      const bool small_pages = fs.ok() && fs->kind == platform::FsKind::kTmpfs &&
                               (fs->tmpfs_huge == "never" || fs->tmpfs_huge == "advise") &&
                               platform::Kernel().has(platform::KernelFeature::kCollapse);
      double minimal = 1e9, minimal_collapsed = 1e9, hashed = 1e9, ours = 1e9;
      for (int r = 0; r < runs; ++r) {
        minimal = std::min(minimal, MinimalLoad(model, dir, false));
        if (small_pages) {
          minimal_collapsed = std::min(minimal_collapsed, MinimalLoad(model, dir, true));
        }
        hashed = std::min(hashed, MinimalLoad(model, dir, small_pages, true));
        ours = std::min(ours, TimeArenaOpen(model, dir + "/ea-load-bench-arena-" +
                                                       std::to_string(getpid()),
                                            reader, true));
      }
      if (small_pages) {
        std::printf("| %s (%s), minimal loader collapsing to 2 MiB pages as the arena does | "
                    "%.3f | %.3f | %.3f | %.2fx | %.2fx |\n",
                    dir.c_str(), kind.c_str(), minimal_collapsed, hashed, ours,
                    minimal_collapsed / ours, hashed / ours);
        std::printf("| %s (%s), minimal loader on 4 KiB pages | %.3f | | %.3f | %.2fx | |\n",
                    dir.c_str(), kind.c_str(), minimal, ours, minimal / ours);
      } else {
        std::printf("| %s (%s) | %.3f | %.3f | %.3f | %.2fx | %.2fx |\n", dir.c_str(),
                    kind.c_str(), minimal, hashed, ours, minimal / ours, hashed / ours);
      }
    }
    if (ceiling_only) return 0;
  }

  auto plan = source::PlanModel({.files = {model}, .select_all = true});
  Check(plan.ok() ? Status::Ok() : plan.status(), "plan");
  format::ArenaTable& table = plan->table;
  uint64_t tensor_bytes = 0;
  for (const auto& t : table.tensors) tensor_bytes += t.bytes;
  const double gib = static_cast<double>(tensor_bytes) / kGiB;

  // The destination: anonymous memory on 2 MiB pages, populated before anything is timed.
  auto buffer = platform::Mapping::MapAnonymous(table.data_bytes, kHugePageBytes);
  Check(buffer.ok() ? Status::Ok() : buffer.status(), "buffer");
  (void)platform::AdviseRange(buffer->data(), buffer->size(), platform::Advice::kHugePage,
                              "buffer");
  Check(platform::AdviseRange(buffer->data(), buffer->size(), platform::Advice::kPopulateWrite,
                              "buffer"),
        "populate");
  (void)platform::AdviseRange(buffer->data(), buffer->size(), platform::Advice::kCollapse,
                              "buffer");
  auto huge = platform::HugeBytesInRange(buffer->data(), buffer->size());

  // Warm the page cache with the model and map it, faulted in, for the memcpy baseline.
  auto fd = platform::OpenFile(model, {.no_follow = false});
  Check(fd.ok() ? Status::Ok() : fd.status(), "open");
  auto st = platform::StatFd(*fd);
  auto source = platform::Mapping::MapFile(*fd, st->size, false, kHugePageBytes);
  Check(source.ok() ? Status::Ok() : source.status(), "map model");
  Check(platform::AdviseRange(source->data(), source->size(), platform::Advice::kPopulateRead,
                              "model"),
        "populate model");

  std::vector<double> memcpy_s, load_s, pread_s, hash_s;
  load::LoadResult last;
  for (int r = 0; r < runs; ++r) {
    memcpy_s.push_back(MemcpyTensors(table, source->data(), buffer->data(), 2));
    pread_s.push_back(PreadTensors(table, *fd, buffer->data(), 2));
    hash_s.push_back(HashTensors(table, buffer->data(), 2));
    load::LoadRequest request;
    request.data = buffer->bytes();
    request.reader = reader;
    request.chunk_bytes = chunk_mib * kMiB;
    request.direct_chunk_bytes = direct_chunk_mib * kMiB;
    request.queue_depth = qd;
    request.threads = threads;
    request.hot_copy = !no_hot_copy;
    request.direct_io = !no_direct;
    request.hot_block_bytes = hot_block_kib * kKiB;
    auto loaded = load::LoadTensors(request, table);
    Check(loaded.ok() ? Status::Ok() : loaded.status(), "load");
    load_s.push_back(loaded->seconds);
    last = *loaded;
  }
  source->Reset();

  std::printf(
      "model: %s, %zu tensors, %.2f GiB; buffer %.2f of %.2f GiB on 2 MiB pages; "
      "reader %s\n\n",
      model.c_str(), table.tensors.size(), gib,
      huge.ok() ? static_cast<double>(*huge) / kGiB : -1.0,
      static_cast<double>(buffer->size()) / kGiB, last.reader.c_str());
  std::printf("| case | seconds (median of %d) | GiB/s | load vs peer |\n|---|---|---|---|\n",
              runs);
  const double warm_load = Median(load_s), warm_memcpy = Median(memcpy_s);
  std::printf(
      "| warm: LoadTensors (%s, xxh3 included, %.0f%% copied from a mapping and hashed while "
      "hot) into populated 2 MiB buffer | %.3f | %.2f | |\n",
      last.reader.c_str(), 100.0 * last.hot_bytes / last.bytes_read, warm_load, gib / warm_load);
  std::printf(
      "| warm: 2-thread memcpy from pre-faulted mapping, same buffer | %.3f | %.2f | %.2fx |\n",
      warm_memcpy, gib / warm_memcpy, warm_memcpy / warm_load);
  std::printf(
      "| warm, parts: 2-thread pread of the same pieces (kernel copy, no checksum) | %.3f | "
      "%.2f | |\n",
      Median(pread_s), gib / Median(pread_s));
  std::printf(
      "| warm, parts: 2-thread xxh3 (library build) of the tensors in the buffer | %.3f | %.2f | "
      "|\n",
      Median(hash_s), gib / Median(hash_s));

  if (!skip_cp) {
    buffer->Reset();  // keep the footprint at model + one copy
    std::string shm = "/dev/shm/ea-load-bench-cp-" + std::to_string(getpid());
    std::string arena = "/dev/shm/ea-load-bench-arena-" + std::to_string(getpid());
    std::vector<double> cp_s, e2e_s, before_s;
    std::string e2e_runs, before_runs;
    // Every round starts with cp; the two arena orders take turns right after it. On a VM,
    // memory the host has taken back (free page reporting) is slow to touch again: the first
    // arena after cp (whose freed 4 KiB pages make no 2 MiB block) gets most of it, the
    // second reuses the 2 MiB blocks the first one just freed. Each run is listed with which
    // it was.
    auto time_arena = [&](bool alongside, bool first) {
      const double t = TimeArenaOpen(model, arena, reader, alongside);
      (alongside ? e2e_s : before_s).push_back(t);
      char buf[48];
      std::snprintf(buf, sizeof buf, "%s%.2f%s",
                    (alongside ? e2e_runs : before_runs).empty() ? "" : ", ", t,
                    first ? " (first)" : "");
      (alongside ? e2e_runs : before_runs) += buf;
    };
    for (int r = 0; r < runs; ++r) {
      cp_s.push_back(TimeCommand("cp " + model + " " + shm));
      (void)platform::UnlinkPath(shm);
      time_arena(r % 2 == 0, true);
      time_arena(r % 2 != 0, false);
    }
    const double cp = Median(cp_s), e2e = Median(e2e_s), before = Median(before_s);
    std::printf(
        "| warm: Arena::Open end to end into /dev/shm (allocate, 2 MiB pages alongside the "
        "read, publish); runs: %s | %.3f | %.2f | |\n",
        e2e_runs.c_str(), e2e, gib / e2e);
    std::printf(
        "| warm: the same, all 2 MiB pages before the read (pages_alongside_load = false); "
        "runs: %s | %.3f | %.2f | %.2fx |\n",
        before_runs.c_str(), before, gib / before, before / e2e);
    std::printf("| warm: cp model /dev/shm/x | %.3f | %.2f | %.2fx |\n", cp, gib / cp, cp / e2e);
  }

  if (!skip_cold) {
    if (!buffer->data()) {
      buffer = platform::Mapping::MapAnonymous(table.data_bytes, kHugePageBytes);
      Check(buffer.ok() ? Status::Ok() : buffer.status(), "buffer");
      (void)platform::AdviseRange(buffer->data(), buffer->size(), platform::Advice::kHugePage, "b");
      Check(platform::AdviseRange(buffer->data(), buffer->size(), platform::Advice::kPopulateWrite,
                                  "buffer"),
            "populate");
    }
    std::vector<double> dd_s, cold_s;
    for (int r = 0; r < runs; ++r) {
      if (!DropCaches()) {
        std::printf(
            "\n(cold runs skipped: /proc/sys/vm/drop_caches is not writable; run as root)\n");
        break;
      }
      dd_s.push_back(
          TimeCommand("dd if=" + model + " of=/dev/null bs=4M iflag=direct status=none"));
      DropCaches();
      load::LoadRequest request;
      request.data = buffer->bytes();
      request.reader = reader;
      request.chunk_bytes = chunk_mib * kMiB;
      request.direct_chunk_bytes = direct_chunk_mib * kMiB;
      request.queue_depth = qd;
      request.threads = threads;
      request.hot_copy = !no_hot_copy;
      request.direct_io = !no_direct;
      request.hot_block_bytes = hot_block_kib * kKiB;
      auto loaded = load::LoadTensors(request, table);
      Check(loaded.ok() ? Status::Ok() : loaded.status(), "cold load");
      cold_s.push_back(loaded->seconds);
      last = *loaded;
    }
    if (!cold_s.empty()) {
      // dd reads the whole file; the loader the tensors. Compare rates.
      const double dd = Median(dd_s), cold = Median(cold_s);
      const double file_gib = static_cast<double>(st->size) / kGiB;
      std::printf(
          "| cold: LoadTensors (%s, %.0f%% O_DIRECT, %.0f%% through bounce buffers) | "
          "%.3f | %.2f | %.2fx |\n",
          last.reader.c_str(), 100.0 * last.direct_bytes / last.bytes_read,
          100.0 * last.bounce_bytes / last.bytes_read, cold, gib / cold,
          (gib / cold) / (file_gib / dd));
      std::printf("| cold: dd bs=4M iflag=direct | %.3f | %.2f | |\n", dd, file_gib / dd);
    }
    if (!cold_s.empty() && !skip_cp) {
      // End to end from a cold page cache: the reads wait on the disk, so the 2 MiB pages
      // made alongside them cost (nearly) nothing, where made first they add their time.
      buffer->Reset();
      std::string arena = "/dev/shm/ea-load-bench-arena-" + std::to_string(getpid());
      std::vector<double> alongside_s, before_s;
      for (int r = 0; r < runs; ++r) {
        for (int k = 0; k < 2; ++k) {
          if (!DropCaches()) break;
          const bool alongside = (r + k) % 2 == 0;
          (alongside ? alongside_s : before_s)
              .push_back(TimeArenaOpen(model, arena, reader, alongside));
        }
      }
      const double alongside = Median(alongside_s), before = Median(before_s);
      std::printf(
          "| cold: Arena::Open end to end into /dev/shm, 2 MiB pages alongside the read | "
          "%.3f | %.2f | |\n",
          alongside, gib / alongside);
      std::printf("| cold: the same, all 2 MiB pages before the read | %.3f | %.2f | %.2fx |\n",
                  before, gib / before, before / alongside);
    }
  }
  return 0;
}
