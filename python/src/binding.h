// The parts of expert_arena._core that the arena and the stream bindings share: errors
// raised from a Status, arrays whose base keeps their owner alive, shapes and dtype names.
#ifndef EXPERT_ARENA_PYTHON_BINDING_H_
#define EXPERT_ARENA_PYTHON_BINDING_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "expert_arena/stream.h"
#include "format/dtypes.h"

#ifndef EXPERT_ARENA_VERSION_STRING
#define EXPERT_ARENA_VERSION_STRING "unknown"
#endif

namespace py = pybind11;

namespace expert_arena::python {

// expert_arena.BusyError and expert_arena.NoSpaceError (OSError subclasses), made at import.
inline PyObject* busy_error = nullptr;
inline PyObject* no_space_error = nullptr;

// A path or a name as a Python str: bytes that are not UTF-8 (a file name is any bytes but '/'
// and NUL on Linux; a GGUF tensor name is any bytes) become lone surrogates, as os.fsdecode
// makes them, so that the str handed back (FsBytes) names the same bytes. Never raises.
inline py::str FsStr(std::string_view bytes) {
  PyObject* text = PyUnicode_DecodeUTF8(bytes.data(), static_cast<py::ssize_t>(bytes.size()),
                                        "surrogateescape");
  if (text == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(text);
}

// A message (an error, a log line, a start line) as a Python str: bytes that are not UTF-8 as
// \xNN, so that printing or logging it never fails.
inline py::str MessageStr(std::string_view bytes) {
  PyObject* text = PyUnicode_DecodeUTF8(bytes.data(), static_cast<py::ssize_t>(bytes.size()),
                                        "backslashreplace");
  if (text == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(text);
}

// The bytes of a path or a name given as str (lone surrogates back to the bytes they stand
// for, as os.fsencode does) or as bytes.
inline std::string FsBytes(py::handle value, const char* what) {
  if (PyBytes_Check(value.ptr())) {
    return std::string(PyBytes_AS_STRING(value.ptr()),
                       static_cast<size_t>(PyBytes_GET_SIZE(value.ptr())));
  }
  if (PyUnicode_Check(value.ptr())) {
    PyObject* bytes = PyUnicode_AsEncodedString(value.ptr(), "utf-8", "surrogateescape");
    if (bytes == nullptr) throw py::error_already_set();
    std::string out(PyBytes_AS_STRING(bytes), static_cast<size_t>(PyBytes_GET_SIZE(bytes)));
    Py_DECREF(bytes);
    return out;
  }
  throw py::type_error(std::string(what) + " must be str or bytes, not " +
                       Py_TYPE(value.ptr())->tp_name);
}

// Raises `type` with `message`, whose bytes need not be UTF-8 (py::value_error and friends
// decode strictly and would raise UnicodeDecodeError instead).
[[noreturn]] inline void RaiseMessage(PyObject* type, std::string_view message) {
  PyErr_SetObject(type, MessageStr(message).ptr());
  throw py::error_already_set();
}

// Raises the Python exception for `status`, keeping its message; OSError subclasses also get
// the errno that names the cause.
[[noreturn]] inline void RaiseStatus(const Status& status) {
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
  py::object exc = py::reinterpret_borrow<py::object>(type)(MessageStr(status.message()));
  if (err != 0) exc.attr("errno") = err;
  PyErr_SetObject(type, exc.ptr());
  throw py::error_already_set();
}

template <typename T>
inline T Take(Result<T>&& result) {
  if (!result.ok()) RaiseStatus(result.status());
  return std::move(result).value();
}

[[noreturn]] inline void RaiseClosed(const char* what) {
  throw py::value_error(std::string(what) + " is closed");
}

inline std::shared_ptr<spdlog::logger> QuietLogger() {
  static auto logger = std::make_shared<spdlog::logger>(
      "expert_arena_quiet", std::make_shared<spdlog::sinks::null_sink_mt>());
  return logger;
}

// A 1-D uint8 NumPy array over `bytes` whose base keeps `owner` alive.
template <typename Owner>
py::array ByteArray(std::span<const std::byte> bytes, std::shared_ptr<Owner> owner, bool writable) {
  auto* holder = new std::shared_ptr<Owner>(std::move(owner));
  py::capsule base(holder, [](void* p) { delete static_cast<std::shared_ptr<Owner>*>(p); });
  py::array array = py::array_t<uint8_t>({static_cast<py::ssize_t>(bytes.size())}, {py::ssize_t{1}},
                                         reinterpret_cast<const uint8_t*>(bytes.data()), base);
  if (!writable) {
    py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  }
  return array;
}

inline py::tuple Shape(std::span<const uint64_t> shape) {
  py::tuple t(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t[i] = py::int_(shape[i]);
  return t;
}

inline std::vector<uint64_t> ShapeFrom(const std::vector<int64_t>& dims) {
  std::vector<uint64_t> shape;
  shape.reserve(dims.size());
  for (int64_t d : dims) {
    if (d < 0) throw py::value_error("shape has a negative dimension " + std::to_string(d));
    shape.push_back(static_cast<uint64_t>(d));
  }
  return shape;
}

// Bytes of one element of `dtype`, from its Python attribute: pybind11 before 2.12 (Debian 12
// ships 2.10) reads PyArray_Descr::elsize at NumPy 1.x's offset, which under NumPy 2 (PyPI's,
// beside torch 2.x) is the low half of the new 64-bit flags word: 0 for every plain dtype.
// Never py::dtype::itemsize() or py::array::itemsize()/nbytes() in this package.
inline py::ssize_t ItemSize(const py::dtype& dtype) {
  return dtype.attr("itemsize").cast<py::ssize_t>();
}

// A C-contiguous array of `dtype` and `shape` over `bytes`, whose base keeps `owner` alive,
// made in one step (the caller's layout has checked that dtype and shape cover the bytes;
// this checks it again and names `what` when they do not).
template <typename Owner>
py::array TypedArray(std::span<const std::byte> bytes, std::shared_ptr<Owner> owner, bool writable,
                     const py::dtype& dtype, const std::vector<py::ssize_t>& shape,
                     const std::string& what) {
  py::ssize_t count = 1;
  for (py::ssize_t d : shape) count *= d;
  const py::ssize_t item_size = ItemSize(dtype);
  if (count * item_size != static_cast<py::ssize_t>(bytes.size())) {
    throw py::value_error(what + ": " + std::to_string(bytes.size()) +
                          " bytes, but the view takes " + std::to_string(count * item_size));
  }
  auto* holder = new std::shared_ptr<Owner>(std::move(owner));
  py::capsule base(holder, [](void* p) { delete static_cast<std::shared_ptr<Owner>*>(p); });
  // Strides given, not left to py::array, which would compute them from py::dtype::itemsize().
  std::vector<py::ssize_t> strides(shape.size());
  py::ssize_t stride = item_size;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  py::array array(dtype, shape, strides, reinterpret_cast<const void*>(bytes.data()), base);
  if (!writable) {
    py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  }
  return array;
}

// The bytes of a Python bytes object, borrowed (the caller keeps the object alive).
inline std::string_view BytesView(PyObject* object, const char* what) {
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
inline uint64_t ElementBytes(const std::string& name) {
  static const std::pair<const char*, uint64_t> kSizes[] = {
      {"f64", 8},  {"f32", 4}, {"f16", 2},   {"bf16", 2},    {"i64", 8},     {"i32", 4},
      {"i16", 2},  {"i8", 1},  {"u64", 8},   {"u32", 4},     {"u16", 2},     {"u8", 1},
      {"bool", 1}, {"c64", 8}, {"c128", 16}, {"f8_e4m3", 1}, {"f8_e5m2", 1}, {"f8_e8m0", 1}};
  for (const auto& [n, size] : kSizes) {
    if (name == n) return size;
  }
  return 0;
}

inline ModelFormat ParseFormat(const std::string& format) {
  if (format == "auto") return ModelFormat::kAuto;
  if (format == "gguf") return ModelFormat::kGguf;
  if (format == "safetensors") return ModelFormat::kSafetensors;
  if (format == "raw") return ModelFormat::kRaw;
  throw py::value_error("format=" + format +
                        ": use \"auto\", \"gguf\", \"safetensors\" or \"raw\"");
}

inline HugePages ParseHuge(const std::string& huge) {
  if (huge == "auto") return HugePages::kAuto;
  if (huge == "on") return HugePages::kOn;
  if (huge == "off") return HugePages::kOff;
  throw py::value_error("huge=" + huge + ": use \"auto\", \"on\" or \"off\"");
}

// gpu="cuda:1", reader="pread", peer_transport="am": the library's words, refused by name.
inline GpuDevice ParseGpu(const std::string& gpu) {
  auto device = ParseGpuDevice(gpu);
  if (!device.ok()) throw py::value_error("gpu=" + device.status().message());
  return *device;
}

inline ModelReader ParseReaderWord(const std::string& reader) {
  auto r = ParseModelReader(reader);
  if (!r.ok()) throw py::value_error(r.status().message());
  return *r;
}

inline PeerTransport ParseTransportWord(const std::string& transport) {
  auto t = ParsePeerTransport(transport);
  if (!t.ok()) throw py::value_error(t.status().message());
  return *t;
}

// The sink of the library's "expert_arena" logger inside Python: it keeps each message (with
// its level as Python's logging numbers it) until Python takes them and hands them to the
// logging module's "expert_arena" logger (expert_arena._emit_logs, after each call that may
// log). Taking the GIL here instead could deadlock: a library thread that logs while holding
// a lock the GIL holder waits for. Bounded: past kMaxRecords, messages are counted, not kept.
class CollectingSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  static constexpr size_t kMaxRecords = 4096;

  // The records collected so far, and how many were dropped; clears both.
  std::pair<std::vector<std::pair<int, std::string>>, uint64_t> Take() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::pair<std::vector<std::pair<int, std::string>>, uint64_t> out{std::move(records_),
                                                                      dropped_};
    records_.clear();
    dropped_ = 0;
    return out;
  }

  bool empty() {
    std::lock_guard<std::mutex> lock(mutex_);
    return records_.empty() && dropped_ == 0;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    if (records_.size() >= kMaxRecords) {
      ++dropped_;
      return;
    }
    static constexpr int kLevels[] = {5, 10, 20, 30, 40, 50, 0};  // trace .. critical, off
    int level = kLevels[std::min<size_t>(static_cast<size_t>(msg.level), 6)];
    records_.emplace_back(level, std::string(msg.payload.data(), msg.payload.size()));
  }
  void flush_() override {}

 private:
  std::vector<std::pair<int, std::string>> records_;
  uint64_t dropped_ = 0;
};

// Adds Arena, open and attach to the module (arena_binding.cc).
void BindArena(py::module_& m);
// Adds StreamProducer, Reservation, StreamTensor, StreamConsumer, sweep and the descriptor
// functions to the module (stream_binding.cc).
void BindStream(py::module_& m);
void BindTorchType(py::module_& m);

}  // namespace expert_arena::python

#endif  // EXPERT_ARENA_PYTHON_BINDING_H_
