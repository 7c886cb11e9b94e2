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
#include <fcntl.h>

#include <cstring>
#include <vector>

#include "binding.h"
#include "platform/file.h"
#include "platform/guarded_copy.h"
#include "remote/core_identity.h"

namespace {

// The rows of an n x 3 uint64 array of runs (read_runs, copy_runs).
struct Runs {
  const uint64_t* at;
  size_t count;
};

Runs CheckedRuns(const pybind11::array_t<uint64_t, pybind11::array::c_style>& runs,
                 const char* what) {
  if (runs.ndim() != 2 || runs.shape(1) != 3) {
    throw pybind11::value_error(std::string(what) + "(): runs must be an n x 3 uint64 array");
  }
  return Runs{runs.data(), static_cast<size_t>(runs.shape(0))};
}

}  // namespace

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
  // The KV connector's copies (expert_arena.vllm_kv): every run of a request's load in one
  // call without the GIL. A load on vLLM's loader thread that released and took back the GIL
  // per run waited for the engine's busy step loop each time (up to the 5 ms switch
  // interval: 1.4 s instead of 0.1 s for 248 runs).
  m.def(
      "read_runs",
      [](int fd, const py::array_t<uint64_t, py::array::c_style>& runs) {
        const Runs r = CheckedRuns(runs, "read_runs");
        // A descriptor of its own: the caller's stays open.
        platform::UniqueFd file(::fcntl(fd, F_DUPFD_CLOEXEC, 0), "the file");
        if (!file.valid()) {
          PyErr_SetFromErrno(PyExc_OSError);
          throw py::error_already_set();
        }
        uint64_t total = 0;
        std::string problem;
        {
          py::gil_scoped_release release;
          for (size_t i = 0; i < r.count && problem.empty(); ++i) {
            const uint64_t offset = r.at[3 * i], bytes = r.at[3 * i + 2];
            auto* to = reinterpret_cast<std::byte*>(static_cast<uintptr_t>(r.at[3 * i + 1]));
            Result<size_t> got = platform::ReadSome(file, offset, {to, bytes});
            if (!got.ok()) {
              problem = got.status().message();
            } else if (*got != bytes) {
              problem = "the file ends at offset " + std::to_string(offset + *got) +
                        ", before the " + std::to_string(bytes) + " bytes at offset " +
                        std::to_string(offset) + " that run " + std::to_string(i) + " reads";
            } else {
              total += bytes;
            }
          }
        }
        if (!problem.empty()) throw py::value_error(problem);
        return total;
      },
      py::arg("fd"), py::arg("runs"),
      "Internal: for each row (file offset, address, bytes) of `runs` (uint64, n x 3), reads "
      "the bytes at that offset of `fd` to that address; the GIL released. A file that ends "
      "early is a ValueError naming the run. Returns the bytes read.");
  m.def(
      "copy_runs",
      [](const py::array_t<uint64_t, py::array::c_style>& runs) {
        const Runs r = CheckedRuns(runs, "copy_runs");
        uint64_t total = 0;
        py::gil_scoped_release release;
        for (size_t i = 0; i < r.count; ++i) {
          std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(r.at[3 * i + 1])),
                      reinterpret_cast<const void*>(static_cast<uintptr_t>(r.at[3 * i])),
                      r.at[3 * i + 2]);
          total += r.at[3 * i + 2];
        }
        return total;
      },
      py::arg("runs"),
      "Internal: for each row (source address, destination address, bytes) of `runs` "
      "(uint64, n x 3), copies the bytes; the GIL released. Returns the bytes copied.");
  // A prefill engine's shared KV cache file, mapped in a decode engine (expert_arena.vllm_kv):
  // its runs copied at memory speed, a truncation under the copy an error (guarded_copy.h).
  py::class_<platform::MappedFileSource, std::shared_ptr<platform::MappedFileSource>>(
      m, "MappedFile",
      "Internal: all of a file mapped read-only, its pages mapped in on a thread, let go of "
      "once the file is removed (checked every watch_seconds)")
      .def(py::init([](int fd, const std::string& what, double watch_seconds) {
             auto opened = [&] {
               py::gil_scoped_release release;
               return platform::MappedFileSource::Open(fd, what, watch_seconds);
             }();
             return Take(std::move(opened));
           }),
           py::arg("fd"), py::arg("what"), py::arg("watch_seconds") = 1.0)
      .def_property_readonly("size", &platform::MappedFileSource::size)
      .def_property_readonly("mapped", &platform::MappedFileSource::mapped)
      .def(
          "wait_populated",
          [](const platform::MappedFileSource& self, double seconds) {
            py::gil_scoped_release release;
            return self.WaitPopulated(seconds);
          },
          py::arg("seconds"))
      .def(
          "copy_runs",
          [](const std::shared_ptr<platform::MappedFileSource>& self,
             const py::array_t<uint64_t, py::array::c_style>& runs) {
            const Runs r = CheckedRuns(runs, "copy_runs");
            std::vector<platform::CopyRun> copies(r.count);
            for (size_t i = 0; i < r.count; ++i) {
              copies[i] = {r.at[3 * i],
                           reinterpret_cast<std::byte*>(static_cast<uintptr_t>(r.at[3 * i + 1])),
                           r.at[3 * i + 2]};
            }
            Result<uint64_t> copied = [&] {
              py::gil_scoped_release release;
              return self->Copy(copies);
            }();
            return Take(std::move(copied));
          },
          py::arg("runs"),
          "For each row (file offset, address, bytes) of `runs` (uint64, n x 3), copies the "
          "file's bytes to that address; the GIL released. A run past the file's size, or a "
          "page the file lost under the copy (truncated), is a ValueError naming the run; a "
          "file removed and let go a FileNotFoundError. Returns the bytes copied.");
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
