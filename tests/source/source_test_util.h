// Helpers of the model-source tests: files and directories that clean up after themselves,
// raw file bytes, and independent parsers of the formats (not the readers under test).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace expert_arena::testing {

// A fresh directory under /tmp, removed with everything in it.
class ScopedDir {
 public:
  explicit ScopedDir(const std::string& tag);
  ~ScopedDir();
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::vector<std::byte> ReadFileBytes(const std::string& path);
void WriteFileBytes(const std::string& path, const std::vector<std::byte>& bytes);
std::vector<std::byte> ReadRange(const std::string& path, uint64_t offset, uint64_t bytes);

struct IndependentTensor {
  uint64_t offset = 0;  // absolute in the file
  uint64_t bytes = 0;
  std::string dtype;
};

// Minimal GGUF parser written for the tests: tensor name -> absolute offset (size from `bytes`
// given per type id: block elems and block bytes for the few types the tests write).
std::map<std::string, IndependentTensor> ParseGgufIndependently(const std::string& path);
// safetensors: name -> absolute offset and size, from the JSON header.
std::map<std::string, IndependentTensor> ParseSafetensorsIndependently(const std::string& path);

}  // namespace expert_arena::testing
