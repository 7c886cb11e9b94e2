// expert_arena._core: arenas (open, attach, Arena and its views).
#include <cstring>
#include <map>
#include <optional>

#include "binding.h"

namespace expert_arena::python {
namespace {

// ---- Arenas -----------------------------------------------------------------------------

// The copy-on-write mappings of shared arenas that Python views point into, by start address,
// so that a tensor about to be pickled can be recognised as a view of one (and sent as a
// reference). An entry holds its Arena weakly: it is stale, and dropped, once the last view is
// gone and the mapping with it (a later mapping may reuse the addresses). Guarded by the GIL.
struct ViewMapping {
  uintptr_t end = 0;
  std::weak_ptr<Arena> arena;
  std::string path;
  uint64_t identity_hash = 0;
};
std::map<uintptr_t, ViewMapping>& ViewMappings() {
  static auto* mappings = new std::map<uintptr_t, ViewMapping>();
  return *mappings;
}

// (path, identity_hash, offset in the data region) of a shared arena's view mapping that
// holds [address, address + length), or None.
py::object FindView(uintptr_t address, uint64_t length) {
  auto& mappings = ViewMappings();
  while (true) {
    auto it = mappings.upper_bound(address);
    if (it == mappings.begin()) return py::none();
    --it;
    if (it->second.arena.expired()) {
      // Unmapped: its addresses may now belong to a later mapping that starts below it.
      mappings.erase(it);
      continue;
    }
    if (address >= it->second.end || length > it->second.end - address) return py::none();
    return py::make_tuple(FsStr(it->second.path), it->second.identity_hash, address - it->first);
  }
}

// Bytes of [address, address + length), inside a shared arena's view mapping, that lie on
// pages a write in this process copied (Arena::PrivateCopies); `changed`: only those whose
// bytes differ from the arena's. None when the range is not inside such a mapping.
py::object ViewPrivateBytes(uintptr_t address, uint64_t length, bool changed) {
  auto& mappings = ViewMappings();
  while (true) {
    auto it = mappings.upper_bound(address);
    if (it == mappings.begin()) return py::none();
    --it;
    std::shared_ptr<Arena> arena = it->second.arena.lock();
    if (!arena) {
      mappings.erase(it);
      continue;
    }
    if (address >= it->second.end || length > it->second.end - address) return py::none();
    if (length == 0) return py::int_(0);
    std::optional<Result<std::vector<ArenaRange>>> ranges;
    {
      py::gil_scoped_release release;
      ranges.emplace(arena->PrivateCopies(changed, address - it->first, length));
    }
    uint64_t bytes = 0;
    for (const ArenaRange& r : Take(std::move(*ranges))) bytes += r.bytes;
    return py::int_(bytes);
  }
}

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

  // ArenaMemory as a dict, read with the GIL released.
  py::dict Memory() const {
    const auto& arena = Get();
    std::optional<Result<ArenaMemory>> m;
    {
      py::gil_scoped_release release;
      m.emplace(arena->Memory());
    }
    if (!m->ok()) RaiseStatus(m->status());
    const ArenaMemory& v = **m;
    py::dict d;
    d["rss_bytes"] = v.rss_bytes;
    d["pss_bytes"] = v.pss_bytes;
    d["shared_bytes"] = v.shared_bytes;
    d["private_bytes"] = v.private_bytes;
    d["mappings"] = v.mappings;
    return d;
  }

  // Publish only what runs (Arena::Confirm / Abandon). Closed: nothing to confirm.
  bool AwaitingConfirm() const { return arena_ != nullptr && arena_->awaiting_confirm(); }
  void Confirm() {
    const auto& arena = Get();
    Status s = Status::Ok();
    {
      py::gil_scoped_release release;
      s = arena->Confirm();
    }
    if (!s.ok()) RaiseStatus(s);
  }
  void Abandon(const std::string& reason) {
    const auto& arena = Get();
    Status s = Status::Ok();
    {
      py::gil_scoped_release release;
      s = arena->Abandon(reason);
    }
    if (!s.ok()) RaiseStatus(s);
  }

