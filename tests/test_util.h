// Test helpers: status assertions, per-test arena paths, child processes, scoped mounts.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "expert_arena/status.h"

#define ASSERT_OK(expr)                                                           \
  do {                                                                            \
    const ::expert_arena::Status ea_s_ = ::expert_arena::testing::ToStatus(expr); \
    ASSERT_TRUE(ea_s_.ok()) << #expr << ": " << ea_s_.ToString();                 \
  } while (0)
#define EXPECT_OK(expr)                                                           \
  do {                                                                            \
    const ::expert_arena::Status ea_s_ = ::expert_arena::testing::ToStatus(expr); \
    EXPECT_TRUE(ea_s_.ok()) << #expr << ": " << ea_s_.ToString();                 \
  } while (0)
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(EA_CONCAT(ea_r_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)                    \
  auto tmp = (expr);                                                 \
  ASSERT_TRUE(tmp.ok()) << #expr << ": " << tmp.status().ToString(); \
  lhs = std::move(tmp).value()

namespace expert_arena::testing {

inline Status ToStatus(const Status& s) { return s; }
template <typename T>
Status ToStatus(const Result<T>& r) {
  return r.ok() ? Status::Ok() : r.status();
}

// The directory tests put arena files in: $EXPERT_ARENA_TEST_DIR, else /dev/shm.
std::string ArenaTestDir();

// A unique path in `dir` for this test (pid, test name and a counter); the file is removed
// when the object dies, whatever the test did.
class ScopedPath {
 public:
  explicit ScopedPath(const std::string& tag, std::string dir = "");
  ~ScopedPath();
  ScopedPath(const ScopedPath&) = delete;
  ScopedPath& operator=(const ScopedPath&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A file of `bytes` deterministic pseudo-random bytes (seeded) at a fresh path in /tmp,
// removed on destruction. Not a model: an arena loads it only as ModelFormat::kRaw (one u8
// tensor of the whole file).
class ScopedDataFile {
 public:
  ScopedDataFile(uint64_t bytes, uint64_t seed);
  ~ScopedDataFile();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// ---- files that are not models -----------------------------------------------------------
// What a user passes by mistake, each with words its refusal must hold (source/model_format.h):
// shared by the library, CLI and C interface tests so that all three check the same cases.
struct NotAModel {
  std::string name;   // the file's name (its extension matters to the message)
  std::string bytes;  // its contents
  std::string words;  // in the refusal message
};
std::vector<NotAModel> NotAModels();

// A fresh, empty directory in ArenaTestDir() for arena files, removed with its contents at
// the end; entries() lists what is in it (a refused load must leave nothing).
class ScopedArenaDir {
 public:
  explicit ScopedArenaDir(const std::string& tag);
  ~ScopedArenaDir();
  ScopedArenaDir(const ScopedArenaDir&) = delete;
  ScopedArenaDir& operator=(const ScopedArenaDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }
  std::vector<std::string> entries() const;

 private:
  std::string path_;
};

// ---- child processes --------------------------------------------------------------------
// A role is a function run in a child process: the test binary re-executes itself with
// `--ea-child-role=NAME arg...` (posix_spawn, never fork: a parent with huge pages mapped
// would copy them). Its exit code is the role's return value.
using ChildRole = std::function<int(const std::vector<std::string>& args)>;
bool RegisterChildRole(const std::string& name, ChildRole role);
#define EA_CHILD_ROLE(name)                                           \
  static int name##_role(const std::vector<std::string>& args);       \
  static const bool name##_registered =                               \
      ::expert_arena::testing::RegisterChildRole(#name, name##_role); \
  static int name##_role([[maybe_unused]] const std::vector<std::string>& args)

// A running child; its stdout is captured. The destructor kills it if it still runs.
class Child {
 public:
  Child() = default;
  Child(Child&& other) noexcept;
  Child& operator=(Child&& other) noexcept;
  ~Child();
  pid_t pid() const { return pid_; }
  // Waits for exit (with a timeout in seconds); returns the exit code, or 128+signal, or -1 on
  // timeout (the child is then killed).
  int Wait(double timeout_seconds = 60);
  // Everything the child wrote to stdout so far (reads until EOF after Wait()).
  const std::string& Output();
  // Reads stdout until it contains `needle` (true), or the child exits or time runs out.
  bool WaitForOutput(const std::string& needle, double timeout_seconds = 60);
  void Kill(int sig);

 private:
  friend Child SpawnRole(const std::string&, const std::vector<std::string>&);
  friend Child SpawnProgram(const std::string&, const std::vector<std::string>&);
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string output_;
  int exit_code_ = -2;
  void Drain();
};

Child SpawnRole(const std::string& role, const std::vector<std::string>& args);
// Runs a program (argv[0] = program), stdout captured, stderr inherited.
Child SpawnProgram(const std::string& program, const std::vector<std::string>& args);

// The directory holding the built tools (expert-arena, moe-engine).
std::string BinDir();

// ---- system settings --------------------------------------------------------------------
// A tmpfs (4 KiB pages, or huge=always) or hugetlbfs mount in a fresh directory, made as root and undone on
// destruction (nr_hugepages restored too). Tests that use one hold a machine-wide lock so two
// test processes never change these settings at once. skip_reason() says why none was made.
class ScopedMount {
 public:
  // kHugetlbfs1G reserves 1 GiB pages (hugepages-1048576kB) for the mount and gives them back;
  // kHugetlbfsNoSize reserves 2 MiB pages but mounts without size= (the pool is the limit).
  enum class Kind { kTmpfs, kTmpfsHuge, kHugetlbfs, kHugetlbfs1G, kHugetlbfsNoSize };
  ScopedMount(Kind kind, uint64_t bytes);
  ~ScopedMount();
  bool ok() const { return skip_reason_.empty(); }
  const std::string& skip_reason() const { return skip_reason_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::string skip_reason_;
  int lock_fd_ = -1;
  long saved_nr_hugepages_ = -1;
  std::string nr_hugepages_path_;
  bool mounted_ = false;
};

}  // namespace expert_arena::testing
