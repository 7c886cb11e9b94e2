// Helpers for the stream tests: private directories, deterministic tensor contents, and a
// file-based channel between the test and its child processes.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/stream.h"

namespace expert_arena::testing {

// A fresh stream directory under the test directory (/dev/shm) and a spill directory under
// /tmp, both removed at the end. remaining() lists what is still in them.
class StreamDirs {
 public:
  StreamDirs();
  ~StreamDirs();
  const std::string& shm() const { return shm_; }
  const std::string& spill() const { return spill_; }
  std::vector<std::string> remaining() const;
  StreamOptions Producer(const std::string& logical = "test") const;
  ConsumerOptions Consumer() const;

 private:
  std::string shm_;
  std::string spill_;
};

// Bytes derived from (key, size) only, so any process can check them.
void FillPattern(std::span<std::byte> out, const std::string& key);
bool CheckPattern(std::span<const std::byte> bytes, const std::string& key);

// Length-prefixed messages appended to a file; WriteMessages replaces the file atomically.
void WriteMessages(const std::string& path, const std::vector<std::string>& messages);
std::vector<std::string> ReadMessages(const std::string& path);

// Waits until `path` exists (true) or the timeout passes (false).
bool WaitForFile(const std::string& path, double seconds);
void TouchFile(const std::string& path);

// True when `text` is printable ASCII (0x20..0x7e), newlines too with `allow_newlines`: what
// a message or a tool's output that quotes a peer's string must be.
bool PrintableAscii(std::string_view text, bool allow_newlines = false);

// Overwrites the logical name field of the header of the segment file at `path` with `name`
// (NUL-padded to the field's 64 bytes, or cut to them), as a hostile or buggy peer could.
void WriteLogicalName(const std::string& path, const std::string& name);

}  // namespace expert_arena::testing