  void Close() {
    std::shared_ptr<Arena> arena = std::move(arena_);
    // Unmapping (and unregistering from a GPU) can take a while; views may still hold it.
    py::gil_scoped_release release;
    arena.reset();
  }

  size_t Length() const { return Get()->tensor_count(); }

  bool Contains(py::handle name) const { return Get()->Find(FsBytes(name, "name")).has_value(); }

  py::list Names() const {
    const auto& arena = Get();
    py::list names(arena->tensor_count());
    for (size_t i = 0; i < arena->tensor_count(); ++i) {
      names[i] = FsStr(arena->tensor(i).name);
    }
    return names;
  }

  TensorView Find(py::handle name_object) const {
    const std::string name = FsBytes(name_object, "a tensor name");
    const auto& arena = Get();
    auto view = arena->Find(name);
    if (!view) {
      const std::string& path = arena->report().path;
      RaiseMessage(PyExc_KeyError, "no tensor " + name + " in the arena" +
                                       (path.empty() ? std::string(" (private)") : " " + path) +
                                       " (" + std::to_string(arena->tensor_count()) + " tensors)");
    }
    return *view;
  }

  static py::dict Info(const TensorView& v) {
    py::dict d;
    d["name"] = FsStr(v.name);
    d["dtype"] = FsStr(v.dtype);
    d["shape"] = Shape(v.shape);
    d["bytes"] = v.bytes.size();
    d["checksum"] = v.checksum;
    d["file_offset"] = v.file_offset;
    return d;
  }

  py::dict InfoOf(py::handle name) const { return Info(Find(name)); }

  py::list Tensors() const {
    const auto& arena = Get();
    py::list out(arena->tensor_count());
    for (size_t i = 0; i < arena->tensor_count(); ++i) out[i] = Info(arena->tensor(i));
    return out;
  }

  // The bytes of `name` in the copy-on-write mapping (Arena::CopyOnWriteData): every Python
  // view points there, so no route from a view (np.asarray, torch.from_numpy, dlpack, the
  // buffer protocol) reaches the shared (read-only, or GPU-registered) mapping. `writable` only
  // sets the array's flag; a write through it copies a page into this process.
  py::array Buffer(py::handle name, bool writable) const {
    TensorView v = Find(name);
    std::span<std::byte> data = ViewData();
    const auto offset = static_cast<size_t>(v.bytes.data() - Get()->data().data());
    return ByteArray(std::span<const std::byte>(data.data() + offset, v.bytes.size()), Get(),
                     writable);
  }

  // [offset, offset + length) of the data region in the copy-on-write mapping (a view sent
  // by reference from another process, rebuilt here).
  py::array Region(uint64_t offset, uint64_t length, bool writable) const {
    std::span<std::byte> data = ViewData();
    if (offset > data.size() || length > data.size() - offset) {
      RaiseMessage(PyExc_ValueError,
                   "bytes [" + std::to_string(offset) + ", +" + std::to_string(length) +
                       ") lie outside the data region of the arena " + Get()->report().path +
                       " (" + std::to_string(data.size()) + " bytes)");
    }
    return ByteArray(std::span<const std::byte>(data.data() + offset, length), Get(), writable);
  }

  // (address, bytes) of the views' mapping.
  py::tuple DataRange() const {
    std::span<std::byte> data = ViewData();
    return py::make_tuple(reinterpret_cast<uintptr_t>(data.data()), data.size());
  }

  // (address, bytes) of the arena's own mapping (the one registered with a GPU).
  py::tuple SharedRange() const {
    auto data = Get()->data();
    return py::make_tuple(reinterpret_cast<uintptr_t>(data.data()), data.size());
  }

  // [(offset, bytes)] of the views' pages that are this process's private copies
  // (Arena::PrivateCopies); `changed`: only those whose bytes differ from the arena's.
  py::list PrivateCopies(bool changed) const {
    std::shared_ptr<Arena> arena = Get();  // held while the GIL is released
    std::optional<Result<std::vector<ArenaRange>>> ranges;
    {
      py::gil_scoped_release release;
      ranges.emplace(arena->PrivateCopies(changed));
    }
    py::list out;
    for (const ArenaRange& r : Take(std::move(*ranges))) {
      out.append(py::make_tuple(r.offset, r.bytes));
    }
    return out;
  }

