// expert_arena._core: arenas (open, attach, Arena and its views).
#include "binding.h"

namespace expert_arena::python {
namespace {

// ---- Arenas -----------------------------------------------------------------------------

// The Python Arena's handle. close() drops `arena`; views hold their own shared_ptr.
class PyArena {
 public:
  explicit PyArena(Arena arena)
      : arena_(std::make_shared<Arena>(std::move(arena))),
        start_line_(arena_->report().StartLine()) {}

  const std::shared_ptr<Arena>& Get(const char* what = "arena") const {
    if (!arena_) RaiseClosed(what);
    return arena_;
  }

  bool closed() const { return arena_ == nullptr; }

  void Close() {
    std::shared_ptr<Arena> arena = std::move(arena_);
    // Unmapping (and unregistering from a GPU) can take a while; views may still hold it.
    py::gil_scoped_release release;
    arena.reset();
  }

  size_t Length() const { return Get()->tensor_count(); }

  bool Contains(const std::string& name) const { return Get()->Find(name).has_value(); }

  py::list Names() const {
    const auto& arena = Get();
    py::list names(arena->tensor_count());
    for (size_t i = 0; i < arena->tensor_count(); ++i) {
      names[i] = py::str(arena->tensor(i).name.data(), arena->tensor(i).name.size());
    }
    return names;
  }

  TensorView Find(const std::string& name) const {
    const auto& arena = Get();
    auto view = arena->Find(name);
    if (!view) {
      const std::string& path = arena->report().path;
      throw py::key_error("no tensor " + name + " in the arena" +
                          (path.empty() ? std::string(" (private)") : " " + path) + " (" +
                          std::to_string(arena->tensor_count()) + " tensors)");
    }
    return *view;
  }

  static py::dict Info(const TensorView& v) {
    py::dict d;
    d["name"] = py::str(v.name.data(), v.name.size());
    d["dtype"] = py::str(v.dtype.data(), v.dtype.size());
    d["shape"] = Shape(v.shape);
    d["bytes"] = v.bytes.size();
    d["checksum"] = v.checksum;
    d["file_offset"] = v.file_offset;
    return d;
  }

  py::dict InfoOf(const std::string& name) const { return Info(Find(name)); }

  py::list Tensors() const {
    const auto& arena = Get();
    py::list out(arena->tensor_count());
    for (size_t i = 0; i < arena->tensor_count(); ++i) out[i] = Info(arena->tensor(i));
    return out;
  }

  py::array Buffer(const std::string& name, bool writable) const {
    TensorView v = Find(name);
    return ByteArray(v.bytes, Get(), writable);
  }

  py::tuple DataRange() const {
    auto data = Get()->data();
    return py::make_tuple(reinterpret_cast<uintptr_t>(data.data()), data.size());
  }

  py::dict Report() const {
    const ArenaReport& r = Get()->report();
    py::dict d;
    d["role"] = ArenaRoleName(r.role);
    d["path"] = r.path;
    d["backing"] = r.backing;
    d["identity"] = r.identity;
    d["identity_hash"] = r.identity_hash;
    d["seconds"] = r.seconds;
    d["load_seconds"] = r.load_seconds;
    d["wait_seconds"] = r.wait_seconds;
    d["collapse_seconds"] = r.collapse_seconds;
    d["bytes_read"] = r.bytes_read;
    d["huge_bytes"] = r.huge_bytes;
    d["mapped_bytes"] = r.mapped_bytes;
    d["data_bytes"] = r.data_bytes;
    d["tensor_bytes"] = r.tensor_bytes;
    d["tensors"] = r.tensors;
    d["model_tensors"] = r.model_tensors;
    d["model_tensor_bytes"] = r.model_tensor_bytes;
    d["reader"] = r.reader;
    d["reader_note"] = r.reader_note;
    d["huge_note"] = r.huge_note;
    d["kernel_note"] = r.kernel_note;
    py::list missing;
    for (const KernelFallbackReport& m : r.kernel_missing) {
      py::dict f;
      f["feature"] = m.feature;
      f["since"] = m.since;
      f["answer"] = m.answer;
      f["fallback"] = m.fallback;
      f["used"] = m.used;
      f["seconds"] = m.seconds;
      f["bytes"] = m.bytes;
      missing.append(f);
    }
    d["kernel"] = py::dict(py::arg("release") = r.kernel_release, py::arg("note") = r.kernel_note,
                           py::arg("missing") = missing);
    d["charge"] = r.charge_note;
    d["gpu"] = r.gpu_note.empty() ? std::string("none") : r.gpu_note;
    d["gpu_registered_bytes"] = r.gpu_registered_bytes;
    d["gpu_seconds"] = r.gpu_seconds;
    d["pinned_bytes"] = r.pinned_bytes;
    d["waited_for_pid"] = r.waited_for_pid;
    d["start_line"] = start_line_;
    d["from_peer"] = r.from_peer;
    d["peer_bytes"] = r.peer_bytes;
    d["peer_note"] = r.peer_note;
    return d;
  }

