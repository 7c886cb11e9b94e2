// The loader: both readers fill the arena with the model's bytes at the offsets the formats
// define, with checksums equal to XXH3_64bits of each tensor; O_DIRECT for cold aligned data;
// the pread fallback when io_uring is refused (a seccomp filter in a child process).
#include "load/loader.h"

#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "common/ready_front.h"
#include "common/units.h"
#include "expert_arena/arena.h"
#include "generators/gguf_writer.h"
#include "generators/synthetic_model.h"
#include "load/progress.h"
#include "platform/file.h"
#include "platform/file_cache.h"
#include "platform/io_ring.h"
#include "platform/mapping.h"
#include "platform/page_cache_stat.h"
#include "format/dtypes.h"
#include "source/model_source.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena::load {
namespace {

using testing::ScopedDir;

bool IoUringWorks() { return platform::IoRing::Create(4).ok(); }

struct Loaded {
  platform::Mapping memory;
  format::ArenaTable table;
  LoadResult result;
};

// `request` without its data: the arena memory is made here.
Result<Loaded> LoadWith(const source::ModelPlan& plan, LoadRequest request) {
  Loaded out;
  out.table = plan.table;
  EA_ASSIGN_OR_RETURN(out.memory,
                      platform::Mapping::MapAnonymous(out.table.data_bytes, kHugePageBytes));
  request.data = out.memory.bytes();
  EA_ASSIGN_OR_RETURN(out.result, LoadTensors(request, out.table));
  return out;
}

Result<Loaded> LoadInto(const source::ModelPlan& plan, const std::string& reader,
                        uint64_t chunk_bytes) {
  LoadRequest request;
  request.reader = reader;
  request.chunk_bytes = chunk_bytes;
  return LoadWith(plan, request);
}

// Every tensor: the bytes equal the file's at the offset computed by the test's own parser, and
// the checksum is the one-shot XXH3 of those bytes.
void ExpectMatchesSources(const Loaded& loaded,
                          const std::map<std::string, testing::IndependentTensor>& independent,
                          const std::string& path_of_all = "") {
  for (const format::TensorRecord& t : loaded.table.tensors) {
    auto it = independent.find(t.name);
    ASSERT_NE(it, independent.end()) << t.name;
    ASSERT_EQ(it->second.bytes, t.bytes) << t.name;
    const std::string& path =
        path_of_all.empty() ? loaded.table.sources[t.source_index].path : path_of_all;
    auto want = testing::ReadRange(path, it->second.offset, t.bytes);
    const std::byte* got = loaded.memory.data() + t.arena_offset;
    ASSERT_EQ(std::memcmp(got, want.data(), t.bytes), 0) << t.name;
    EXPECT_EQ(t.checksum, XXH3_64bits(want.data(), want.size())) << t.name;
  }
}

class LoaderReadersTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LoaderReadersTest, GgufOfEveryDtypeFamily) {
  if (GetParam() == "io_uring" && !IoUringWorks()) GTEST_SKIP() << "io_uring is not allowed here";
  for (const char* dtype : {"f32", "f16", "bf16", "q8_0"}) {
    ScopedDir dir("load-gguf");
    source::SyntheticModelOptions o{.format = "gguf",
                                    .out = dir.File("m.gguf"),
                                    .layers = 2,
                                    .experts = 3,
                                    .hidden = 96,
                                    .ffn = 160,
                                    .dtype = dtype};
    ASSERT_OK(source::WriteSyntheticModel(o));
    ModelSpec spec{.files = {o.out}, .select_all = true};
    ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel(spec));
    // Small chunks: tensors span many pieces, so hashes stream across threads.
    ASSERT_OK_AND_ASSIGN(Loaded loaded, LoadInto(plan, GetParam(), 64 * kKiB));
    EXPECT_EQ(loaded.result.reader, GetParam());
    ExpectMatchesSources(loaded, testing::ParseGgufIndependently(o.out), o.out);
  }
}

