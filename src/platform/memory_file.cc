#include "platform/memory_file.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

namespace expert_arena::platform {

Result<UniqueFd> CreateMemoryFile(const std::string& name, std::span<const std::byte> contents) {
  int raw = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (raw < 0) return ErrnoStatus(errno, "memfd_create", name);
  UniqueFd fd(raw, "/proc/self/fd/" + std::to_string(raw));
  if (!contents.empty()) EA_RETURN_IF_ERROR(WriteFull(fd, 0, contents));
  return fd;
}

}  // namespace expert_arena::platform
