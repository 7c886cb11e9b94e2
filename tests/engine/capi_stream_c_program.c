/* A C engine's use of tensor streaming: only expert_arena.h (which includes
 * expert_arena_stream.h) and libexpert_arena.so; xxhash only to print checksums.
 *
 * Usage: capi_stream_c_program check DIR SPILL_DIR
 *            every call of the C stream interface in this process (put and open bit-exact,
 *            reserve/publish, cancel, abort of an exact key, errors and their messages,
 *            strict mode at the cap, descriptor buffers, struct sizes, lifetimes, four threads
 *            on one producer and consumer), then real processes: this program as a consumer
 *            and as a producer in a child, and a killed producer's segments swept. DIR and SPILL_DIR must be empty private directories;
 *            they are empty again at the end.
 *        capi_stream_c_program produce DIR
 *            puts one tensor per case (half with ea_stream_put, half reserved, written in
 *            place and published); prints "<key> <dtype> <shape,..> <xxh3> <descriptor hex>"
 *            per tensor, then "ready"; destroys the producer and exits when stdin closes.
 *        capi_stream_c_program consume DIR
 *            reads descriptor hex lines from stdin; for each prints
 *            "<key> <dtype> <shape,..> <xxh3 of the bytes>" (or "error <errno> <message>")
 *            and releases.
 * The produce and consume lines are those of tests/python/python_peer.cc and stream_roles.py,
 * so any of the three opens what another made. Exit 0 when every check passes ("all checks
 * passed"); each failure is printed. */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "c_check.h"
#include "expert_arena/expert_arena.h"

extern char** environ;

#define MIB (1024u * 1024u)

/* ---- shared routines ---- */

static void Fill(unsigned char* p, size_t n, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = (unsigned char)(s >> 56);
  }
}

static void PrintHex(FILE* f, const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) fprintf(f, "%02x", p[i]);
}

/* Hex text to bytes; returns the byte count, or 0 for text that is not hex. */
static size_t Unhex(const char* text, unsigned char* out, size_t capacity) {
  size_t n = strlen(text);
  while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r')) --n;
  if (n % 2 != 0 || n / 2 > capacity) return 0;
  for (size_t i = 0; i < n / 2; ++i) {
    unsigned v = 0;
    if (sscanf(text + 2 * i, "%2x", &v) != 1) return 0;
    out[i] = (unsigned char)v;
  }
  return n / 2;
}

static void ShapeText(const uint64_t* shape, uint32_t ndim, char* out, size_t capacity) {
  size_t at = 0;
  out[0] = '\0';
  if (ndim == 0) {
    snprintf(out, capacity, "-");
    return;
  }
  for (uint32_t i = 0; i < ndim && at < capacity; ++i) {
    at += (size_t)snprintf(out + at, capacity - at, "%s%llu", i ? "," : "",
                           (unsigned long long)shape[i]);
  }
}

static ea_stream_params Params(const char* dir, const char* spill) {
  ea_stream_params p;
  ea_stream_params_init(&p);
  p.directory = dir;
  p.spill_directory = spill;
  p.logical_name = "capi_c";
  p.segment_bytes = 8 * MIB;
  p.max_segments = 4;
  p.sweep_at_start = 0;
  p.quiet = 1;
  return p;
}

static ea_stream_stats Stats(ea_stream_producer* producer) {
  ea_stream_stats s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  CHECK(ea_stream_reclaim(producer) == 0);
  CHECK(ea_stream_get_stats(producer, &s) == 0);
  return s;
}

/* Entries of `dir` other than . and .. (0 when empty, -1 when it cannot be read). */
static int CountEntries(const char* dir) {
  DIR* d = opendir(dir);
  if (d == NULL) return -1;
  int n = 0;
  for (struct dirent* e = readdir(d); e != NULL; e = readdir(d)) {
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) ++n;
  }
  closedir(d);
  return n;
}

static int Contains(const char* text, const char* words) { return strstr(text, words) != NULL; }

/* ---- the produce and consume roles ---- */

struct Case {
  const char* dtype;
  size_t item;
  uint32_t ndim;
  uint64_t shape[3];
};

static const struct Case kCases[] = {
    {"f32", 4, 3, {7, 3, 2}}, {"bf16", 2, 2, {4, 11}}, {"i8", 1, 2, {3, 17}},
    {"u8", 1, 1, {257}},      {"f64", 8, 2, {3, 5}},   {"bool", 1, 1, {12}},
    {"i64", 8, 1, {6}},       {"f16", 2, 2, {9, 4}},   {"f32", 4, 2, {512, 1024}}, /* 2 MiB */
};
#define CASE_COUNT (sizeof kCases / sizeof kCases[0])

static size_t CaseBytes(const struct Case* c) {
  size_t n = c->item;
  for (uint32_t d = 0; d < c->ndim; ++d) n *= (size_t)c->shape[d];
  return n;
}

/* Puts every case (odd ones reserved and written in place); prints a line per tensor.
 * Returns 0 on success. */
static int ProduceInto(ea_stream_producer* producer, FILE* out) {
  for (size_t i = 0; i < CASE_COUNT; ++i) {
    const struct Case* c = &kCases[i];
    size_t n = CaseBytes(c);
    unsigned char* bytes = malloc(n);
    if (bytes == NULL) return 1;
    Fill(bytes, n, i + 1);
    if (strcmp(c->dtype, "bool") == 0) {
      for (size_t k = 0; k < n; ++k) bytes[k] &= 1;
    }
    char key[64];
    unsigned char d[EA_STREAM_DESCRIPTOR_MAX];
    size_t len = 0;
    int rc;
    if (i % 2 == 0) {
      snprintf(key, sizeof key, "c-%s-%zu", c->dtype, i);
      rc =
          ea_stream_put(producer, key, bytes, n, c->dtype, c->shape, c->ndim, 1, d, sizeof d, &len);
    } else {
      snprintf(key, sizeof key, "c-in-place-%s-%zu", c->dtype, i);
      ea_stream_reservation* r = NULL;
      void* at = NULL;
      rc = ea_stream_reserve(producer, key, n, &r, &at);
      if (rc == 0) {
        memcpy(at, bytes, n);
        rc = ea_stream_publish(r, c->dtype, c->shape, c->ndim, 1, d, sizeof d, &len);
      }
      ea_stream_reservation_destroy(r);
    }
    if (rc != 0) {
      fprintf(stderr, "capi_stream: put %s: %d %s\n", key, rc, ea_last_error());
      free(bytes);
      return 1;
    }
    char shape[128];
    ShapeText(c->shape, c->ndim, shape, sizeof shape);
    fprintf(out, "%s %s %s %016llx ", key, c->dtype, shape,
            (unsigned long long)XXH3_64bits(bytes, n));
    PrintHex(out, d, len);
    fprintf(out, "\n");
    fflush(out);
    free(bytes);
  }
  return 0;
}

