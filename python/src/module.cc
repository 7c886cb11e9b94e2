// expert_arena._core: the compiled half of the Python package (python/expert_arena wraps it).
//
// It binds the C++ API (expert_arena/arena.h, expert_arena/stream.h) directly. Lifetimes:
// every array this module hands out is a NumPy array over the arena's or the segment's bytes
// whose base is a capsule holding a shared_ptr to the owner (the Arena, or the StreamTensor),
// so memory a view points into stays mapped until the last view is gone, whatever the Python
// code closes or releases first. close() and release() only drop the handle's reference.
//
// Errors: a failed Status becomes the Python exception of its code with the library's message
// (which names the file and the cause); see RaiseStatus. Calls that read files, wait on locks
// or copy tensors release the GIL; they hold their own reference to the C++ object meanwhile,
// so another thread's close() cannot free it under them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "expert_arena/stream.h"
#include "source/dtypes.h"

#ifndef EXPERT_ARENA_VERSION_STRING
#define EXPERT_ARENA_VERSION_STRING "unknown"
#endif

namespace py = pybind11;

namespace expert_arena::python {
namespace {

// expert_arena.BusyError and expert_arena.NoSpaceError (OSError subclasses), made at import.
PyObject* busy_error = nullptr;
PyObject* no_space_error = nullptr;

// Raises the Python exception for `status`, keeping its message; OSError subclasses also get
// the errno that names the cause.
[[noreturn]] void RaiseStatus(const Status& status) {
  PyObject* type = PyExc_RuntimeError;
  int err = 0;
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kCorrupt:
      type = PyExc_ValueError;
      break;
    case StatusCode::kNotFound:
      type = PyExc_FileNotFoundError;
      err = ENOENT;
      break;
    case StatusCode::kPermission:
      type = PyExc_PermissionError;
      err = EACCES;
      break;
    case StatusCode::kTimedOut:
      type = PyExc_TimeoutError;
      err = ETIMEDOUT;
      break;
    case StatusCode::kBusy:
      type = busy_error;
      err = EBUSY;
      break;
    case StatusCode::kNoSpace:
      type = no_space_error;
      err = ENOSPC;
      break;
    case StatusCode::kUnsupported:
      type = PyExc_OSError;
      err = ENOTSUP;
      break;
    case StatusCode::kIoError:
      type = PyExc_OSError;
      err = EIO;
      break;
    case StatusCode::kOk:
    case StatusCode::kInternal:
      type = PyExc_RuntimeError;
      break;
  }
  py::object exc = py::reinterpret_borrow<py::object>(type)(status.message());
  if (err != 0) exc.attr("errno") = err;
  PyErr_SetObject(type, exc.ptr());
  throw py::error_already_set();
}

template <typename T>
T Take(Result<T>&& result) {
  if (!result.ok()) RaiseStatus(result.status());
  return std::move(result).value();
}

[[noreturn]] void RaiseClosed(const char* what) {
  throw py::value_error(std::string(what) + " is closed");
}

std::shared_ptr<spdlog::logger> QuietLogger() {
  static auto logger =
      std::make_shared<spdlog::logger>("expert_arena_quiet", std::make_shared<spdlog::sinks::null_sink_mt>());
  return logger;
}

// A 1-D uint8 NumPy array over `bytes` whose base keeps `owner` alive.
template <typename Owner>
py::array ByteArray(std::span<const std::byte> bytes, std::shared_ptr<Owner> owner,
                    bool writable) {
  auto* holder = new std::shared_ptr<Owner>(std::move(owner));
  py::capsule base(holder, [](void* p) { delete static_cast<std::shared_ptr<Owner>*>(p); });
  py::array array = py::array_t<uint8_t>({static_cast<py::ssize_t>(bytes.size())}, {py::ssize_t{1}},
                             reinterpret_cast<const uint8_t*>(bytes.data()), base);
  if (!writable) {
    py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  }
  return array;
}

py::tuple Shape(std::span<const uint64_t> shape) {
  py::tuple t(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t[i] = py::int_(shape[i]);
  return t;
}

std::vector<uint64_t> ShapeFrom(const std::vector<int64_t>& dims) {
  std::vector<uint64_t> shape;
  shape.reserve(dims.size());
  for (int64_t d : dims) {
    if (d < 0) throw py::value_error("shape has a negative dimension " + std::to_string(d));
    shape.push_back(static_cast<uint64_t>(d));
  }
  return shape;
}

// A C-contiguous array of `dtype` and `shape` over `bytes`, whose base keeps `owner` alive,
// made in one step (the caller's layout has checked that dtype and shape cover the bytes;
// this checks it again and names `what` when they do not).
template <typename Owner>
py::array TypedArray(std::span<const std::byte> bytes, std::shared_ptr<Owner> owner,
                     bool writable, const py::dtype& dtype, const std::vector<py::ssize_t>& shape,
                     const std::string& what) {
  py::ssize_t count = 1;
  for (py::ssize_t d : shape) count *= d;
  if (count * dtype.itemsize() != static_cast<py::ssize_t>(bytes.size())) {
    throw py::value_error(what + ": " + std::to_string(bytes.size()) +
                          " bytes, but the view takes " + std::to_string(count * dtype.itemsize()));
  }
  auto* holder = new std::shared_ptr<Owner>(std::move(owner));
  py::capsule base(holder, [](void* p) { delete static_cast<std::shared_ptr<Owner>*>(p); });
  py::array array(dtype, shape, reinterpret_cast<const void*>(bytes.data()), base);
  if (!writable) {
    py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  }
  return array;
}

// The bytes of a Python bytes object, borrowed (the caller keeps the object alive).
std::string_view BytesView(PyObject* object, const char* what) {
  char* data = nullptr;
  py::ssize_t size = 0;
  if (!PyBytes_Check(object)) {
    throw py::type_error(std::string(what) + ": a descriptor is bytes, got " +
                         Py_TYPE(object)->tp_name);
  }
  if (PyBytes_AsStringAndSize(object, &data, &size) != 0) throw py::error_already_set();
  return {data, static_cast<size_t>(size)};
}

// Bytes of one element of a stream dtype name put() writes (0: not one of them).
uint64_t ElementBytes(const std::string& name) {
  static const std::pair<const char*, uint64_t> kSizes[] = {
      {"f64", 8}, {"f32", 4}, {"f16", 2}, {"bf16", 2}, {"i64", 8}, {"i32", 4},
      {"i16", 2}, {"i8", 1}, {"u64", 8}, {"u32", 4}, {"u16", 2}, {"u8", 1},
      {"bool", 1}, {"c64", 8}, {"c128", 16}, {"f8_e4m3", 1}, {"f8_e5m2", 1}, {"f8_e8m0", 1}};
  for (const auto& [n, size] : kSizes) {
    if (name == n) return size;
  }
  return 0;
}

ModelFormat ParseFormat(const std::string& format) {
  if (format == "auto") return ModelFormat::kAuto;
  if (format == "gguf") return ModelFormat::kGguf;
  if (format == "safetensors") return ModelFormat::kSafetensors;
  if (format == "raw") return ModelFormat::kRaw;
  throw py::value_error("format=" + format +
                        ": use \"auto\", \"gguf\", \"safetensors\" or \"raw\"");
}

HugePages ParseHuge(const std::string& huge) {
  if (huge == "auto") return HugePages::kAuto;
  if (huge == "on") return HugePages::kOn;
  if (huge == "off") return HugePages::kOff;
  throw py::value_error("huge=" + huge + ": use \"auto\", \"on\" or \"off\"");
}

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
    d["gpu"] = r.gpu_note.empty() ? std::string("none") : r.gpu_note;
    d["gpu_registered_bytes"] = r.gpu_registered_bytes;
    d["gpu_seconds"] = r.gpu_seconds;
    d["pinned_bytes"] = r.pinned_bytes;
    d["waited_for_pid"] = r.waited_for_pid;
    d["start_line"] = start_line_;
    return d;
  }