  // [(name, bytes)] of the tensors whose bytes lie on those pages, in arena order, with how
  // many of their bytes do.
  py::list PrivateTensors(bool changed) const {
    std::shared_ptr<Arena> arena = Get();  // held while the GIL is released
    std::optional<Result<std::vector<ArenaRange>>> result;
    {
      py::gil_scoped_release release;
      result.emplace(arena->PrivateCopies(changed));
    }
    std::vector<ArenaRange> ranges = Take(std::move(*result));
    py::list out;
    if (ranges.empty()) return out;
    const std::byte* base = arena->data().data();
    for (size_t i = 0; i < arena->tensor_count(); ++i) {
      TensorView v = arena->tensor(i);
      const auto begin = static_cast<uint64_t>(v.bytes.data() - base);
      const uint64_t end = begin + v.bytes.size();
      uint64_t bytes = 0;
      for (const ArenaRange& r : ranges) {
        const uint64_t from = std::max(begin, r.offset);
        const uint64_t to = std::min(end, r.offset + r.bytes);
        if (from < to) bytes += to - from;
      }
      if (bytes > 0) out.append(py::make_tuple(FsStr(v.name), bytes));
    }
    return out;
  }

  std::span<std::byte> ViewData() const {
    const auto& arena = Get();  // raises once closed
    if (view_data_.data() == nullptr) {
      view_data_ = Take(arena->CopyOnWriteData());
      const ArenaReport& r = arena->report();
      if (!r.path.empty() && !view_data_.empty()) {
        auto start = reinterpret_cast<uintptr_t>(view_data_.data());
        ViewMappings()[start] =
            ViewMapping{start + view_data_.size(), arena, r.path, r.identity_hash};
      }
    }
    return view_data_;
  }

  py::dict Report() const {
    const ArenaReport& r = Get()->report();
    py::dict d;
    d["role"] = ArenaRoleName(r.role);
    d["path"] = FsStr(r.path);
    d["backing"] = MessageStr(r.backing);
    d["identity"] = FsStr(r.identity);
    d["identity_hash"] = r.identity_hash;
    d["seconds"] = r.seconds;
    d["load_seconds"] = r.load_seconds;
    d["wait_seconds"] = r.wait_seconds;
    d["collapse_seconds"] = r.collapse_seconds;
    d["bytes_read"] = r.bytes_read;
    d["huge_bytes"] = r.huge_bytes;
    d["page_bytes"] = r.page_bytes;
    d["mapped_bytes"] = r.mapped_bytes;
    d["data_bytes"] = r.data_bytes;
    d["tensor_bytes"] = r.tensor_bytes;
    d["tensors"] = r.tensors;
    d["model_tensors"] = r.model_tensors;
    d["model_tensor_bytes"] = r.model_tensor_bytes;
    d["reader"] = MessageStr(r.reader);
    d["reader_note"] = MessageStr(r.reader_note);
    d["huge_note"] = MessageStr(r.huge_note);
    d["kernel_note"] = MessageStr(r.kernel_note);
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
    d["kernel"] = py::dict(py::arg("release") = MessageStr(r.kernel_release),
                           py::arg("note") = MessageStr(r.kernel_note),
                           py::arg("missing") = missing);
    py::dict numa_nodes;
    for (const NumaNodeBytes& n : r.numa_nodes) numa_nodes[py::int_(n.node)] = n.bytes;
    d["numa"] = py::dict(py::arg("placement") = r.numa, py::arg("policy") = r.numa_policy,
                         py::arg("note") = MessageStr(r.numa_note), py::arg("nodes") = numa_nodes);
    d["charge"] = MessageStr(r.charge_note);
    d["gpu"] = r.gpu_note.empty() ? py::str("none") : MessageStr(r.gpu_note);
    d["gpu_registered_bytes"] = r.gpu_registered_bytes;
    d["gpu_seconds"] = r.gpu_seconds;
    d["pinned_bytes"] = r.pinned_bytes;
    d["waited_for_pid"] = r.waited_for_pid;
    d["start_line"] = MessageStr(start_line_);
    d["from_peer"] = r.from_peer;
    d["peer_bytes"] = r.peer_bytes;
    d["peer_note"] = MessageStr(r.peer_note);
    d["peer_transport"] = r.peer_transport;
    return d;
  }

