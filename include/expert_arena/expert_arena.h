/* expert_arena.h: the C interface of expert-arena, for C engines and for Python (ctypes)
 * or any language with a C FFI. It wraps the engine-facing C++ API (expert_arena/arena.h):
 * open an arena (private, shared, or attach to an existing shared file), look up tensor
 * views, close.
 *
 *   ea_open_params p;
 *   ea_open_params_init(&p);
 *   const char* files[] = {"model.gguf"};
 *   p.model_files = files;
 *   p.model_file_count = 1;
 *   p.shared_path = "/dev/shm/model.arena";      // NULL: a private arena
 *   ea_arena* arena = NULL;
 *   int rc = ea_arena_open(&p, &arena);
 *   if (rc != 0) fprintf(stderr, "%s\n", ea_last_error());
 *   ea_tensor_view v;
 *   v.size = sizeof v;
 *   rc = ea_arena_find(arena, "blk.0.ffn_up_exps.weight", &v);
 *   ... v.data, v.bytes ...
 *   ea_arena_close(arena);
 *
 * Tensor streaming between processes (producer, reservation, consumer, sweep) is declared in
 * expert_arena/expert_arena_stream.h, included at the end of this header, in the same
 * conventions.
 *
 * Conventions:
 * - Every call that can fail returns 0 or a negative errno value (-EINVAL bad argument,
 *   -ENOENT no such file or tensor, -EBUSY in use by another engine, -ETIMEDOUT waiting for
 *   another loader, -ENOSPC filesystem too small, -EBADMSG damaged file, -EACCES, -ENOTSUP,
 *   -EIO, -ENOMEM). ea_last_error() then gives the message, which names the file and cause.
 * - Structs passed in or out start with a `size` member that the caller sets to
 *   sizeof(struct) as it was compiled; the library reads and writes only that many bytes,
 *   so fields can be added at the end without breaking older callers.
 * - Opaque handle; views and strings stay valid until ea_arena_close. Tensor data is
 *   read-only. All calls are thread-safe on distinct handles; lookups on one handle may run
 *   concurrently; ea_arena_close must not race with other calls on the same handle.
 * - No C++ exception crosses this interface.
 */
#ifndef EXPERT_ARENA_EXPERT_ARENA_H_
#define EXPERT_ARENA_EXPERT_ARENA_H_

#include <stddef.h>
#include <stdint.h>

#include "expert_arena/export.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ea_arena ea_arena;

/* How this process got its arena. */
enum ea_role { EA_ROLE_LOADED = 0, EA_ROLE_ATTACHED = 1, EA_ROLE_PRIVATE = 2 };

/* 2 MiB pages on tmpfs or anonymous memory (hugetlbfs always has them). */
enum ea_huge_pages { EA_HUGE_AUTO = 0, EA_HUGE_ON = 1, EA_HUGE_OFF = 2 };

/* How the model files are read (ModelFormat in arena.h). EA_FORMAT_AUTO recognises GGUF,
 * safetensors and a safetensors index and refuses anything else (-EINVAL or -EBADMSG, the
 * message saying what the file looks like: empty, a Git LFS pointer, an HTML page, a damaged
 * header). EA_FORMAT_RAW loads each file's bytes as one tensor of dtype "u8". */
enum ea_model_format {
  EA_FORMAT_AUTO = 0,
  EA_FORMAT_GGUF = 1,
  EA_FORMAT_SAFETENSORS = 2,
  EA_FORMAT_RAW = 3
};