 private:
  std::shared_ptr<Arena> arena_;
  std::string start_line_;
};

ArenaOptions MakeArenaOptions(const std::optional<std::string>& shared_path,
                              const std::string& gpu, bool gpu_required, const std::string& huge,
                              double wait_timeout, uint32_t file_mode, bool allow_foreign_owner,
                              uint64_t pin_budget_bytes, const std::string& reader, bool quiet,
                              bool progress) {
  ArenaOptions options;
  if (shared_path) options.shared_path = *shared_path;
  options.gpu = gpu;
  options.gpu_required = gpu_required;
  options.huge = ParseHuge(huge);
  if (!(wait_timeout >= 0)) throw py::value_error("wait_timeout must be >= 0 seconds");
  options.wait_timeout_seconds = wait_timeout;
  if (file_mode > 07777) throw py::value_error("file_mode " + std::to_string(file_mode) + " is not a mode");
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
                  const std::string& format) {
  if (files.empty()) throw py::value_error("open(): model_files names no file");
  ModelSpec model;
  model.files = std::move(files);
  model.format = ParseFormat(format);
  if (select) model.select = *select;
  model.select_all = select_all;
  model.alignment = alignment;
  ArenaOptions options =
      MakeArenaOptions(shared_path, gpu, gpu_required, huge, wait_timeout, file_mode,
                       allow_foreign_owner, pin_budget_bytes, reader, quiet, progress);
  std::optional<Result<Arena>> arena;
  {
    py::gil_scoped_release release;
    arena.emplace(Arena::Open(model, options));
  }
  return PyArena(Take(std::move(*arena)));
}

PyArena AttachArena(const std::string& path, const std::string& gpu, bool gpu_required,
                    bool allow_foreign_owner, uint64_t pin_budget_bytes, bool quiet) {
  ArenaOptions options = MakeArenaOptions(path, gpu, gpu_required, "auto", 0, 0600,
                                          allow_foreign_owner, pin_budget_bytes, "auto", quiet,
                                          false);
  std::optional<Result<Arena>> arena;
  {
    py::gil_scoped_release release;
    arena.emplace(Arena::AttachExisting(path, options));
  }
  return PyArena(Take(std::move(*arena)));
}

