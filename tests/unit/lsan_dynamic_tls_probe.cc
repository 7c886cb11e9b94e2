// lsan_dynamic_tls_probe MODULE: loads MODULE (lsan_tls_module) and has 130 threads each make
// a block of its TLS and keep a heap pointer there, then exits with the threads alive, so that
// LeakSanitizer scans their dynamic TLS at exit. Passes when that scan neither crashes nor
// calls the kept blocks leaks (exit 0); prints how many TLS blocks lay at 16 mod 4096, the
// address that made gcc 12's runtime read a range from the bytes before the block.
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: lsan_dynamic_tls_probe MODULE\n");
    return 2;
  }
  void* module = dlopen(argv[1], RTLD_NOW);
  if (module == nullptr) {
    std::fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
    return 2;
  }
  auto keep = reinterpret_cast<uintptr_t (*)()>(dlsym(module, "Keep"));
  if (keep == nullptr) {
    std::fprintf(stderr, "no Keep in %s\n", argv[1]);
    return 2;
  }
  constexpr int kThreads = 130;
  std::atomic<int> ready{0};
  std::atomic<int> at_16{0};
  for (int i = 0; i < kThreads; ++i) {
    std::thread([&] {
      if (keep() % 4096 == 16) at_16.fetch_add(1);
      ready.fetch_add(1);
      pause();  // alive when the process exits
    }).detach();
  }
  while (ready.load() < kThreads) usleep(1000);
  std::printf("%d threads, %d TLS blocks at 16 mod 4096\n", kThreads, at_16.load());
  std::fflush(stdout);
  return 0;
}
