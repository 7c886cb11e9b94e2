/* expert_arena_stream.h: the C interface of tensor streaming (the C++ API is
 * expert_arena/stream.h; docs/streaming.md describes segments, release and spill). A producer
 * puts tensors into shared segments and hands each consumer a small descriptor (bytes, sent
 * over the engine's own channel); a consumer in any process on the host opens it as a
 * zero-copy, read-only view and releases it.
 *
 *   ea_stream_params sp;
 *   ea_stream_params_init(&sp);                 // directory "/dev/shm", the C++ defaults
 *   sp.logical_name = "prefill";
 *   ea_stream_producer* prod;
 *   if (ea_stream_producer_create(&sp, &prod) != 0) fprintf(stderr, "%s\n", ea_last_error());
 *   const uint64_t shape[2] = {4, 4096};
 *   unsigned char desc[EA_STREAM_DESCRIPTOR_MAX];
 *   size_t len;
 *   ea_stream_put(prod, "req-17", data, 4 * 4096 * 2, "bf16", shape, 2, 1, desc, sizeof desc,
 *                 &len);                        // send desc[0..len) to the consumer
 *   ...
 *   ea_stream_consumer* cons;                   // in the consumer's process
 *   ea_stream_consumer_create(&sp, &cons);
 *   ea_stream_tensor* t;
 *   ea_stream_open(cons, desc, len, &t);
 *   ea_stream_tensor_info info = {.size = sizeof info};
 *   ea_stream_tensor_get_info(t, &info);        // info.data, info.bytes, info.key, info.shape
 *   ea_stream_release(t);                       // the producer gets the space back
 *
 * This part is its own header so that the stream's handles, lifetimes and rules read on their
 * own; expert_arena.h includes it, so one include still gives the whole C interface, and this
 * header includes expert_arena.h for what both parts share (ea_last_error, enum
 * ea_huge_pages, the export macro).
 *
 * Conventions (those of expert_arena.h):
 * - Every call that can fail returns 0 or a negative errno, the same mapping as the arena
 *   calls: -EINVAL bad argument (a key that is empty, longer than 1024 bytes or holds a control
 *   byte; a dtype likewise; more than 16 dimensions; a descriptor that does not decode),
 *   -ENOENT no such file or directory, -EBUSY the block was aborted, reused or already released
 *   (open) or its key was aborted while it was written (publish), -ENOSPC the cap is reached in
 *   strict mode or the filesystem is too small, -ERANGE an output buffer too small, -EACCES,
 *   -EBADMSG a damaged segment, -ENOTSUP, -EIO, -ENOMEM. ea_last_error() then gives the
 *   library's message, which names the directory, file, key or field.
 * - Structs passed in or out start with `size`, set by the caller to its sizeof; the library
 *   reads and writes only that many bytes. ea_stream_params_init_sized is the FFI form of the
 *   inline ea_stream_params_init.
 * - Descriptors are written into the caller's buffer (no allocation to free):
 *   EA_STREAM_DESCRIPTOR_MAX bytes always suffice. A smaller buffer is checked before anything
 *   is reserved or published: when it may be too small for this tensor (the bound counts the
 *   key, dtype and shape and the longest segment name a descriptor may carry, so it can exceed
 *   the descriptor by up to about 170 bytes) the call fails with -ERANGE, stores the size it
 *   needs in *descriptor_len and changes nothing (a reservation stays unpublished); a NULL
 *   buffer asks for that size. A descriptor is never truncated.
 * - Keys and dtypes are NUL-terminated strings.
 * - Handles are opaque; no C++ exception crosses this interface.
 *
 * Lifetimes:
 * - A reservation's bytes are writable until ea_stream_reservation_destroy. Destroying it
 *   unpublished (ea_stream_publish not called, or failed) cancels it: the space goes back to
 *   the producer. Every successful ea_stream_reserve is paired with one destroy.
 * - ea_stream_producer_destroy unlinks the producer's segments and spill files. A reservation
 *   still alive keeps the producer's state (and its segments) until it is destroyed; consumers
 *   that opened its tensors keep their mappings until they release them.
 * - A tensor's data, key, dtype and shape stay valid until ea_stream_release, also past
 *   ea_stream_consumer_destroy (the mapping stays until the tensor is released).
 *
 * Thread-safety: calls on one producer or one consumer may run concurrently from any threads
 * (put, put_many, reserve, abort, reclaim, stats, open); a reservation or a tensor is used by
 * one thread at a time; a destroy or release must not race with other calls on the same
 * handle. ea_last_error() is per thread.
 */
#ifndef EXPERT_ARENA_EXPERT_ARENA_STREAM_H_
#define EXPERT_ARENA_EXPERT_ARENA_STREAM_H_

