// The C interface (include/expert_arena/expert_arena.h) over the C++ Arena API.
//
// Every entry point catches everything: a C caller (or a Python interpreter) has no way to
// handle a C++ exception, so an allocation failure becomes -ENOMEM and anything else -EIO,
// with the message in ea_last_error().
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#include "capi/capi_internal.h"
#include "expert_arena/arena.h"
#include "expert_arena/expert_arena.h"

#ifndef EXPERT_ARENA_VERSION_STRING
#define EXPERT_ARENA_VERSION_STRING "unknown"
#endif

struct ea_arena {
  expert_arena::Arena arena;
  std::string start_line;
};

namespace expert_arena {
namespace {

using capi::CopyOut;
using capi::Fail;
using capi::last_error;

int FillView(const TensorView& v, ea_tensor_view* out) {
  ea_tensor_view view{};
  view.size = sizeof view;
  // The names and dtypes are std::strings of the arena's tensor table, so their data() is
  // NUL-terminated and lives as long as the arena.
  view.name = v.name.data();
  view.dtype = v.dtype.data();
  view.shape = v.shape.data();
  view.ndim = static_cast<uint32_t>(v.shape.size());
  view.data = v.bytes.data();
  view.bytes = v.bytes.size();
  view.file_offset = v.file_offset;
  view.checksum = v.checksum;
  CopyOut(view, out);
  return 0;
}

// What an engine's callback returned, as the library's status: "returned -12 (Cannot allocate
// memory)", with the code of that errno.
Status CallbackFailed(int rc) {
  const int err = rc < 0 ? -rc : EIO;
  return Status(ErrnoStatus(err, "", "").code(),
                "returned " + std::to_string(rc) + " (" + std::strerror(err) + ")");
}

// The options of an ea_open_params (already merged with the defaults); 0 or a Fail().
int MakeOptions(const ea_open_params& p, const std::string& who, ArenaOptions& options) {
  options.shared_path = p.shared_path != nullptr ? p.shared_path : "";
  if (!(p.wait_timeout_seconds >= 0)) {
    return Fail(-EINVAL, who + ": wait_timeout_seconds is negative or not a number");
  }
  options.wait_timeout_seconds = p.wait_timeout_seconds;
  switch (p.huge_pages) {
    case EA_HUGE_AUTO:
      options.huge = HugePages::kAuto;
      break;
    case EA_HUGE_ON:
      options.huge = HugePages::kOn;
      break;
    case EA_HUGE_OFF:
      options.huge = HugePages::kOff;
      break;
    default:
      return Fail(-EINVAL, who + ": huge_pages " + std::to_string(p.huge_pages) +
                               " is not EA_HUGE_AUTO, EA_HUGE_ON or EA_HUGE_OFF");
  }
  if (p.gpu != nullptr) {
    auto gpu = ParseGpuDevice(p.gpu);
    if (!gpu.ok()) return Fail(-EINVAL, who + ": gpu: " + gpu.status().message());
    options.gpu = *gpu;
  }
  options.gpu_required = p.gpu_required != 0;
  options.file_mode = static_cast<mode_t>(p.file_mode != 0 ? p.file_mode : 0600);
  options.allow_foreign_owner = p.allow_foreign_owner != 0;
  options.allow_world_writable = p.allow_world_writable != 0;
  options.progress = false;
  options.from_peer = p.from_peer != nullptr ? p.from_peer : "";
  options.peer_token = p.peer_token != nullptr ? p.peer_token : "";
  options.pin_budget_bytes = p.pin_budget_bytes;
  if (p.reader != nullptr && *p.reader != '\0') {
    auto reader = ParseModelReader(p.reader);
    if (!reader.ok()) return Fail(-EINVAL, who + ": " + reader.status().message());
    options.reader = *reader;
  }
  options.peer_stall_seconds = p.peer_stall_seconds;
  if (p.peer_transport != nullptr && *p.peer_transport != '\0') {
    auto transport = ParsePeerTransport(p.peer_transport);
    if (!transport.ok()) return Fail(-EINVAL, who + ": " + transport.status().message());
    options.peer_transport = *transport;
  }
  if (p.numa != nullptr && *p.numa != '\0') {
    Status numa = ParseNumaPlacement(p.numa, &options.numa, &options.numa_node);
    if (!numa.ok()) return Fail(-EINVAL, who + ": " + numa.message());
  }
  if (p.quiet != 0) {
    options.logger = std::make_shared<spdlog::logger>(
        "expert_arena_c", std::make_shared<spdlog::sinks::null_sink_mt>());
  }
  return 0;
}

// The smallest struct sizes this library accepts: the fields of the first version.
constexpr size_t kMinParamsSize = offsetof(ea_open_params, quiet) + sizeof(int);
constexpr size_t kMinViewSize = offsetof(ea_tensor_view, checksum) + sizeof(uint64_t);
constexpr size_t kMinInfoSize = offsetof(ea_arena_info, gpu_registered_bytes) + sizeof(uint64_t);
constexpr size_t kMinEngineSize = offsetof(ea_engine_params, user) + sizeof(void*);
constexpr size_t kMinEngineTensorSize = offsetof(ea_engine_tensor, alignment) + sizeof(uint64_t);

// The defaults are built in a whole struct of this version (`set` fills them in) and only the
// caller's bytes are copied out: an older caller's struct ends early and must not be written
// past.
template <typename Params, typename Set>
void InitSized(Params* params, size_t size, Set set) {
  if (params == nullptr || size < sizeof params->size) return;
  Params defaults;
  std::memset(static_cast<void*>(&defaults), 0, sizeof defaults);
  defaults.size = size;
  set(defaults);
  std::memcpy(static_cast<void*>(params), &defaults, std::min(size, sizeof defaults));
}

}  // namespace
}  // namespace expert_arena