TEST_P(LoaderReadersTest, ShardedSafetensors) {
  if (GetParam() == "io_uring" && !IoUringWorks()) GTEST_SKIP() << "io_uring is not allowed here";
  ScopedDir dir("load-st");
  source::SyntheticModelOptions o{.format = "safetensors",
                                  .out = dir.File("m"),
                                  .layers = 2,
                                  .experts = 4,
                                  .hidden = 64,
                                  .ffn = 200,
                                  .dtype = "bf16",
                                  .shards = 3};
  ASSERT_OK_AND_ASSIGN(auto report, source::WriteSyntheticModel(o));
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {o.out}}));
  ASSERT_OK_AND_ASSIGN(Loaded loaded, LoadInto(plan, GetParam(), 64 * kKiB));
  std::map<std::string, testing::IndependentTensor> independent;
  for (size_t s = 0; s < 3; ++s) {
    for (auto& [name, t] : testing::ParseSafetensorsIndependently(report.files[s])) {
      independent[name] = t;
    }
  }
  ExpectMatchesSources(loaded, independent);
}

INSTANTIATE_TEST_SUITE_P(Readers, LoaderReadersTest, ::testing::Values("io_uring", "pread"));

// A GGUF of i8 tensors of odd sizes (16 MiB in all): tiny ones, and ones that straddle many
// 64 KiB pieces.
std::string WriteOddSizedGguf(const ScopedDir& dir) {
  const std::string path = dir.File("odd.gguf");
  const std::vector<uint64_t> sizes = {1,       777,   64 * 1024 + 1, 300001,       3,
                                       1048573, 65535, 131073,        5 * kMiB + 3, 9 * kMiB + 1};
  source::GgufWriter w;
  for (size_t t = 0; t < sizes.size(); ++t) {
    EXPECT_OK(w.AddTensor("blk." + std::to_string(t) + ".ffn_up_exps.weight",
                          *source::FindGgmlTypeByName("i8"), {sizes[t]}));
  }
  EXPECT_OK(w.WriteFile(path, [](size_t t, uint64_t offset, std::span<std::byte> out) {
    for (size_t k = 0; k < out.size(); ++k) {
      out[k] = std::byte(((offset + k) * 2654435761u >> 13) + t);
    }
    return Status::Ok();
  }));
  return path;
}

// Cached pieces copied from the source's mapping and hashed block by block while hot give the
// same arena and the same checksums (XXH3_64bits of each tensor) as reading them and hashing
// afterwards, whatever the block size, the piece size and the number of threads (1: the
// worker takes every piece itself; 2-4: runs of pieces and steals from other runs).
TEST_P(LoaderReadersTest, HotCopyGivesTheSameArenaAsReads) {
  if (GetParam() == "io_uring" && !IoUringWorks()) GTEST_SKIP() << "io_uring is not allowed here";
  ScopedDir dir("load-hot");
  const std::string path = WriteOddSizedGguf(dir);
  (void)testing::ReadRange(path, 0, std::filesystem::file_size(path));  // in the page cache
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {path}}));
  const auto independent = testing::ParseGgufIndependently(path);
  LoadRequest plain;
  plain.reader = GetParam();
  plain.chunk_bytes = 64 * kKiB;
  plain.hot_copy = false;
  ASSERT_OK_AND_ASSIGN(Loaded reference, LoadWith(plan, plain));
  ExpectMatchesSources(reference, independent, path);
  EXPECT_EQ(reference.result.hot_bytes, 0u);
  for (unsigned threads : {1u, 2u, 3u, 4u}) {
    for (uint64_t block : {uint64_t{4096}, uint64_t{5000}, 32 * kKiB, 64 * kKiB}) {
      LoadRequest hot = plain;
      hot.hot_copy = true;
      hot.hot_block_bytes = block;
      hot.threads = threads;
      ASSERT_OK_AND_ASSIGN(Loaded loaded, LoadWith(plan, hot));
      SCOPED_TRACE(std::to_string(threads) + " threads, block " + std::to_string(block));
      EXPECT_EQ(loaded.result.hot_bytes, loaded.result.bytes_read);
      ASSERT_EQ(loaded.memory.size(), reference.memory.size());
      EXPECT_EQ(std::memcmp(loaded.memory.data(), reference.memory.data(), loaded.memory.size()),
                0);
      for (size_t t = 0; t < loaded.table.tensors.size(); ++t) {
        EXPECT_EQ(loaded.table.tensors[t].checksum, reference.table.tensors[t].checksum) << t;
      }
    }
  }
}

