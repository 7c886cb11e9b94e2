#include "test_util.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

extern char** environ;

namespace expert_arena::testing {
namespace {

std::atomic<int> counter{0};

std::string TestName() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return "child";
  std::string name = std::string(info->test_suite_name()) + "." + info->name();
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  return name;
}

std::map<std::string, ChildRole>& Roles() {
  static std::map<std::string, ChildRole> roles;
  return roles;
}

std::string SelfExe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

}  // namespace

std::string ArenaTestDir() {
  const char* dir = std::getenv("EXPERT_ARENA_TEST_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/dev/shm";
}

ScopedPath::ScopedPath(const std::string& tag, std::string dir) {
  if (dir.empty()) dir = ArenaTestDir();
  path_ = dir + "/ea-test-" + std::to_string(getpid()) + "-" + std::to_string(counter++) + "-" +
          TestName() + "-" + tag;
}

ScopedPath::~ScopedPath() { unlink(path_.c_str()); }

std::vector<NotAModel> NotAModels() {
  auto le64 = [](uint64_t v) {
    std::string out(8, '\0');
    std::memcpy(out.data(), &v, 8);
    return out;
  };
  std::string ggux = "GGUX" + std::string("\x03\x00\x00\x00", 4) + std::string(56, '\0');
  std::string binary;
  for (int i = 0; i < 64; ++i) binary += static_cast<char>(i * 37 % 256);
  return {
      {"empty.gguf", "", "empty file"},
      // What a clone without `git lfs pull` leaves under a shard's name.
      {"model-00001-of-00163.safetensors",
       "version https://git-lfs.github.com/spec/v1\n"
       "oid sha256:0a3f1e0c5c4f7e3a7b1d2c9e8f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a\n"
       "size 4955472296\n",
       "a Git LFS pointer (version https://git-lfs.github.com/spec/v1"},
      {"lfs.gguf", "version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 12\n",
       "not the model: fetch it with git lfs pull"},
      // An error page saved under the model's name.
      {"page.safetensors",
       "<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head><body>gone</body></html>\n",
       "an HTML page"},
      {"damaged.gguf", ggux, "GGUF magic expected, found 'GGUX'"},
      // The bytes found are quoted escaped: a terminal escape is never passed through.
      {"hostile.gguf", "\x1b[31m" + std::string(60, 'x'), "found '\\x1b[31'"},
      {"short.safetensors", le64(1000000) + R"({"a":1})" + std::string(85, ' '),
       "safetensors header length 1000000 is larger than the file (100 bytes)"},
      {"weights.bin", binary, "not a GGUF, safetensors or safetensors index file"},
      {"weights.dat", binary, "ask for the raw format ("},
  };
}

ScopedArenaDir::ScopedArenaDir(const std::string& tag) {
  path_ = ArenaTestDir() + "/ea-test-" + std::to_string(getpid()) + "-" +
          std::to_string(counter++) + "-" + tag;
  std::filesystem::create_directories(path_);
}

ScopedArenaDir::~ScopedArenaDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<std::string> ScopedArenaDir::entries() const {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(path_, ec)) {
    out.push_back(e.path().filename().string());
  }
  return out;
}

ScopedDataFile::ScopedDataFile(uint64_t bytes, uint64_t seed) {
  path_ = "/tmp/ea-test-data-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  std::ofstream out(path_, std::ios::binary);
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> block(1 << 16);
  uint64_t left = bytes;
  while (left > 0) {
    for (auto& w : block) w = rng();
    uint64_t n = std::min<uint64_t>(left, block.size() * 8);
    out.write(reinterpret_cast<const char*>(block.data()), static_cast<std::streamsize>(n));
    left -= n;
  }
}

ScopedDataFile::~ScopedDataFile() { unlink(path_.c_str()); }

bool RegisterChildRole(const std::string& name, ChildRole role) {
  Roles()[name] = std::move(role);
  return true;
}