// ---- Streaming --------------------------------------------------------------------------

py::dict StatsDict(const StreamStats& s) {
  py::dict d;
  d["total_bytes"] = s.total_bytes;
  d["free_bytes"] = s.free_bytes;
  d["largest_free_block"] = s.largest_free_block;
  d["segments"] = s.segments;
  d["dedicated_segments"] = s.dedicated_segments;
  d["live_blocks"] = s.live_blocks;
  d["pinned_bytes"] = s.pinned_bytes;
  d["spills"] = s.spills;
  d["spill_files"] = s.spill_files;
  d["fragmentation_failures"] = s.fragmentation_failures;
  d["reclaimed_blocks"] = s.reclaimed_blocks;
  d["dead_readers_cleared"] = s.dead_readers_cleared;
  d["segments_grown_ahead"] = s.segments_grown_ahead;
  return d;
}

// Space reserved in a segment, written in place through writable views, then published.
// The views and the Python Reservation share the C++ Reservation: unpublished, its space goes
// back when the last of them is gone (cancel() drops only the handle's share), so no view ever
// writes into space another tensor was given; it also keeps the producer's segments mapped.
struct HeldReservation {
  Reservation reservation;
};

class PyReservation {
 public:
  PyReservation(Reservation reservation, std::string key)
      : key_(std::move(key)),
        bytes_(reservation.bytes()),
        spilled_(reservation.spilled()),
        held_(std::make_shared<HeldReservation>(HeldReservation{std::move(reservation)})) {}

  const std::shared_ptr<HeldReservation>& Get() const {
    if (!held_) {
      throw py::value_error("reservation of key " + key_ +
                            (published_ ? " was published: write before publish(), and make a "
                                          "new reservation for the next tensor"
                                        : " was cancelled"));
    }
    return held_;
  }

  py::array View(const py::dtype& dtype, const std::vector<py::ssize_t>& shape) const {
    return TypedArray(std::span<const std::byte>(bytes_), Get(), true, dtype, shape,
                      "reservation of key " + key_);
  }

  py::bytes Publish(const std::string& dtype, const std::vector<int64_t>& shape,
                    uint32_t readers) {
    const auto& held = Get();
    TensorInfo info;
    info.dtype = dtype;
    info.shape = ShapeFrom(shape);
    Result<std::string> descriptor = held->reservation.Publish(info, readers);
    if (descriptor.ok() || descriptor.status().code() == StatusCode::kBusy) {
      // Published, or aborted meanwhile (its space given back): either way it is done.
      published_ = descriptor.ok();
      held_.reset();
    }
    return py::bytes(Take(std::move(descriptor)));
  }

  void Cancel() { held_.reset(); }
  bool published() const { return published_; }
  bool open() const { return held_ != nullptr; }
  bool spilled() const { return spilled_; }
  uintptr_t Address() const { return reinterpret_cast<uintptr_t>(bytes_.data()); }
  uint64_t nbytes() const { return bytes_.size(); }

 private:
  std::string key_;
  std::span<std::byte> bytes_;
  bool spilled_ = false;
  bool published_ = false;
  std::shared_ptr<HeldReservation> held_;
};

class PyProducer {
 public:
  PyProducer(const std::string& directory, const std::string& logical_name,
             uint64_t segment_bytes, uint32_t max_segments, bool strict,
             double strict_wait_seconds, const std::string& gpu, uint64_t pin_budget_bytes,
             uint64_t block_alignment, const std::string& spill_directory,
             const std::string& huge, uint32_t copy_threads, bool grow_ahead,
             bool sweep_at_start, bool quiet) {
    StreamOptions options;
    options.directory = directory;
    options.logical_name = logical_name;
    options.segment_bytes = segment_bytes;
    options.max_segments = max_segments;
    options.strict = strict;
    options.strict_wait_seconds = strict_wait_seconds;
    options.gpu = gpu;
    options.pin_budget_bytes = pin_budget_bytes;
    options.block_alignment = block_alignment;
    options.spill_directory = spill_directory;
    options.huge = ParseHuge(huge);
    options.copy_threads = copy_threads;
    options.grow_ahead = grow_ahead;
    options.sweep_at_start = sweep_at_start;
    if (quiet) options.logger = QuietLogger();
    std::optional<Result<StreamProducer>> producer;
    {
      py::gil_scoped_release release;
      producer.emplace(StreamProducer::Create(options));
    }
    producer_ = std::make_shared<StreamProducer>(Take(std::move(*producer)));
  }

  std::shared_ptr<StreamProducer> Get() const {
    if (!producer_) RaiseClosed("StreamProducer");
    return producer_;
  }