#include <stddef.h>
#include <stdint.h>

#include "expert_arena/expert_arena.h"
#include "expert_arena/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A descriptor never exceeds this many bytes (consumers refuse longer ones). */
#define EA_STREAM_DESCRIPTOR_MAX 4096

typedef struct ea_stream_producer ea_stream_producer;
typedef struct ea_stream_reservation ea_stream_reservation;
typedef struct ea_stream_consumer ea_stream_consumer;
typedef struct ea_stream_tensor ea_stream_tensor;

/* Options of a producer (StreamOptions) and of a consumer (ConsumerOptions). A consumer reads
 * directory, spill_directory, gpu, pin_budget_bytes, allow_foreign_owner and quiet, which must
 * name the producers' directories (descriptors carry file names only). NULL strings take the
 * default. */
typedef struct ea_stream_params {
  size_t size;                     /* the caller's sizeof; set by ea_stream_params_init */
  const char* directory;           /* segments' shared directory; NULL: "/dev/shm" */
  const char* logical_name;        /* in segment names: [A-Za-z0-9_.-]{1,48}, no ".."; "stream" */
  uint64_t segment_bytes;          /* data bytes of a segment, a multiple of 2 MiB; 256 MiB */
  uint32_t max_segments;           /* cap on segment files; 32 */
  uint64_t block_alignment;        /* of every tensor, a power of two 64 B .. 2 MiB; 4096 */
  const char* spill_directory;     /* where tensors go at the cap; NULL: "/var/tmp" */
  int strict;                      /* nonzero: at the cap wait, then -ENOSPC instead of spilling */
  double strict_wait_seconds;      /* that wait; 1.0 */
  int huge_pages;                  /* enum ea_huge_pages; EA_HUGE_AUTO */
  const char* gpu;                 /* "none", "cuda[:N]", "hip[:N]"; NULL: "none" */
  uint64_t pin_budget_bytes;       /* GPU registration budget of the process; 4 GiB, 0: no bound */
  uint32_t copy_threads;           /* put's copy threads for 8 MiB and more; 0: automatic */
  uint64_t non_temporal_copy_from; /* 0: automatic; UINT64_MAX: never */
  int grow_ahead;                  /* nonzero: make the next segment ahead of need; 1 */
  double warning_interval_seconds; /* fragmentation warning rate limit; 10 */
  int sweep_at_start;              /* nonzero: remove dead owners' segments at create; 1 */
  int allow_foreign_owner;         /* consumer: map segments of another user; 0 */
  int quiet;                       /* nonzero: no log lines (start, growth, spill) on stderr */
  double lease_check_seconds;      /* how often a put may check for dead consumers; 1.0 */
  /* Across hosts over UCX (docs/cross-host.md). Producer: listen is "ADDR:PORT" to serve
   * consumers on other hosts (port 0: any free port, see ea_stream_producer_remote_address);
   * NULL: nothing listens. listen_token: the producer asks remote consumers for it, a consumer
   * presents it; NULL: none. remote_lease_seconds: a remote consumer's hold ends at most this
   * long after its tensor was served; 60. remote_timeout_seconds: a consumer's bound on one
   * open from another host; 30. */
  const char* listen;
  const char* listen_token;
  double remote_lease_seconds;
  double remote_timeout_seconds;
  /* Producer: where segments' pages live on a host with several NUMA nodes (docs/numa.md):
   * "auto" (NULL or ""), the producer's own node (that of its CPU affinity); "local" (first
   * touch), "interleave", "node:N". -EINVAL for anything else, "replicate" included, and for a
   * node this process may not allocate on. Appended last: older callers' structs end before. */
  const char* numa;
} ea_stream_params;

/* The producer's counters (StreamStats). */
typedef struct ea_stream_stats {
  size_t size; /* set by the caller: sizeof(ea_stream_stats) */
  uint64_t total_bytes;
  uint64_t free_bytes;
  uint64_t largest_free_block;
  uint64_t segments; /* regular + dedicated */
  uint64_t dedicated_segments;
  uint64_t live_blocks; /* reserved, published or aborted-but-held */
  uint64_t pinned_bytes;
  uint64_t spills;
  uint64_t spill_files;
  uint64_t fragmentation_failures;
  uint64_t reclaimed_blocks;
  uint64_t dead_readers_cleared;
  uint64_t segments_grown_ahead;
  /* The node every segment is on (the producer's own, node:N, or the only one); -1 when they
   * are interleaved or on first touch across several nodes. Appended last. */
  int64_t numa_node;
} ea_stream_stats;

