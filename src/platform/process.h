// Child processes of the library: the network process of a listening stream producer and of
// `serve` (src/remote/net_process.h), started with posix_spawn (never fork without exec: the
// engines that hold us are multithreaded and map huge pages), each with one control socket.
//
// Linux only (compiled under __linux__). Thread-safety: the functions are; a SpawnedChild is
// owned by one caller.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "expert_arena/status.h"
#include "platform/file.h"

namespace expert_arena::platform {

// The control socket's number in the child.
inline constexpr int kChildControlFd = 3;

struct SpawnedChild {
  pid_t pid = -1;
  UniqueFd control;  // our end of a SOCK_STREAM socketpair: non-blocking, close-on-exec
};

// Starts `program` with `argv` (argv[0] included) and the current environment. The child gets
// stdin from /dev/null, our stdout and stderr, the other end of a socketpair as fd 3, no other
// descriptor of ours (closefrom), an empty signal mask and default dispositions. Fails with
// kIoError naming the program when the socketpair or posix_spawn fails (an exec failure of
// the child shows as its exit status 127).
Result<SpawnedChild> SpawnWithControl(const std::string& program,
                                      const std::vector<std::string>& argv);

// How a child ended, when it has: waitpid(WNOHANG). nullopt while it runs. A child reaped by
// somebody else (ECHILD: SIGCHLD ignored, a waitpid(-1) of the engine's) reads as running
// while kill(pid, 0) reaches it, then as "gone (reaped elsewhere)".
std::optional<std::string> ReapIfExited(pid_t pid);
// Waits up to `timeout_seconds` for the child to end, then SIGKILLs and reaps it. Returns how
// it ended ("exit 0", "killed by signal 9").
std::string StopChild(pid_t pid, double timeout_seconds);
// kill(pid, signal); an error naming the pid when it fails.
Status SignalProcess(pid_t pid, int signal);

// In a child: SIGKILL when the thread that spawned us ends (PR_SET_PDEATHSIG), and kInternal
// when our parent is no longer `parent` (it ended before prctl: the caller exits).
Status DieWithParent(pid_t parent);

// O_NONBLOCK on `fd` (the child's control socket, for the bounded reads of net_control.h).
Status SetNonBlocking(int fd);

// True when `path` names a regular file we may execute.
bool IsExecutableFile(const std::string& path);

}  // namespace expert_arena::platform
