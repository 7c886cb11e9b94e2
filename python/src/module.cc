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
#include "binding.h"
#include "remote/core_identity.h"

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

  BindArena(m);
  BindStream(m);
  BindTorchType(m);

  m.def("ggml_block", [](const std::string& name) -> std::optional<std::pair<uint32_t, uint32_t>> {
    const source::GgmlType* type = source::FindGgmlTypeByName(name);
    if (type == nullptr) return std::nullopt;
    return std::make_pair(type->block_elems, type->block_bytes);
  });
  m.def(
      "xxh3_64",
      [](const py::buffer& buffer) {
        py::buffer_info info = buffer.request();
        if (info.ndim != 1 || info.strides[0] != info.itemsize) {
          throw py::value_error("xxh3_64(): needs a contiguous 1-D buffer");
        }
        const void* data = info.ptr;
        size_t bytes = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release release;
        return static_cast<uint64_t>(XXH3_64bits(data, bytes));
      },
      "xxh3-64 of a contiguous buffer's bytes (the checksum of the arena's tensor table)");
  m.def(
      "array_address",
      [](const py::array& array) { return reinterpret_cast<uintptr_t>(array.data()); },
      "Address of a NumPy array's first byte (what array.ctypes.data gives, without ctypes)");
  m.def("is_stream_segment", [](const std::string& path) { return IsStreamSegment(path); });
  m.def(
      "_core_identity",
      [](bool plugin) {
        auto as_dict = [](const remote::CoreIdentity& id) {
          py::dict d;
          d["fork_registry"] = id.fork_registry;
          d["pin_budget"] = id.pin_budget;
          d["kernel_features"] = id.kernel_features;
          d["object"] = id.object;
          return d;
        };
        if (!plugin) return as_dict(remote::ThisCoreIdentity());
        Result<remote::CoreIdentity> id = [] {
          py::gil_scoped_release release;
          return remote::PluginCoreIdentity();
        }();
        if (!id.ok()) RaiseStatus(id.status());
        return as_dict(*id);
      },
      py::arg("plugin") = false,
      "Diagnostic: the addresses of the process-wide objects (fork registry, pin budget, "
      "kernel-feature probe) of the core this module reaches, or with plugin=True the one the "
      "UCX transport plugin reaches (loading it), and the file that answered");
}