static int Produce(const char* dir) {
  ea_stream_params p = Params(dir, NULL);
  ea_stream_producer* producer = NULL;
  if (ea_stream_producer_create(&p, &producer) != 0) {
    fprintf(stderr, "capi_stream: %s\n", ea_last_error());
    return 1;
  }
  int rc = ProduceInto(producer, stdout);
  printf("ready\n");
  fflush(stdout);
  int ch;
  while ((ch = getchar()) != EOF) {
  }
  ea_stream_producer_destroy(producer);
  return rc;
}

/* Opens one hex descriptor line and prints what it holds; returns the open's rc. */
static int ConsumeLine(ea_stream_consumer* consumer, const char* line, FILE* out) {
  static unsigned char d[EA_STREAM_DESCRIPTOR_MAX];
  size_t len = Unhex(line, d, sizeof d);
  ea_stream_tensor* t = NULL;
  int rc = ea_stream_open(consumer, d, len, &t);
  if (rc != 0) {
    fprintf(out, "error %d %s\n", rc, ea_last_error());
    fflush(out);
    return rc;
  }
  ea_stream_tensor_info info;
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  rc = ea_stream_tensor_get_info(t, &info);
  if (rc == 0) {
    char shape[128];
    ShapeText(info.shape, info.ndim, shape, sizeof shape);
    fprintf(out, "%s %s %s %016llx\n", info.key, info.dtype, shape,
            (unsigned long long)XXH3_64bits(info.data, (size_t)info.bytes));
  }
  fflush(out);
  ea_stream_release(t);
  return rc;
}

static int Consume(const char* dir) {
  ea_stream_params p = Params(dir, NULL);
  ea_stream_consumer* consumer = NULL;
  if (ea_stream_consumer_create(&p, &consumer) != 0) {
    fprintf(stderr, "capi_stream: %s\n", ea_last_error());
    return 1;
  }
  char line[2 * EA_STREAM_DESCRIPTOR_MAX + 8];
  while (fgets(line, sizeof line, stdin) != NULL) {
    if (line[0] == '\n') continue;
    (void)ConsumeLine(consumer, line, stdout);
  }
  ea_stream_consumer_destroy(consumer);
  return 0;
}

/* ---- a child of this program with pipes on stdin and stdout ---- */

typedef struct Peer {
  pid_t pid;
  FILE* in;  /* the child's stdin */
  FILE* out; /* the child's stdout */
} Peer;