// A DeepSeek-V3-shaped checkpoint of tiny tensors (FP8 weights of 256 bytes, 4-byte scales):
// runs of tiny tensors adjacent in a shard are handled in batches, never across shards: cached
// ones copied from the mapping (one madvise a batch), others read with one pread of the range
// they span (hot_copy off); each tensor copied into place across the arena's padding between
// them and hashed on its own. Every byte and checksum is the file's, whatever the threads and
// the block size that bounds a batch.
TEST_P(LoaderReadersTest, TinyTensorsAreCopiedInBatches) {
  if (GetParam() == "io_uring" && !IoUringWorks()) GTEST_SKIP() << "io_uring is not allowed here";
  ScopedDir dir("load-batch");
  source::SyntheticModelOptions o{.format = "safetensors",
                                  .layout = "deepseek-v3",
                                  .out = dir.File("m"),
                                  .layers = 5,
                                  .experts = 24,
                                  .hidden = 16,
                                  .ffn = 16,
                                  .shards = 3};
  ASSERT_OK_AND_ASSIGN(auto report, source::WriteSyntheticModel(o));
  std::map<std::string, testing::IndependentTensor> independent;
  for (const std::string& shard : report.files) {
    if (shard.ends_with(".json")) continue;
    (void)testing::ReadRange(shard, 0, std::filesystem::file_size(shard));  // in the page cache
    for (auto& [name, t] : testing::ParseSafetensorsIndependently(shard)) independent[name] = t;
  }
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {o.out}}));
  ASSERT_GT(plan.table.tensors.size(), 200u);
  // Tiny tensors are padded in the arena (a 4-byte scale takes 64 bytes): the batches copy
  // tensor by tensor, not the file's range as one block.
  bool padded = false;
  for (size_t t = 1; t < plan.table.tensors.size(); ++t) {
    const auto& a = plan.table.tensors[t - 1];
    const auto& b = plan.table.tensors[t];
    padded |= a.source_index == b.source_index && b.source_offset == a.source_offset + a.bytes &&
              b.arena_offset > a.arena_offset + a.bytes;
  }
  ASSERT_TRUE(padded);
  std::optional<Loaded> reference;
  for (bool hot_copy : {false, true}) {
    for (unsigned threads : {1u, 2u, 3u}) {
      for (uint64_t block : {uint64_t{4096}, 128 * kKiB}) {
        LoadRequest request;
        request.reader = GetParam();
        request.hot_copy = hot_copy;
        request.hot_block_bytes = block;
        request.threads = threads;
        ASSERT_OK_AND_ASSIGN(Loaded loaded, LoadWith(plan, request));
        SCOPED_TRACE(std::string(hot_copy ? "hot" : "read") + ", " + std::to_string(threads) +
                     " threads, block " + std::to_string(block));
        EXPECT_EQ(loaded.result.hot_bytes, hot_copy ? loaded.result.bytes_read : 0);
        ExpectMatchesSources(loaded, independent);
        if (!reference) {
          reference = std::move(loaded);
          continue;
        }
        ASSERT_EQ(loaded.memory.size(), reference->memory.size());
        EXPECT_EQ(std::memcmp(loaded.memory.data(), reference->memory.data(), loaded.memory.size()),
                  0);
      }
    }
  }
}