typedef struct ea_open_params {
  size_t size;                    /* the caller's sizeof; set by ea_open_params_init */
  const char* const* model_files; /* the model's files (shards); unused with attach_only */
  size_t model_file_count;
  const char* select;          /* regex of tensor names; NULL or "": the routed experts */
  int select_all;              /* nonzero: every tensor of the model */
  const char* shared_path;     /* arena file on tmpfs/hugetlbfs; NULL or "": private */
  int attach_only;             /* nonzero: attach to a published shared_path, no model */
  double wait_timeout_seconds; /* wait for another engine's load; default 600 */
  int huge_pages;              /* enum ea_huge_pages; default EA_HUGE_AUTO */
  const char* gpu;             /* "none", "cuda[:N]", "hip[:N]"; NULL: "none" */
  int gpu_required;            /* nonzero: fail when the registration does not happen */
  uint32_t file_mode;          /* mode of a created file (bits of 0666 only); default 0600 */
  int allow_foreign_owner;     /* nonzero: attach to a file owned by another user */
  int quiet;                   /* nonzero: no start line or notes on stderr */
  /* Added after the first version: a caller whose size ends before it gets the default. */
  int format; /* enum ea_model_format; default EA_FORMAT_AUTO */
  /* Fill the shared arena from `expert-arena serve` at this HOST:PORT over UCX, checking every
   * checksum (docs/cross-host.md); NULL or "": no peer. With no model files, the peer's table
   * is used; with them, their layout must be the peer's, and they are read if the fill fails. */
  const char* from_peer;
  const char* peer_token; /* the peer's shared token; NULL: none */
  /* Added later still (docs/options.md lists every option in each API). */
  uint64_t pin_budget_bytes;  /* upper bound on bytes pinned for the GPU; 0: no bound */
  const char* reader;         /* "auto", "io_uring", "pread"; NULL: "auto" */
  uint64_t alignment;         /* of every tensor, a power of two up to 2 MiB; default 4096 */
  double peer_stall_seconds;  /* longest wait for the peer before the fill is abandoned; 30 */
  const char* peer_transport; /* "auto", "am", "get"; NULL: "auto" (docs/cross-host.md) */
  /* Where a loader puts the pages on a host with several NUMA nodes (docs/numa.md): "auto",
   * "local", "interleave", "node:N" or "replicate"; NULL or "": "auto". Anything else is
   * -EINVAL naming the accepted forms. */
  const char* numa;
  /* Nonzero: create (file_mode with 0002) or attach to an arena file every user may write.
   * 0: such a file is refused (-EACCES), as is a file_mode with bits outside 0666 (-EINVAL). */
  int allow_world_writable;
} ea_open_params;

typedef struct ea_tensor_view {
  size_t size;           /* set by the caller: sizeof(ea_tensor_view) */
  const char* name;      /* NUL-terminated */
  const char* dtype;     /* "f16", "q8_0" (GGUF), "BF16" (safetensors), "u8" (raw) ... */
  const uint64_t* shape; /* ndim values, in the source format's order (ggml: ne0 first) */
  uint32_t ndim;
  const void* data; /* bytes of the tensor in the arena (read-only) */
  uint64_t bytes;
  uint64_t file_offset; /* absolute offset in the arena file; 0 for a private arena */
  uint64_t checksum;    /* xxh3-64 of the bytes, as `expert-arena info` shows it */
} ea_tensor_view;

typedef struct ea_arena_info {
  size_t size;            /* set by the caller: sizeof(ea_arena_info) */
  int role;               /* enum ea_role */
  const char* path;       /* the shared file, "" when private */
  const char* backing;    /* "tmpfs", "hugetlbfs", "anonymous", "other" */
  const char* start_line; /* the one line an operator reads */
  const void* data;       /* the whole data region */
  uint64_t data_bytes;
  uint64_t tensor_count;
  uint64_t tensor_bytes;
  uint64_t huge_bytes; /* bytes of this mapping on 2 MiB pages */
  uint64_t bytes_read; /* model bytes this process read */
  double seconds;      /* open to ready */
  uint64_t identity_hash;
  uint64_t gpu_registered_bytes;
} ea_arena_info;

/* Fills the first `size` bytes of `params` with the defaults and sets params->size = size.
 * `size` is the caller's sizeof(ea_open_params) as it was compiled: the library never writes
 * past it, so a program built against an older, smaller struct stays safe with a newer
 * library. Does nothing when params is NULL or size is too small to hold `size` itself.
 * C and C++ callers use ea_open_params_init below; callers through an FFI (ctypes, cffi) call
 * this with the size of their own struct. */
EXPERT_ARENA_EXPORT void ea_open_params_init_sized(ea_open_params* params, size_t size);

/* Fills `params` with the defaults and sets params->size to the caller's sizeof. Inline so
 * that the size is the one this program was compiled with, not the library's. */
static inline void ea_open_params_init(ea_open_params* params) {
  ea_open_params_init_sized(params, sizeof *params);
}

/* Loads the model into an arena, attaches to a shared one another engine loaded, or (with
 * attach_only) attaches to a published shared_path. On success *out is a handle for
 * ea_arena_close; on failure *out is NULL and the return value a negative errno. */
EXPERT_ARENA_EXPORT int ea_arena_open(const ea_open_params* params, ea_arena** out);