  // Copies `nbytes` at `address` (a contiguous CPU buffer the caller keeps alive for the
  // call) into a segment and publishes it.
  py::bytes Put(const std::string& key, uintptr_t address, uint64_t nbytes,
                const std::string& dtype, const std::vector<int64_t>& shape, uint32_t readers) {
    auto producer = Get();
    TensorInfo info;
    info.dtype = dtype;
    info.shape = ShapeFrom(shape);
    std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(address), nbytes);
    std::optional<Result<std::string>> descriptor;
    {
      py::gil_scoped_release release;
      descriptor.emplace(producer->Put(key, bytes, info, readers));
    }
    return py::bytes(Take(std::move(*descriptor)));
  }

  // Put of a batch, all or none (StreamProducer::PutMany): `items` is a list of
  // (key, address, nbytes, dtype, shape) tuples whose buffers the caller keeps alive.
  py::list PutMany(const py::list& items, uint32_t readers) {
    auto producer = Get();
    const size_t n = items.size();
    std::vector<std::string> keys(n);
    std::vector<PutItem> puts(n);
    for (size_t i = 0; i < n; ++i) {
      py::handle item = items[i];
      if (!PyTuple_Check(item.ptr()) || PyTuple_GET_SIZE(item.ptr()) != 5) {
        throw py::type_error("put_many: item " + std::to_string(i) +
                             " is not a (key, address, nbytes, dtype, shape) tuple");
      }
      py::tuple t = py::reinterpret_borrow<py::tuple>(item);
      keys[i] = t[0].cast<std::string>();
      puts[i].key = keys[i];
      puts[i].bytes = std::span<const std::byte>(
          reinterpret_cast<const std::byte*>(t[1].cast<uintptr_t>()), t[2].cast<uint64_t>());
      puts[i].info.dtype = t[3].cast<std::string>();
      puts[i].info.shape = ShapeFrom(t[4].cast<std::vector<int64_t>>());
    }
    std::optional<Result<std::vector<std::string>>> descriptors;
    {
      py::gil_scoped_release release;
      descriptors.emplace(producer->PutMany(puts, readers));
    }
    std::vector<std::string> out = Take(std::move(*descriptors));
    py::list list(out.size());
    for (size_t i = 0; i < out.size(); ++i) list[i] = py::bytes(out[i]);
    return list;
  }

  // put_many from the caller's (key, tensor) pairs. A C-contiguous NumPy array of a dtype in
  // `numpy_names`, and a CPU, strided, contiguous torch tensor (`torch_type`, `strided`) of a
  // dtype in `torch_names`, are read here, with no Python code run per item; anything else is
  // handed to `slow(index, key, object)`, which returns (address, nbytes, dtype, shape) or
  // raises the error that names what the object is. `pairs` keeps every buffer alive.
  py::list PutManyPairs(const py::list& pairs, uint32_t readers, const py::dict& numpy_names,
                        const py::object& torch_type, const py::object& strided,
                        const py::dict& torch_names, const py::object& slow) {
    auto producer = Get();
    static const py::str kIsCpu("is_cpu"), kLayout("layout"), kIsContiguous("is_contiguous"),
        kDtype("dtype"), kDataPtr("data_ptr"), kShape("shape");
    const size_t n = pairs.size();
    std::vector<std::string> keys(n), dtypes(n);
    std::vector<PutItem> puts(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* pair = PyList_GET_ITEM(pairs.ptr(), static_cast<py::ssize_t>(i));
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        throw py::type_error("put_many(): item " + std::to_string(i) +
                             " is not a (key, tensor) pair: " + Py_TYPE(pair)->tp_name);
      }
      PyObject* key = PyTuple_GET_ITEM(pair, 0);
      py::handle tensor = PyTuple_GET_ITEM(pair, 1);
      py::ssize_t key_size = 0;
      const char* key_data = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &key_size)
                                                  : nullptr;
      if (key_data == nullptr) {
        PyErr_Clear();
        throw py::type_error("put_many(): the key of item " + std::to_string(i) +
                             " is not a str: " + Py_TYPE(key)->tp_name);
      }
      keys[i].assign(key_data, static_cast<size_t>(key_size));
      PutItem& put = puts[i];
      bool done = false;
      if (py::isinstance<py::array>(tensor)) {
        auto array = py::reinterpret_borrow<py::array>(tensor);
        PyObject* name = PyDict_GetItem(numpy_names.ptr(), array.dtype().ptr());
        if (name != nullptr && (array.flags() & py::array::c_style) != 0) {
          dtypes[i] = py::reinterpret_borrow<py::str>(name);
          put.bytes = std::span<const std::byte>(static_cast<const std::byte*>(array.data()),
                                                 static_cast<size_t>(array.nbytes()));
          put.info.shape.assign(array.shape(), array.shape() + array.ndim());
          done = true;
        }
      } else if (!torch_type.is_none() &&
                 PyObject_TypeCheck(tensor.ptr(),
                                    reinterpret_cast<PyTypeObject*>(torch_type.ptr())) &&
                 tensor.attr(kIsCpu).ptr() == Py_True &&
                 tensor.attr(kLayout).ptr() == strided.ptr() &&
                 tensor.attr(kIsContiguous)().ptr() == Py_True) {
        PyObject* name = PyDict_GetItem(torch_names.ptr(), tensor.attr(kDtype).ptr());
        if (name != nullptr) {
          dtypes[i] = py::reinterpret_borrow<py::str>(name);
          py::tuple shape = py::tuple(tensor.attr(kShape));
          uint64_t count = 1;
          put.info.shape.reserve(shape.size());
          for (py::handle d : shape) {
            put.info.shape.push_back(d.cast<uint64_t>());
            count *= put.info.shape.back();
          }
          uint64_t item_size = ElementBytes(dtypes[i]);
          put.bytes = std::span<const std::byte>(
              reinterpret_cast<const std::byte*>(tensor.attr(kDataPtr)().cast<uintptr_t>()),
              count * item_size);
          done = item_size != 0;
        }
      }
      if (!done) {
        py::tuple source = slow(i, py::handle(key), tensor);
        put.bytes = std::span<const std::byte>(
            reinterpret_cast<const std::byte*>(source[0].cast<uintptr_t>()),
            source[1].cast<uint64_t>());
        dtypes[i] = source[2].cast<std::string>();
        put.info.shape = ShapeFrom(source[3].cast<std::vector<int64_t>>());
      }
      put.key = keys[i];
      put.info.dtype = dtypes[i];
    }
    std::optional<Result<std::vector<std::string>>> descriptors;
    {
      py::gil_scoped_release release;
      descriptors.emplace(producer->PutMany(puts, readers));
    }
    std::vector<std::string> out = Take(std::move(*descriptors));
    py::list list(out.size());
    for (size_t i = 0; i < out.size(); ++i) {
      PyObject* b = PyBytes_FromStringAndSize(out[i].data(), static_cast<py::ssize_t>(out[i].size()));
      if (b == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(list.ptr(), static_cast<py::ssize_t>(i), b);
    }
    return list;
  }

  PyReservation Reserve(const std::string& key, uint64_t nbytes) {
    auto producer = Get();
    std::optional<Result<Reservation>> reservation;
    {
      py::gil_scoped_release release;
      reservation.emplace(producer->Reserve(key, nbytes));
    }
    return PyReservation(Take(std::move(*reservation)), key);
  }

  uint64_t Abort(const std::string& key) {
    auto producer = Get();
    std::optional<Result<uint64_t>> marked;
    {
      py::gil_scoped_release release;
      marked.emplace(producer->Abort(key));
    }
    return Take(std::move(*marked));
  }

  void Reclaim() {
    auto producer = Get();
    Status s;
    {
      py::gil_scoped_release release;
      s = producer->Reclaim();
    }
    if (!s.ok()) RaiseStatus(s);
  }

  py::dict Stats() {
    auto producer = Get();
    StreamStats s;
    {
      py::gil_scoped_release release;
      s = producer->Stats();
    }
    return StatsDict(s);
  }

  std::vector<std::string> SegmentPaths() { return Get()->SegmentPaths(); }
  std::string InstanceName() { return Get()->instance_name(); }
  bool closed() const { return producer_ == nullptr; }

  void Close() {
    std::shared_ptr<StreamProducer> producer = std::move(producer_);
    py::gil_scoped_release release;
    producer.reset();
  }

 private:
  std::shared_ptr<StreamProducer> producer_;
};

