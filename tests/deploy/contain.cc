#include "contain.h"

#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

extern char** environ;

namespace expert_arena::testing {
namespace {

std::string SelfPath() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

bool WriteFileText(const std::string& path, const std::string& text) {
  int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  return ok;
}

int Die(const char* what) {
  std::fprintf(stderr, "contain: %s: %s\n", what, std::strerror(errno));
  return 97;
}

// args: key=value... -- role_or_program args...
// Keys: cgroup, uid, gid, groups (comma-separated), umask (octal), ns (1: unshare and spawn
// the namespace's first process), init (1: we are that process), bind_from, bind_to, stderr.
int ContainRole(const std::vector<std::string>& args) {
  std::vector<std::string> opts, rest;
  bool after = false;
  for (const auto& a : args) {
    if (!after && a == "--") {
      after = true;
    } else {
      (after ? rest : opts).push_back(a);
    }
  }
  auto get = [&](const std::string& key) {
    for (const auto& o : opts) {
      if (o.rfind(key + "=", 0) == 0) return o.substr(key.size() + 1);
    }
    return std::string();
  };
  if (get("stderr") == "1") dup2(STDOUT_FILENO, STDERR_FILENO);
  if (!get("cgroup").empty() &&
      !WriteFileText(get("cgroup") + "/cgroup.procs", std::to_string(getpid()))) {
    return Die("join cgroup");
  }
  if (get("ns") == "1") {
    if (unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS) != 0) {
      return Die("unshare");
    }
    // The new PID namespace holds our next child only: spawn ourselves as its first process.
    std::vector<std::string> argv = {SelfPath(), "--ea-child-role=contain", "init=1"};
    for (const auto& o : opts) {
      if (o.rfind("ns=", 0) != 0 && o.rfind("cgroup=", 0) != 0) argv.push_back(o);
    }
    argv.push_back("--");
    argv.insert(argv.end(), rest.begin(), rest.end());
    std::vector<char*> cargv;
    for (auto& s : argv) cargv.push_back(s.data());
    cargv.push_back(nullptr);
    pid_t pid;
    int rc = posix_spawn(&pid, cargv[0], nullptr, nullptr, cargv.data(), environ);
    if (rc != 0) {
      errno = rc;
      return Die("posix_spawn");
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    // _exit, not return: once the namespace's first process is gone no process can be made in
    // it, and LeakSanitizer's exit-time check (a sanitizer build) would clone its tracer there
    // and fail with a fatal error.
    std::fflush(nullptr);
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  if (get("init") == "1") {
    // The first process of the namespace: it and everything in the namespace die with the
    // outer process (a test's SIGKILL of the Child).
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
      return Die("mount private");
    // A /proc of this PID namespace, as a container runtime mounts one.
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) {
      return Die("mount /proc");
    }
    if (!get("bind_from").empty() &&
        mount(get("bind_from").c_str(), get("bind_to").c_str(), nullptr, MS_BIND, nullptr) != 0) {
      return Die("bind mount");
    }
    const char host[] = "ea-container";
    sethostname(host, sizeof host - 1);
  }
  if (!get("umask").empty())
    umask(static_cast<mode_t>(std::strtoul(get("umask").c_str(), nullptr, 8)));
  if (!get("uid").empty()) {
    std::vector<gid_t> groups;
    std::stringstream list(get("groups"));
    for (std::string g; std::getline(list, g, ',');) {
      if (!g.empty()) groups.push_back(static_cast<gid_t>(std::stoul(g)));
    }
    gid_t gid = static_cast<gid_t>(std::stoul(get("gid")));
    uid_t uid = static_cast<uid_t>(std::stoul(get("uid")));
    if (setgroups(groups.size(), groups.data()) != 0) return Die("setgroups");
    if (setresgid(gid, gid, gid) != 0) return Die("setresgid");
    if (setresuid(uid, uid, uid) != 0) return Die("setresuid");
  }
  if (rest.empty()) return 96;
  std::vector<std::string> argv;
  if (rest[0][0] == '/') {
    argv = rest;
  } else {
    argv = {SelfPath(), "--ea-child-role=" + rest[0]};
    argv.insert(argv.end(), rest.begin() + 1, rest.end());
  }
  std::vector<char*> cargv;
  for (auto& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  execv(cargv[0], cargv.data());
  return Die("execv");
}

const bool contain_registered = RegisterChildRole("contain", ContainRole);

std::atomic<int> cgroup_counter{0};

}  // namespace

bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

std::string WhyCannotContain() {
  if (geteuid() != 0) return "needs root (setresuid, unshare, mount, cgroups)";
  return "";
}

Child SpawnContained(const Containment& c, const std::string& role_or_program,
                     const std::vector<std::string>& args) {
  std::vector<std::string> argv;
  if (!c.cgroup.empty()) argv.push_back("cgroup=" + c.cgroup);
  if (c.uid >= 0) {
    argv.push_back("uid=" + std::to_string(c.uid));
    argv.push_back("gid=" + std::to_string(c.gid));
    std::string groups;
    for (int g : c.groups) groups += (groups.empty() ? "" : ",") + std::to_string(g);
    argv.push_back("groups=" + groups);
  }
  if (c.umask >= 0) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%o", c.umask);
    argv.push_back(std::string("umask=") + buf);
  }
  if (c.namespaces) {
    argv.push_back("ns=1");
    if (!c.bind_from.empty()) {
      argv.push_back("bind_from=" + c.bind_from);
      argv.push_back("bind_to=" + c.bind_to);
    }
  }
  if (c.stderr_to_stdout) argv.push_back("stderr=1");
  argv.push_back("--");
  argv.push_back(role_or_program);
  argv.insert(argv.end(), args.begin(), args.end());
  return SpawnRole("contain", argv);
}

ScopedCgroup::ScopedCgroup(const std::string& controller) {
  if (!WhyCannotContain().empty()) {
    skip_reason_ = WhyCannotContain();
    return;
  }
  // This process's cgroup of the controller: v1 "N:memory:/path", else v2 "0::/path".
  std::ifstream cg("/proc/self/cgroup");
  std::string v1_path, v2_path;
  for (std::string line; std::getline(cg, line);) {
    size_t a = line.find(':'), b = line.find(':', a + 1);
    std::string names = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, 2, "0:") == 0 && names.empty()) v2_path = path;
    std::stringstream list(names);
    for (std::string n; std::getline(list, n, ',');) {
      if (n == controller) v1_path = path;
    }
  }
  std::string base;
  if (!v1_path.empty() && access(("/sys/fs/cgroup/" + controller).c_str(), W_OK) == 0) {
    version_ = 1;
    base = "/sys/fs/cgroup/" + controller;
    path_ = v1_path;
  } else {
    for (const char* mount : {"/sys/fs/cgroup/unified", "/sys/fs/cgroup"}) {
      std::ifstream list(std::string(mount) + "/cgroup.controllers");
      std::string words((std::istreambuf_iterator<char>(list)), {});
      if (!v2_path.empty() && (" " + words + " ").find(" " + controller) != std::string::npos) {
        version_ = 2;
        base = mount;
        path_ = v2_path;
        break;
      }
    }
  }
  if (version_ == 0) {
    skip_reason_ = "no writable cgroup hierarchy with the " + controller + " controller";
    return;
  }
  if (path_ == "/") path_.clear();
  path_ += "/ea-test-" + std::to_string(getpid()) + "-" + std::to_string(cgroup_counter++);
  dir_ = base + path_;
  if (mkdir(dir_.c_str(), 0755) != 0) {
    skip_reason_ = "cannot create cgroup " + dir_ + ": " + std::strerror(errno);
    dir_.clear();
    return;
  }
  if (version_ == 2) {
    // v2: a controller is used in a child only when its parent enables it for its children.
    std::string parent = dir_.substr(0, dir_.find_last_of('/'));
    std::ifstream enabled(parent + "/cgroup.subtree_control");
    std::string words((std::istreambuf_iterator<char>(enabled)), {});
    if ((" " + words + " ").find(" " + controller + " ") == std::string::npos &&
        (" " + words).find(" " + controller + "\n") == std::string::npos &&
        WriteFileText(parent + "/cgroup.subtree_control", "+" + controller)) {
      enabled_in_ = parent;
      controller_ = controller;
    }
    if (access((dir_ + "/" + controller + (controller == "memory" ? ".max" : ".2MB.max")).c_str(),
               F_OK) != 0) {
      skip_reason_ = "the " + controller + " controller cannot be enabled in " + parent;
    }
  }
}

ScopedCgroup::~ScopedCgroup() {
  if (dir_.empty()) return;
  // Its processes have exited (the tests wait for them); rmdir fails while any remain.
  for (int i = 0; i < 500 && rmdir(dir_.c_str()) != 0 && errno == EBUSY; ++i) usleep(10000);
  // Leave the parent as it was.
  if (!enabled_in_.empty())
    WriteFileText(enabled_in_ + "/cgroup.subtree_control", "-" + controller_);
}

bool ScopedCgroup::Write(const std::string& name, const std::string& value) {
  if (!WriteFileText(dir_ + "/" + name, value)) {
    ADD_FAILURE() << "write " << value << " to " << dir_ << "/" << name << ": "
                  << std::strerror(errno);
    return false;
  }
  return true;
}

}  // namespace expert_arena::testing
