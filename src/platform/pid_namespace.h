// PID namespaces: a pid means something only in the namespace it was taken in. Engines in two
// containers (two PID namespaces) share arena files and stream segments whose headers record a
// pid; a message that names such a pid says whether it is one of this namespace.
//
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <string>

namespace expert_arena::platform {

// The inode of /proc/self/ns/pid: equal in two processes exactly when they share a PID
// namespace. 0 when it cannot be read (no /proc).
uint64_t PidNamespaceId();

// "pid 42" when `pid_namespace` is this process's namespace (or unknown: 0, a file written
// before it was recorded), else "pid 42 of another PID namespace (pid:[4026532301]), not a
// process here".
std::string DescribePid(uint64_t pid, uint64_t pid_namespace);

// Whether a pid recorded with `pid_namespace` names a process of this namespace (true when
// unknown).
bool PidIsLocal(uint64_t pid_namespace);

}  // namespace expert_arena::platform