// One opened tensor: the views and the Python StreamTensor share it; the reader's share goes
// back to the producer when the last of them is gone.
struct OpenedTensor {
  StreamTensor tensor;
};

class PyStreamTensor {
 public:
  explicit PyStreamTensor(StreamTensor tensor)
      : descriptor_(tensor.descriptor()),
        opened_(std::make_shared<OpenedTensor>(OpenedTensor{std::move(tensor)})) {}

  const std::shared_ptr<OpenedTensor>& Get() const {
    if (!opened_) {
      throw py::value_error("stream tensor " + descriptor_.key + " was released");
    }
    return opened_;
  }

  py::array Buffer(bool writable) const {
    const auto& opened = Get();
    return ByteArray(opened->tensor.bytes(), opened, writable);
  }

  // A read-only (or writable) C-contiguous array of `dtype` and `shape` over the bytes, made in
  // one step (the caller's layout has checked that dtype and shape cover exactly the bytes).
  py::array View(bool writable, const py::dtype& dtype, const std::vector<py::ssize_t>& shape) const {
    const auto& opened = Get();
    return TypedArray(opened->tensor.bytes(), opened, writable, dtype, shape,
                      "stream tensor " + descriptor_.key);
  }

  void Release() { opened_.reset(); }
  bool released() const { return opened_ == nullptr; }
  const TensorDescriptor& descriptor() const { return descriptor_; }
  uintptr_t Address() const {
    return reinterpret_cast<uintptr_t>(Get()->tensor.bytes().data());
  }

 private:
  TensorDescriptor descriptor_;
  std::shared_ptr<OpenedTensor> opened_;
};