using expert_arena::capi::Fail;
using expert_arena::capi::Guarded;

extern "C" {


void ea_open_params_init_sized(ea_open_params* params, size_t size) {
  expert_arena::InitSized(params, size, [](ea_open_params& d) {
    d.wait_timeout_seconds = 600.0;
    d.huge_pages = EA_HUGE_AUTO;
    d.file_mode = 0600;
    d.format = EA_FORMAT_AUTO;
    d.alignment = 4096;
    d.peer_stall_seconds = 30.0;
  });
}

int ea_arena_open(const ea_open_params* params_in, ea_arena** out) {
  using namespace expert_arena;
  last_error.clear();
  if (out == nullptr) return Fail(-EINVAL, "ea_arena_open: out is NULL");
  *out = nullptr;
  if (params_in == nullptr) return Fail(-EINVAL, "ea_arena_open: params is NULL");
  if (params_in->size < kMinParamsSize) {
    return Fail(-EINVAL, "ea_arena_open: params->size " + std::to_string(params_in->size) +
                             " is smaller than any version of ea_open_params (call "
                             "ea_open_params_init)");
  }
  return Guarded("ea_arena_open", [&]() -> int {
    // A newer caller's extra fields are ignored; an older caller's missing ones keep the
    // defaults.
    ea_open_params p;
    ea_open_params_init_sized(&p, sizeof p);
    std::memcpy(static_cast<void*>(&p), params_in, std::min(params_in->size, sizeof p));

    ArenaOptions options;
    if (int rc = MakeOptions(p, "ea_arena_open", options); rc != 0) return rc;

    Result<Arena> arena = Status(StatusCode::kInternal, "not opened");
    if (p.attach_only != 0) {
      if (options.shared_path.empty()) {
        return Fail(-EINVAL, "ea_arena_open: attach_only needs shared_path");
      }
      arena = Arena::AttachExisting(options.shared_path, options);
    } else {
      if ((p.model_file_count == 0 || p.model_files == nullptr) && options.from_peer.empty()) {
        return Fail(-EINVAL,
                    "ea_arena_open: no model file given (or set attach_only or from_peer)");
      }
      ModelSpec model;
      model.words = OptionWords::kC;
      for (size_t i = 0; p.model_files != nullptr && i < p.model_file_count; ++i) {
        if (p.model_files[i] == nullptr) {
          return Fail(-EINVAL, "ea_arena_open: model_files[" + std::to_string(i) + "] is NULL");
        }
        model.files.emplace_back(p.model_files[i]);
      }
      switch (p.format) {
        case EA_FORMAT_AUTO:
          model.format = ModelFormat::kAuto;
          break;
        case EA_FORMAT_GGUF:
          model.format = ModelFormat::kGguf;
          break;
        case EA_FORMAT_SAFETENSORS:
          model.format = ModelFormat::kSafetensors;
          break;
        case EA_FORMAT_RAW:
          model.format = ModelFormat::kRaw;
          break;
        default:
          return Fail(-EINVAL, "ea_arena_open: format " + std::to_string(p.format) +
                                   " is not EA_FORMAT_AUTO, EA_FORMAT_GGUF, "
                                   "EA_FORMAT_SAFETENSORS or EA_FORMAT_RAW");
      }
      model.select = p.select != nullptr ? p.select : "";
      model.select_all = p.select_all != 0;
      model.alignment = p.alignment;
      arena = Arena::Open(model, options);
    }
    if (!arena.ok()) return Fail(arena.status());
    auto* handle = new ea_arena{std::move(arena).value(), {}};
    handle->start_line = handle->arena.report().StartLine();
    *out = handle;
    return 0;
  });
}

void ea_engine_params_init_sized(ea_engine_params* params, size_t size) {
  expert_arena::InitSized(params, size, [](ea_engine_params& d) { d.alignment = 4096; });
}

int ea_arena_open_engine(const ea_open_params* params_in, const ea_engine_params* engine_in,
                         ea_arena** out) {
  using namespace expert_arena;
  last_error.clear();
  if (out == nullptr) return Fail(-EINVAL, "ea_arena_open_engine: out is NULL");
  *out = nullptr;
  if (params_in == nullptr || engine_in == nullptr) {
    return Fail(-EINVAL, "ea_arena_open_engine: params or engine is NULL");
  }
  if (params_in->size < kMinParamsSize || engine_in->size < kMinEngineSize) {
    return Fail(-EINVAL,
                "ea_arena_open_engine: params->size or engine->size is smaller than any "
                "version of its struct (call ea_open_params_init and ea_engine_params_init)");
  }
  return Guarded("ea_arena_open_engine", [&]() -> int {
    ea_open_params p;
    ea_open_params_init_sized(&p, sizeof p);
    std::memcpy(static_cast<void*>(&p), params_in, std::min(params_in->size, sizeof p));
    ea_engine_params e;
    ea_engine_params_init_sized(&e, sizeof e);
    std::memcpy(static_cast<void*>(&e), engine_in, std::min(engine_in->size, sizeof e));
    ArenaOptions options;
    if (int rc = MakeOptions(p, "ea_arena_open_engine", options); rc != 0) return rc;
    if (e.declare == nullptr || e.fill == nullptr) {
      return Fail(-EINVAL, "ea_arena_open_engine: declare and fill must both be set");
    }
    EngineArenaSpec spec;
    spec.identity = e.identity != nullptr ? e.identity : "";
    for (size_t i = 0; e.files != nullptr && i < e.file_count; ++i) {
      if (e.files[i] == nullptr) {
        return Fail(-EINVAL, "ea_arena_open_engine: files[" + std::to_string(i) + "] is NULL");
      }
      spec.files.emplace_back(e.files[i]);
    }
    spec.alignment = e.alignment;
    spec.declare = [&]() -> Result<std::vector<EngineTensor>> {
      const ea_engine_tensor* tensors = nullptr;
      size_t count = 0;
      int rc = e.declare(e.user, &tensors, &count);
      if (rc != 0) return CallbackFailed(rc);
      if (count > 0 && tensors == nullptr) {
        return InvalidArgument("the engine's declare gave " + std::to_string(count) +
                               " tensors and a NULL array");
      }
      std::vector<EngineTensor> out;
      if (count == 0) return out;
      // The array has the caller's stride, tensors[0].size: a caller built against a later
      // header has a larger struct; fields of this version are read, the rest ignored.
      const size_t stride = tensors[0].size;
      if (stride < kMinEngineTensorSize) {
        return InvalidArgument("declared tensor 0: size " + std::to_string(stride) +
                               " is smaller than any version of ea_engine_tensor");
      }
      out.reserve(count);
      for (size_t i = 0; i < count; ++i) {
        ea_engine_tensor t{};
        std::memcpy(static_cast<void*>(&t), reinterpret_cast<const char*>(tensors) + i * stride,
                    std::min(stride, sizeof t));
        if (t.size != stride) {
          return InvalidArgument("declared tensor " + std::to_string(i) + ": size " +
                                 std::to_string(t.size) + " differs from tensors[0].size " +
                                 std::to_string(stride));
        }
        if (t.name == nullptr || t.dtype == nullptr || (t.ndim > 0 && t.shape == nullptr)) {
          return InvalidArgument("declared tensor " + std::to_string(i) +
                                 ": a NULL name, dtype or shape");
        }
        if (t.ndim > 64) {
          return InvalidArgument("declared tensor " + std::to_string(i) + ": " +
                                 std::to_string(t.ndim) + " dimensions");
        }
        out.push_back(EngineTensor{t.name, t.dtype,
                                   std::vector<uint64_t>(t.shape, t.shape + t.ndim), t.bytes,
                                   t.alignment});
      }
      return out;
    };
    spec.fill = [&](std::span<const WritableTensor> views) -> Status {
      std::vector<ea_writable_tensor> c(views.size());
      for (size_t i = 0; i < views.size(); ++i) {
        c[i].size = sizeof(ea_writable_tensor);
        // Names and dtypes are the arena table's std::strings: NUL-terminated.
        c[i].name = views[i].name.data();
        c[i].dtype = views[i].dtype.data();
        c[i].shape = views[i].shape.data();
        c[i].ndim = static_cast<uint32_t>(views[i].shape.size());
        c[i].data = views[i].bytes.data();
        c[i].bytes = views[i].bytes.size();
      }
      int rc = e.fill(e.user, c.data(), c.size());
      if (rc != 0) return CallbackFailed(rc);
      return Status::Ok();
    };
    Result<Arena> arena = Arena::OpenEngine(spec, options);
    if (!arena.ok()) return Fail(arena.status());
    auto* handle = new ea_arena{std::move(arena).value(), {}};
    handle->start_line = handle->arena.report().StartLine();
    *out = handle;
    return 0;
  });
}

void ea_arena_close(ea_arena* arena) { delete arena; }

int ea_arena_get_info(const ea_arena* arena, ea_arena_info* out) {
  using namespace expert_arena;
  if (arena == nullptr || out == nullptr) return Fail(-EINVAL, "ea_arena_get_info: NULL argument");
  if (out->size < kMinInfoSize) {
    return Fail(-EINVAL, "ea_arena_get_info: out->size " + std::to_string(out->size) +
                             " is smaller than any version of ea_arena_info");
  }
  return Guarded("ea_arena_get_info", [&]() -> int {
    const ArenaReport& r = arena->arena.report();
    ea_arena_info info{};
    info.size = sizeof info;
    info.role = r.role == ArenaRole::kLoaded     ? EA_ROLE_LOADED
                : r.role == ArenaRole::kAttached ? EA_ROLE_ATTACHED
                                                 : EA_ROLE_PRIVATE;
    info.path = r.path.c_str();
    info.backing = r.backing.c_str();
    info.start_line = arena->start_line.c_str();
    info.data = arena->arena.data().data();
    info.data_bytes = arena->arena.data().size();
    info.tensor_count = arena->arena.tensor_count();
    info.tensor_bytes = r.tensor_bytes;
    info.huge_bytes = r.huge_bytes;
    info.bytes_read = r.bytes_read;
    info.seconds = r.seconds;
    info.identity_hash = r.identity_hash;
    info.gpu_registered_bytes = r.gpu_registered_bytes;
    CopyOut(info, out);
    return 0;
  });
}

size_t ea_arena_tensor_count(const ea_arena* arena) {
  return arena == nullptr ? 0 : arena->arena.tensor_count();
}

int ea_arena_tensor(const ea_arena* arena, size_t index, ea_tensor_view* out) {
  using namespace expert_arena;
  if (arena == nullptr || out == nullptr) return Fail(-EINVAL, "ea_arena_tensor: NULL argument");
  if (out->size < kMinViewSize) {
    return Fail(-EINVAL, "ea_arena_tensor: out->size " + std::to_string(out->size) +
                             " is smaller than any version of ea_tensor_view");
  }
  size_t count = arena->arena.tensor_count();
  if (index >= count) {
    return Fail(-ERANGE, "ea_arena_tensor: index " + std::to_string(index) +
                             " is past the last of " + std::to_string(count) + " tensors");
  }
  return Guarded("ea_arena_tensor", [&] { return FillView(arena->arena.tensor(index), out); });
}

int ea_arena_find(const ea_arena* arena, const char* name, ea_tensor_view* out) {
  using namespace expert_arena;
  if (arena == nullptr || name == nullptr || out == nullptr) {
    return Fail(-EINVAL, "ea_arena_find: NULL argument");
  }
  if (out->size < kMinViewSize) {
    return Fail(-EINVAL, "ea_arena_find: out->size " + std::to_string(out->size) +
                             " is smaller than any version of ea_tensor_view");
  }
  return Guarded("ea_arena_find", [&]() -> int {
    auto view = arena->arena.Find(name);
    if (!view) {
      const std::string& path = arena->arena.report().path;
      return Fail(-ENOENT, std::string("no tensor named ") + name + " in the arena" +
                               (path.empty() ? std::string() : " " + path));
    }
    return FillView(*view, out);
  });
}

const char* ea_last_error(void) { return expert_arena::capi::last_error.c_str(); }

const char* ea_version(void) { return EXPERT_ARENA_VERSION_STRING; }

}  // extern "C"
