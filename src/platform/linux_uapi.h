// Linux constants newer than the oldest headers the library builds against (glibc 2.28 of
// RHEL 8 has none of these): defined by number, as the kernel's uapi headers define them.
// Whether the running kernel accepts them is kernel_features.h's question.
#pragma once

#include <sys/mman.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
