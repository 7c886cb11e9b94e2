#include "source/model_fingerprint.h"

#include <xxhash.h>

#include <cstring>

#include "platform/file.h"
#include "platform/mapping.h"
#include "source/model_source.h"
#include "source/safetensors_reader.h"

namespace expert_arena::source {
namespace {

struct Hasher {
  XXH3_state_t* state = XXH3_createState();
  Hasher() { XXH3_64bits_reset(state); }
  ~Hasher() { XXH3_freeState(state); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void Add(const void* p, size_t n) { XXH3_64bits_update(state, p, n); }
  void U64(uint64_t v) { Add(&v, sizeof v); }
  void Str(const std::string& s) {
    U64(s.size());
    Add(s.data(), s.size());
  }
  uint64_t Digest() { return XXH3_64bits_digest(state); }
};

// The file's bytes [0, size) through a read-only mapping (no heap, whatever the size).
Result<platform::Mapping> MapPrefix(const platform::UniqueFd& fd, uint64_t size) {
  return platform::Mapping::MapFile(fd, size, false, platform::BasePageSize());
}

}  // namespace

uint64_t HashSafetensorsHeader(uint64_t header_length, const void* text) {
  return XXH3_64bits_withSeed(text, header_length, header_length);
}

uint64_t HashIndexBytes(const void* bytes, uint64_t size) {
  return XXH3_64bits_withSeed(bytes, size, size ^ 0x696e646578ull);
}

uint64_t CombineFingerprint(const ModelSpec& spec, std::span<const FingerprintFile> files,
                            std::span<const format::SourceRecord> sources,
                            std::span<const uint64_t> source_hashes) {
  Hasher h;
  h.U64(kPlanRevision);
  h.Str(spec.select);
  h.U64(spec.select_all ? 1 : 0);
  h.U64(spec.alignment);
  h.U64(files.size());
  for (const FingerprintFile& f : files) {
    h.Str(f.path);
    h.U64(f.index ? 1 : 0);
    h.U64(f.index_hash);
  }
  h.U64(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    h.Str(sources[i].path);
    h.U64(sources[i].size);
    h.U64(static_cast<uint64_t>(sources[i].mtime_ns));
    h.U64(i < source_hashes.size() ? source_hashes[i] : 0);
  }
  uint64_t value = h.Digest();
  return value == 0 ? 1 : value;  // 0 means "none"
}

Result<bool> HasFingerprint(const ModelSpec& spec) {
  EA_ASSIGN_OR_RETURN(std::vector<ModelFile> files, ResolveModelFiles(spec));
  for (const ModelFile& f : files) {
    if (f.kind != ModelFileKind::kSafetensors && f.kind != ModelFileKind::kSafetensorsIndex) {
      return false;
    }
  }
  return !files.empty();
}

Result<FingerprintCheck> FingerprintFromSources(const ModelSpec& spec,
                                                std::span<const format::SourceRecord> sources) {
  FingerprintCheck check;
  EA_ASSIGN_OR_RETURN(std::vector<ModelFile> resolved, ResolveModelFiles(spec));
  std::vector<FingerprintFile> files;
  files.reserve(resolved.size());
  for (const ModelFile& f : resolved) {
    FingerprintFile file{f.path, f.kind == ModelFileKind::kSafetensorsIndex, 0};
    if (file.index) {
      EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(f.path, {.no_follow = false}));
      EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
      if (st.size == 0 || st.size > kMaxSafetensorsIndexBytes) {
        check.mismatch = f.path + ": index of " + std::to_string(st.size) + " bytes";
        return check;
      }
      EA_ASSIGN_OR_RETURN(platform::Mapping map, MapPrefix(fd, st.size));
      file.index_hash = HashIndexBytes(map.data(), st.size);
      check.bytes_read += st.size;
    }
    files.push_back(std::move(file));
  }
  std::vector<uint64_t> hashes(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const format::SourceRecord& source = sources[i];
    auto fd = platform::OpenFile(source.path, {.no_follow = false});
    if (!fd.ok()) {
      check.mismatch = fd.status().message();
      return check;
    }
    EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(*fd));
    if (!st.regular || st.size != source.size || st.mtime_ns != source.mtime_ns) {
      check.mismatch = source.path + " changed (size or modification time)";
      return check;
    }
    uint64_t length = 0;
    if (st.size < 8) {
      check.mismatch = source.path + ": too short for a safetensors header";
      return check;
    }
    EA_RETURN_IF_ERROR(
        platform::ReadFull(*fd, 0, {reinterpret_cast<std::byte*>(&length), sizeof length}));
    if (length > kMaxSafetensorsHeaderBytes || length > st.size - 8) {
      check.mismatch = source.path + ": header length " + std::to_string(length);
      return check;
    }
    EA_ASSIGN_OR_RETURN(platform::Mapping map, MapPrefix(*fd, 8 + length));
    hashes[i] = HashSafetensorsHeader(length, map.data() + 8);
    check.bytes_read += 8 + length;
  }
  check.fingerprint = CombineFingerprint(spec, files, sources, hashes);
  return check;
}

}  // namespace expert_arena::source
