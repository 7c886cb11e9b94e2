// Engine-made arenas (docs/engine-arenas.md): the identity, the table and the fill of an arena
// whose tensors an engine made itself. The protocol is the shared one (shared_arena.cc, with
// ModelWant::engine_identity); what differs is who knows the table: only the engine that builds,
// so an arena is matched by its identity hash alone, and planned by the engine holding FILL.
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "arena/arena_impl.h"
#include "common/escape.h"
#include "common/units.h"
#include "format/arena_format.h"
#include "common/fast_xxh3.h"
#include "common/ready_front.h"
#include "platform/file.h"

namespace expert_arena::arena {
namespace {

// Bumped when the same spec would make another table or another hash.
constexpr char kEngineDomain[] = "expert-arena engine arena v1";
// A checkpoint's small files (config.json, an index) are hashed whole, up to this.
constexpr uint64_t kWholeFileBytes = 1 * kMiB;
// Of any other file that is not safetensors, the first bytes.
constexpr uint64_t kPrefixBytes = 64 * 1024;
// A safetensors header larger than this is not one (the format's own limit is 100 MB).
constexpr uint64_t kMaxSafetensorsHeader = 100 * 1000 * 1000;

class Hasher {
 public:
  Hasher() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
  ~Hasher() { XXH3_freeState(state_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void Bytes(const void* p, size_t n) { XXH3_64bits_update(state_, p, n); }
  void U64(uint64_t v) { Bytes(&v, sizeof v); }
  void Str(std::string_view s) {
    U64(s.size());
    Bytes(s.data(), s.size());
  }
  uint64_t Digest() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;
};

bool IsCheckpointFile(const std::filesystem::path& p) {
  static const std::set<std::string> kinds = {".safetensors", ".gguf", ".json", ".bin", ".pt",
                                              ".pth"};
  return kinds.count(p.extension().string()) > 0;
}

// The files a given path stands for: itself, or a directory's checkpoint files (not its
// subdirectories), sorted; symlinks (a Hugging Face cache's snapshots) resolved.
Result<std::vector<std::string>> ExpandFiles(const std::vector<std::string>& given) {
  std::vector<std::string> out;
  for (const std::string& path : given) {
    std::error_code ec;
    std::filesystem::path real = std::filesystem::canonical(path, ec);
    if (ec) {
      return NotFound("checkpoint file " + QuoteForMessage(path) +
                      " of the engine arena: " + ec.message());
    }
    if (std::filesystem::is_directory(real, ec)) {
      std::vector<std::string> found;
      for (const auto& entry : std::filesystem::directory_iterator(real, ec)) {
        if (!IsCheckpointFile(entry.path())) continue;
        std::filesystem::path target = std::filesystem::canonical(entry.path(), ec);
        if (!ec && std::filesystem::is_regular_file(target, ec)) {
          found.push_back(entry.path().string() + "\n" + target.string());
        }
      }
      if (ec) {
        return Internal("reading the checkpoint directory " + real.string() + ": " +
                       ec.message());
      }
      if (found.empty()) {
        return NotFound("checkpoint directory " + real.string() +
                        " holds no .safetensors, .gguf, .json, .bin or .pt file");
      }
      std::sort(found.begin(), found.end());
      for (const std::string& f : found) out.push_back(f.substr(f.find('\n') + 1));
    } else {
      out.push_back(real.string());
    }
  }
  return out;
}

// Hashes what identifies one file's contents without reading its tensors.
Status HashFile(const std::string& path, const platform::FileStat& st, Hasher& h,
                uint64_t& bytes_read) {
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(path, platform::OpenOptions{}));
  std::vector<std::byte> buf;
  auto read = [&](uint64_t offset, uint64_t n) -> Status {
    buf.resize(n);
    EA_RETURN_IF_ERROR(platform::ReadFull(fd, offset, buf));
    bytes_read += n;
    h.Bytes(buf.data(), buf.size());
    return Status::Ok();
  };
  if (path.ends_with(".safetensors") && st.size >= 8) {
    uint64_t header = 0;
    std::vector<std::byte> length(8);
    EA_RETURN_IF_ERROR(platform::ReadFull(fd, 0, length));
    bytes_read += 8;
    std::memcpy(&header, length.data(), 8);
    if (header > 0 && header <= kMaxSafetensorsHeader && header <= st.size - 8) {
      h.U64(header);
      return read(8, header);
    }
  }
  return read(0, std::min(st.size, st.size <= kWholeFileBytes ? st.size : kPrefixBytes));
}

}  // namespace

Result<EngineIdentity> IdentifyEngineArena(const EngineArenaSpec& spec) {
  if (spec.identity.empty()) {
    return InvalidArgument(
        "an engine-made arena needs an identity (the engine and its version, the transform's "
        "settings, rank and world size)");
  }
  EngineIdentity id;
  id.text = EscapeForMessage(spec.identity);
  Hasher h;
  h.Str(kEngineDomain);
  h.Str(spec.identity);
  h.U64(spec.alignment);
  EA_ASSIGN_OR_RETURN(std::vector<std::string> files, ExpandFiles(spec.files));
  h.U64(files.size());
  for (const std::string& path : files) {
    EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatPath(path));
    h.Str(path);
    h.U64(st.size);
    h.U64(static_cast<uint64_t>(st.mtime_ns));
    EA_RETURN_IF_ERROR(HashFile(path, st, h, id.bytes_read));
    id.sources.push_back(format::SourceRecord{path, st.size, st.mtime_ns});
  }
  id.hash = h.Digest();
  if (id.hash == 0) id.hash = 1;  // 0 means "not an engine arena"
  if (id.sources.empty()) {
    // Every tensor names a source: an engine arena made from no file names its identity.
    id.sources.push_back(format::SourceRecord{"engine:" + spec.identity, 0, 0});
  }
  return id;
}

Result<source::ModelPlan> PlanEngineArena(const EngineArenaSpec& spec, const EngineIdentity& id) {
  Result<std::vector<EngineTensor>> declared = Internal("declare did not run");
  try {
    declared = spec.declare();
  } catch (const std::exception& e) {
    return Internal(std::string("the engine's declare threw: ") + e.what());
  } catch (...) {
    return Internal("the engine's declare threw");
  }
  if (!declared.ok()) return declared.status().WithContext("the engine's declare");
  const std::vector<EngineTensor>& tensors = *declared;
  if (tensors.empty()) return InvalidArgument("the engine declared no tensor");
  auto power_of_two = [](uint64_t a) { return a != 0 && (a & (a - 1)) == 0 && a <= kHugePageBytes; };
  if (!power_of_two(spec.alignment)) {
    return InvalidArgument("engine arena alignment must be a power of two up to 2 MiB, got " +
                           std::to_string(spec.alignment));
  }
  source::ModelPlan plan;
  plan.format = "engine";
  format::ArenaTable& table = plan.table;
  table.sources = id.sources;
  table.alignment = spec.alignment;
  std::set<std::string_view> names;
  uint64_t cursor = 0;
  for (const EngineTensor& t : tensors) {
    std::string problem = format::TensorNameProblem(t.name);
    if (!problem.empty()) return InvalidArgument("declared tensor " + QuoteForMessage(t.name) + ": " + problem);
    if (!names.insert(t.name).second) {
      return InvalidArgument("tensor " + QuoteForMessage(t.name) + " declared twice");
    }
    if (t.dtype.empty() || t.dtype.size() > 32 || !ControlByteProblem(t.dtype).empty()) {
      return InvalidArgument("declared tensor " + QuoteForMessage(t.name) + ": dtype " +
                             QuoteForMessage(t.dtype) +
                             " must be 1 to 32 printable bytes (\"F32\", \"BF16\", ...)");
    }
    if (t.shape.size() > format::kMaxDims) {
      return InvalidArgument("declared tensor " + QuoteForMessage(t.name) + ": " +
                             std::to_string(t.shape.size()) + " dimensions, at most " +
                             std::to_string(format::kMaxDims));
    }
    const uint64_t asked = t.alignment == 0 ? spec.alignment : t.alignment;
    const uint64_t alignment = std::max(asked, format::TensorAlignment(spec.alignment, t.bytes));
    if (!power_of_two(asked) || !power_of_two(alignment)) {
      return InvalidArgument("declared tensor " + QuoteForMessage(t.name) +
                             ": alignment must be a power of two up to 2 MiB, got " +
                             std::to_string(t.alignment));
    }
    const uint64_t offset = (cursor + alignment - 1) / alignment * alignment;
    if (offset < cursor || t.bytes > UINT64_MAX - offset - kHugePageBytes) {
      return InvalidArgument("engine arena size overflows at tensor " + QuoteForMessage(t.name));
    }
    format::TensorRecord r;
    r.name = t.name;
    r.dtype = t.dtype;
    r.shape = t.shape;
    r.bytes = t.bytes;
    r.arena_offset = offset;
    cursor = offset + t.bytes;
    table.model_bytes_total += t.bytes;
    table.tensors.push_back(std::move(r));
  }
  table.model_tensors_total = table.tensors.size();
  const uint64_t data = (cursor + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  table.data_bytes = data == 0 ? kHugePageBytes : data;
  table.identity_hash = id.hash;
  // The fingerprint equal to the identity hash is what marks the table engine-made
  // (format::EngineMade): its identity is not recomputed from the table when it is read.
  table.fingerprint = id.hash;
  table.identity_text = "engine " + id.text + " (" + std::to_string(table.tensors.size()) +
                        " tensors, " + FormatBytes(table.model_bytes_total) + ")";
  return plan;
}

Result<load::LoadResult> FillEngineArena(const EngineArenaSpec& spec,
                                         const load::LoadRequest& request,
                                         format::ArenaTable& table) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<WritableTensor> views;
  views.reserve(table.tensors.size());
  for (const format::TensorRecord& t : table.tensors) {
    if (t.arena_offset > request.data.size() || t.bytes > request.data.size() - t.arena_offset) {
      return Internal("engine tensor " + t.name + " lies outside the data region");
    }
    WritableTensor view{t.name, t.dtype, t.shape, request.data.subspan(t.arena_offset, t.bytes),
                        nullptr};
    if (request.permit_pages && request.ready_front != nullptr) {
      // Paced pages: this tensor's are made when its writer asks, not before fill.
      const uint64_t end = request.ready_base + t.arena_offset + t.bytes;
      view.make_pages = [&request, end] {
        request.permit_pages(end);
        return request.ready_front->WaitFor(end);
      };
    } else {
      view.make_pages = [] { return Status::Ok(); };
    }
    views.push_back(std::move(view));
  }
  Status filled = Internal("fill did not run");
  try {
    filled = spec.fill(views);
  } catch (const std::exception& e) {
    return Internal(std::string("the engine's fill threw: ") + e.what());
  } catch (...) {
    return Internal("the engine's fill threw");
  }
  if (!filled.ok()) return filled.WithContext("the engine's fill");
  // The checksums: one pass over every byte written, the tensors shared among up to 8 threads
  // (on a build's critical path: an engine is not ready before its arena is sealed).
  std::atomic<size_t> next{0};
  const auto hash = [&] {
    for (size_t i = next++; i < table.tensors.size(); i = next++) {
      format::TensorRecord& t = table.tensors[i];
      t.checksum = FastXxh3(request.data.data() + t.arena_offset, t.bytes);
    }
  };
  const unsigned threads = static_cast<unsigned>(std::min<size_t>(
      std::clamp(std::thread::hardware_concurrency(), 1u, 8u), table.tensors.size()));
  std::vector<std::thread> helpers;
  for (unsigned i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(hash);
    } catch (const std::system_error&) {
      break;  // no thread to be had (a pids limit): this one hashes the rest
    }
  }
  hash();
  for (std::thread& t : helpers) t.join();
  load::LoadResult result;
  result.reader = "engine";
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace expert_arena::arena