static int StartPeer(const char* self, const char* role, const char* dir, Peer* peer) {
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0) return -1;
  if (pipe(from_child) != 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
  posix_spawn_file_actions_addclose(&actions, to_child[1]);
  posix_spawn_file_actions_addclose(&actions, from_child[0]);
  char* argv[] = {(char*)self, (char*)role, (char*)dir, NULL};
  int rc = posix_spawn(&peer->pid, self, &actions, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(to_child[0]);
  close(from_child[1]);
  if (rc != 0) return -1;
  peer->in = fdopen(to_child[1], "w");
  peer->out = fdopen(from_child[0], "r");
  return peer->in != NULL && peer->out != NULL ? 0 : -1;
}

static int WaitPeer(Peer* peer) {
  if (peer->in != NULL) fclose(peer->in);
  peer->in = NULL;
  int status = 0;
  if (waitpid(peer->pid, &status, 0) != peer->pid) return -1;
  if (peer->out != NULL) fclose(peer->out);
  peer->out = NULL;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* One line of a produce role: key, dtype, shape, xxh3, descriptor hex. */
typedef struct Row {
  char key[128], dtype[64], shape[128], xxh[32];
  char hex[2 * EA_STREAM_DESCRIPTOR_MAX + 1];
} Row;

static int ParseRow(const char* line, Row* row) {
  return sscanf(line, "%127s %63s %127s %31s %8192s", row->key, row->dtype, row->shape, row->xxh,
                row->hex) == 5;
}

/* ---- the in-process checks ---- */

static void CheckParamsAndSizes(const char* dir) {
  ea_stream_params p;
  ea_stream_params_init(&p);
  CHECK(p.size == sizeof p);
  CHECK(p.directory == NULL && p.spill_directory == NULL && p.gpu == NULL);
  CHECK(p.segment_bytes == 256ull * MIB && p.max_segments == 32);
  CHECK(p.block_alignment == 4096 && p.strict == 0 && p.strict_wait_seconds == 1.0);
  CHECK(p.sweep_at_start == 1 && p.grow_ahead == 1 && p.quiet == 0);
  CHECK(p.pin_budget_bytes == 4ull * 1024 * MIB && p.huge_pages == EA_HUGE_AUTO);

  /* An older caller's struct that ends early: the init writes its bytes only. */
  union {
    ea_stream_params params;
    unsigned char bytes[sizeof(ea_stream_params) + 16];
  } older;
  memset(&older, 0xAB, sizeof older);
  const size_t older_size = offsetof(ea_stream_params, huge_pages);
  ea_stream_params_init_sized(&older.params, older_size);
  CHECK(older.params.size == older_size && older.params.max_segments == 32);
  CHECK(older.params.strict_wait_seconds == 1.0 && older.params.directory == NULL);
  for (size_t i = older_size; i < sizeof older.bytes; ++i) CHECK(older.bytes[i] == 0xAB);
  ea_stream_params_init_sized(NULL, sizeof p);   /* ignored */
  ea_stream_params_init_sized(&older.params, 4); /* too small to hold size: ignored */
  CHECK(older.params.size == older_size);

  /* A struct smaller than any version is refused, not read past. */
  ea_stream_producer* producer = (ea_stream_producer*)1;
  ea_stream_params tiny = Params(dir, NULL);
  tiny.size = 8;
  CHECK(ea_stream_producer_create(&tiny, &producer) == -EINVAL && producer == NULL);
  CHECK(Contains(ea_last_error(), "ea_stream_params"));
  ea_stream_consumer* consumer = (ea_stream_consumer*)1;
  CHECK(ea_stream_consumer_create(&tiny, &consumer) == -EINVAL && consumer == NULL);
  CHECK(ea_stream_producer_create(NULL, &producer) == -EINVAL);

  /* A newer caller's struct, longer than ours with bytes we do not know: only ours are read. */
  union {
    ea_stream_params params;
    unsigned char bytes[sizeof(ea_stream_params) + 32];
  } newer;
  memset(&newer, 0x5A, sizeof newer);
  newer.params = Params(dir, NULL);
  newer.params.size = sizeof newer.bytes;
  CHECK(ea_stream_producer_create(&newer.params, &producer) == 0 && producer != NULL);
  CHECK(ea_stream_producer_name(producer) != NULL &&
        strncmp(ea_stream_producer_name(producer), "ea-stream-capi_c-", 17) == 0);
  CHECK(CountEntries(dir) == 0); /* its first segment comes with its first put */

  /* Output structs: too small refused; exactly the first version's size filled. */
  ea_stream_stats s;
  s.size = 8;
  CHECK(ea_stream_get_stats(producer, &s) == -EINVAL);
  union {
    ea_stream_stats stats;
    unsigned char bytes[sizeof(ea_stream_stats) + 16];
  } st;
  memset(&st, 0xAB, sizeof st);
  st.stats.size = sizeof st.stats;
  CHECK(ea_stream_get_stats(producer, &st.stats) == 0);
  CHECK(st.stats.size == sizeof st.stats && st.stats.segments == 0); /* none before a put */
  CHECK(st.stats.total_bytes == 0 && st.stats.free_bytes == 0);
  for (size_t i = sizeof st.stats; i < sizeof st.bytes; ++i) CHECK(st.bytes[i] == 0xAB);
  ea_stream_producer_destroy(producer);
  CHECK(CountEntries(dir) == 0);

  /* Bad options get the library's message. */
  ea_stream_params bad = Params(dir, NULL);
  bad.logical_name = "has space";
  CHECK(ea_stream_producer_create(&bad, &producer) == -EINVAL && producer == NULL);
  CHECK(Contains(ea_last_error(), "logical name"));
  bad = Params(dir, NULL);
  bad.segment_bytes = 3 * MIB;
  CHECK(ea_stream_producer_create(&bad, &producer) == -EINVAL);
  CHECK(Contains(ea_last_error(), "multiple of 2 MiB"));
  bad = Params(dir, NULL);
  bad.huge_pages = 7;
  CHECK(ea_stream_producer_create(&bad, &producer) == -EINVAL);
  CHECK(Contains(ea_last_error(), "huge_pages 7"));
  bad = Params("/nonexistent-ea-dir", NULL);
  CHECK(ea_stream_producer_create(&bad, &producer) == -ENOENT);
  CHECK(Contains(ea_last_error(), "/nonexistent-ea-dir"));
  CHECK(ea_stream_consumer_create(&bad, &consumer) == -ENOENT);
  CHECK(Contains(ea_last_error(), "/nonexistent-ea-dir"));
}

/* ea_stream_pending lists what is held; a forked child gets -EINVAL naming the fork from the
 * parent's producer and consumer, and destroying them there unlinks and releases nothing. */
static void CheckPendingAndFork(const char* dir, const char* spill) {
  ea_stream_params p = Params(dir, spill);
  ea_stream_producer* producer = NULL;
  ea_stream_consumer* consumer = NULL;
  CHECK(ea_stream_producer_create(&p, &producer) == 0);
  CHECK(ea_stream_consumer_create(&p, &consumer) == 0);
  if (producer == NULL || consumer == NULL) return;
  unsigned char data[3000];
  Fill(data, sizeof data, 5);
  unsigned char d[EA_STREAM_DESCRIPTOR_MAX], e[EA_STREAM_DESCRIPTOR_MAX];
  size_t len = 0, elen = 0;
  CHECK(ea_stream_put(producer, "held", data, sizeof data, NULL, NULL, 0, 2, d, sizeof d, &len) ==
        0);
  CHECK(ea_stream_put(producer, "other", data, sizeof data, NULL, NULL, 0, 1, e, sizeof e,
                      &elen) == 0);
  ea_stream_tensor* t = NULL;
  CHECK(ea_stream_open(consumer, d, len, &t) == 0);
  size_t count = 0;
  CHECK(ea_stream_pending(producer, NULL, 0, &count) == -ERANGE && count == 2); /* the count */
  ea_stream_pending_block blocks[2];
  memset(blocks, 0, sizeof blocks);
  blocks[0].size = sizeof blocks[0];
  CHECK(ea_stream_pending(producer, blocks, 1, &count) == -ERANGE && count == 2);
  CHECK(ea_stream_pending(producer, blocks, 2, &count) == 0 && count == 2);
  for (int i = 0; i < 2; ++i) {
    CHECK(blocks[i].key != NULL && blocks[i].state != NULL && blocks[i].bytes == sizeof data);
    if (blocks[i].key != NULL && strcmp(blocks[i].key, "held") == 0) {
      CHECK(blocks[i].readers_left == 2 && blocks[i].holders == 1);
      CHECK(strcmp(blocks[i].state, "published") == 0 && blocks[i].age_seconds >= 0);
    }
  }
  const int segments = CountEntries(dir);
  pid_t child = fork();
  if (child == 0) {
    int bad = 0;
    size_t n = 0;
    if (ea_stream_put(producer, "child", data, sizeof data, NULL, NULL, 0, 1, d, sizeof d, &n) !=
            -EINVAL ||
        !Contains(ea_last_error(), "a forked child")) {
      bad |= 1;
    }
    ea_stream_tensor* u = NULL;
    if (ea_stream_open(consumer, e, elen, &u) != -EINVAL) bad |= 2;
    if (ea_stream_pending(producer, NULL, 0, &n) != -EINVAL) bad |= 4;
    ea_stream_stats inherited;
    memset(&inherited, 0, sizeof inherited);
    inherited.size = sizeof inherited;
    if (ea_stream_get_stats(producer, &inherited) != -EINVAL ||
        !Contains(ea_last_error(), "a forked child")) {
      bad |= 8;
    }
    ea_stream_release(t);
    ea_stream_consumer_destroy(consumer);
    ea_stream_producer_destroy(producer);
    _exit(bad);
  }
  int status = -1;
  CHECK(child > 0 && waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(CountEntries(dir) == segments); /* the child unlinked nothing */
  ea_stream_tensor_info info;
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(ea_stream_tensor_get_info(t, &info) == 0 && memcmp(info.data, data, sizeof data) == 0);
  CHECK(ea_stream_pending(producer, blocks, 2, &count) == 0 && count == 2);
  for (int i = 0; i < 2; ++i) {
    if (blocks[i].key != NULL && strcmp(blocks[i].key, "held") == 0) {
      CHECK(blocks[i].readers_left == 2 && blocks[i].holders == 1); /* no share spent */
    }
  }
  ea_stream_release(t);
  ea_stream_consumer_destroy(consumer);
  ea_stream_producer_destroy(producer);
  CHECK(CountEntries(dir) == 0);
}

static void CheckPutOpenReserve(const char* dir, const char* spill) {
  ea_stream_params p = Params(dir, spill);
  ea_stream_producer* producer = NULL;
  ea_stream_consumer* consumer = NULL;
  CHECK(ea_stream_producer_create(&p, &producer) == 0);
  CHECK(ea_stream_consumer_create(&p, &consumer) == 0);
  if (producer == NULL || consumer == NULL) return;

  /* put + open: bit-exact, with key, dtype and shape; zero-copy (not the caller's bytes). */
  const uint64_t shape[2] = {4, 33};
  unsigned char data[4 * 33 * 2];
  Fill(data, sizeof data, 17);
  unsigned char d[EA_STREAM_DESCRIPTOR_MAX];
  size_t len = 0;
  CHECK(ea_stream_put(producer, "req-17", data, sizeof data, "bf16", shape, 2, 1, d, sizeof d,
                      &len) == 0);
  CHECK(len > 16 && len < EA_STREAM_DESCRIPTOR_MAX && memcmp(d, "EATD", 4) == 0);
  ea_stream_tensor* t = NULL;
  CHECK(ea_stream_open(consumer, d, len, &t) == 0 && t != NULL);
  ea_stream_tensor_info info;
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(ea_stream_tensor_get_info(t, &info) == 0);
  CHECK(info.bytes == sizeof data && info.data != NULL && info.data != (const void*)data);
  CHECK(info.data != NULL && memcmp(info.data, data, sizeof data) == 0);
  CHECK(info.key != NULL && strcmp(info.key, "req-17") == 0);
  CHECK(info.dtype != NULL && strcmp(info.dtype, "bf16") == 0);
  CHECK(info.ndim == 2 && info.shape != NULL && info.shape[0] == 4 && info.shape[1] == 33);
  CHECK(info.spilled == 0);
  info.size = 4;
  CHECK(ea_stream_tensor_get_info(t, &info) == -EINVAL);
  CHECK(Stats(producer).live_blocks == 1); /* held by the open view */
  ea_stream_release(t);
  CHECK(Stats(producer).live_blocks == 0); /* released: the space came back */
  /* Its one reader released it: a second open is refused. */
  CHECK(ea_stream_open(consumer, d, len, &t) == -EBUSY && t == NULL);
  CHECK(Contains(ea_last_error(), "req-17"));

  /* Two readers: both open it, the space comes back after the second release. */
  CHECK(ea_stream_put(producer, "two", data, sizeof data, NULL, NULL, 0, 2, d, sizeof d, &len) ==
        0);
  ea_stream_tensor *a = NULL, *b = NULL;
  CHECK(ea_stream_open(consumer, d, len, &a) == 0 && ea_stream_open(consumer, d, len, &b) == 0);
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(ea_stream_tensor_get_info(b, &info) == 0 && strcmp(info.dtype, "u8") == 0);
  CHECK(info.ndim == 0);
  ea_stream_release(a);
  CHECK(Stats(producer).live_blocks == 1);
  ea_stream_release(b);
  CHECK(Stats(producer).live_blocks == 0);

  /* A too-small descriptor buffer: -ERANGE with the size needed, and nothing reserved. */
  ea_stream_stats before = Stats(producer);
  unsigned char small[16];
  len = 0;
  CHECK(ea_stream_put(producer, "small", data, sizeof data, "f16", shape, 2, 1, small, sizeof small,
                      &len) == -ERANGE);
  CHECK(len > sizeof small && len <= EA_STREAM_DESCRIPTOR_MAX);
  CHECK(Contains(ea_last_error(), "descriptor buffer of 16 bytes"));
  ea_stream_stats after = Stats(producer);
  CHECK(after.live_blocks == before.live_blocks && after.free_bytes == before.free_bytes);
  size_t needed = 0;
  CHECK(ea_stream_put(producer, "small", data, sizeof data, "f16", shape, 2, 1, NULL, 0, &needed) ==
        -ERANGE); /* a NULL buffer asks for the size */
  CHECK(needed == len);
  unsigned char* exact = malloc(needed);
  size_t got = 0;
  CHECK(exact != NULL && ea_stream_put(producer, "small", data, sizeof data, "f16", shape, 2, 1,
                                       exact, needed, &got) == 0);
  CHECK(got > 16 && got <= needed);
  CHECK(ea_stream_open(consumer, exact, got, &t) == 0);
  ea_stream_release(t);
  free(exact);
  CHECK(ea_stream_put(producer, "small", data, sizeof data, "f16", shape, 2, 1, d, sizeof d,
                      NULL) == -EINVAL);

  /* reserve, write in place, publish; the bytes are the consumer's. */
  ea_stream_reservation* r = NULL;
  void* at = NULL;
  CHECK(ea_stream_reserve(producer, "in-place", 1000, &r, &at) == 0 && r != NULL && at != NULL);
  ea_stream_reservation_info ri;
  memset(&ri, 0, sizeof ri);
  ri.size = sizeof ri;
  CHECK(ea_stream_reservation_get_info(r, &ri) == 0);
  CHECK(ri.data == at && ri.bytes == 1000 && ri.spilled == 0 && strcmp(ri.key, "in-place") == 0);
  if (at != NULL) Fill(at, 1000, 99);
  unsigned char expect[1000];
  Fill(expect, sizeof expect, 99);
  const uint64_t flat[1] = {1000};
  /* A too-small buffer leaves it unpublished; publishing again works. */
  CHECK(ea_stream_publish(r, "u8", flat, 1, 1, small, sizeof small, &len) == -ERANGE);
  CHECK(ea_stream_publish(r, "u\x02", flat, 1, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(ea_stream_publish(r, "u8", flat, 1, 1, d, sizeof d, &len) == 0);
  CHECK(ea_stream_publish(r, "u8", flat, 1, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(Contains(ea_last_error(), "published already"));
  ea_stream_reservation_destroy(r); /* published: the block stays for its reader */
  CHECK(ea_stream_open(consumer, d, len, &t) == 0);
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(ea_stream_tensor_get_info(t, &info) == 0 && info.bytes == 1000);
  CHECK(info.data != NULL && memcmp(info.data, expect, 1000) == 0);
  CHECK(info.ndim == 1 && info.shape[0] == 1000 && strcmp(info.key, "in-place") == 0);
  ea_stream_release(t);

  /* cancel: an unpublished reservation gives its space back. */
  before = Stats(producer);
  CHECK(before.live_blocks == 0);
  CHECK(ea_stream_reserve(producer, "cancelled", 3 * MIB, &r, NULL) == 0);
  ea_stream_stats held = Stats(producer);
  CHECK(held.live_blocks == 1 && held.free_bytes + 3 * MIB <= before.free_bytes);
  ea_stream_reservation_destroy(r);
  after = Stats(producer);
  CHECK(after.live_blocks == 0 && after.free_bytes == before.free_bytes);
  ea_stream_reservation_destroy(NULL);

  /* abort: the exact key only ("abc" leaves "abc_1_2"). */
  unsigned char d_abc[EA_STREAM_DESCRIPTOR_MAX], d_long[EA_STREAM_DESCRIPTOR_MAX];
  size_t len_abc = 0, len_long = 0;
  CHECK(ea_stream_put(producer, "abc", data, 100, "u8", NULL, 0, 1, d_abc, sizeof d_abc,
                      &len_abc) == 0);
  CHECK(ea_stream_put(producer, "abc_1_2", data, 100, "u8", NULL, 0, 1, d_long, sizeof d_long,
                      &len_long) == 0);
  uint64_t marked = 99;
  CHECK(ea_stream_abort(producer, "abc", &marked) == 0 && marked == 1);
  /* Nobody held it: the block was freed at once, so its descriptor is refused. */
  CHECK(ea_stream_open(consumer, d_abc, len_abc, &t) == -EBUSY && t == NULL);
  CHECK(Contains(ea_last_error(), "key \"abc\""));
  CHECK(ea_stream_open(consumer, d_long, len_long, &t) == 0);
  ea_stream_release(t);
  CHECK(ea_stream_abort(producer, "no-such-key", &marked) == 0 && marked == 0);
  CHECK(ea_stream_abort(producer, "abc", NULL) == 0);

  /* abort while written: publish refuses it and the space goes back. */
  CHECK(ea_stream_reserve(producer, "doomed", 4096, &r, &at) == 0);
  CHECK(ea_stream_abort(producer, "doomed", &marked) == 0 && marked == 1);
  CHECK(ea_stream_publish(r, "u8", NULL, 0, 1, d, sizeof d, &len) == -EBUSY);
  CHECK(Contains(ea_last_error(), "doomed") && Contains(ea_last_error(), "aborted"));
  ea_stream_reservation_destroy(r);
  CHECK(Stats(producer).live_blocks == 0);

  /* Bad input: a negative errno and a message naming the field; nothing reserved. */
  CHECK(ea_stream_put(producer, "bad\x01key", data, 10, "u8", NULL, 0, 1, d, sizeof d, &len) ==
        -EINVAL);
  CHECK(Contains(ea_last_error(), "key") && Contains(ea_last_error(), "control"));
  CHECK(ea_stream_reserve(producer, "tab\tkey", 10, &r, &at) == -EINVAL && r == NULL);
  CHECK(Contains(ea_last_error(), "control"));
  CHECK(ea_stream_put(producer, "", data, 10, "u8", NULL, 0, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(Contains(ea_last_error(), "empty"));
  CHECK(ea_stream_put(producer, "k", data, 10, "f\x7f", NULL, 0, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(Contains(ea_last_error(), "dtype"));
  uint64_t many[17];
  for (int i = 0; i < 17; ++i) many[i] = 1;
  CHECK(ea_stream_put(producer, "k", data, 1, "u8", many, 17, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(Contains(ea_last_error(), "17 dimensions"));
  CHECK(ea_stream_put(producer, "k", data, 10, "u8", NULL, 2, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(Contains(ea_last_error(), "shape is NULL"));
  CHECK(ea_stream_put(producer, "k", data, 10, "u8", NULL, 0, 0, d, sizeof d, &len) == -EINVAL);
  CHECK(Contains(ea_last_error(), "readers 0"));
  CHECK(ea_stream_put(producer, "k", NULL, 10, "u8", NULL, 0, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(ea_stream_put(NULL, "k", data, 10, "u8", NULL, 0, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(Stats(producer).live_blocks == 0);

  /* Garbage, truncated and damaged descriptors: refused before anything is mapped. */
  unsigned char garbage[64];
  Fill(garbage, sizeof garbage, 5);
  CHECK(ea_stream_open(consumer, garbage, sizeof garbage, &t) == -EINVAL && t == NULL);
  CHECK(Contains(ea_last_error(), "tensor descriptor refused"));
  CHECK(ea_stream_put(producer, "k", data, 10, "u8", NULL, 0, 1, d, sizeof d, &len) == 0);
  CHECK(ea_stream_open(consumer, d, len - 1, &t) == -EINVAL && t == NULL);
  d[len - 12] ^= 1;
  CHECK(ea_stream_open(consumer, d, len, &t) == -EINVAL);
  CHECK(Contains(ea_last_error(), "checksum"));
  CHECK(ea_stream_open(consumer, NULL, 0, &t) == -EINVAL);
  CHECK(ea_stream_open(NULL, d, len, &t) == -EINVAL);
  CHECK(ea_stream_abort(producer, "k", NULL) == 0);

  /* The longest key and dtype and the most dimensions a descriptor carries: it fits in
   * EA_STREAM_DESCRIPTOR_MAX, and one byte more of key is refused. */
  static char long_key[1026], long_dtype[1025];
  memset(long_key, 'k', 1024);
  long_key[1024] = '\0';
  memset(long_dtype, 'd', 1024);
  long_dtype[1024] = '\0';
  uint64_t dims16[16];
  for (int i = 0; i < 16; ++i) dims16[i] = 1;
  CHECK(ea_stream_put(producer, long_key, data, 1, long_dtype, dims16, 16, 1, d, sizeof d, &len) ==
        0);
  CHECK(len > 2048 && len <= EA_STREAM_DESCRIPTOR_MAX);
  CHECK(ea_stream_open(consumer, d, len, &t) == 0);
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(ea_stream_tensor_get_info(t, &info) == 0 && strlen(info.key) == 1024);
  CHECK(strlen(info.dtype) == 1024 && info.ndim == 16);
  ea_stream_release(t);
  long_key[1024] = 'k';
  long_key[1025] = '\0';
  CHECK(ea_stream_put(producer, long_key, data, 1, "u8", NULL, 0, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(Contains(ea_last_error(), "1025 bytes"));
  /* A key far too long: refused as such, not as a buffer too small for it. */
  static char huge_key[5001];
  memset(huge_key, 'h', 5000);
  huge_key[5000] = '\0';
  CHECK(ea_stream_put(producer, huge_key, data, 1, "u8", NULL, 0, 1, d, sizeof d, &len) == -EINVAL);
  CHECK(Contains(ea_last_error(), "5000 bytes"));
  CHECK(ea_stream_put(producer, huge_key, data, 1, "u8", NULL, 0, 1, NULL, 0, &len) == -ERANGE);
  CHECK(len == EA_STREAM_DESCRIPTOR_MAX);

  /* put_many: all or none, the descriptors back to back; a newer caller's wider items. */
  struct WideItem {
    ea_stream_put_item item;
    unsigned char extra[24];
  } wide[3];
  memset(wide, 0x5A, sizeof wide);
  static unsigned char src[3][300];
  const char* keys[3] = {"batch-0", "batch-1", "batch-2"};
  const uint64_t bshape[2] = {10, 30};
  for (int i = 0; i < 3; ++i) {
    Fill(src[i], 300, 40 + (uint64_t)i);
    wide[i].item.size = sizeof wide[0];
    wide[i].item.key = keys[i];
    wide[i].item.data = src[i];
    wide[i].item.bytes = 300;
    wide[i].item.dtype = i == 1 ? "i8" : NULL;
    wide[i].item.shape = bshape;
    wide[i].item.ndim = 2;
  }
  static unsigned char all[3 * EA_STREAM_DESCRIPTOR_MAX];
  size_t lens[3] = {0, 0, 0}, total = 0;
  before = Stats(producer);
  CHECK(ea_stream_put_many(producer, &wide[0].item, 3, 1, all, 100, lens, &total) == -ERANGE);
  CHECK(total > 100 && Stats(producer).live_blocks == before.live_blocks);
  CHECK(ea_stream_put_many(producer, &wide[0].item, 3, 1, all, sizeof all, lens, &total) == 0);
  CHECK(lens[0] + lens[1] + lens[2] == total && lens[0] > 16);
  CHECK(Stats(producer).live_blocks == before.live_blocks + 3);
  size_t offset = 0;
  for (int i = 0; i < 3; ++i) {
    CHECK(ea_stream_open(consumer, all + offset, lens[i], &t) == 0);
    memset(&info, 0, sizeof info);
    info.size = sizeof info;
    CHECK(ea_stream_tensor_get_info(t, &info) == 0 && strcmp(info.key, keys[i]) == 0);
    CHECK(strcmp(info.dtype, i == 1 ? "i8" : "u8") == 0 && info.ndim == 2);
    CHECK(info.shape[0] == 10 && info.shape[1] == 30);
    CHECK(info.bytes == 300 && memcmp(info.data, src[i], 300) == 0);
    ea_stream_release(t);
    offset += lens[i];
  }
  CHECK(Stats(producer).live_blocks == before.live_blocks);
  wide[1].item.key = "bad\x01";
  CHECK(ea_stream_put_many(producer, &wide[0].item, 3, 1, all, sizeof all, lens, &total) ==
        -EINVAL);
  CHECK(Contains(ea_last_error(), "item 1") && Contains(ea_last_error(), "control"));
  wide[1].item.key = keys[1];
  wide[2].item.size = sizeof(ea_stream_put_item);
  CHECK(ea_stream_put_many(producer, &wide[0].item, 3, 1, all, sizeof all, lens, &total) ==
        -EINVAL);
  CHECK(Contains(ea_last_error(), "item 2") && Contains(ea_last_error(), "differs"));
  wide[2].item.size = sizeof wide[0];
  CHECK(ea_stream_put_many(producer, &wide[0].item, 3, 0, all, sizeof all, lens, &total) ==
        -EINVAL);
  CHECK(Stats(producer).live_blocks == before.live_blocks); /* none of the failed batches */
  CHECK(ea_stream_put_many(producer, NULL, 0, 1, NULL, 0, NULL, &total) == 0 && total == 0);

  /* Lifetimes: a tensor outlives its consumer handle, a reservation its producer handle. */
  CHECK(ea_stream_put(producer, "outlives", data, sizeof data, "u8", NULL, 0, 1, d, sizeof d,
                      &len) == 0);
  CHECK(ea_stream_open(consumer, d, len, &t) == 0);
  ea_stream_consumer_destroy(consumer);
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK(ea_stream_tensor_get_info(t, &info) == 0 && strcmp(info.key, "outlives") == 0);
  CHECK(info.data != NULL && memcmp(info.data, data, sizeof data) == 0);
  CHECK(ea_stream_reserve(producer, "late", 4096, &r, &at) == 0);
  ea_stream_producer_destroy(producer);
  CHECK(CountEntries(dir) == 1); /* the reservation keeps the producer's state and segment */
  /* The unlinked segment stays mapped for the open tensor and the live reservation. */
  CHECK(info.data != NULL && memcmp(info.data, data, sizeof data) == 0);
  if (at != NULL) memset(at, 7, 4096);
  CHECK(ea_stream_reservation_get_info(r, &ri) == 0 && ri.bytes == 4096);
  ea_stream_reservation_destroy(r);
  ea_stream_release(t);
  CHECK(CountEntries(dir) == 0 && CountEntries(spill) == 0);
  ea_stream_producer_destroy(NULL);
  ea_stream_consumer_destroy(NULL);
  ea_stream_release(NULL);
}

/* Strict mode at the cap: a bounded wait, then -ENOSPC with the message; after the reader
 * releases, the same put fits. Without strict mode the tensor spills. */
static void CheckStrictAndSpill(const char* dir, const char* spill) {
  ea_stream_params p = Params(dir, spill);
  p.segment_bytes = 2 * MIB;
  p.max_segments = 1;
  p.strict = 1;
  p.strict_wait_seconds = 0.05;
  ea_stream_producer* producer = NULL;
  ea_stream_consumer* consumer = NULL;
  CHECK(ea_stream_producer_create(&p, &producer) == 0);
  CHECK(ea_stream_consumer_create(&p, &consumer) == 0);
  if (producer == NULL || consumer == NULL) return;
  unsigned char* big = malloc(1536 * 1024);
  if (big == NULL) return;
  Fill(big, 1536 * 1024, 3);
  unsigned char d[EA_STREAM_DESCRIPTOR_MAX], d2[EA_STREAM_DESCRIPTOR_MAX];
  size_t len = 0, len2 = 0;
  CHECK(ea_stream_put(producer, "first", big, 1536 * 1024, "u8", NULL, 0, 1, d, sizeof d, &len) ==
        0);
  ea_stream_tensor* t = NULL;
  CHECK(ea_stream_open(consumer, d, len, &t) == 0);
  CHECK(ea_stream_put(producer, "second", big, 1024 * 1024, "u8", NULL, 0, 1, d2, sizeof d2,
                      &len2) == -ENOSPC);
  CHECK(strlen(ea_last_error()) > 0);
  printf("capi_stream: strict at the cap: %s\n", ea_last_error());
  ea_stream_release(t);
  CHECK(ea_stream_put(producer, "second", big, 1024 * 1024, "u8", NULL, 0, 1, d2, sizeof d2,
                      &len2) == 0);
  CHECK(ea_stream_open(consumer, d2, len2, &t) == 0);
  ea_stream_release(t);
  ea_stream_producer_destroy(producer);

  /* Not strict: the tensor that does not fit spills, and opens the same way. */
  p.strict = 0;
  CHECK(ea_stream_producer_create(&p, &producer) == 0);
  if (producer != NULL) {
    CHECK(ea_stream_put(producer, "first", big, 1536 * 1024, "u8", NULL, 0, 1, d, sizeof d, &len) ==
          0);
    CHECK(ea_stream_open(consumer, d, len, &t) == 0);
    ea_stream_tensor* s = NULL;
    CHECK(ea_stream_put(producer, "spilled", big, 1024 * 1024, "u8", NULL, 0, 1, d2, sizeof d2,
                        &len2) == 0);
    CHECK(Stats(producer).spills == 1 && CountEntries(spill) == 1);
    CHECK(ea_stream_open(consumer, d2, len2, &s) == 0);
    ea_stream_tensor_info info;
    memset(&info, 0, sizeof info);
    info.size = sizeof info;
    CHECK(ea_stream_tensor_get_info(s, &info) == 0 && info.spilled == 1);
    CHECK(info.bytes == 1024 * 1024 && memcmp(info.data, big, 1024 * 1024) == 0);
    ea_stream_release(s);
    ea_stream_release(t);
    ea_stream_producer_destroy(producer);
  }
  ea_stream_consumer_destroy(consumer);
  free(big);
  CHECK(CountEntries(dir) == 0 && CountEntries(spill) == 0);
}

/* Threads: one producer and one consumer shared by four threads that put, open and release
 * at once, each checking its own bytes and its own thread's error message. */
typedef struct ThreadJob {
  ea_stream_producer* producer;
  ea_stream_consumer* consumer;
  int index;
  int failures;
} ThreadJob;

static void* ThreadRounds(void* arg) {
  ThreadJob* job = arg;
  unsigned char data[3000], d[EA_STREAM_DESCRIPTOR_MAX];
  for (int round = 0; round < 200; ++round) {
    char key[64];
    snprintf(key, sizeof key, "thread-%d-%d", job->index, round);
    size_t n = 100 + (size_t)((job->index * 7 + round * 13) % 2900);
    Fill(data, n, (uint64_t)(job->index * 1000 + round));
    size_t len = 0;
    ea_stream_tensor* t = NULL;
    if (ea_stream_put(job->producer, key, data, n, "u8", NULL, 0, 1, d, sizeof d, &len) != 0 ||
        ea_stream_open(job->consumer, d, len, &t) != 0) {
      ++job->failures;
      continue;
    }
    ea_stream_tensor_info info;
    memset(&info, 0, sizeof info);
    info.size = sizeof info;
    if (ea_stream_tensor_get_info(t, &info) != 0 || info.bytes != n ||
        memcmp(info.data, data, n) != 0 || strcmp(info.key, key) != 0) {
      ++job->failures;
    }
    ea_stream_release(t);
    /* This thread's own failure and message, whatever the others do meanwhile. */
    char bad[64];
    snprintf(bad, sizeof bad, "bad\x01%d", job->index);
    if (ea_stream_put(job->producer, bad, data, 1, "u8", NULL, 0, 1, d, sizeof d, &len) !=
            -EINVAL ||
        strstr(ea_last_error(), "control") == NULL) {
      ++job->failures;
    }
  }
  return NULL;
}

static void CheckThreads(const char* dir) {
  ea_stream_params p = Params(dir, NULL);
  ea_stream_producer* producer = NULL;
  ea_stream_consumer* consumer = NULL;
  CHECK(ea_stream_producer_create(&p, &producer) == 0);
  CHECK(ea_stream_consumer_create(&p, &consumer) == 0);
  if (producer == NULL || consumer == NULL) return;
  ThreadJob jobs[4];
  pthread_t threads[4];
  for (int i = 0; i < 4; ++i) {
    jobs[i] = (ThreadJob){producer, consumer, i, 0};
    CHECK(pthread_create(&threads[i], NULL, ThreadRounds, &jobs[i]) == 0);
  }
  for (int i = 0; i < 4; ++i) {
    pthread_join(threads[i], NULL);
    CHECK(jobs[i].failures == 0);
  }
  CHECK(Stats(producer).live_blocks == 0);
  ea_stream_consumer_destroy(consumer);
  ea_stream_producer_destroy(producer);
  CHECK(CountEntries(dir) == 0);
}

/* Real processes: a C consumer child reads what this process puts; this process reads what a
 * C producer child puts, and keeps reading a tensor after that producer exited; a killed
 * producer's segments are swept. */
static void CheckProcesses(const char* self, const char* dir) {
  /* This process produces, a child consumes. */
  ea_stream_params p = Params(dir, NULL);
  ea_stream_producer* producer = NULL;
  CHECK(ea_stream_producer_create(&p, &producer) == 0);
  Peer consumer;
  if (producer != NULL && StartPeer(self, "consume", dir, &consumer) == 0) {
    char* text = NULL;
    size_t text_len = 0;
    FILE* lines = open_memstream(&text, &text_len);
    CHECK(ProduceInto(producer, lines) == 0);
    fclose(lines);
    CHECK(Stats(producer).live_blocks == CASE_COUNT);
    /* Every descriptor to the child, then compare its report with ours. */
    Row* rows = calloc(CASE_COUNT, sizeof(Row));
    size_t n = 0;
    for (char* line = strtok(text, "\n"); line != NULL && n < CASE_COUNT;
         line = strtok(NULL, "\n")) {
      if (ParseRow(line, &rows[n])) fprintf(consumer.in, "%s\n", rows[n++].hex);
    }
    CHECK(n == CASE_COUNT);
    fclose(consumer.in);
    consumer.in = NULL;
    char got[512];
    size_t seen = 0;
    while (fgets(got, sizeof got, consumer.out) != NULL && seen < n) {
      char expect[512];
      snprintf(expect, sizeof expect, "%s %s %s %s\n", rows[seen].key, rows[seen].dtype,
               rows[seen].shape, rows[seen].xxh);
      CHECK(strcmp(got, expect) == 0);
      if (strcmp(got, expect) != 0) fprintf(stderr, "got %sexpected %s", got, expect);
      ++seen;
    }
    CHECK(seen == CASE_COUNT);
    CHECK(WaitPeer(&consumer) == 0);
    /* The child released each tensor: the space is back without a word from it. */
    CHECK(Stats(producer).live_blocks == 0);
    free(rows);
    free(text);
  } else {
    CHECK(!"consumer child started");
  }
  ea_stream_producer_destroy(producer);
  CHECK(CountEntries(dir) == 0);

  /* A child produces, this process consumes. */
  Peer prod;
  ea_stream_consumer* consumer2 = NULL;
  CHECK(ea_stream_consumer_create(&p, &consumer2) == 0);
  if (consumer2 != NULL && StartPeer(self, "produce", dir, &prod) == 0) {
    char line[2 * EA_STREAM_DESCRIPTOR_MAX + 512];
    Row row;
    char kept_xxh[32] = "";
    size_t n = 0;
    ea_stream_tensor* kept = NULL;
    while (fgets(line, sizeof line, prod.out) != NULL && strcmp(line, "ready\n") != 0) {
      CHECK(ParseRow(line, &row));
      if (n == 0) {
        /* Held across the producer's exit. */
        unsigned char d[EA_STREAM_DESCRIPTOR_MAX];
        size_t len = Unhex(row.hex, d, sizeof d);
        CHECK(ea_stream_open(consumer2, d, len, &kept) == 0);
        snprintf(kept_xxh, sizeof kept_xxh, "%s", row.xxh);
      } else {
        char got[512], expect[512];
        FILE* out = fmemopen(got, sizeof got, "w");
        CHECK(ConsumeLine(consumer2, row.hex, out) == 0);
        fclose(out);
        snprintf(expect, sizeof expect, "%s %s %s %s\n", row.key, row.dtype, row.shape, row.xxh);
        CHECK(strcmp(got, expect) == 0);
      }
      ++n;
    }
    CHECK(n == CASE_COUNT);
    CHECK(WaitPeer(&prod) == 0);
    CHECK(CountEntries(dir) == 0); /* the producer unlinked its segments at exit */
    if (kept != NULL) {
      ea_stream_tensor_info info;
      memset(&info, 0, sizeof info);
      info.size = sizeof info;
      CHECK(ea_stream_tensor_get_info(kept, &info) == 0);
      char xxh[32];
      snprintf(xxh, sizeof xxh, "%016llx",
               (unsigned long long)XXH3_64bits(info.data, (size_t)info.bytes));
      CHECK(strcmp(xxh, kept_xxh) == 0); /* still mapped, still the producer's bytes */
      ea_stream_release(kept);
    }
  } else {
    CHECK(!"producer child started");
  }
  ea_stream_consumer_destroy(consumer2);

  /* A killed producer: its segments stay until a sweep, which removes them. */
  Peer doomed;
  if (StartPeer(self, "produce", dir, &doomed) == 0) {
    char line[2 * EA_STREAM_DESCRIPTOR_MAX + 512];
    int ready = 0;
    while (fgets(line, sizeof line, doomed.out) != NULL) {
      if (strcmp(line, "ready\n") == 0) {
        ready = 1;
        break;
      }
    }
    CHECK(ready);
    size_t removed = 99, live = 99;
    CHECK(ea_stream_sweep(dir, &removed, &live) == 0 && removed == 0 && live >= 1);
    kill(doomed.pid, SIGKILL);
    CHECK(WaitPeer(&doomed) == 128 + SIGKILL);
    CHECK(CountEntries(dir) >= 1);
    CHECK(ea_stream_sweep(dir, &removed, &live) == 0 && removed >= 1 && live == 0);
    CHECK(CountEntries(dir) == 0);
  } else {
    CHECK(!"killed producer started");
  }
  CHECK(ea_stream_sweep("/nonexistent-ea-dir", NULL, NULL) < 0);
  CHECK(Contains(ea_last_error(), "/nonexistent-ea-dir"));
  CHECK(ea_stream_sweep(NULL, NULL, NULL) == -EINVAL);
}

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc == 3 && strcmp(argv[1], "produce") == 0) return Produce(argv[2]);
  if (argc == 3 && strcmp(argv[1], "consume") == 0) return Consume(argv[2]);
  /* One group of checks per run (each its own test in capi_test.cc), or "all". */
  static const char* const kGroups[] = {"params", "put-open-reserve", "pending-fork",
                                        "strict-spill", "threads", "processes", "all"};
  int known = 0;
  for (size_t i = 0; argc == 5 && i < sizeof kGroups / sizeof kGroups[0]; ++i) {
    if (strcmp(argv[2], kGroups[i]) == 0) known = 1;
  }
  if (argc != 5 || strcmp(argv[1], "check") != 0 || !known) {
    fprintf(stderr,
            "usage: %s check params|put-open-reserve|pending-fork|strict-spill|threads|"
            "processes|all DIR SPILL_DIR | produce DIR | consume DIR\n",
            argv[0]);
    return 2;
  }
  const char* group = argv[2];
  const char* dir = argv[3];
  const char* spill = argv[4];
  if (CountEntries(dir) != 0 || CountEntries(spill) != 0) {
    fprintf(stderr, "%s and %s must be empty directories\n", dir, spill);
    return 2;
  }
#define GROUP(name) (strcmp(group, name) == 0 || strcmp(group, "all") == 0)
  if (GROUP("params")) CheckParamsAndSizes(dir);
  if (GROUP("put-open-reserve")) CheckPutOpenReserve(dir, spill);
  if (GROUP("pending-fork")) CheckPendingAndFork(dir, spill);
  if (GROUP("strict-spill")) CheckStrictAndSpill(dir, spill);
  if (GROUP("threads")) CheckThreads(dir);
  if (GROUP("processes")) CheckProcesses(argv[0], dir);
#undef GROUP
  CHECK(CountEntries(dir) == 0 && CountEntries(spill) == 0);
  if (failures == 0) printf("capi_stream: all checks of %s passed\n", group);
  return failures == 0 ? 0 : 1;
}