 private:
  std::shared_ptr<Arena> arena_;
  std::string start_line_;
  mutable std::span<std::byte> view_data_;  // guarded by the GIL
};

ArenaOptions MakeArenaOptions(const std::optional<std::string>& shared_path, const std::string& gpu,
                              bool gpu_required, const std::string& huge, double wait_timeout,
                              uint32_t file_mode, bool allow_foreign_owner,
                              uint64_t pin_budget_bytes, const std::string& reader, bool quiet,
                              bool progress) {
  ArenaOptions options;
  if (shared_path) options.shared_path = *shared_path;
  options.gpu = ParseGpu(gpu);
  options.gpu_required = gpu_required;
  options.huge = ParseHuge(huge);
  if (!(wait_timeout >= 0)) throw py::value_error("wait_timeout must be >= 0 seconds");
  options.wait_timeout_seconds = wait_timeout;
  if (file_mode > 07777)
    throw py::value_error("file_mode " + std::to_string(file_mode) + " is not a mode");
  options.file_mode = static_cast<mode_t>(file_mode);
  options.allow_foreign_owner = allow_foreign_owner;
  options.pin_budget_bytes = pin_budget_bytes;
  options.reader = ParseReaderWord(reader);
  options.progress = progress && !quiet;
  if (quiet) options.logger = QuietLogger();
  return options;
}

// Paths and names as str (lone surrogates for bytes that are not UTF-8) or bytes.
std::vector<std::string> FsBytesList(const py::sequence& items, const char* what) {
  std::vector<std::string> out;
  out.reserve(items.size());
  for (py::handle item : items) out.push_back(FsBytes(item, what));
  return out;
}

PyArena OpenArena(const py::sequence& file_objects, const py::object& shared_path_object,
                  std::optional<std::string> select, bool select_all, const std::string& gpu,
                  bool gpu_required, const std::string& huge, double wait_timeout,
                  uint32_t file_mode, bool allow_foreign_owner, uint64_t pin_budget_bytes,
                  const std::string& reader, bool quiet, bool progress, uint64_t alignment,
                  const std::string& format, const std::string& from_peer,
                  const std::string& peer_token, double peer_stall_seconds,
                  const std::string& peer_transport, const std::string& numa,
                  bool allow_world_writable, bool peer_allow_no_token) {
  std::vector<std::string> files = FsBytesList(file_objects, "a model file");
  std::optional<std::string> shared_path;
  if (!shared_path_object.is_none()) shared_path = FsBytes(shared_path_object, "shared_path");
  if (files.empty() && from_peer.empty()) {
    throw py::value_error("open(): model_files names no file (or give from_peer)");
  }
  ModelSpec model;
  model.words = OptionWords::kPython;
  model.files = std::move(files);
  model.format = ParseFormat(format);
  if (select) model.select = *select;
  model.select_all = select_all;
  model.alignment = alignment;
  ArenaOptions options =
      MakeArenaOptions(shared_path, gpu, gpu_required, huge, wait_timeout, file_mode,
                       allow_foreign_owner, pin_budget_bytes, reader, quiet, progress);
  options.allow_world_writable = allow_world_writable;
  options.from_peer = from_peer;
  options.peer_token = peer_token;
  options.peer_allow_no_token = peer_allow_no_token;
  options.peer_stall_seconds = peer_stall_seconds;
  options.peer_transport = ParseTransportWord(peer_transport);
  if (Status s = ParseNumaPlacement(numa, &options.numa, &options.numa_node); !s.ok()) {
    throw py::value_error("open(): numa=" + s.message());
  }
  std::optional<Result<Arena>> arena;
  {
    py::gil_scoped_release release;
    arena.emplace(Arena::Open(model, options));
  }
  return PyArena(Take(std::move(*arena)));
}

PyArena AttachArena(const py::object& path_object, const std::string& gpu, bool gpu_required,
                    bool allow_foreign_owner, uint64_t pin_budget_bytes, bool quiet,
                    bool allow_world_writable) {
  const std::string path = FsBytes(path_object, "path");
  ArenaOptions options =
      MakeArenaOptions(path, gpu, gpu_required, "auto", 0, 0600, allow_foreign_owner,
                       pin_budget_bytes, "auto", quiet, false);
  options.allow_world_writable = allow_world_writable;
  std::optional<Result<Arena>> arena;
  {
    py::gil_scoped_release release;
    arena.emplace(Arena::AttachExisting(path, options));
  }
  return PyArena(Take(std::move(*arena)));
}

// ---- Engine-made arenas ---------------------------------------------------------------------

// What the fill callback writes through: the declared tensors' places in the mapping, valid
// only during the call (write() raises afterwards).
struct EngineWriterState {
  std::span<const WritableTensor> views;
  bool valid = false;
};

class PyEngineWriter {
 public:
  explicit PyEngineWriter(std::shared_ptr<EngineWriterState> state) : state_(std::move(state)) {}

