// The CLI on input a hostile or careless file or user gives it: metadata that would cost
// gigabytes if kept whole, under an address-space limit; bytes that are not UTF-8 or are
// terminal control sequences in paths, tensor names and identities. Every case ends with exit
// 0 or 1 and readable output, never an abort.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/arena_format.h"
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

// Runs expert-arena with stdout captured (stderr not: it holds the log).
int ExpertArena(const std::vector<std::string>& args, std::string* out) {
  auto child = testing::SpawnProgram(testing::BinDir() + "/expert-arena", args);
  int code = child.Wait(120);
  *out = child.Output();
  return code;
}

// The first line of `out` that starts a JSON object.
std::string JsonLine(const std::string& out) {
  size_t at = 0;
  while (at < out.size()) {
    size_t end = out.find('\n', at);
    if (end == std::string::npos) end = out.size();
    if (out[at] == '{') return out.substr(at, end - at);
    at = end + 1;
  }
  return "";
}

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
  // AddressSanitizer reserves terabytes of address space for its shadow at start, so an ASan
  // build cannot run under an address-space limit: there its own resident-set limit stands in
  // (1 GiB with its quarantine kept small: the metadata kept whole would be gigabytes).
#if defined(__SANITIZE_ADDRESS__)
  const char* env = std::getenv("ASAN_OPTIONS");
  const std::string limit = "ASAN_OPTIONS='" + std::string(env != nullptr ? env : "") +
                            ":hard_rss_limit_mb=1024:quarantine_size_mb=16' ";
#else
  const std::string limit = "ulimit -v 524288 && ";
#endif
  const int code = Shell(limit + "exec " + testing::BinDir() +
                             "/expert-arena load --all --model " + Quoted(model) + " --arena " +
                             Quoted(arena.path()),
                         &out);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("1 tensor"), std::string::npos) << out;
}

// Bytes that are not UTF-8 where Linux allows them: in the model's path (legal in any file
// name) and at the end of a GGUF tensor name. `load --json` and `info --json` print valid
// JSON with each such byte written \\xNN, and the text outputs show the same escapes, never
// the raw byte.
TEST(CliHostileInputTest, BytesThatAreNotUtf8AreEscapedInJsonAndText) {
  ScopedDir dir("cli-not-utf8");
  const std::string model = dir.File("m\xff\xfe.gguf");
  const std::string tensor = "blk.0.ffn_up_exps.weight\xff";
  {
    RawGguf g(model);
    g.Begin(0);
    g.End(tensor);
  }
  ScopedPath arena("cli-not-utf8-\xff.arena");
  const std::string tool = testing::BinDir() + "/expert-arena";
  std::string out;
  ASSERT_EQ(Shell("exec " + tool + " load --all --json --model " + Quoted(model) + " --arena " +
                      Quoted(arena.path()),
                  &out),
            0)
      << out;
  const auto load = nlohmann::json::parse(JsonLine(out), nullptr, false);
  ASSERT_FALSE(load.is_discarded()) << out;
  EXPECT_NE(load["arena"].get<std::string>().find("cli-not-utf8-\\xff"), std::string::npos)
      << out;
  EXPECT_EQ(out.find('\xff'), std::string::npos) << "a raw 0xff byte in: " << out;

  ASSERT_EQ(ExpertArena({"info", "--json", arena.path()}, &out), 0) << out;
  const auto info = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(info.is_discarded()) << out;
  ASSERT_EQ(info["tensors"].size(), 1u) << out;
  EXPECT_EQ(info["tensors"][0]["name"], "blk.0.ffn_up_exps.weight\\xff");
  EXPECT_NE(info["sources"][0]["path"].get<std::string>().find("m\\xff\\xfe.gguf"),
            std::string::npos)
      << out;

  ASSERT_EQ(Shell("exec " + tool + " info " + Quoted(arena.path()), &out), 0) << out;
  EXPECT_NE(out.find("blk.0.ffn_up_exps.weight\\xff"), std::string::npos) << out;
  EXPECT_EQ(out.find('\xff'), std::string::npos) << "a raw 0xff byte in: " << out;
}

// An identity edited in the file (its header checksum recomputed, as a hostile writer would)
// to hold a terminal escape sequence and a byte that is not UTF-8: `info` shows it escaped,
// and `info --json` is valid JSON holding the same text.
TEST(CliHostileInputTest, AnIdentityWithEscapeSequencesIsShownEscaped) {
  ScopedDir dir("cli-identity");
  const std::string model = dir.File("m.gguf");
  {
    RawGguf g(model);
    g.Begin(0);
    g.End("blk.0.ffn_up_exps.weight");
  }
  ScopedPath arena("cli-identity.arena");
  const std::string tool = testing::BinDir() + "/expert-arena";
  std::string out;
  ASSERT_EQ(Shell("exec " + tool + " load --all --model " + Quoted(model) + " --arena " +
                      Quoted(arena.path()),
                  &out),
            0)
      << out;
  {
    const int fd = ::open(arena.path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    format::HeaderFixed fixed;
    ASSERT_EQ(::pread(fd, &fixed, sizeof fixed, 0), static_cast<ssize_t>(sizeof fixed));
    std::memset(fixed.identity_text, 0, sizeof fixed.identity_text);
    const std::string hostile = "model \x1b]0;owned\x07\x1b[2J\xff";
    std::memcpy(fixed.identity_text, hostile.data(), hostile.size());
    fixed.header_checksum = 0;
    fixed.header_checksum = XXH3_64bits(&fixed, sizeof fixed);
    ASSERT_EQ(::pwrite(fd, &fixed, sizeof fixed, 0), static_cast<ssize_t>(sizeof fixed));
    ::close(fd);
  }
  const std::string shown = "model \\x1b]0;owned\\x07\\x1b[2J\\xff";
  Shell("exec " + tool + " info " + Quoted(arena.path()), &out);
  EXPECT_NE(out.find(shown), std::string::npos) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << "a raw escape byte in: " << out;
  EXPECT_EQ(out.find('\xff'), std::string::npos) << "a raw 0xff byte in: " << out;

  ExpertArena({"info", "--json", arena.path()}, &out);
  const auto info = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(info.is_discarded()) << out;
  EXPECT_EQ(info["identity"], shown);
}

}  // namespace
}  // namespace expert_arena
