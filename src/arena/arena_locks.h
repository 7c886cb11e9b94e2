// The two one-byte OFD locks of an arena file (docs/arena-protocol.md), shared
// by the protocol (shared_arena.cc) and the tools (arena_file.cc) so they can never disagree.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "platform/file.h"

namespace expert_arena::arena {

// Exclusive while an engine decides what to do with the file and, when it loads, until the
// load is published.
inline constexpr uint64_t kFillByte = 0;
// Shared by every engine that maps the published file; exclusive by a loader until it
// publishes, and by an engine that replaces or removes the file.
inline constexpr uint64_t kUserByte = 1;

// Whether `path` still names the file `st` was taken of: a decision taken under the locks of
// an open file is only about the path while it does (another engine may have replaced the
// file, by unlink and create, between our open and our lock).
inline bool PathNamesFile(const std::string& path, const platform::FileStat& st) {
  auto now = platform::StatPath(path);
  return now.ok() && now->device == st.device && now->inode == st.inode;
}

// The directory holding `path`, for statfs.
inline std::string DirectoryOf(const std::string& path) {
  auto parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

}  // namespace expert_arena::arena
