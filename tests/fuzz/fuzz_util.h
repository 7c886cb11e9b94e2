// Shared by the fuzz targets: invariant checks that abort (so libFuzzer, and the corpus
// replay under ctest, report the input), and inputs turned into in-memory files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "expert_arena/status.h"
#include "platform/file.h"
#include "platform/memory_file.h"

// A parser accepted something it must not have, or produced a result that breaks its own
// contract: abort so the fuzzer keeps the input.
#define FUZZ_CHECK(cond)                                                                         \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      std::fprintf(stderr, "fuzz invariant violated: %s at %s:%d\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                              \
    }                                                                                            \
  } while (0)

namespace expert_arena::fuzz {

inline std::span<const std::byte> Bytes(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const std::byte*>(data), size};
}

// The input as an anonymous file. A failure here is not the parser's fault unless it is
// EMFILE, which means a reader leaked descriptors across runs: abort on every failure, so
// that leak is reported too.
inline platform::UniqueFd MemoryFileOrDie(const char* name, std::span<const std::byte> bytes) {
  auto fd = platform::CreateMemoryFile(name, bytes);
  if (!fd.ok()) {
    std::fprintf(stderr, "fuzz: %s\n", fd.status().ToString().c_str());
    std::abort();
  }
  return std::move(*fd);
}

// Refusals must say what is wrong: an empty message is a bug. EA_FUZZ_VERBOSE=1 prints them
// (to see what a seed exercises when replaying it).
inline void CheckRefusal(const Status& status) {
  FUZZ_CHECK(!status.message().empty());
  static const bool verbose = std::getenv("EA_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "  refused: %s\n", status.ToString().c_str());
}

}  // namespace expert_arena::fuzz