/* ---- Engine-made arenas (docs/engine-arenas.md) -------------------------------------------
 * Tensors the engine made itself (fused, repacked), published once under the same protocol:
 * the engine that wins the shared file declares and fills them; every other engine attaches. */

/* One tensor the engine declares. The declared array's stride is tensors[0].size (every
 * element's size must equal it): a program built against a later version of this header, or
 * one whose elements are larger structs that begin with an ea_engine_tensor, is read right. */
typedef struct ea_engine_tensor {
  size_t size;           /* the caller's sizeof of each element (at least this struct's) */
  const char* name;      /* unique, printable */
  const char* dtype;     /* the engine's name: "F32", "BF16", ... (1-32 printable bytes) */
  const uint64_t* shape; /* ndim values (at most 8) */
  uint32_t ndim;
  uint64_t bytes;
  uint64_t alignment; /* of its offset, a power of two up to 2 MiB; 0: the params' */
} ea_engine_tensor;

/* A declared tensor's place in the mapping, writable during fill only. The array fill gets
 * has the library's stride, tensors[0].size: index it by that size, not this header's sizeof. */
typedef struct ea_writable_tensor {
  size_t size; /* sizeof(ea_writable_tensor) of the library */
  const char* name;
  const char* dtype;
  const uint64_t* shape;
  uint32_t ndim;
  void* data;
  uint64_t bytes;
} ea_writable_tensor;

/* Called only in the engine that builds, while it holds the file (the others wait): sets
 * *tensors to an array of *count tensors (the engine's memory, read before fill is called) and
 * returns 0, or a negative errno (nothing is published). */
typedef int (*ea_engine_declare_fn)(void* user, const ea_engine_tensor** tensors, size_t* count);
/* Then writes every tensor in place; 0, or a negative errno (nothing is published). */
typedef int (*ea_engine_fill_fn)(void* user, const ea_writable_tensor* tensors, size_t count);

typedef struct ea_engine_params {
  size_t size;          /* set by ea_engine_params_init */
  const char* identity; /* the engine, its version, the transform's settings, rank/world */
  const char* const* files; /* the checkpoint files or directories, fingerprinted */
  size_t file_count;
  uint64_t alignment; /* default 4096 */
  ea_engine_declare_fn declare;
  ea_engine_fill_fn fill;
  void* user; /* passed to declare and fill */
} ea_engine_params;

EXPERT_ARENA_EXPORT void ea_engine_params_init_sized(ea_engine_params* params, size_t size);
static inline void ea_engine_params_init(ea_engine_params* params) {
  ea_engine_params_init_sized(params, sizeof *params);
}

/* Attaches to the engine-made arena of engine->identity over engine->files at
 * params->shared_path (required), or builds and publishes it (declare, fill); the other
 * fields of params as for ea_arena_open (model_files, select, attach_only, format and
 * from_peer are not used). */
EXPERT_ARENA_EXPORT int ea_arena_open_engine(const ea_open_params* params,
                                             const ea_engine_params* engine, ea_arena** out);

/* Unmaps the arena and drops this process's use of a shared file (which stays for the next
 * engine). NULL is ignored. */
EXPERT_ARENA_EXPORT void ea_arena_close(ea_arena* arena);

/* Facts of the open arena; strings live as long as the handle. */
EXPERT_ARENA_EXPORT int ea_arena_get_info(const ea_arena* arena, ea_arena_info* out);

/* Number of tensors in the arena (0 for NULL). */
EXPERT_ARENA_EXPORT size_t ea_arena_tensor_count(const ea_arena* arena);

/* The view of tensor `index` (0 <= index < count); -ERANGE past the end. */
EXPERT_ARENA_EXPORT int ea_arena_tensor(const ea_arena* arena, size_t index, ea_tensor_view* out);

/* The view of the tensor named `name`; -ENOENT when there is none. */
EXPERT_ARENA_EXPORT int ea_arena_find(const ea_arena* arena, const char* name, ea_tensor_view* out);

/* The message of the last failed call on this thread ("" when none failed). Valid until
 * the next call on this thread. */
EXPERT_ARENA_EXPORT const char* ea_last_error(void);

/* The library's version, "MAJOR.MINOR.PATCH". */
EXPERT_ARENA_EXPORT const char* ea_version(void);

#ifdef __cplusplus
}
#endif

/* The streaming part of the C interface (it includes this header for what both share). */
#include "expert_arena/expert_arena_stream.h"

#endif /* EXPERT_ARENA_EXPERT_ARENA_H_ */
