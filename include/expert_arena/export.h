// Symbol visibility for the shared library: only what carries EXPERT_ARENA_EXPORT is
// visible outside libexpert_arena.so (the library builds with -fvisibility=hidden).
#pragma once

#if defined(EXPERT_ARENA_BUILDING_LIBRARY)
#define EXPERT_ARENA_EXPORT [[gnu::visibility("default")]]
#else
#define EXPERT_ARENA_EXPORT
#endif
