// Model sources: turn the files a user names into an ArenaTable (which tensors, from which
// file and offset, how many bytes), reading only headers and file metadata.
//
// Formats are detected from the file contents: GGUF by its magic, safetensors by its
// header or a model.safetensors.index.json; anything else is refused, saying what the file
// looks like (source/model_format.h). Only when the caller asks for ModelFormat::kRaw is
// each file loaded as one raw tensor (dtype "u8").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "format/arena_table.h"

namespace expert_arena::source {

struct ModelPlan {
  format::ArenaTable table;          // arena offsets assigned, identity computed
  std::string format;                // "gguf", "safetensors", "raw"
  uint64_t metadata_bytes_read = 0;  // header bytes read to build the plan
};

// Reads the headers of spec.files, selects tensors, assigns arena offsets, computes the
// identity. Errors name the file (and the tensor) that is wrong.
Result<ModelPlan> PlanModel(const ModelSpec& spec);

// The files of a spec as PlanModel sees them: resolved (a directory stands for its index or
// model.safetensors), made absolute, and classified from their first bytes (kRaw: every file
// when spec.format says raw).
enum class ModelFileKind { kGguf, kSafetensors, kSafetensorsIndex, kRaw };
struct ModelFile {
  std::string path;
  ModelFileKind kind;
};
Result<std::vector<ModelFile>> ResolveModelFiles(const ModelSpec& spec);

// The raw reader (ModelFormat::kRaw): every file is one tensor of dtype "u8" named after the
// file.
Result<ModelPlan> PlanRawFiles(const ModelSpec& spec);

}  // namespace expert_arena::source