class PyConsumer {
 public:
  PyConsumer(const std::string& directory, const std::string& spill_directory,
             const std::string& gpu, uint64_t pin_budget_bytes, bool allow_foreign_owner,
             bool quiet) {
    ConsumerOptions options;
    options.directory = directory;
    options.spill_directory = spill_directory;
    options.gpu = gpu;
    options.pin_budget_bytes = pin_budget_bytes;
    options.allow_foreign_owner = allow_foreign_owner;
    if (quiet) options.logger = QuietLogger();
    std::optional<Result<StreamConsumer>> consumer;
    {
      py::gil_scoped_release release;
      consumer.emplace(StreamConsumer::Create(options));
    }
    consumer_ = std::make_shared<StreamConsumer>(Take(std::move(*consumer)));
  }

  std::shared_ptr<StreamConsumer> Get() const {
    if (!consumer_) RaiseClosed("StreamConsumer");
    return consumer_;
  }

  PyStreamTensor Open(const py::bytes& descriptor) {
    auto consumer = Get();
    // A view of the bytes object's buffer: the caller's reference keeps it alive meanwhile.
    std::string_view wire = BytesView(descriptor.ptr(), "open");
    std::optional<Result<StreamTensor>> tensor;
    {
      py::gil_scoped_release release;
      tensor.emplace(consumer->Open(wire));
    }
    return PyStreamTensor(Take(std::move(*tensor)));
  }

  // Opens every descriptor of `descriptors` (bytes objects the caller keeps alive) with the
  // GIL released once, all or none: when one fails, those opened before it are released and
  // the error names its index.
  std::vector<StreamTensor> OpenAll(const py::list& descriptors) {
    auto consumer = Get();
    const size_t n = descriptors.size();
    std::vector<std::string_view> wires(n);
    for (size_t i = 0; i < n; ++i) wires[i] = BytesView(descriptors[i].ptr(), "open_many");
    std::vector<StreamTensor> opened;
    opened.reserve(n);
    Status failed;
    size_t failed_at = 0;
    {
      py::gil_scoped_release release;
      for (size_t i = 0; i < n; ++i) {
        Result<StreamTensor> t = consumer->Open(wires[i]);
        if (!t.ok()) {
          failed = t.status();
          failed_at = i;
          opened.clear();  // gives back the reader's share of each opened before it
          break;
        }
        opened.push_back(std::move(t).value());
      }
    }
    if (!failed.ok()) {
      RaiseStatus(Status(failed.code(),
                         "stream open_many: item " + std::to_string(failed_at) + " of " +
                             std::to_string(n) + ": " + failed.message() +
                             (failed_at > 0 ? " (the items opened before it were released)"
                                            : "")));
    }
    return opened;
  }

  // Open of a batch, all or none: [(handle, key, dtype, shape, nbytes), ...] in order.
  py::list OpenManySummary(const py::list& descriptors) {
    std::vector<StreamTensor> opened = OpenAll(descriptors);
    py::list out(opened.size());
    for (size_t i = 0; i < opened.size(); ++i) {
      out[i] = Summary(PyStreamTensor(std::move(opened[i])));
    }
    return out;
  }

  // Open of a batch straight to read-only NumPy arrays, all or none: each array's base holds
  // its opened tensor, so the reader's share goes back when the array (and every view of it)
  // is gone. `layouts` maps a lower-case dtype name to its NumPy dtype (_dtypes); a name not
  // in it gives the raw bytes as uint8.
  //
  // With `for_torch` the arrays are writable (the package wraps each in a read-only tensor and
  // never hands the array out), and a tensor whose dtype is not in `layouts` comes as a
  // (uint8 array of its bytes, dtype, shape, key) tuple for the package to view.
  py::list OpenManyArrays(const py::list& descriptors, const py::dict& layouts, bool for_torch) {
    std::vector<StreamTensor> tensors = OpenAll(descriptors);
    const size_t n = tensors.size();
    std::vector<std::shared_ptr<OpenedTensor>> opened;
    opened.reserve(n);
    for (StreamTensor& t : tensors) {
      opened.push_back(std::make_shared<OpenedTensor>(OpenedTensor{std::move(t)}));
    }
    static const py::dtype kBytes = py::dtype::of<uint8_t>();
    py::list out(n);
    std::string lower;
    std::vector<py::ssize_t> shape;
    for (size_t i = 0; i < n; ++i) {
      const TensorDescriptor& d = opened[i]->tensor.descriptor();
      std::span<const std::byte> bytes = opened[i]->tensor.bytes();
      lower.assign(d.dtype);
      for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      PyObject* dtype = PyDict_GetItemString(layouts.ptr(), lower.c_str());
      shape.clear();
      if (dtype != nullptr) {
        shape.assign(d.shape.begin(), d.shape.end());
        out[i] = TypedArray(bytes, opened[i], for_torch,
                            py::reinterpret_borrow<py::dtype>(dtype), shape,
                            "stream tensor " + d.key + " (" + d.dtype + ")");
      } else {
        shape.push_back(static_cast<py::ssize_t>(bytes.size()));
        py::array raw = TypedArray(bytes, opened[i], for_torch, kBytes, shape,
                                   "stream tensor " + d.key);
        if (for_torch) {
          out[i] = py::make_tuple(raw, py::str(d.dtype), Shape(d.shape), py::str(d.key));
        } else {
          out[i] = raw;
        }
      }
    }
    return out;
  }

