// Anonymous in-memory files (memfd_create): bytes that readers taking a UniqueFd or a path
// can parse like a file, leaving nothing on disk or in /dev/shm. The fuzz targets feed their
// inputs to the model and arena readers this way.
//
// Thread-safety: the returned UniqueFd is an ordinary move-only owner; the file disappears
// when the last descriptor to it is closed.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "expert_arena/status.h"
#include "platform/file.h"

namespace expert_arena::platform {

// Creates an anonymous file (memfd_create, close-on-exec) holding `contents`. The returned
// fd's path() is "/proc/self/fd/N", which this process can open again by name (readers that
// only take a path). Fails with errno naming `name` when the kernel refuses or memory is short.
Result<UniqueFd> CreateMemoryFile(const std::string& name, std::span<const std::byte> contents);

}  // namespace expert_arena::platform