// Half of the file in the page cache: hot copies, direct reads (straight and bounced) and
// buffered reads meet inside the same tensors; every byte and checksum is still right.
TEST_P(LoaderReadersTest, PartlyCachedFileMixesHotCopiesAndReads) {
  if (GetParam() == "io_uring" && !IoUringWorks()) GTEST_SKIP() << "io_uring is not allowed here";
  ScopedDir dir("load-mixed");
  const std::string path = WriteOddSizedGguf(dir);
  const uint64_t size = std::filesystem::file_size(path);
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {path}}));
  const auto independent = testing::ParseGgufIndependently(path);  // reads the whole file
  for (unsigned threads : {1u, 2u, 3u}) {
    {
      // Evicted, then every other 2 MiB (the residency granule) back in the cache, with no
      // readahead past them.
      ASSERT_OK_AND_ASSIGN(auto fd, platform::OpenFile(path, {}));
      ASSERT_OK(platform::EvictFromPageCache(fd));
      auto cached = platform::CachedPages(fd, 0, size);
      if (cached.ok() && *cached > 0) GTEST_SKIP() << "the page cache of /tmp cannot be evicted";
      ASSERT_EQ(::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_RANDOM), 0);
      std::vector<std::byte> buffer(2 * kMiB);
      for (uint64_t at = 0; at < size; at += 4 * kMiB) {
        const uint64_t bytes = std::min<uint64_t>(2 * kMiB, size - at);
        ASSERT_OK(platform::ReadFull(fd, at, {buffer.data(), bytes}));
      }
      if (cached.ok()) {
        // The first 2 MiB in the cache, read again where the kernel let a page of it go
        // (510 of 512 resident once, in CI).
        const uint64_t want = 2 * kMiB / platform::BasePageSize();
        uint64_t now = 0;
        for (int attempt = 0; attempt < 5; ++attempt) {
          ASSERT_OK_AND_ASSIGN(now, platform::CachedPages(fd, 0, 2 * kMiB));
          if (now == want) break;
          ASSERT_OK(platform::ReadFull(fd, 0, {buffer.data(), std::min<uint64_t>(2 * kMiB, size)}));
        }
        EXPECT_EQ(now, want);
      }
    }
    LoadRequest request;
    request.reader = GetParam();
    request.chunk_bytes = 64 * kKiB;
    request.threads = threads;
    ASSERT_OK_AND_ASSIGN(Loaded loaded, LoadWith(plan, request));
    EXPECT_GT(loaded.result.hot_bytes, 0u) << threads;
    EXPECT_LT(loaded.result.hot_bytes, loaded.result.bytes_read) << threads;
    ExpectMatchesSources(loaded, independent, path);
  }
}

// Memory that becomes writable only as a ReadyFront moves over it, like an arena whose pages
// are still being made: bytes past the front are PROT_NONE, so a loader that wrote there
// before the front covered them would die of SIGSEGV (hot copies, bounce copies) or see
// EFAULT (reads straight into it). The front's coordinates start at `base`, like an arena
// file's header bytes before its data region.
class GatedMemory {
 public:
  static constexpr uint64_t kBase = 3 * 4096 + 17;

  explicit GatedMemory(uint64_t bytes) : bytes_(bytes) {
    auto m = platform::Mapping::MapAnonymous(bytes, kHugePageBytes);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    memory_ = std::move(*m);
    EXPECT_EQ(::mprotect(memory_.data(), memory_.size(), PROT_NONE), 0);
  }
  ~GatedMemory() { Join(); }
  // Waits until the mover is done (the loader may finish before it reaches the data region's
  // padding at the end).
  void Join() {
    if (mover_.joinable()) mover_.join();
  }
  std::span<std::byte> data() { return {memory_.data(), bytes_}; }
  const ReadyFront& front() const { return front_; }

