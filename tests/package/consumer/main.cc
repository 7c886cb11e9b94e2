// Opens a private arena of the file given and prints its first tensor's checksum: proves the
// installed headers, library and CMake package are enough for an engine.
#include <expert_arena/arena.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  expert_arena::ModelSpec spec;
  spec.files = {argv[1]};
  expert_arena::ArenaOptions options;
  if (argc > 2) options.shared_path = argv[2];
  auto arena = expert_arena::Arena::Open(spec, options);
  if (!arena.ok()) {
    std::fprintf(stderr, "%s\n", arena.status().ToString().c_str());
    return 1;
  }
  std::printf("%s %zu %016llx\n", expert_arena::ArenaRoleName(arena->role()), arena->tensor_count(),
              static_cast<unsigned long long>(arena->tensor(0).checksum));
  return 0;
}
