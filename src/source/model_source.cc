#include "source/model_source.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <new>
#include <numeric>

#include "common/name_map.h"
#include "platform/file.h"
#include "source/gguf_reader.h"
#include "source/model_fingerprint.h"
#include "source/model_format.h"
#include "source/safetensors_reader.h"
#include "source/selection.h"

namespace expert_arena::source {
namespace {

std::string Absolute(const std::string& path) {
  std::error_code ec;
  auto absolute = std::filesystem::absolute(path, ec);
  return ec ? path : absolute.lexically_normal().string();
}

// A directory stands for the safetensors model in it.
Result<std::string> ResolveDirectory(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return path;
  for (const char* name : {kSafetensorsIndexName, "model.safetensors"}) {
    std::string candidate = (std::filesystem::path(path) / name).string();
    if (std::filesystem::exists(candidate, ec)) return candidate;
  }
  return InvalidArgument(path + ": a directory without " + kSafetensorsIndexName +
                         " or model.safetensors");
}

// A tensor found in a model file, before selection.
struct Candidate {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  uint32_t source_index = 0;
  uint64_t source_offset = 0;
  uint64_t bytes = 0;
};

struct Collected {
  std::vector<format::SourceRecord> sources;
  std::vector<uint64_t> source_hashes;  // of each safetensors header parsed (fingerprint)
  std::vector<Candidate> tensors;
  uint64_t header_bytes = 0;
};

uint32_t AddSource(Collected& out, const std::string& path, uint64_t size) {
  // The size recorded is the one the reader validated against (the loader re-checks it); the
  // time is the target's when the path is a symlink (model caches link to blobs).
  int64_t mtime = 0;
  auto fd = platform::OpenFile(path, {.no_follow = false});
  if (fd.ok()) {
    auto st = platform::StatFd(*fd);
    if (st.ok()) mtime = st->mtime_ns;
  }
  out.sources.push_back({Absolute(path), size, mtime});
  return static_cast<uint32_t>(out.sources.size() - 1);
}

Status CollectGguf(const std::string& path, Collected& out) {
  EA_ASSIGN_OR_RETURN(GgufFile file, ReadGguf(path));
  out.header_bytes += file.header_bytes_read;
  uint32_t source = AddSource(out, path, file.file_size);
  for (GgufTensorInfo& t : file.tensors) {
    out.tensors.push_back(
        {std::move(t.name), t.type->name, std::move(t.ne), source, t.absolute_offset, t.bytes});
  }
  return Status::Ok();
}

void AddSafetensors(SafetensorsFile& file, Collected& out) {
  out.header_bytes += file.header_bytes_read;
  uint32_t source = AddSource(out, file.path, file.file_size);
  out.source_hashes.resize(out.sources.size());
  out.source_hashes[source] = file.header_hash;
  for (SafetensorsTensorInfo& t : file.tensors) {
    out.tensors.push_back({std::move(t.name), std::move(t.dtype), std::move(t.shape), source,
                           t.absolute_offset, t.bytes});
  }
}

Result<ModelPlan> PlanFromCollected(Collected collected, const ModelSpec& spec,
                                    const std::string& format) {
  // Tensor names are unique across the files of one model.
  NameMap<const Candidate*> seen(collected.tensors.size());
  for (const Candidate& t : collected.tensors) {
    auto [first, inserted] = seen.Insert(t.name, &t);
    if (!inserted) {
      return Corrupt("tensor " + t.name + " appears in both " +
                     collected.sources[(*first)->source_index].path + " and " +
                     collected.sources[t.source_index].path);
    }
  }
  EA_ASSIGN_OR_RETURN(TensorSelector selector, TensorSelector::Make(spec));
  ModelPlan plan;
  plan.format = format;
  plan.metadata_bytes_read = collected.header_bytes;
  plan.table.alignment = spec.alignment;
  plan.table.model_tensors_total = collected.tensors.size();
  plan.table.tensors.reserve(collected.tensors.size());
  for (Candidate& t : collected.tensors) {
    plan.table.model_bytes_total += t.bytes;
    EA_ASSIGN_OR_RETURN(bool selected, selector.Selects(t.name));
    if (!selected) continue;
    format::TensorRecord record;
    record.name = std::move(t.name);
    record.dtype = std::move(t.dtype);
    record.shape = std::move(t.shape);
    record.source_index = t.source_index;
    record.source_offset = t.source_offset;
    record.bytes = t.bytes;
    plan.table.tensors.push_back(std::move(record));
  }
  if (plan.table.tensors.empty()) {
    std::string files = collected.sources.empty() ? "" : collected.sources[0].path;
    if (collected.sources.size() > 1) {
      files += " and " + std::to_string(collected.sources.size() - 1) + " more";
    }
    return InvalidArgument("no tensor of " + files + " (" +
                           std::to_string(collected.tensors.size()) + " tensors) is selected by " +
                           selector.Describe() + "; " + selector.Advice());
  }
  // File order: the loader then reads each file front to back (the readers give each file's
  // tensors in offset order, so this is mostly already so).
  auto file_order = [](const format::TensorRecord& a, const format::TensorRecord& b) {
    return a.source_index != b.source_index ? a.source_index < b.source_index
                                            : a.source_offset < b.source_offset;
  };
  if (!std::is_sorted(plan.table.tensors.begin(), plan.table.tensors.end(), file_order)) {
    std::stable_sort(plan.table.tensors.begin(), plan.table.tensors.end(), file_order);
  }
  plan.table.sources = std::move(collected.sources);
  EA_RETURN_IF_ERROR(format::AssignArenaOffsets(plan.table));
  format::ComputeIdentity(plan.table);
  return plan;
}

Result<ModelPlan> PlanModelFiles(const ModelSpec& spec) {
  if (spec.files.empty()) return InvalidArgument("no model file given");
  if (spec.format == ModelFormat::kRaw) return PlanRawFiles(spec);  // asked for, never guessed
  std::vector<std::string> paths;
  std::vector<FileKind> kinds;
  for (const std::string& given : spec.files) {
    EA_ASSIGN_OR_RETURN(std::string path, ResolveDirectory(given));
    EA_ASSIGN_OR_RETURN(FileKind kind, DetectFileKind(path, spec.format, spec.words));
    paths.push_back(path);
    kinds.push_back(kind);
  }
  auto family = [](FileKind k) {
    return k == FileKind::kSafetensorsIndex ? FileKind::kSafetensors : k;
  };
  for (size_t i = 1; i < kinds.size(); ++i) {
    if (family(kinds[i]) != family(kinds[0])) {
      return InvalidArgument("model files of different formats: " + paths[0] + " is " +
                             FileKindName(kinds[0]) + ", " + paths[i] + " is " +
                             FileKindName(kinds[i]));
    }
  }
  Collected collected;
  if (kinds[0] == FileKind::kGguf) {
    for (const std::string& path : paths) EA_RETURN_IF_ERROR(CollectGguf(path, collected));
    return PlanFromCollected(std::move(collected), spec, "gguf");
  }

  // safetensors: shards named by indexes and files named directly, each read once.
  std::vector<FingerprintFile> fingerprint_files;
  for (size_t i = 0; i < paths.size(); ++i) {
    fingerprint_files.push_back(
        {Absolute(paths[i]), kinds[i] == FileKind::kSafetensorsIndex, 0});
  }
  std::vector<std::string> done;
  auto already = [&](const std::string& path) {
    std::string abs = Absolute(path);
    if (std::find(done.begin(), done.end(), abs) != done.end()) return true;
    done.push_back(abs);
    return false;
  };
  for (size_t i = 0; i < paths.size(); ++i) {
    if (kinds[i] == FileKind::kSafetensorsIndex) {
      EA_ASSIGN_OR_RETURN(SafetensorsIndex index, ReadSafetensorsIndex(paths[i]));
      collected.header_bytes += index.bytes_read;
      fingerprint_files[i].index_hash = index.content_hash;
      EA_ASSIGN_OR_RETURN(std::vector<SafetensorsFile> shards, ReadShardedSafetensors(index));
      size_t count = collected.tensors.size();
      for (const SafetensorsFile& shard : shards) count += shard.tensors.size();
      collected.tensors.reserve(count);
      for (SafetensorsFile& shard : shards) {
        if (!already(shard.path)) AddSafetensors(shard, collected);
      }
    } else if (!already(paths[i])) {
      EA_ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(paths[i]));
      AddSafetensors(file, collected);
    }
  }
  std::vector<uint64_t> hashes = std::move(collected.source_hashes);
  EA_ASSIGN_OR_RETURN(ModelPlan plan, PlanFromCollected(std::move(collected), spec, "safetensors"));
  plan.table.fingerprint =
      CombineFingerprint(spec, fingerprint_files, plan.table.sources, hashes);
  return plan;
}

}  // namespace