  // Opens the memory in steps of `step` (page-aligned) from another thread; with stop_at
  // below the size the front fails there with `error` instead. Each step waits until the
  // loader has caught up and blocked on the front (or is done), so every run, however slow
  // the loader (sanitizers), writes against a front that moves under it.
  void StartMoving(uint64_t step, uint64_t stop_at = ~uint64_t{0}, Status error = Status::Ok()) {
    mover_ = std::thread([this, step, stop_at, error] {
      for (uint64_t ready = step;; ready += step) {
        if (ready >= stop_at) {
          front_.Fail(error);
          return;
        }
        const uint64_t waits = front_.waits();
        const uint64_t open = std::min(ready, memory_.size());
        EXPECT_EQ(::mprotect(memory_.data(), open, PROT_READ | PROT_WRITE), 0);
        front_.Advance(kBase + std::min(ready, bytes_));
        if (ready >= bytes_) return;
        while (front_.waits() == waits && !loader_done_.load()) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
    });
  }
  // The loader returned: the mover stops waiting for it to block.
  void LoaderDone() { loader_done_.store(true); }

 private:
  uint64_t bytes_;
  platform::Mapping memory_;
  std::atomic<bool> loader_done_{false};
  ReadyFront front_;
  std::thread mover_;
};

// The loader writes a piece only once the front covers it, with every kind of piece (hot
// copies from the page cache, O_DIRECT reads straight in and through bounce buffers) and
// both readers; the result is the same arena.
TEST_P(LoaderReadersTest, WritesOnlyWhereTheFrontIsReady) {
  if (GetParam() == "io_uring" && !IoUringWorks()) GTEST_SKIP() << "io_uring is not allowed here";
  ScopedDir dir("load-front");
  const std::string path = WriteOddSizedGguf(dir);
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {path}}));
  const auto independent = testing::ParseGgufIndependently(path);
  for (const bool cached : {true, false}) {
    {
      ASSERT_OK_AND_ASSIGN(auto fd, platform::OpenFile(path, {}));
      if (cached) {
        (void)testing::ReadRange(path, 0, std::filesystem::file_size(path));
      } else {
        ASSERT_OK(platform::EvictFromPageCache(fd));
      }
    }
    Loaded loaded;
    loaded.table = plan.table;
    GatedMemory memory(loaded.table.data_bytes);
    LoadRequest request;
    request.reader = GetParam();
    request.chunk_bytes = 256 * kKiB;
    request.direct_chunk_bytes = 256 * kKiB;
    request.data = memory.data();
    request.ready_front = &memory.front();
    request.ready_base = GatedMemory::kBase;
    memory.StartMoving(75 * 4096);
    auto result = LoadTensors(request, loaded.table);
    memory.LoaderDone();
    ASSERT_TRUE(result.ok()) << result.status().ToString();
    loaded.result = *result;
    memory.Join();
    EXPECT_GT(loaded.result.ready_wait_seconds, 0.0) << "the loader caught up with the front";
    EXPECT_GT(memory.front().waits(), 10u);
    ASSERT_OK_AND_ASSIGN(loaded.memory,
                         platform::Mapping::MapAnonymous(loaded.table.data_bytes, kHugePageBytes));
    std::memcpy(loaded.memory.data(), memory.data().data(), loaded.table.data_bytes);
    ExpectMatchesSources(loaded, independent, path);
    if (cached) {
      EXPECT_GT(loaded.result.hot_bytes, 0u);
    } else {
      EXPECT_GT(loaded.result.direct_bytes, 0u);
    }
  }
}

