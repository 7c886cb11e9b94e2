// Streams a model file to disk: a header, then each tensor's bytes at its offset, produced
// piece by piece by a filler, so a model of tens of GiB never sits in memory. Gaps between
// tensors are zeros. The file is written under a temporary name and renamed into place, so a
// reader never sees half a model at `path`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "expert_arena/status.h"

namespace expert_arena::source {

// Fills `out` with bytes [offset, offset + out.size()) of tensor `tensor`. Pieces start at
// multiples of the tensor's granule and, except the last, are multiples of it.
using TensorFiller =
    std::function<Status(size_t tensor, uint64_t offset, std::span<std::byte> out)>;

struct TensorPlacement {
  uint64_t offset = 0;  // absolute in the file
  uint64_t bytes = 0;
  uint64_t granule = 1;  // a quantization block or an element
};

// Writes header at 0 and every tensor (in order of offset; they must not overlap) at its
// place; the file is file_bytes long.
Status WriteTensorFile(const std::string& path, std::span<const std::byte> header,
                       std::span<const TensorPlacement> tensors, uint64_t file_bytes,
                       const TensorFiller& fill);

}  // namespace expert_arena::source