  // Open plus the summary in one call: (handle, key, dtype, shape, nbytes).
  py::tuple OpenSummary(const py::bytes& descriptor) { return Summary(Open(descriptor)); }

  static py::tuple Summary(PyStreamTensor tensor) {
    const TensorDescriptor& d = tensor.descriptor();
    py::str key(d.key);
    py::str dtype(d.dtype);
    py::tuple shape = Shape(d.shape);
    py::int_ length(d.length);
    return py::make_tuple(py::cast(std::move(tensor)), key, dtype, shape, length);
  }

  uint64_t PollReleases() {
    auto consumer = Get();
    py::gil_scoped_release release;
    return consumer->PollReleases();
  }

  py::dict Stats() {
    ConsumerStats s = Get()->Stats();
    py::dict d;
    d["mapped_segments"] = s.mapped_segments;
    d["mapped_bytes"] = s.mapped_bytes;
    d["pinned_bytes"] = s.pinned_bytes;
    d["open_views"] = s.open_views;
    d["deferred_releases"] = s.deferred_releases;
    d["dropped_segments"] = s.dropped_segments;
    return d;
  }

  bool closed() const { return consumer_ == nullptr; }

  void Close() {
    std::shared_ptr<StreamConsumer> consumer = std::move(consumer_);
    py::gil_scoped_release release;
    consumer.reset();
  }

 private:
  std::shared_ptr<StreamConsumer> consumer_;
};

py::dict DescriptorDict(const TensorDescriptor& d) {
  py::dict out;
  out["segment"] = d.segment;
  out["spilled"] = d.spilled;
  out["slot"] = d.slot;
  out["generation"] = d.generation;
  out["offset"] = d.offset;
  out["length"] = d.length;
  out["dtype"] = d.dtype;
  out["shape"] = Shape(d.shape);
  out["key"] = d.key;
  return out;
}

py::dict SegmentDict(const SegmentInfo& s) {
  py::dict d;
  d["path"] = s.path;
  d["ours"] = s.ours;
  d["problem"] = s.problem;
  d["owner_pid"] = s.owner_pid;
  d["owner_start_time"] = s.owner_start_time;
  d["owner_uid"] = s.owner_uid;
  d["owner_alive"] = s.owner_alive;
  d["dedicated"] = s.dedicated;
  d["spill"] = s.spill;
  d["logical_name"] = s.logical_name;
  d["file_bytes"] = s.file_bytes;
  d["data_bytes"] = s.data_bytes;
  d["slots"] = s.slots;
  d["live_blocks"] = s.live_blocks;
  d["live_bytes"] = s.live_bytes;
  d["published_blocks"] = s.published_blocks;
  d["aborted_blocks"] = s.aborted_blocks;
  d["readers"] = s.readers;
  return d;
}

}  // namespace
}  // namespace expert_arena::python

