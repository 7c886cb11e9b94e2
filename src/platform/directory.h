// Directory listing for the stream sweep (readdir(3) behind a Status).
#pragma once

#include <string>
#include <vector>

#include "expert_arena/status.h"

namespace expert_arena::platform {

// The names in `dir` (not "." or ".."), in the order the kernel returns them. Fails naming the
// directory when it cannot be opened or read.
Result<std::vector<std::string>> ListDirectory(const std::string& dir);

}  // namespace expert_arena::platform