  size_t Length() const { return Views().size(); }

  // Copies a C-contiguous buffer of exactly the tensor's bytes into tensor `index`.
  void Write(size_t index, py::object source) {
    const WritableTensor& t = At(index);
    Py_buffer buffer;
    if (PyObject_GetBuffer(source.ptr(), &buffer, PyBUF_C_CONTIGUOUS) != 0) {
      throw py::error_already_set();
    }
    const uint64_t length = static_cast<uint64_t>(buffer.len);
    if (length != t.bytes.size()) {
      PyBuffer_Release(&buffer);
      RaiseMessage(PyExc_ValueError, "engine arena tensor " + std::string(t.name) + ": " +
                                         std::to_string(length) + " bytes given, " +
                                         std::to_string(t.bytes.size()) + " declared");
    }
    Status pages = Status::Ok();
    {
      py::gil_scoped_release release;
      pages = t.make_pages ? t.make_pages() : Status::Ok();
      if (pages.ok()) std::memcpy(t.bytes.data(), buffer.buf, length);
    }
    PyBuffer_Release(&buffer);
    if (!pages.ok()) RaiseStatus(pages.WithContext("engine arena tensor " + std::string(t.name)));
  }

  // A writable memoryview of tensor `index`'s bytes in the arena, its pages made: for a
  // tensor the engine lets go of once written (its storage moved onto these bytes). Valid
  // while the arena is open; writable only until fill returns (read-only afterwards).
  py::object Buffer(size_t index) {
    const WritableTensor& t = At(index);
    Status pages = Status::Ok();
    {
      py::gil_scoped_release release;
      pages = t.make_pages ? t.make_pages() : Status::Ok();
    }
    if (!pages.ok()) RaiseStatus(pages.WithContext("engine arena tensor " + std::string(t.name)));
    return py::reinterpret_steal<py::object>(
        PyMemoryView_FromMemory(reinterpret_cast<char*>(t.bytes.data()),
                                static_cast<Py_ssize_t>(t.bytes.size()), PyBUF_WRITE));
  }

 private:
  const WritableTensor& At(size_t index) const {
    std::span<const WritableTensor> views = Views();
    if (index >= views.size()) {
      throw py::index_error("engine arena writer: tensor index " + std::to_string(index) +
                            " of " + std::to_string(views.size()));
    }
    return views[index];
  }