/* One tensor of ea_stream_put_many; its bytes are read during the call only. */
typedef struct ea_stream_put_item {
  size_t size; /* the caller's sizeof(ea_stream_put_item), the same in every item */
  const char* key;
  const void* data;
  uint64_t bytes;
  const char* dtype; /* NULL: "u8" */
  const uint64_t* shape;
  uint32_t ndim;
} ea_stream_put_item;

typedef struct ea_stream_reservation_info {
  size_t size; /* set by the caller */
  void* data;  /* writable until ea_stream_reservation_destroy */
  uint64_t bytes;
  int spilled; /* nonzero: in a spill file */
  const char* key;
} ea_stream_reservation_info;

typedef struct ea_stream_tensor_info {
  size_t size;      /* set by the caller: sizeof(ea_stream_tensor_info) */
  const void* data; /* read-only; every field is valid until ea_stream_release */
  uint64_t bytes;
  const char* key;       /* NUL-terminated, no control bytes */
  const char* dtype;     /* as the producer gave it */
  const uint64_t* shape; /* ndim values */
  uint32_t ndim;
  int spilled; /* nonzero: read from a spill file */
} ea_stream_tensor_info;

/* Fills the first `size` bytes of `params` with the defaults and sets params->size = size;
 * never writes past `size`. Does nothing when params is NULL or size cannot hold `size`. */
EXPERT_ARENA_EXPORT void ea_stream_params_init_sized(ea_stream_params* params, size_t size);

static inline void ea_stream_params_init(ea_stream_params* params) {
  ea_stream_params_init_sized(params, sizeof *params);
}

/* ---- producer ---- */

/* Checks the directory against the cap and sweeps dead owners' segments (sweep_at_start);
 * the first segment is made by the first put. *out is NULL on failure. */
EXPERT_ARENA_EXPORT int ea_stream_producer_create(const ea_stream_params* params,
                                                  ea_stream_producer** out);

/* Unlinks the producer's segments (see Lifetimes). NULL is ignored. In a forked child of the
 * process that created the producer it unlinks and frees nothing of the parent's, and every
 * call on the producer (or a reservation or consumer the child inherited) fails with -EINVAL
 * "... a forked child (process C) must create its own". */
EXPERT_ARENA_EXPORT void ea_stream_producer_destroy(ea_stream_producer* producer);

/* Copies `bytes` bytes at `data` into the stream as the tensor `key` (dtype, shape of ndim
 * values, at most 16), readable by `readers` releases (1 for one consumer), and writes its
 * descriptor to out_descriptor[0 .. *descriptor_len). */
EXPERT_ARENA_EXPORT int ea_stream_put(ea_stream_producer* producer, const char* key,
                                      const void* data, uint64_t bytes, const char* dtype,
                                      const uint64_t* shape, uint32_t ndim, uint32_t readers,
                                      void* out_descriptor, size_t descriptor_capacity,
                                      size_t* descriptor_len);

/* ea_stream_put of `count` tensors, all or none: every key and info is checked, then each
 * tensor's space reserved and its bytes copied, then all are published at once (a consumer
 * never sees part of the batch). When a step fails nothing is published, the space reserved
 * so far goes back, and the message names the item's index and key. The descriptors are
 * written back to back into out_descriptors, descriptor_lens[i] (count values, the caller's
 * array) the length of the i-th; *total_len the bytes written. -ERANGE when the buffer may be
 * too small, with the bytes needed in *total_len (count x EA_STREAM_DESCRIPTOR_MAX always
 * suffices). `items` is an array of the caller's structs: its stride is items[0].size. */
EXPERT_ARENA_EXPORT int ea_stream_put_many(ea_stream_producer* producer,
                                           const ea_stream_put_item* items, size_t count,
                                           uint32_t readers, void* out_descriptors,
                                           size_t descriptors_capacity, size_t* descriptor_lens,
                                           size_t* total_len);

/* Space for `bytes` bytes owned by `key`: write into *data (NULL: not wanted; also in
 * ea_stream_reservation_get_info), then ea_stream_publish. */
EXPERT_ARENA_EXPORT int ea_stream_reserve(ea_stream_producer* producer, const char* key,
                                          uint64_t bytes, ea_stream_reservation** out, void** data);

EXPERT_ARENA_EXPORT int ea_stream_reservation_get_info(const ea_stream_reservation* reservation,
                                                       ea_stream_reservation_info* out);

/* Publishes the reserved bytes as ea_stream_put does. On -ERANGE or -EINVAL nothing changed:
 * fix the argument and publish again. -EBUSY: the key was aborted meanwhile and the space was
 * given back. Publishing twice is -EINVAL. The handle still needs
 * ea_stream_reservation_destroy. */
EXPERT_ARENA_EXPORT int ea_stream_publish(ea_stream_reservation* reservation, const char* dtype,
                                          const uint64_t* shape, uint32_t ndim, uint32_t readers,
                                          void* out_descriptor, size_t descriptor_capacity,
                                          size_t* descriptor_len);

