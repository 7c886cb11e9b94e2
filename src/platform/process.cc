// Child processes (process.h).
#include "platform/process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

extern char** environ;

namespace expert_arena::platform {
namespace {

std::string ExitText(int status) {
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = strsignal(sig);
    return "killed by signal " + std::to_string(sig) + (name ? std::string(" (") + name + ")" : "");
  }
  return "status " + std::to_string(status);
}

}  // namespace

Result<SpawnedChild> SpawnWithControl(const std::string& program,
                                      const std::vector<std::string>& argv) {
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    return ErrnoStatus(errno, "socketpair", "control of " + program);
  }
  UniqueFd ours(pair[0], "control of " + program);
  UniqueFd theirs(pair[1], "control of " + program);
  if (theirs.get() == kChildControlFd) {
    // dup2 onto itself would leave close-on-exec set: move it first.
    int moved = fcntl(theirs.get(), F_DUPFD_CLOEXEC, kChildControlFd + 1);
    if (moved < 0) return ErrnoStatus(errno, "fcntl F_DUPFD", "control of " + program);
    theirs = UniqueFd(moved, "control of " + program);
  }
  EA_RETURN_IF_ERROR(SetNonBlocking(ours.get()));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, theirs.get(), kChildControlFd);
  posix_spawn_file_actions_addclosefrom_np(&actions, kChildControlFd + 1);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  sigset_t all;
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int err = posix_spawn(&pid, program.c_str(), &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (err != 0) return ErrnoStatus(err, "posix_spawn", program);
  return SpawnedChild{pid, std::move(ours)};
}

std::optional<std::string> ReapIfExited(pid_t pid) {
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return std::nullopt;
  if (r < 0) {
    // ECHILD: somebody else reaps our children (SIGCHLD ignored: the kernel does). Alive while
    // it can still be signalled.
    if (kill(pid, 0) == 0) return std::nullopt;
    return std::string("gone (reaped elsewhere)");
  }
  return ExitText(status);
}

std::string StopChild(pid_t pid, double timeout_seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (auto how = ReapIfExited(pid)) return *how;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid, &status, 0);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return "gone (reaped elsewhere)";
  return ExitText(status) + " (after " + std::to_string(timeout_seconds) + " s)";
}

Status SignalProcess(pid_t pid, int signal) {
  if (kill(pid, signal) != 0) return ErrnoStatus(errno, "kill", "pid " + std::to_string(pid));
  return Status::Ok();
}

Status DieWithParent(pid_t parent) {
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return ErrnoStatus(errno, "prctl", "PDEATHSIG");
  // The parent may have gone before prctl: we were then given to another process.
  if (getppid() != parent) return Internal("the parent process is gone");
  return Status::Ok();
}

Status SetNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoStatus(errno, "fcntl O_NONBLOCK", "fd " + std::to_string(fd));
  }
  return Status::Ok();
}

bool IsExecutableFile(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

}  // namespace expert_arena::platform
