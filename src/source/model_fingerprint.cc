#include "source/model_fingerprint.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "platform/file.h"
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

// XXH3-64 (seeded) of the file's bytes [offset, offset + length), read in pieces through one
// buffer: the same value as the one-shot hash of those bytes, in bounded memory.
Result<uint64_t> HashFileRange(const platform::UniqueFd& fd, uint64_t offset, uint64_t length,
                               uint64_t seed, std::vector<std::byte>& buffer) {
  constexpr uint64_t kPiece = 1 << 20;
  if (buffer.size() < std::min(length, kPiece)) buffer.resize(std::min(length, kPiece));
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset_withSeed(state, seed);
  for (uint64_t done = 0; done < length;) {
    size_t n = static_cast<size_t>(std::min(length - done, kPiece));
    Status s = platform::ReadFull(fd, offset + done, std::span(buffer).first(n));
    if (!s.ok()) {
      XXH3_freeState(state);
      return s;
    }
    XXH3_64bits_update(state, buffer.data(), n);
    done += n;
  }
  uint64_t value = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return value;
}

uint64_t IndexSeed(uint64_t size) { return size ^ 0x696e646578ull; }

}  // namespace

uint64_t HashSafetensorsHeader(uint64_t header_length, const void* text) {
  return XXH3_64bits_withSeed(text, header_length, header_length);
}

uint64_t HashIndexBytes(const void* bytes, uint64_t size) {
  return XXH3_64bits_withSeed(bytes, size, IndexSeed(size));
}

uint64_t CombineFingerprint(const ModelSpec& spec, std::span<const FingerprintFile> files,
                            std::span<const format::SourceRecord> sources,
                            std::span<const uint64_t> source_hashes) {
  Hasher h;
  h.U64(kPlanRevision);
  h.Str(spec.select);
  h.U64(spec.select_all ? 1 : 0);
  h.U64(spec.alignment);
  h.U64(static_cast<uint64_t>(spec.format));
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
  std::vector<std::byte> buffer;
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
      EA_ASSIGN_OR_RETURN(file.index_hash,
                          HashFileRange(fd, 0, st.size, IndexSeed(st.size), buffer));
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
    EA_ASSIGN_OR_RETURN(hashes[i], HashFileRange(*fd, 8, length, length, buffer));
    check.bytes_read += 8 + length;
  }
  check.fingerprint = CombineFingerprint(spec, files, sources, hashes);
  return check;
}

}  // namespace expert_arena::source