  std::span<const WritableTensor> Views() const {
    if (!state_->valid) {
      throw py::value_error("engine arena writer used after fill returned: the arena is published");
    }
    return state_->views;
  }
  std::shared_ptr<EngineWriterState> state_;
};

// declare() -> [(name, dtype, shape, bytes, alignment)], fill(writer). Their exceptions are
// raised again from here, after the library cleaned up (nothing published).
PyArena OpenEngineArena(const py::object& path_object, const py::object& identity_object,
                        const py::sequence& file_objects, uint64_t alignment, py::object declare,
                        py::object fill, const std::string& gpu, bool gpu_required,
                        const std::string& huge, double wait_timeout, uint32_t file_mode,
                        bool allow_foreign_owner, uint64_t pin_budget_bytes, bool quiet,
                        bool allow_world_writable, bool confirm_after_run,
                        bool pages_as_written, py::object freed_as_written,
                        bool huge_after_build) {
  const std::string path = FsBytes(path_object, "path");
  ArenaOptions options = MakeArenaOptions(path, gpu, gpu_required, huge, wait_timeout, file_mode,
                                          allow_foreign_owner, pin_budget_bytes, "auto", quiet,
                                          false);
  options.allow_world_writable = allow_world_writable;
  EngineArenaSpec spec;
  spec.confirm_after_run = confirm_after_run;
  spec.pages_as_written = pages_as_written;
  spec.huge_after_build = huge_after_build;
  spec.identity = FsBytes(identity_object, "identity");
  spec.files = FsBytesList(file_objects, "a checkpoint file");
  spec.alignment = alignment;
  std::optional<py::error_already_set> raised;
  spec.declare = [&]() -> Result<std::vector<EngineTensor>> {
    py::gil_scoped_acquire acquire;
    try {
      std::vector<EngineTensor> out;
      for (py::handle item : declare()) {
        auto entry = item.cast<py::tuple>();
        if (entry.size() != 5) throw py::value_error("declare() entries are (name, dtype, shape, bytes, alignment)");
        EngineTensor t;
        t.name = FsBytes(entry[0], "a tensor name");
        t.dtype = entry[1].cast<std::string>();
        t.shape = entry[2].cast<std::vector<uint64_t>>();
        t.bytes = entry[3].cast<uint64_t>();
        t.alignment = entry[4].cast<uint64_t>();
        out.push_back(std::move(t));
      }
      // The bytes fill frees as it writes: a number, or a callable asked once declare returned.
      py::object freed =
          PyCallable_Check(freed_as_written.ptr()) ? freed_as_written() : freed_as_written;
      try {
        spec.freed_as_written = freed.is_none() ? 0 : freed.cast<uint64_t>();
      } catch (const py::cast_error&) {
        return InvalidArgument("freed_as_written must be a number of bytes (0 or more), got " +
                               py::repr(freed).cast<std::string>());
      }
      return out;
    } catch (py::error_already_set& e) {
      raised.emplace(std::move(e));
      return Internal("the engine's declare raised");
    } catch (const py::cast_error& e) {
      return InvalidArgument(std::string("declare() returned a malformed table: ") + e.what());
    }
  };
  spec.fill = [&](std::span<const WritableTensor> views) -> Status {
    py::gil_scoped_acquire acquire;
    auto state = std::make_shared<EngineWriterState>();
    state->views = views;
    state->valid = true;
    try {
      fill(PyEngineWriter(state));
      state->valid = false;
      return Status::Ok();
    } catch (py::error_already_set& e) {
      state->valid = false;
      raised.emplace(std::move(e));
      return Internal("the engine's fill raised");
    }
  };
  std::optional<Result<Arena>> arena;
  {
    py::gil_scoped_release release;
    arena.emplace(Arena::OpenEngine(spec, options));
  }
  if (raised) {
    arena.reset();
    raised->restore();
    throw py::error_already_set();
  }
  return PyArena(Take(std::move(*arena)));
}

// Routes the library's "expert_arena" logger into a CollectingSink (made once per process).
std::shared_ptr<CollectingSink> LogSink() {
  static std::shared_ptr<CollectingSink> sink = [] {
    auto made = std::make_shared<CollectingSink>();
    auto logger = spdlog::get("expert_arena");
    if (logger) {
      logger->sinks().clear();
      logger->sinks().push_back(made);
    } else {
      logger = std::make_shared<spdlog::logger>("expert_arena", made);
      spdlog::register_logger(logger);
    }
    return made;
  }();
  return sink;
}

py::tuple TakeLogs() {
  const auto& sink = LogSink();
  if (sink->empty()) return py::make_tuple(py::list(), 0);
  auto [records, dropped] = sink->Take();
  py::list out;
  for (auto& [level, text] : records) out.append(py::make_tuple(level, MessageStr(text)));
  return py::make_tuple(out, dropped);
}

}  // namespace

