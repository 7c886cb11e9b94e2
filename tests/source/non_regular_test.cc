// A model path that is not a regular file (a FIFO, a device, a socket) is a clear error that
// names it, at once: open(2) of a FIFO without a writer would otherwise wait forever.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <future>

#include "expert_arena/arena.h"
#include "platform/file.h"
#include "source/gguf_reader.h"
#include "source/model_source.h"
#include "source/safetensors_reader.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::ScopedDir;

std::string MakeFifo(const ScopedDir& dir, const std::string& name) {
  std::string path = dir.File(name);
  EXPECT_EQ(::mkfifo(path.c_str(), 0600), 0) << path;
  return path;
}

// Runs `call` on its own thread with a bound: if it hangs in open(2) of `fifo`, the FIFO is
// opened for writing so the call returns, and the test fails instead of hanging.
Status Bounded(const std::string& fifo, std::function<Status()> call) {
  auto result = std::async(std::launch::async, std::move(call));
  if (result.wait_for(std::chrono::seconds(20)) == std::future_status::timeout) {
    ADD_FAILURE() << "hung on " << fifo;
    int unblock = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
    Status s = result.get();
    if (unblock >= 0) ::close(unblock);
    return s;
  }
  return result.get();
}

void ExpectNotRegular(const Status& s, const std::string& path, const char* kind) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(path + ": not a regular file (" + kind + ")"), std::string::npos)
      << s.ToString();
}

Status PlanFiles(std::vector<std::string> files) {
  ModelSpec spec;
  spec.files = std::move(files);
  spec.select_all = true;
  auto plan = source::PlanModel(spec);
  return plan.ok() ? Status::Ok() : plan.status();
}

TEST(NonRegularFileTest, OpenFileRefusesAFifoWithoutBlocking) {
  ScopedDir dir("nonreg-open");
  const std::string fifo = MakeFifo(dir, "pipe");
  for (bool write : {false, true}) {
    Status s = Bounded(fifo, [&] {
      auto fd = platform::OpenFile(fifo, {.write = write, .no_follow = false});
      return fd.ok() ? Status::Ok() : fd.status();
    });
    ExpectNotRegular(s, fifo, "a FIFO");
  }
  // O_CREAT of an existing FIFO opens it: refused too.
  auto created = platform::OpenFile(fifo, {.write = true, .create = true});
  ExpectNotRegular(created.status(), fifo, "a FIFO");
  ExpectNotRegular(platform::OpenFile("/dev/null", {}).status(), "/dev/null", "a character device");
  ExpectNotRegular(platform::OpenFile(dir.path(), {}).status(), dir.path(), "a directory");
  // A regular file opens and reads as before (O_NONBLOCK cleared).
  const std::string file = dir.File("plain");
  testing::WriteFileBytes(file, std::vector<std::byte>(10, std::byte{1}));
  ASSERT_OK_AND_ASSIGN(platform::UniqueFd fd, platform::OpenFile(file, {}));
  EXPECT_EQ(::fcntl(fd.get(), F_GETFL) & O_NONBLOCK, 0);
}

TEST(NonRegularFileTest, ModelEntryPointsRefuseAFifo) {
  ScopedDir dir("nonreg-model");
  const std::string fifo = MakeFifo(dir, "model.gguf");
  ExpectNotRegular(Bounded(fifo, [&] { return PlanFiles({fifo}); }), fifo, "a FIFO");
  ExpectNotRegular(Bounded(fifo, [&] { return source::ReadGguf(fifo).status(); }), fifo, "a FIFO");
  ExpectNotRegular(Bounded(fifo, [&] { return source::ReadSafetensors(fifo).status(); }), fifo,
                   "a FIFO");
  ExpectNotRegular(Bounded(fifo,
                           [&] {
                             ModelSpec spec;
                             spec.files = {fifo};
                             auto plan = source::PlanRawFiles(spec);
                             return plan.ok() ? Status::Ok() : plan.status();
                           }),
                   fifo, "a FIFO");
}

TEST(NonRegularFileTest, AFifoNamedAsAShardOrAsTheIndexIsRefused) {
  ScopedDir dir("nonreg-shard");
  const std::string index = dir.File("model.safetensors.index.json");
  const std::string text = R"({"weight_map": {"a": "s1.safetensors"}})";
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  testing::WriteFileBytes(index, bytes);
  const std::string shard = MakeFifo(dir, "s1.safetensors");
  // The directory, the index and the shard itself.
  for (const std::string& path : {dir.path(), index, shard}) {
    ExpectNotRegular(Bounded(shard, [&] { return PlanFiles({path}); }), shard, "a FIFO");
  }
  ScopedDir dir2("nonreg-index");
  const std::string index_fifo = MakeFifo(dir2, "model.safetensors.index.json");
  ExpectNotRegular(Bounded(index_fifo, [&] { return PlanFiles({dir2.path()}); }), index_fifo,
                   "a FIFO");
}

TEST(NonRegularFileTest, ASocketIsRefused) {
  ScopedDir dir("nonreg-sock");
  const std::string path = dir.File("model.gguf");
  int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(sock, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  Status s = PlanFiles({path});
  ::close(sock);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace expert_arena
