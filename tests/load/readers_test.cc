// The io_uring readers on an error: they return only when the kernel holds no read into the
// arena or a bounce buffer, since the caller unmaps (and may unlink) the arena as soon as they
// return. The submit error is injected at the ring's fault point (tests/hooks).
#include "load/readers.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <string>
#include <vector>

#include "load/tensor_hasher.h"
#include "platform/file.h"
#include "platform/io_ring.h"
#include "platform/ring_hooks.h"
#include "test_util.h"

namespace expert_arena::load {
namespace {

constexpr uint64_t kPiece = 64 * 1024;  // above ReadJob::kBatchPieceBytes: one read each

// Piece 0 comes from a pipe, whose read stays in the kernel until bytes arrive (a slow
// device); pieces 1 and 2 from a file. With a queue depth of two, the first submit sends
// pieces 0 and 1, piece 1 completes, and the second submit (piece 2) fails while the read of
// piece 0 is in flight.
TEST(UringReadersTest, ASubmitErrorReturnsOnlyWhenNoReadIsLeftInTheKernel) {
  if (!platform::IoRing::Create(4).ok()) GTEST_SKIP() << "io_uring is not available here";
  int ends[2];
  ASSERT_EQ(pipe2(ends, O_CLOEXEC), 0);
  platform::UniqueFd pipe_read(ends[0], "pipe"), pipe_write(ends[1], "pipe");
  testing::ScopedDataFile file(2 * kPiece, 11);
  auto file_fd = platform::OpenFile(file.path(), {});
  ASSERT_TRUE(file_fd.ok()) << file_fd.status().ToString();

  ReadPlan plan;
  plan.pieces = {{.tensor = 0, .source = 0, .source_offset = 0, .arena_offset = 0, .bytes = kPiece},
                 {.tensor = 1, .source = 1, .source_offset = 0, .arena_offset = kPiece,
                  .bytes = kPiece},
                 {.tensor = 2, .source = 1, .source_offset = kPiece, .arena_offset = 2 * kPiece,
                  .bytes = kPiece}};
  plan.tensor_first = {0, 1, 2, 3};
  plan.total_bytes = 3 * kPiece;
  plan.largest_piece = kPiece;
  std::vector<std::byte> arena(3 * kPiece, std::byte{0});
  TensorHasher hasher(plan, arena);
  ReadJob job;
  job.plan = &plan;
  job.data = arena;
  job.buffered = {&pipe_read, &*file_fd};
  job.direct = {nullptr, nullptr};
  job.direct_alignment = {0, 0};
  job.mapped = {nullptr, nullptr};
  job.hasher = &hasher;
  job.Prepare();

  std::atomic<int> submits{0};
  platform::test_hooks::SetRingSubmit([&] { return ++submits == 2 ? -ENOMEM : 0; });
  std::vector<platform::IoRing> rings;
  auto ring = platform::IoRing::Create(2);
  ASSERT_TRUE(ring.ok()) << ring.status().ToString();
  rings.push_back(std::move(*ring));
  Status result = RunUringReaders(job, rings, 2);
  platform::test_hooks::SetRingSubmit(nullptr);
  ASSERT_GE(submits.load(), 2);
  EXPECT_FALSE(result.ok());
  EXPECT_NE(result.ToString().find("io_uring_submit"), std::string::npos) << result.ToString();

  // The caller would unmap the arena now. Bytes that arrive in the pipe from here on must
  // stay there: no read of the failed load may take them into the arena.
  ASSERT_EQ(fcntl(pipe_read.get(), F_SETFL, O_NONBLOCK), 0);
  const std::string late(4096, 'L');
  ASSERT_EQ(write(pipe_write.get(), late.data(), late.size()),
            static_cast<ssize_t>(late.size()));
  std::string back(late.size(), '\0');
  EXPECT_EQ(read(pipe_read.get(), back.data(), back.size()), static_cast<ssize_t>(late.size()))
      << "a read of the failed load took the pipe's bytes after the readers returned";
  EXPECT_TRUE(back == late) << "the pipe's bytes were not all there";
  EXPECT_EQ(arena[0], std::byte{0});
  EXPECT_EQ(arena[late.size() - 1], std::byte{0});
}

}  // namespace
}  // namespace expert_arena::load