// A front that fails (the filesystem filled up while the pages were made) fails the load with
// its error, at once, and nothing past it is written (the memory there is PROT_NONE).
TEST_P(LoaderReadersTest, AFailedFrontFailsTheLoadWithItsError) {
  if (GetParam() == "io_uring" && !IoUringWorks()) GTEST_SKIP() << "io_uring is not allowed here";
  ScopedDir dir("load-front-fails");
  const std::string path = WriteOddSizedGguf(dir);
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {path}}));
  format::ArenaTable table = plan.table;
  GatedMemory memory(table.data_bytes);
  LoadRequest request;
  request.reader = GetParam();
  request.chunk_bytes = 256 * kKiB;
  request.data = memory.data();
  request.ready_front = &memory.front();
  request.ready_base = GatedMemory::kBase;
  memory.StartMoving(256 * 4096, table.data_bytes / 3, NoSpace("/dev/shm/x: no space left"));
  auto result = LoadTensors(request, table);
  memory.LoaderDone();
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kNoSpace) << result.status().ToString();
  EXPECT_NE(result.status().message().find("/dev/shm/x"), std::string::npos);
}

TEST(LoaderTest, IoUringAndPreadGiveIdenticalArenas) {
  if (!IoUringWorks()) GTEST_SKIP() << "io_uring is not allowed here";
  ScopedDir dir("load-same");
  source::SyntheticModelOptions o{.format = "safetensors",
                                  .out = dir.File("m.safetensors"),
                                  .layers = 3,
                                  .experts = 4,
                                  .hidden = 128,
                                  .ffn = 96,
                                  .dtype = "f16"};
  ASSERT_OK(source::WriteSyntheticModel(o));
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {o.out}}));
  ASSERT_OK_AND_ASSIGN(Loaded a, LoadInto(plan, "io_uring", 16 * kKiB));
  ASSERT_OK_AND_ASSIGN(Loaded b, LoadInto(plan, "pread", 1 * kMiB));
  ASSERT_EQ(a.memory.size(), b.memory.size());
  EXPECT_EQ(std::memcmp(a.memory.data(), b.memory.data(), a.memory.size()), 0);
  for (size_t t = 0; t < a.table.tensors.size(); ++t) {
    EXPECT_EQ(a.table.tensors[t].checksum, b.table.tensors[t].checksum);
  }
}

// A file whose pages are not cached, on a filesystem with O_DIRECT, is read with O_DIRECT:
// straight into the arena when aligned (a GGUF with general.alignment 4096), through bounce
// buffers when not (gen-model's 32-aligned GGUF, safetensors); the bytes are the same.
TEST(LoaderTest, ColdDataIsReadWithODirect) {
  ScopedDir dir("load-direct");
  source::SyntheticModelOptions o{.format = "gguf",
                                  .out = dir.File("m.gguf"),
                                  .layers = 2,
                                  .experts = 4,
                                  .hidden = 256,
                                  .ffn = 512,
                                  .dtype = "f16"};
  ASSERT_OK(source::WriteSyntheticModel(o));
  const std::string aligned = dir.File("aligned.gguf");
  {
    source::GgufWriter w;
    w.SetAlignment(4096);
    for (int t = 0; t < 3; ++t) {
      ASSERT_OK(w.AddTensor("blk." + std::to_string(t) + ".ffn_up_exps.weight",
                            *source::FindGgmlTypeByName("f32"), {1000 + 24ull * t, 301}));
    }
    ASSERT_OK(w.WriteFile(aligned, [](size_t t, uint64_t offset, std::span<std::byte> out) {
      for (size_t k = 0; k < out.size(); ++k) out[k] = std::byte((offset + k + t) * 7 >> 3);
      return Status::Ok();
    }));
  }
  {
    platform::OpenOptions direct;
    direct.direct = true;
    auto fd = platform::OpenFile(o.out, direct);
    if (!fd.ok() || platform::QueryDirectIoAlignment(*fd).memory == 0) {
      GTEST_SKIP() << "no O_DIRECT on the filesystem of /tmp";
    }
    ASSERT_OK_AND_ASSIGN(auto plain, platform::OpenFile(o.out, {}));
    ASSERT_OK(platform::EvictFromPageCache(plain));
  }
  for (const std::string& path : {o.out, aligned}) {
    ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {path}}));
    for (const std::string reader : {"auto", "pread"}) {
      {
        ASSERT_OK_AND_ASSIGN(auto plain, platform::OpenFile(path, {}));
        ASSERT_OK(platform::EvictFromPageCache(plain));
      }
      ASSERT_OK_AND_ASSIGN(Loaded loaded, LoadInto(plan, reader, 256 * kKiB));
      ExpectMatchesSources(loaded, testing::ParseGgufIndependently(path), path);
      // Every tensor is large enough to have an aligned body: most bytes go direct.
      EXPECT_GT(loaded.result.direct_bytes, loaded.result.bytes_read / 2) << path << " " << reader;
      if (path == aligned) {
        EXPECT_LT(loaded.result.bounce_bytes, loaded.result.direct_bytes) << reader;
      }
    }
  }
}

