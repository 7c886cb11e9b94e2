/* CHECK for the C test programs: counts a failed condition and prints it with the library's
 * last error; main returns `failures == 0 ? 0 : 1`. One thread only (threads count their own). */
#ifndef EXPERT_ARENA_TESTS_ENGINE_C_CHECK_H_
#define EXPERT_ARENA_TESTS_ENGINE_C_CHECK_H_

#include <stdio.h>

#include "expert_arena/expert_arena.h"

static int failures = 0;

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              ea_last_error());                                                                \
      ++failures;                                                                              \
    }                                                                                          \
  } while (0)

#endif /* EXPERT_ARENA_TESTS_ENGINE_C_CHECK_H_ */