/* Frees the handle; unpublished space goes back to the producer. NULL is ignored. */
EXPERT_ARENA_EXPORT void ea_stream_reservation_destroy(ea_stream_reservation* reservation);

/* Frees the blocks owned by exactly `key` (never a prefix: "abc" leaves "abc_1_2"), each once
 * its current readers released it; a block still being written is refused at publish.
 * *marked (may be NULL) gets how many blocks were marked, 0 when the key owns none. */
EXPERT_ARENA_EXPORT int ea_stream_abort(ea_stream_producer* producer, const char* key,
                                        uint64_t* marked);

/* Reclaims every block all of whose readers released it and clears dead readers' holds (a
 * reserve does this itself when it needs space). */
EXPERT_ARENA_EXPORT int ea_stream_reclaim(ea_stream_producer* producer);

/* The producer's figures; in a forked child of its creator, an error naming the fork, as for
 * every other call there. */
EXPERT_ARENA_EXPORT int ea_stream_get_stats(ea_stream_producer* producer, ea_stream_stats* out);

/* The producer's instance name, "ea-stream-<logical>-<pid>-<start>-<random>", the prefix of its
 * segment files; valid until ea_stream_producer_destroy (NULL for NULL). */
EXPERT_ARENA_EXPORT const char* ea_stream_producer_name(const ea_stream_producer* producer);

/* "ADDR:PORT" the producer serves other hosts on ("" without ea_stream_params.listen); valid
 * until ea_stream_producer_destroy (NULL for NULL). */
EXPERT_ARENA_EXPORT const char* ea_stream_producer_remote_address(
    const ea_stream_producer* producer);

/* A block the producer still holds for its readers (ea_stream_pending). */
typedef struct ea_stream_pending_block {
  size_t size;          /* set by the caller in out[0]: sizeof(ea_stream_pending_block) */
  const char* key;      /* the strings stay valid until the next ea_stream_pending on this */
  const char* state;    /* producer or its destroy; state: "writing", "published", "aborted" */
  const char* segment;  /* file name in the stream or spill directory */
  double age_seconds;   /* since it was reserved */
  uint32_t readers_left; /* releases still expected (published blocks) */
  uint32_t holders;      /* consumer processes holding a view of it now */
  uint64_t bytes;
  int spilled;
  uint32_t remote_holders; /* consumers on other hosts holding it (ea_stream_params.listen) */
} ea_stream_pending_block;

/* Ends the leases of dead consumers (as ea_stream_reclaim does), then lists the blocks not yet
 * given back, oldest first: *count gets how many there are, and the first min(count,
 * capacity) are written to `out` (an array of the caller's structs, stride out[0].size).
 * -ERANGE when capacity is short (the first capacity are written); out NULL with capacity 0
 * asks for the count (-ERANGE unless nothing is pending). Not concurrently with another
 * ea_stream_pending on the same producer. */
EXPERT_ARENA_EXPORT int ea_stream_pending(ea_stream_producer* producer,
                                          ea_stream_pending_block* out, size_t capacity,
                                          size_t* count);

/* ---- consumer ---- */

EXPERT_ARENA_EXPORT int ea_stream_consumer_create(const ea_stream_params* params,
                                                  ea_stream_consumer** out);

/* Drops the consumer's handle; tensors still open stay valid, with their mappings, until
 * ea_stream_release. NULL is ignored. */
EXPERT_ARENA_EXPORT void ea_stream_consumer_destroy(ea_stream_consumer* consumer);

/* Validates the descriptor (-EINVAL with the reason when it does not decode), maps the
 * segment (once per consumer) and takes a hold on the block: *out is a read-only view. */
EXPERT_ARENA_EXPORT int ea_stream_open(ea_stream_consumer* consumer, const void* descriptor,
                                       size_t descriptor_len, ea_stream_tensor** out);

EXPERT_ARENA_EXPORT int ea_stream_tensor_get_info(const ea_stream_tensor* tensor,
                                                  ea_stream_tensor_info* out);

/* Returns this reader's share of the block and frees the handle. NULL is ignored. */
EXPERT_ARENA_EXPORT void ea_stream_release(ea_stream_tensor* tensor);

/* ---- tools ---- */

/* Removes the stream segments in `directory` whose owner process is gone (never another
 * user's files, nor files that are not segments). *removed and *live (either may be NULL) get
 * how many were removed and how many have a live owner. */
EXPERT_ARENA_EXPORT int ea_stream_sweep(const char* directory, size_t* removed, size_t* live);

#ifdef __cplusplus
}
#endif

#endif /* EXPERT_ARENA_EXPERT_ARENA_STREAM_H_ */
