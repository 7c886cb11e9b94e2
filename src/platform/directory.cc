#include "platform/directory.h"

#include <dirent.h>

#include <cerrno>
#include <cstring>

namespace expert_arena::platform {

Result<std::vector<std::string>> ListDirectory(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    // The words an operator uses, not the call's: a typo in a path is the common case.
    if (errno == ENOENT) return NotFound(dir + ": the directory does not exist");
    if (errno == ENOTDIR) return InvalidArgument(dir + ": not a directory");
    return ErrnoStatus(errno, "open directory", dir);
  }
  std::vector<std::string> names;
  for (;;) {
    errno = 0;
    struct dirent* entry = ::readdir(d);
    if (entry == nullptr) break;
    if (std::strcmp(entry->d_name, ".") == 0 || std::strcmp(entry->d_name, "..") == 0) continue;
    names.emplace_back(entry->d_name);
  }
  int err = errno;
  ::closedir(d);
  if (err != 0) return ErrnoStatus(err, "read directory", dir);
  return names;
}

}  // namespace expert_arena::platform
