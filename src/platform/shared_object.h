// Shared objects loaded at run time (dlopen), for the parts of expert-arena that are built as
// plugins so that a process loads their dependencies only when it uses them (src/remote's UCX
// transport, docs/cross-host.md).
//
// Linux only (compiled under __linux__). Thread-safety: every function may be called from any
// thread (the dynamic linker serializes them).
#pragma once

#include <string>

#include "expert_arena/status.h"

namespace expert_arena::platform {

// A loaded shared object. Never closed: a plugin's code, its vtables and whatever it made stay
// valid until the process exits.
struct SharedObject {
  void* handle = nullptr;
  std::string path;  // as given to OpenSharedObject
};

// dlopen(path, RTLD_NOW | RTLD_LOCAL): every symbol is bound now (a missing one is an error
// here, not a crash later) and none of the object's symbols is visible to the rest of the
// process. A `path` without '/' is searched for like a DT_NEEDED name (LD_LIBRARY_PATH, the
// cache, the default directories). Errors: kNotFound with the dynamic linker's text.
Result<SharedObject> OpenSharedObject(const std::string& path);

// dlsym of `name` in `object`; kNotFound with the dynamic linker's text (the file and the
// symbol) when it has none.
Result<void*> FindSymbol(const SharedObject& object, const char* name);

// The absolute path of the file (the executable or a shared object) whose mapping holds
// `address`, e.g. a function's: /proc/self/exe for the executable (dladdr gives argv[0]
// there), the object's path made absolute otherwise. kNotFound when no loaded object holds it.
Result<std::string> PathOfObjectContaining(const void* address);

}  // namespace expert_arena::platform