// Called from test_main.cc: runs the role named by --ea-child-role=NAME, if any.
int RunChildRoleIfAsked(int argc, char** argv, bool* ran) {
  *ran = false;
  if (argc < 2) return 0;
  std::string flag = argv[1];
  const std::string prefix = "--ea-child-role=";
  if (flag.rfind(prefix, 0) != 0) return 0;
  *ran = true;
  auto it = Roles().find(flag.substr(prefix.size()));
  if (it == Roles().end()) {
    std::fprintf(stderr, "unknown child role %s\n", flag.c_str());
    return 99;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  return it->second(args);
}

Child::Child(Child&& other) noexcept
    : pid_(other.pid_),
      out_fd_(other.out_fd_),
      output_(std::move(other.output_)),
      exit_code_(other.exit_code_) {
  other.pid_ = -1;
  other.out_fd_ = -1;
}

Child& Child::operator=(Child&& other) noexcept {
  if (this != &other) {
    this->~Child();
    new (this) Child(std::move(other));
  }
  return *this;
}

Child::~Child() {
  if (pid_ > 0 && exit_code_ == -2) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (out_fd_ >= 0) close(out_fd_);
}

void Child::Kill(int sig) {
  if (pid_ > 0 && exit_code_ == -2) kill(pid_, sig);
}

int Child::Wait(double timeout_seconds) {
  if (pid_ <= 0) return -1;
  if (exit_code_ != -2) return exit_code_;
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  for (;;) {
    int status = 0;
    pid_t got = waitpid(pid_, &status, WNOHANG);
    if (got == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      Output();
      return exit_code_;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      exit_code_ = -1;
      return -1;
    }
    Drain();  // so a chatty child never blocks on a full pipe
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void Child::Drain() {
  if (out_fd_ < 0) return;
  int flags = fcntl(out_fd_, F_GETFL);
  fcntl(out_fd_, F_SETFL, flags | O_NONBLOCK);
  char buf[4096];
  ssize_t n;
  while ((n = read(out_fd_, buf, sizeof buf)) > 0) output_.append(buf, static_cast<size_t>(n));
  fcntl(out_fd_, F_SETFL, flags);
}

bool Child::WaitForOutput(const std::string& needle, double timeout_seconds) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  for (;;) {
    Drain();
    if (output_.find(needle) != std::string::npos) return true;
    if (pid_ <= 0 || exit_code_ != -2) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      Output();
      return output_.find(needle) != std::string::npos;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

const std::string& Child::Output() {
  if (out_fd_ >= 0 && exit_code_ != -2) {
    char buf[4096];
    ssize_t n;
    while ((n = read(out_fd_, buf, sizeof buf)) > 0) output_.append(buf, static_cast<size_t>(n));
    close(out_fd_);
    out_fd_ = -1;
  }
  return output_;
}

static Child SpawnInto(const std::vector<std::string>& argv_strings, pid_t* pid, int* fd) {
  int pipefd[2];
  *pid = -1;
  *fd = -1;
  if (pipe2(pipefd, O_CLOEXEC) != 0) return Child();
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDOUT_FILENO);
  std::vector<char*> argv;
  for (const auto& a : argv_strings) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int rc = posix_spawn(pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipefd[1]);
  if (rc != 0) {
    close(pipefd[0]);
    *pid = -1;
    ADD_FAILURE() << "posix_spawn " << argv_strings[0] << ": " << std::strerror(rc);
    return Child();
  }
  *fd = pipefd[0];
  return Child();
}

Child SpawnRole(const std::string& role, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {SelfExe(), "--ea-child-role=" + role};
  argv.insert(argv.end(), args.begin(), args.end());
  Child child;
  SpawnInto(argv, &child.pid_, &child.out_fd_);
  return child;
}

Child SpawnProgram(const std::string& program, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {program};
  argv.insert(argv.end(), args.begin(), args.end());
  Child child;
  SpawnInto(argv, &child.pid_, &child.out_fd_);
  return child;
}

std::string BinDir() {
  const char* dir = std::getenv("EXPERT_ARENA_BIN_DIR");
  if (dir != nullptr && *dir != '\0') return dir;
  std::string self = SelfExe();
  return self.substr(0, self.rfind('/'));
}

// ---- mounts ------------------------------------------------------------------------------

namespace {
const char* kNrHugepages = "/proc/sys/vm/nr_hugepages";

long ReadLong(const char* path) {
  std::ifstream in(path);
  long v = -1;
  in >> v;
  return v;
}

bool WriteLong(const char* path, long v) {
  std::ofstream out(path);
  out << v;
  return static_cast<bool>(out);
}
}  // namespace

ScopedMount::ScopedMount(Kind kind, uint64_t bytes) {
  if (geteuid() != 0) {
    skip_reason_ = "needs root to mount tmpfs/hugetlbfs";
    return;
  }
  // One test process at a time changes mounts and nr_hugepages on this machine.
  lock_fd_ = open("/tmp/expert-arena-test-system.lock", O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (lock_fd_ < 0 || flock(lock_fd_, LOCK_EX) != 0) {
    skip_reason_ = "cannot take /tmp/expert-arena-test-system.lock";
    return;
  }
  char tmpl[] = "/tmp/ea-test-mount-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    skip_reason_ = std::string("mkdtemp: ") + std::strerror(errno);
    return;
  }
  dir_ = tmpl;
  uint64_t mib = (bytes + (1 << 20) - 1) >> 20;
  if (kind != Kind::kHugetlbfs && kind != Kind::kHugetlbfs1G && kind != Kind::kHugetlbfsNoSize) {
    const char* huge = kind == Kind::kTmpfsHuge ? "always" : "never";
    std::string opts = "size=" + std::to_string(mib) + "m,huge=" + huge + ",mode=0700";
    if (mount("tmpfs", dir_.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      skip_reason_ = std::string("mount tmpfs huge=") + huge + ": " + std::strerror(errno);
      return;
    }
  } else {
    const bool gib = kind == Kind::kHugetlbfs1G;
    const uint64_t page_mib = gib ? 1024 : 2;
    const std::string pool_dir =
        std::string("/sys/kernel/mm/hugepages/hugepages-") + (gib ? "1048576kB/" : "2048kB/");
    nr_hugepages_path_ = gib ? pool_dir + "nr_hugepages" : kNrHugepages;
    const char* pool = nr_hugepages_path_.c_str();
    saved_nr_hugepages_ = ReadLong(pool);
    const long pages = static_cast<long>((mib + page_mib - 1) / page_mib);
    // The pool grows until `pages` of it are free and unreserved: growing it first turns
    // surplus pages that another process still uses (a lazily unmounted hugetlbfs, say) into
    // persistent ones, which would leave this mount short and a copy-on-write fault SIGBUS.
    const auto available = [&] {
      return ReadLong((pool_dir + "free_hugepages").c_str()) -
             ReadLong((pool_dir + "resv_hugepages").c_str());
    };
    long target = saved_nr_hugepages_ + pages;
    for (int tries = 0; tries < 3 && saved_nr_hugepages_ >= 0; ++tries) {
      if (!WriteLong(pool, target)) break;
      const long now = ReadLong(pool);
      if (now < target) {
        skip_reason_ = "the kernel gave only " + std::to_string(now - saved_nr_hugepages_) +
                       " of " + std::to_string(pages) + " huge pages of " +
                       std::to_string(page_mib) + " MiB (memory fragmented)";
        return;
      }
      const long free = available();
      if (free >= pages) break;
      target += pages - free;
    }
    if (saved_nr_hugepages_ < 0 || ReadLong(pool) < target) {
      skip_reason_ = std::string("cannot set ") + pool;
      return;
    }
    if (available() < pages) {
      skip_reason_ = "only " + std::to_string(available()) + " of " + std::to_string(pages) +
                     " huge pages of " + std::to_string(page_mib) +
                     " MiB stay free: another process takes them";
      return;
    }
    std::string opts = std::string("pagesize=") + (gib ? "1G" : "2M") + ",mode=0700";
    if (kind != Kind::kHugetlbfsNoSize) opts += ",size=" + std::to_string(pages * page_mib) + "m";
    if (mount("hugetlbfs", dir_.c_str(), "hugetlbfs", 0, opts.c_str()) != 0) {
      skip_reason_ = std::string("mount hugetlbfs: ") + std::strerror(errno);
      return;
    }
  }
  mounted_ = true;
}

ScopedMount::~ScopedMount() {
  if (mounted_) umount2(dir_.c_str(), MNT_DETACH);
  if (!dir_.empty()) rmdir(dir_.c_str());
  if (saved_nr_hugepages_ >= 0) WriteLong(nr_hugepages_path_.c_str(), saved_nr_hugepages_);
  if (lock_fd_ >= 0) close(lock_fd_);
}

}  // namespace expert_arena::testing