PYBIND11_MODULE(_core, m) {
  using namespace expert_arena;
  using namespace expert_arena::python;
  m.doc() = "expert_arena._core: the compiled part of expert_arena (use the package, not this)";
  m.attr("__version__") = EXPERT_ARENA_VERSION_STRING;

  busy_error = PyErr_NewExceptionWithDoc(
      "expert_arena.BusyError",
      "Somebody else holds the resource: an arena file of another model in use, a lock, an "
      "aborted key. An OSError with errno EBUSY.",
      PyExc_OSError, nullptr);
  no_space_error = PyErr_NewExceptionWithDoc(
      "expert_arena.NoSpaceError",
      "A filesystem, the huge page pool or a stream cap is too small. An OSError with errno "
      "ENOSPC.",
      PyExc_OSError, nullptr);
  if (busy_error == nullptr || no_space_error == nullptr) throw py::error_already_set();
  m.attr("BusyError") = py::reinterpret_borrow<py::object>(busy_error);
  m.attr("NoSpaceError") = py::reinterpret_borrow<py::object>(no_space_error);

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
        py::arg("alignment"), py::arg("format"));
  m.def("attach", &AttachArena, py::arg("path"), py::arg("gpu"), py::arg("gpu_required"),
        py::arg("allow_foreign_owner"), py::arg("pin_budget_bytes"), py::arg("quiet"));

  py::class_<PyProducer>(m, "StreamProducer")
      .def(py::init<const std::string&, const std::string&, uint64_t, uint32_t, bool, double,
                    const std::string&, uint64_t, uint64_t, const std::string&,
                    const std::string&, uint32_t, bool, bool, bool>(),
           py::arg("directory"), py::arg("logical_name"), py::arg("segment_bytes"),
           py::arg("max_segments"), py::arg("strict"), py::arg("strict_wait_seconds"),
           py::arg("gpu"), py::arg("pin_budget_bytes"), py::arg("block_alignment"),
           py::arg("spill_directory"), py::arg("huge"), py::arg("copy_threads"),
           py::arg("grow_ahead"), py::arg("sweep_at_start"), py::arg("quiet"))
      .def("put", &PyProducer::Put, py::arg("key"), py::arg("address"), py::arg("nbytes"),
           py::arg("dtype"), py::arg("shape"), py::arg("readers"))
      .def("put_many", &PyProducer::PutMany, py::arg("items"), py::arg("readers"))
      .def("put_many_pairs", &PyProducer::PutManyPairs, py::arg("pairs"), py::arg("readers"),
           py::arg("numpy_names"), py::arg("torch_type"), py::arg("strided"),
           py::arg("torch_names"), py::arg("slow"))
      .def("reserve", &PyProducer::Reserve, py::arg("key"), py::arg("nbytes"))
      .def("abort", &PyProducer::Abort)
      .def("reclaim", &PyProducer::Reclaim)
      .def("stats", &PyProducer::Stats)
      .def("segment_paths", &PyProducer::SegmentPaths)
      .def("instance_name", &PyProducer::InstanceName)
      .def("close", &PyProducer::Close)
      .def_property_readonly("closed", &PyProducer::closed);

  py::class_<PyReservation>(m, "Reservation")
      .def("view", &PyReservation::View, py::arg("dtype"), py::arg("shape"))
      .def("publish", &PyReservation::Publish, py::arg("dtype"), py::arg("shape"),
           py::arg("readers"))
      .def("cancel", &PyReservation::Cancel)
      .def("address", &PyReservation::Address)
      .def_property_readonly("published", &PyReservation::published)
      .def_property_readonly("open", &PyReservation::open)
      .def_property_readonly("spilled", &PyReservation::spilled)
      .def_property_readonly("nbytes", &PyReservation::nbytes);

  py::class_<PyStreamTensor>(m, "StreamTensor")
      .def("buffer", &PyStreamTensor::Buffer, py::arg("writable") = false)
      .def("view", &PyStreamTensor::View, py::arg("writable"), py::arg("dtype"), py::arg("shape"))
      .def("release", &PyStreamTensor::Release)
      .def("address", &PyStreamTensor::Address)
      .def_property_readonly("released", &PyStreamTensor::released)
      .def("descriptor",
           [](const PyStreamTensor& t) { return DescriptorDict(t.descriptor()); })
      .def("summary", [](const PyStreamTensor& t) {
        const TensorDescriptor& d = t.descriptor();
        return py::make_tuple(d.key, d.dtype, Shape(d.shape), d.length);
      });

  py::class_<PyConsumer>(m, "StreamConsumer")
      .def(py::init<const std::string&, const std::string&, const std::string&, uint64_t, bool,
                    bool>(),
           py::arg("directory"), py::arg("spill_directory"), py::arg("gpu"),
           py::arg("pin_budget_bytes"), py::arg("allow_foreign_owner"), py::arg("quiet"))
      .def("open", &PyConsumer::Open)
      .def("open_summary", &PyConsumer::OpenSummary)
      .def("open_many_summary", &PyConsumer::OpenManySummary)
      .def("open_many_arrays", &PyConsumer::OpenManyArrays, py::arg("descriptors"),
           py::arg("layouts"), py::arg("for_torch") = false)
      .def("poll_releases", &PyConsumer::PollReleases)
      .def("stats", &PyConsumer::Stats)
      .def("close", &PyConsumer::Close)
      .def_property_readonly("closed", &PyConsumer::closed);

  m.def("decode_descriptor", [](const py::bytes& wire) {
    std::string bytes = wire;
    return DescriptorDict(Take(TensorDescriptor::Decode(bytes)));
  });
  m.def("sweep", [](const std::string& directory) {
    std::optional<Result<SweepReport>> report;
    {
      py::gil_scoped_release release;
      report.emplace(SweepStreamDirectory(directory));
    }
    SweepReport r = Take(std::move(*report));
    py::dict d;
    d["removed"] = r.removed;
    d["live"] = r.live;
    d["notes"] = r.notes;
    return d;
  });
  m.def("inspect_segment", [](const std::string& path) {
    return SegmentDict(Take(InspectSegment(path)));
  });
  m.def("ggml_block", [](const std::string& name) -> std::optional<std::pair<uint32_t, uint32_t>> {
    const source::GgmlType* type = source::FindGgmlTypeByName(name);
    if (type == nullptr) return std::nullopt;
    return std::make_pair(type->block_elems, type->block_bytes);
  });
  m.def("xxh3_64", [](const py::buffer& buffer) {
    py::buffer_info info = buffer.request();
    if (info.ndim != 1 || info.strides[0] != info.itemsize) {
      throw py::value_error("xxh3_64(): needs a contiguous 1-D buffer");
    }
    const void* data = info.ptr;
    size_t bytes = static_cast<size_t>(info.size * info.itemsize);
    py::gil_scoped_release release;
    return static_cast<uint64_t>(XXH3_64bits(data, bytes));
  }, "xxh3-64 of a contiguous buffer's bytes (the checksum of the arena's tensor table)");
  m.def("array_address", [](const py::array& array) {
    return reinterpret_cast<uintptr_t>(array.data());
  }, "Address of a NumPy array's first byte (what array.ctypes.data gives, without ctypes)");
  m.def("is_stream_segment", [](const std::string& path) { return IsStreamSegment(path); });
}