Result<ModelPlan> PlanModel(const ModelSpec& spec) {
  // Planning allocates what the model files' headers describe (names, shapes, metadata), all
  // bounded by the files' sizes and the readers' budgets, which may still be more than the
  // process can have (an address-space limit, a cgroup): a refusal, not an abort.
  try {
    return PlanModelFiles(spec);
  } catch (const std::bad_alloc&) {
    std::string files;
    for (const std::string& f : spec.files) files += (files.empty() ? "" : ", ") + f;
    return NoSpace("out of memory while reading the headers of " + files);
  }
}

Result<std::vector<ModelFile>> ResolveModelFiles(const ModelSpec& spec) {
  std::vector<ModelFile> files;
  for (const std::string& given : spec.files) {
    if (spec.format == ModelFormat::kRaw) {
      files.push_back({Absolute(given), ModelFileKind::kRaw});
      continue;
    }
    EA_ASSIGN_OR_RETURN(std::string path, ResolveDirectory(given));
    EA_ASSIGN_OR_RETURN(FileKind kind, DetectFileKind(path, spec.format, spec.words));
    ModelFileKind public_kind = ModelFileKind::kGguf;
    switch (kind) {
      case FileKind::kGguf:
        public_kind = ModelFileKind::kGguf;
        break;
      case FileKind::kSafetensors:
        public_kind = ModelFileKind::kSafetensors;
        break;
      case FileKind::kSafetensorsIndex:
        public_kind = ModelFileKind::kSafetensorsIndex;
        break;
    }
    files.push_back({Absolute(path), public_kind});
  }
  return files;
}

}  // namespace expert_arena::source