void BindArena(py::module_& m) {
  LogSink();
  m.def("take_logs", &TakeLogs);
  py::class_<PyArena>(m, "Arena")
      .def("__len__", &PyArena::Length)
      .def("__contains__", &PyArena::Contains)
      .def("names", &PyArena::Names)
      .def("info", &PyArena::InfoOf)
      .def("tensors", &PyArena::Tensors)
      .def("report", &PyArena::Report)
      .def("buffer", &PyArena::Buffer, py::arg("name"), py::arg("writable") = false)
      .def("data_range", &PyArena::DataRange)
      .def("shared_range", &PyArena::SharedRange)
      .def("region", &PyArena::Region, py::arg("offset"), py::arg("length"), py::arg("writable"))
      .def("private_copies", &PyArena::PrivateCopies, py::arg("changed"))
      .def("private_tensors", &PyArena::PrivateTensors, py::arg("changed"))
      .def("close", &PyArena::Close)
      .def("memory", &PyArena::Memory)
      .def("confirm", &PyArena::Confirm)
      .def("abandon", &PyArena::Abandon, py::arg("reason"))
      .def_property_readonly("awaiting_confirm", &PyArena::AwaitingConfirm)
      .def_property_readonly("closed", &PyArena::closed);

  m.def("open", &OpenArena, py::arg("files"), py::arg("shared_path"), py::arg("select"),
        py::arg("select_all"), py::arg("gpu"), py::arg("gpu_required"), py::arg("huge"),
        py::arg("wait_timeout"), py::arg("file_mode"), py::arg("allow_foreign_owner"),
        py::arg("pin_budget_bytes"), py::arg("reader"), py::arg("quiet"), py::arg("progress"),
        py::arg("alignment"), py::arg("format"), py::arg("from_peer") = "",
        py::arg("peer_token") = "", py::arg("peer_stall_seconds") = 30.0,
        py::arg("peer_transport") = "auto", py::arg("numa") = "auto",
        py::arg("allow_world_writable") = false, py::arg("peer_allow_no_token") = false);
  py::class_<PyEngineWriter>(m, "EngineWriter")
      .def("__len__", &PyEngineWriter::Length)
      .def("write", &PyEngineWriter::Write, py::arg("index"), py::arg("source"))
      .def("buffer", &PyEngineWriter::Buffer, py::arg("index"));
  m.def("open_engine", &OpenEngineArena, py::arg("path"), py::arg("identity"), py::arg("files"),
        py::arg("alignment"), py::arg("declare"), py::arg("fill"), py::arg("gpu"),
        py::arg("gpu_required"), py::arg("huge"), py::arg("wait_timeout"), py::arg("file_mode"),
        py::arg("allow_foreign_owner"), py::arg("pin_budget_bytes"), py::arg("quiet"),
        py::arg("allow_world_writable") = false, py::arg("confirm_after_run") = false,
        py::arg("pages_as_written") = true, py::arg("freed_as_written") = 0,
        py::arg("huge_after_build") = true);
  m.def("find_view", &FindView, py::arg("address"), py::arg("length"));
  m.def("view_private_bytes", &ViewPrivateBytes, py::arg("address"), py::arg("length"),
        py::arg("changed"));
  m.def("attach", &AttachArena, py::arg("path"), py::arg("gpu"), py::arg("gpu_required"),
        py::arg("allow_foreign_owner"), py::arg("pin_budget_bytes"), py::arg("quiet"),
        py::arg("allow_world_writable") = false);
}

}  // namespace expert_arena::python