 private:
  std::shared_ptr<Arena> arena_;
  std::string start_line_;
};

ArenaOptions MakeArenaOptions(const std::optional<std::string>& shared_path, const std::string& gpu,
                              bool gpu_required, const std::string& huge, double wait_timeout,
                              uint32_t file_mode, bool allow_foreign_owner,
                              uint64_t pin_budget_bytes, const std::string& reader, bool quiet,
                              bool progress) {
  ArenaOptions options;
  if (shared_path) options.shared_path = *shared_path;
  options.gpu = gpu;
  options.gpu_required = gpu_required;
  options.huge = ParseHuge(huge);
  if (!(wait_timeout >= 0)) throw py::value_error("wait_timeout must be >= 0 seconds");
  options.wait_timeout_seconds = wait_timeout;
  if (file_mode > 07777)
    throw py::value_error("file_mode " + std::to_string(file_mode) + " is not a mode");
  options.file_mode = static_cast<mode_t>(file_mode);
  options.allow_foreign_owner = allow_foreign_owner;
  options.pin_budget_bytes = pin_budget_bytes;
  options.reader = reader;
  options.progress = progress && !quiet;
  if (quiet) options.logger = QuietLogger();
  return options;
}

PyArena OpenArena(std::vector<std::string> files, std::optional<std::string> shared_path,
                  std::optional<std::string> select, bool select_all, const std::string& gpu,
                  bool gpu_required, const std::string& huge, double wait_timeout,
                  uint32_t file_mode, bool allow_foreign_owner, uint64_t pin_budget_bytes,
                  const std::string& reader, bool quiet, bool progress, uint64_t alignment,
                  const std::string& format, const std::string& from_peer,
                  const std::string& peer_token) {
  if (files.empty() && from_peer.empty()) {
    throw py::value_error("open(): model_files names no file (or give from_peer)");
  }
  ModelSpec model;
  model.files = std::move(files);
  model.format = ParseFormat(format);
  if (select) model.select = *select;
  model.select_all = select_all;
  model.alignment = alignment;
  ArenaOptions options =
      MakeArenaOptions(shared_path, gpu, gpu_required, huge, wait_timeout, file_mode,
                       allow_foreign_owner, pin_budget_bytes, reader, quiet, progress);
  options.from_peer = from_peer;
  options.peer_token = peer_token;
  std::optional<Result<Arena>> arena;
  {
    py::gil_scoped_release release;
    arena.emplace(Arena::Open(model, options));
  }
  return PyArena(Take(std::move(*arena)));
}

PyArena AttachArena(const std::string& path, const std::string& gpu, bool gpu_required,
                    bool allow_foreign_owner, uint64_t pin_budget_bytes, bool quiet) {
  ArenaOptions options =
      MakeArenaOptions(path, gpu, gpu_required, "auto", 0, 0600, allow_foreign_owner,
                       pin_budget_bytes, "auto", quiet, false);
  std::optional<Result<Arena>> arena;
  {
    py::gil_scoped_release release;
    arena.emplace(Arena::AttachExisting(path, options));
  }
  return PyArena(Take(std::move(*arena)));
}

}  // namespace

void BindArena(py::module_& m) {
  py::class_<PyArena>(m, "Arena")
      .def("__len__", &PyArena::Length)
      .def("__contains__", &PyArena::Contains)
      .def("names", &PyArena::Names)
      .def("info", &PyArena::InfoOf)
      .def("tensors", &PyArena::Tensors)
      .def("report", &PyArena::Report)
      .def("buffer", &PyArena::Buffer, py::arg("name"), py::arg("writable") = false)
      .def("data_range", &PyArena::DataRange)
      .def("close", &PyArena::Close)
      .def_property_readonly("closed", &PyArena::closed);

  m.def("open", &OpenArena, py::arg("files"), py::arg("shared_path"), py::arg("select"),
        py::arg("select_all"), py::arg("gpu"), py::arg("gpu_required"), py::arg("huge"),
        py::arg("wait_timeout"), py::arg("file_mode"), py::arg("allow_foreign_owner"),
        py::arg("pin_budget_bytes"), py::arg("reader"), py::arg("quiet"), py::arg("progress"),
        py::arg("alignment"), py::arg("format"), py::arg("from_peer") = "",
        py::arg("peer_token") = "");
  m.def("attach", &AttachArena, py::arg("path"), py::arg("gpu"), py::arg("gpu_required"),
        py::arg("allow_foreign_owner"), py::arg("pin_budget_bytes"), py::arg("quiet"));
}

}  // namespace expert_arena::python
