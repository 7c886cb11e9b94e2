// A fast answer to torch's __torch_function__ question for ArenaTensor.
//
// torch's C++ argument parser asks every tensor argument that is not exactly torch.Tensor for
// its __torch_function__ (check_has_torch_function: every op, every indexing, even `.shape`).
// It asks through PyObject_FastGetAttrString, which calls a type's tp_getattr slot (the
// char* one) when the type has one, and otherwise builds a new interned string each call and
// looks it up through the instance's __dict__ and the MRO: 0.1-0.2 us a call, which made a
// view's no-op `.float()` 1.8x a plain tensor's. ArenaTensor's __torch_function__ is torch's
// disabled implementation, so the answer never changes while the class does not: this
// tp_getattr answers it from the class dict, cached against the type's version tag (any
// assignment to a class attribute invalidates it), and hands every other name, a class value
// that is a descriptor (a classmethod put there later), and every subclass of ArenaTensor to
// the ordinary lookup (tp_getattro). CPython itself prefers
// tp_getattro, so Python attribute access is unchanged; only callers of the char* API
// (PyObject_GetAttrString, torch's and NumPy's fast lookups) come here.
#include <cstring>

#include "binding.h"

namespace expert_arena::python {
namespace {

struct FastType {
  PyTypeObject* type = nullptr;    // strong reference
  PyObject* name = nullptr;        // interned "__torch_function__"
  PyObject* cached = nullptr;      // strong reference: the class's __torch_function__
  unsigned int cached_tag = 0;     // the type's version tag when `cached` was read
  const char* last_name = nullptr; // the caller's literal (torch passes the same pointer)
};
FastType fast;  // touched only with the GIL held

PyObject* GenericGetAttr(PyObject* self, const char* name) {
  PyObject* key = PyUnicode_InternFromString(name);
  if (key == nullptr) return nullptr;
  PyObject* result = PyObject_GetAttr(self, key);  // tp_getattro: never back here
  Py_DECREF(key);
  return result;
}

bool IsTorchFunction(const char* name) {
  if (name == fast.last_name) return true;
  if (std::strcmp(name, "__torch_function__") != 0) return false;
  fast.last_name = name;
  return true;
}

PyObject* FastGetAttr(PyObject* self, char* name) {
  PyTypeObject* type = fast.type;
  if (Py_TYPE(self) != type || !IsTorchFunction(name)) return GenericGetAttr(self, name);
  bool tag_valid = PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG);
  if (fast.cached != nullptr && tag_valid && type->tp_version_tag == fast.cached_tag) {
    Py_INCREF(fast.cached);
    return fast.cached;
  }
  PyObject* found = PyDict_GetItemWithError(type->tp_dict, fast.name);  // borrowed
  if (found == nullptr || Py_TYPE(found)->tp_descr_get != nullptr) {
    // Deleted from the class (the ordinary lookup finds torch.Tensor's), or a classmethod
    // or function that the ordinary lookup binds.
    if (PyErr_Occurred()) return nullptr;
    Py_CLEAR(fast.cached);
    return GenericGetAttr(self, name);
  }
  Py_INCREF(found);
  Py_XSETREF(fast.cached, found);
  fast.cached_tag = tag_valid ? type->tp_version_tag : 0;
  if (!tag_valid) Py_CLEAR(fast.cached);  // no tag to check it against: read it each time
  Py_INCREF(found);
  return found;
}

}  // namespace

void BindTorchType(py::module_& m) {
  m.def(
      "fast_torch_function_lookup",
      [](const py::type& cls) {
        PyTypeObject* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
        if (!PyType_HasFeature(type, Py_TPFLAGS_HEAPTYPE) || type->tp_dict == nullptr) {
          throw py::type_error("fast_torch_function_lookup(): needs a class defined in Python");
        }
        if (type->tp_getattr != nullptr && type->tp_getattr != FastGetAttr) {
          throw py::type_error("fast_torch_function_lookup(): the class has its own tp_getattr");
        }
        if (fast.name == nullptr) {
          fast.name = PyUnicode_InternFromString("__torch_function__");
          if (fast.name == nullptr) throw py::error_already_set();
        }
        Py_INCREF(type);
        Py_XSETREF(fast.type, type);
        Py_CLEAR(fast.cached);
        type->tp_getattr = FastGetAttr;
      },
      "Answer torch's per-call __torch_function__ lookup on instances of `cls` (exactly that "
      "class) from its class dict without building a string: see python/src/torch_type.cc");
}

}  // namespace expert_arena::python
