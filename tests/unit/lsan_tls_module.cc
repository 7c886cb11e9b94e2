// A module with thread-local storage, loaded with dlopen by lsan_dynamic_tls_probe: each
// thread that calls Keep gets its own block of the module's TLS, allocated on first use.
#include <cstdint>
#include <cstdlib>

namespace {
thread_local void* kept[5];
}  // namespace

// Keeps a heap block reachable only through this thread's TLS; returns where the TLS is.
extern "C" uintptr_t Keep() {
  kept[1] = std::malloc(1000);
  return reinterpret_cast<uintptr_t>(&kept[0]);
}
