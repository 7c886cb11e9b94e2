// What a container runtime does to a process, done to a test's child: a memory cgroup, another
// user and umask, new PID, mount, IPC and UTS namespaces with a fresh /proc and a host
// directory bind-mounted in (a hostPath). Each runs as root and is undone when its processes
// exit (namespaces) or by the test (ScopedCgroup removes its cgroup).
#pragma once

#include <string>
#include <vector>

#include "test_util.h"

namespace expert_arena::testing {

// How a child is contained. Empty fields change nothing.
struct Containment {
  std::string cgroup;  // a cgroup directory: the child joins it (cgroup.procs) first
  int uid = -1;        // setresuid/setresgid after everything else
  int gid = -1;
  std::vector<int> groups;  // supplementary groups (setgroups), with uid
  int umask = -1;
  bool namespaces = false;  // new PID, mount, IPC and UTS namespaces, a fresh /proc
  std::string bind_from;    // with namespaces: this host directory ...
  std::string bind_to;      // ... is mounted here inside (e.g. /dev/shm)
  bool stderr_to_stdout = false;
};

// Spawns `role` (a registered child role) or, when it starts with '/', that program, contained.
// The Child is the outer process; killing it with SIGKILL kills everything inside its PID
// namespace too (the namespace's first process dies with its parent).
Child SpawnContained(const Containment& c, const std::string& role_or_program,
                     const std::vector<std::string>& args);

// Whether this process may do it all (root with CAP_SYS_ADMIN): "" when it may, else why not.
std::string WhyCannotContain();

// Skips the test outside CI and fails it in CI (CI=true), with the reason.
bool InCi();
#define EA_SKIP_OR_FAIL_IN_CI(reason)                                     \
  do {                                                                    \
    if (::expert_arena::testing::InCi()) FAIL() << "in CI: " << (reason); \
    GTEST_SKIP() << (reason);                                             \
  } while (0)

// A memory cgroup (v1 memory controller, or v2 with memory in cgroup.controllers) made as a
// child of this process's own, removed on destruction (after its processes exit).
class ScopedCgroup {
 public:
  explicit ScopedCgroup(const std::string& controller = "memory");
  ~ScopedCgroup();
  ScopedCgroup(const ScopedCgroup&) = delete;
  ScopedCgroup& operator=(const ScopedCgroup&) = delete;
  bool ok() const { return skip_reason_.empty(); }
  const std::string& skip_reason() const { return skip_reason_; }
  const std::string& dir() const { return dir_; }
  const std::string& path() const { return path_; }  // as /proc/<pid>/cgroup names it
  int version() const { return version_; }
  // Writes `value` to the file `name` in the cgroup; false (with a test failure) when it fails.
  bool Write(const std::string& name, const std::string& value);

 private:
  std::string dir_;
  std::string path_;
  std::string skip_reason_;
  int version_ = 0;
  std::string enabled_in_;  // v2: the parent whose subtree_control we changed
  std::string controller_;
};

}  // namespace expert_arena::testing
