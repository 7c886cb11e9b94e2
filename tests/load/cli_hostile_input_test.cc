// The CLI on input a hostile or careless file or user gives it: metadata that would cost
// gigabytes if kept whole, under an address-space limit. Every case ends with exit 0 or 1
// and readable output, never an abort.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::ScopedDir;
using testing::ScopedPath;

// Runs a shell command line, stderr folded into the captured output.
int Shell(const std::string& command, std::string* out) {
  auto child = testing::SpawnProgram("/bin/sh", {"-c", command + " 2>&1"});
  int code = child.Wait(300);
  *out = child.Output();
  return code;
}

std::string Quoted(const std::string& path) { return "'" + path + "'"; }

// A GGUF v3 file written byte by byte: the metadata `write_metadata` writes (its entry
// count is `entries`), then one f32 tensor of 1024 values named `tensor`.
class RawGguf {
 public:
  explicit RawGguf(const std::string& path) : out_(path, std::ios::binary) {}
  template <typename T>
  void Put(T v) {
    out_.write(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    out_.write(s.data(), static_cast<std::streamsize>(s.size()));
  }
  void Bytes(const std::string& s) { out_.write(s.data(), static_cast<std::streamsize>(s.size())); }
  void Begin(uint64_t entries) {
    Bytes("GGUF");
    Put<uint32_t>(3);
    Put<uint64_t>(1);  // tensors
    Put<uint64_t>(entries);
  }
  void End(const std::string& tensor) {
    PutString(tensor);
    Put<uint32_t>(1);
    Put<uint64_t>(1024);
    Put<uint32_t>(0);  // F32
    Put<uint64_t>(0);
    while (out_.tellp() % 32 != 0) Put<uint8_t>(0);
    for (int i = 0; i < 1024; ++i) Put<float>(static_cast<float>(i));
    out_.close();
  }

 private:
  std::ofstream out_;
};

// 64 MiB of metadata as nested u8 arrays: about 100 values per KiB, each a value the reader
// would keep (some 6.6 GB kept whole). Under a 512 MiB address-space limit the load keeps
// what fits its budget, reads past the rest and loads the tensor.
TEST(CliHostileInputTest, GigabytesOfNestedArrayMetadataLoadUnderA512MiBLimit) {
  ScopedDir dir("cli-metadata");
  const std::string model = dir.File("nested.gguf");
  {
    RawGguf g(model);
    g.Begin(1);
    constexpr uint64_t kInner = 4096;
    constexpr uint64_t kOuter = (64ull << 20) / (kInner + 12);
    g.PutString("test.nested");
    g.Put<uint32_t>(9);  // array
    g.Put<uint32_t>(9);  // of arrays
    g.Put<uint64_t>(kOuter);
    const std::string inner(kInner, '\x07');
    for (uint64_t i = 0; i < kOuter; ++i) {
      g.Put<uint32_t>(0);  // of u8
      g.Put<uint64_t>(kInner);
      g.Bytes(inner);
    }
    g.End("blk.0.ffn_up_exps.weight");
  }
  ScopedPath arena("cli-metadata.arena");
  std::string out;
  const int code = Shell("ulimit -v 524288 && exec " + testing::BinDir() +
                             "/expert-arena load --all --model " + Quoted(model) + " --arena " +
                             Quoted(arena.path()),
                         &out);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("1 tensor"), std::string::npos) << out;
}

}  // namespace
}  // namespace expert_arena