TEST(LoaderTest, ChangedOrShortSourcesAreErrors) {
  ScopedDir dir("load-changed");
  source::SyntheticModelOptions o{.format = "gguf",
                                  .out = dir.File("m.gguf"),
                                  .layers = 1,
                                  .experts = 2,
                                  .hidden = 64,
                                  .ffn = 64};
  ASSERT_OK(source::WriteSyntheticModel(o));
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {o.out}}));
  std::filesystem::resize_file(o.out, std::filesystem::file_size(o.out) - 100);
  auto loaded = LoadInto(plan, "auto", 64 * kKiB);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("changed size"), std::string::npos);
  EXPECT_NE(loaded.status().message().find("m.gguf"), std::string::npos);
  auto bad = LoadInto(plan, "mmap", 64 * kKiB);
  ASSERT_FALSE(bad.ok());
}

// A source truncated under the loader, after planning, while its pages are copied from a
// mapping (hot copy): an error naming the file, not a SIGBUS.
TEST(LoaderTest, SourceTruncatedDuringTheLoadIsAnError) {
  ScopedDir dir("load-truncated");
  source::SyntheticModelOptions o{.format = "gguf",
                                  .out = dir.File("m.gguf"),
                                  .layers = 2,
                                  .experts = 4,
                                  .hidden = 256,
                                  .ffn = 256};
  ASSERT_OK(source::WriteSyntheticModel(o));
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {o.out}}));
  const uint64_t size = std::filesystem::file_size(o.out);
  LoadRequest request;
  request.chunk_bytes = 64 * kKiB;
  request.after_plan_for_testing = [&] { std::filesystem::resize_file(o.out, size / 3); };
  auto loaded = LoadWith(plan, request);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("m.gguf"), std::string::npos)
      << loaded.status().ToString();
}

// The same for a shard of tiny tensors cut short inside a batch, copied or read: the error
// names the shard.
TEST(LoaderTest, ShardTruncatedInsideABatchIsAnError) {
  ScopedDir dir("load-batch-cut");
  source::SyntheticModelOptions o{.format = "safetensors",
                                  .layout = "deepseek-v3",
                                  .out = dir.File("m"),
                                  .layers = 4,
                                  .experts = 16,
                                  .hidden = 16,
                                  .ffn = 16,
                                  .shards = 2};
  ASSERT_OK(source::WriteSyntheticModel(o));
  ASSERT_OK_AND_ASSIGN(source::ModelPlan plan, source::PlanModel({.files = {o.out}}));
  // The shard holding the most tensors, cut in the middle of their data.
  std::vector<size_t> count(plan.table.sources.size(), 0);
  for (const auto& t : plan.table.tensors) ++count[t.source_index];
  const size_t s = std::max_element(count.begin(), count.end()) - count.begin();
  const std::string shard = plan.table.sources[s].path;
  const uint64_t size = std::filesystem::file_size(shard);
  (void)testing::ReadRange(shard, 0, size);
  for (const char* reader : {"io_uring", "pread", "io_uring-read", "pread-read"}) {
    const std::string name = reader;
    if (name.starts_with("io_uring") && !IoUringWorks()) continue;
    LoadRequest request;
    request.reader = name.substr(0, name.find('-'));
    request.hot_copy = !name.ends_with("-read");  // batches copied or batches read
    request.threads = 1;
    request.after_plan_for_testing = [&] { std::filesystem::resize_file(shard, size / 2); };
    auto loaded = LoadWith(plan, request);
    ASSERT_FALSE(loaded.ok()) << reader;
    EXPECT_NE(loaded.status().message().find(std::filesystem::path(shard).filename().string()),
              std::string::npos)
        << loaded.status().ToString();
    // Whole again for the next reader (same bytes: the generator is deterministic).
    ASSERT_OK(source::WriteSyntheticModel(o));
    ASSERT_OK_AND_ASSIGN(plan, source::PlanModel({.files = {o.out}}));
    (void)testing::ReadRange(shard, 0, size);
  }
}

