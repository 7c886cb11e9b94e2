// Which reader a model file goes to, decided from its first bytes, and the refusal of files
// that are not models.
//
// A file is read as GGUF (its magic), safetensors (an 8-byte header length that fits the
// file, then '{') or a safetensors index (a .json name holding a JSON object). Anything else
// is refused with a message that names the file and says what it looks like, because the
// commonest "model" that is not one is an accident the user can fix: an empty file, a Git LFS
// pointer left by a clone without `git lfs pull`, an HTML error page saved under the model's
// name, a damaged header. Raw bytes are loaded only when the caller asks for ModelFormat::kRaw
// (which never comes here).
#pragma once

#include <string>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"

namespace expert_arena::source {

enum class FileKind { kGguf, kSafetensors, kSafetensorsIndex };

const char* FileKindName(FileKind kind);

// The reader for `path` under `format` (kAuto, kGguf or kSafetensors; not kRaw). Reads at
// most the first 4 KiB; these bytes are not counted as model bytes read (the readers read
// them again and count them). Fails naming the file when it is not a regular file, when it is
// empty, a Git LFS pointer or an HTML page, when its name or `format` promises GGUF or
// safetensors and the header says otherwise, and, under kAuto, when it is none of the three.
Result<FileKind> DetectFileKind(const std::string& path, ModelFormat format,
                                OptionWords words = OptionWords::kCpp);

}  // namespace expert_arena::source
