#include "platform/shared_object.h"

#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <stdlib.h>
#include <unistd.h>

#include <memory>

namespace expert_arena::platform {
namespace {

std::string LastDlError() {
  const char* text = dlerror();
  return text != nullptr ? text : "no error text from the dynamic linker";
}

}  // namespace

Result<SharedObject> OpenSharedObject(const std::string& path) {
  (void)dlerror();
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return NotFound(LastDlError());
  return SharedObject{handle, path};
}

Result<void*> FindSymbol(const SharedObject& object, const char* name) {
  (void)dlerror();
  void* symbol = dlsym(object.handle, name);
  if (symbol == nullptr) {
    // dlerror's text names the file and the symbol; none when the symbol's value is null.
    const char* text = dlerror();
    return NotFound(text != nullptr ? std::string(text)
                                    : object.path + ": symbol " + name + " is null");
  }
  return symbol;
}

Result<std::string> PathOfObjectContaining(const void* address) {
  Dl_info info{};
  link_map* map = nullptr;
  if (dladdr1(address, &info, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) == 0 ||
      map == nullptr) {
    return NotFound("no loaded object holds the address");
  }
  // The executable's link_map has an empty name (dladdr then reports argv[0], which may be
  // relative or a bare name found on PATH).
  std::string path = map->l_name != nullptr && map->l_name[0] != '\0' ? map->l_name : "";
  if (path.empty()) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return NotFound("readlink /proc/self/exe failed");
    return std::string(exe, static_cast<size_t>(n));
  }
  std::unique_ptr<char, decltype(&free)> real(realpath(path.c_str(), nullptr), &free);
  if (real == nullptr) return path;  // the directory moved since it was loaded: as given
  return std::string(real.get());
}

}  // namespace expert_arena::platform