// Refuses io_uring_setup with EPERM in this process (and its future threads), as a container's
// seccomp profile does.
bool RefuseIoUringSetup() {
  struct sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog program = {static_cast<unsigned short>(sizeof filter / sizeof filter[0]),
                               filter};
  return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

// args: model path. Exit 0 when auto falls back to pread with a reason and a forced io_uring is
// refused with one.
EA_CHILD_ROLE(seccomp_loader) {
  if (!RefuseIoUringSetup()) return 10;
  auto plan = source::PlanModel({.files = {args.at(0)}});
  if (!plan.ok()) return 11;
  auto loaded = LoadInto(*plan, "auto", 64 * kKiB);
  if (!loaded.ok() || loaded->result.reader != "pread") return 12;
  // The start line names the reader and why io_uring was not used.
  auto arena = Arena::Open({.files = {args.at(0)}}, ArenaOptions{});
  if (!arena.ok()) return 16;
  const std::string line = arena->report().StartLine();
  if (line.find("pread") == std::string::npos || line.find("EPERM") == std::string::npos) {
    std::printf("start line: %s\n", line.c_str());
    return 17;
  }
  if (loaded->result.note.find("EPERM") == std::string::npos) return 13;
  auto forced = LoadInto(*plan, "io_uring", 64 * kKiB);
  if (forced.ok() || forced.status().code() != StatusCode::kUnsupported) return 14;
  if (forced.status().message().find("io_uring") == std::string::npos) return 15;
  std::printf("%s\n", forced.status().message().c_str());
  return 0;
}

TEST(LoaderTest, FallsBackToPreadWhenSeccompRefusesIoUring) {
  ScopedDir dir("load-seccomp");
  source::SyntheticModelOptions o{.format = "gguf",
                                  .out = dir.File("m.gguf"),
                                  .layers = 1,
                                  .experts = 2,
                                  .hidden = 64,
                                  .ffn = 64};
  ASSERT_OK(source::WriteSyntheticModel(o));
  auto child = testing::SpawnRole("seccomp_loader", {o.out});
  EXPECT_EQ(child.Wait(60), 0) << child.Output();
}


// An engine's logger gets the progress of a long load as messages (its log is not a terminal
// to redraw); nothing reaches stderr around it.
TEST(ProgressLine, GoesThroughTheEnginesLoggerWhenOneIsGiven) {
  std::ostringstream logged;
  spdlog::logger engine("progress-test", std::make_shared<spdlog::sinks::ostream_sink_mt>(logged));
  std::atomic<uint64_t> done{512ull << 20};
  ::testing::internal::CaptureStderr();
  {
    ProgressLine progress(true, 1ull << 30, &done, &engine, 100);
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_NE(logged.str().find("expert-arena: loading 0.50 / 1.00 GiB"), std::string::npos)
      << logged.str();
  EXPECT_EQ(logged.str().find('\r'), std::string::npos) << logged.str();
}

}  // namespace
}  // namespace expert_arena::load
