#include "platform/pid_namespace.h"

#include <sys/stat.h>

namespace expert_arena::platform {

uint64_t PidNamespaceId() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

bool PidIsLocal(uint64_t pid_namespace) {
  if (pid_namespace == 0) return true;
  const uint64_t mine = PidNamespaceId();
  return mine == 0 || mine == pid_namespace;
}

std::string DescribePid(uint64_t pid, uint64_t pid_namespace) {
  std::string out = "pid " + std::to_string(pid);
  if (PidIsLocal(pid_namespace)) return out;
  return out + " of another PID namespace (pid:[" + std::to_string(pid_namespace) +
         "]), not a process here";
}

}  // namespace expert_arena::platform
