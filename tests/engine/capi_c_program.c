/* A C engine's use of expert-arena: only expert_arena.h and libexpert_arena.so.
 * Usage: capi_c_program MODEL_FILE ARENA_PATH
 *        capi_c_program --refused FILE ARENA_PATH WORDS
 * MODEL_FILE is a raw data file, opened with EA_FORMAT_RAW (one tensor of dtype u8, the whole
 * file). Exercises the refusal of that file without EA_FORMAT_RAW, a private arena, a shared
 * one (loaded), a second handle attached to it, lookups, errors and the struct-size rules.
 * --refused opens FILE (not a model) into the shared ARENA_PATH with the default format and
 * checks the refusal: a negative errno, a message naming FILE and holding WORDS, no file
 * left at ARENA_PATH. Exit 0 when every check passes; each failure is printed. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_check.h"
#include "expert_arena/expert_arena.h"

static unsigned char* ReadFile(const char* path, size_t* size) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char* buf = malloc((size_t)n);
  if (buf != NULL && fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  *size = (size_t)n;
  return buf;
}

/* The arena's single tensor must hold exactly the file's bytes. */
static void CheckContents(ea_arena* arena, const unsigned char* expected, size_t size) {
  ea_tensor_view view;
  memset(&view, 0, sizeof view);
  view.size = sizeof view;
  CHECK(ea_arena_tensor_count(arena) == 1);
  CHECK(ea_arena_tensor(arena, 0, &view) == 0);
  CHECK(view.bytes == size);
  CHECK(view.ndim == 1 && view.shape != NULL && view.shape[0] == size);
  CHECK(view.dtype != NULL && strcmp(view.dtype, "u8") == 0);
  CHECK(view.data != NULL && memcmp(view.data, expected, size) == 0);
  CHECK(view.checksum != 0);

  ea_tensor_view by_name;
  memset(&by_name, 0, sizeof by_name);
  by_name.size = sizeof by_name;
  CHECK(ea_arena_find(arena, view.name, &by_name) == 0);
  CHECK(by_name.data == view.data && by_name.checksum == view.checksum);
}

static int PathExists(const char* path) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) return 0;
  fclose(f);
  return 1;
}

/* A file that is not a model, opened as an engine would (default format, shared arena). */
static int CheckRefused(const char* file, const char* arena_path, const char* words) {
  ea_open_params p;
  ea_open_params_init(&p);
  const char* files[1] = {file};
  p.model_files = files;
  p.model_file_count = 1;
  p.shared_path = arena_path;
  p.quiet = 1;
  ea_arena* arena = (ea_arena*)1;
  int rc = ea_arena_open(&p, &arena);
  CHECK(rc == -EINVAL || rc == -EBADMSG);
  CHECK(arena == NULL);
  CHECK(strstr(ea_last_error(), file) != NULL);
  CHECK(strstr(ea_last_error(), words) != NULL);
  CHECK(!PathExists(arena_path));
  if (arena != NULL && arena != (ea_arena*)1) ea_arena_close(arena);
  printf("capi: refused: %s\n", ea_last_error());
  if (failures == 0) printf("capi: all checks passed\n");
  return failures == 0 ? 0 : 1;
}

/* An engine-made arena from C: the engine declares two tensors and fills them; prints
 * "role loaded" or "role attached" and how many times declare and fill ran. */
static const uint64_t kW13Shape[] = {4, 8, 16};
static const uint64_t kScaleShape[] = {3};
/* A tensor as a program built against a later header declares it: the struct grew fields
 * after those of this version, and size says so. */
struct GrownTensor {
  ea_engine_tensor base;
  uint64_t later_flags;
  const char* later_note;
};
struct EngineState {
  int declared, filled, fail, grown;
  ea_engine_tensor tensors[2];
  struct GrownTensor grown_tensors[2];
};

static int Declare(void* user, const ea_engine_tensor** tensors, size_t* count) {
  struct EngineState* s = (struct EngineState*)user;
  ++s->declared;
  if (s->fail) return -ENOMEM;
  memset(s->tensors, 0, sizeof s->tensors);
  s->tensors[0].size = sizeof s->tensors[0];
  s->tensors[0].name = "layers.0.w13";
  s->tensors[0].dtype = "BF16";
  s->tensors[0].shape = kW13Shape;
  s->tensors[0].ndim = 3;
  s->tensors[0].bytes = 4 * 8 * 16 * 2;
  s->tensors[1].size = sizeof s->tensors[1];
  s->tensors[1].name = "layers.0.scale";
  s->tensors[1].dtype = "F32";
  s->tensors[1].shape = kScaleShape;
  s->tensors[1].ndim = 1;
  s->tensors[1].bytes = 12;
  s->tensors[1].alignment = 64;
  *tensors = s->tensors;
  *count = 2;
  if (s->grown) {
    /* The same two tensors in the larger struct; the library must step by base.size. */
    memset(s->grown_tensors, 0, sizeof s->grown_tensors);
    for (int i = 0; i < 2; ++i) {
      s->grown_tensors[i].base = s->tensors[i];
      s->grown_tensors[i].base.size = sizeof s->grown_tensors[i];
      s->grown_tensors[i].later_flags = 0xF5F5F5F5F5F5F5F5ull;
      s->grown_tensors[i].later_note = "a field this library does not know";
    }
    *tensors = &s->grown_tensors[0].base;
  }
  return 0;
}

static int Fill(void* user, const ea_writable_tensor* tensors, size_t count) {
  struct EngineState* s = (struct EngineState*)user;
  ++s->filled;
  for (size_t i = 0; i < count; ++i) memset(tensors[i].data, (int)(0x40 + i), tensors[i].bytes);
  return 0;
}

static int CheckEngine(const char* arena_path, const char* checkpoint, int fail, int grown) {
  ea_open_params p;
  ea_open_params_init(&p);
  p.shared_path = arena_path;
  p.quiet = 1;
  ea_engine_params e;
  ea_engine_params_init(&e);
  CHECK(e.size == sizeof e && e.alignment == 4096);
  struct EngineState state;
  memset(&state, 0, sizeof state);
  state.fail = fail;
  state.grown = grown;
  const char* files[] = {checkpoint};
  e.identity = "c-engine 1 bf16 tp0/1";
  e.files = files;
  e.file_count = 1;
  e.declare = Declare;
  e.fill = Fill;
  e.user = &state;
  ea_arena* arena = NULL;
  int rc = ea_arena_open_engine(&p, &e, &arena);
  if (fail) {
    CHECK(rc < 0);
    CHECK(arena == NULL);
    CHECK(strstr(ea_last_error(), "declare: returned -12 (Cannot allocate memory)") != NULL);
    CHECK(!PathExists(arena_path));
    if (failures == 0) printf("all checks passed\n");
    return failures == 0 ? 0 : 1;
  }
  CHECK(rc == 0);
  if (arena == NULL) return 1;
  ea_arena_info info;
  info.size = sizeof info;
  CHECK(ea_arena_get_info(arena, &info) == 0);
  ea_tensor_view v;
  v.size = sizeof v;
  CHECK(ea_arena_find(arena, "layers.0.w13", &v) == 0);
  CHECK(v.bytes == 4 * 8 * 16 * 2 && v.ndim == 3 && v.shape[1] == 8 && strcmp(v.dtype, "BF16") == 0);
  CHECK(((const unsigned char*)v.data)[0] == 0x40 && v.checksum != 0);
  CHECK(ea_arena_find(arena, "layers.0.scale", &v) == 0);
  CHECK(((const unsigned char*)v.data)[11] == 0x41 && v.file_offset % 64 == 0);
  printf("role %s declared %d filled %d\n", info.role == EA_ROLE_LOADED ? "loaded" : "attached",
         state.declared, state.filled);
  ea_arena_close(arena);
  if (failures == 0) printf("all checks passed\n");
  return failures == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc == 5 && strcmp(argv[1], "--refused") == 0) {
    return CheckRefused(argv[2], argv[3], argv[4]);
  }
  if (argc == 4 && (strcmp(argv[1], "--engine") == 0 || strcmp(argv[1], "--engine-fail") == 0 ||
                    strcmp(argv[1], "--engine-grown") == 0)) {
    return CheckEngine(argv[2], argv[3], strcmp(argv[1], "--engine-fail") == 0,
                       strcmp(argv[1], "--engine-grown") == 0);
  }
  if (argc != 3) {
    fprintf(stderr, "usage: %s MODEL_FILE ARENA_PATH | --refused FILE ARENA_PATH WORDS\n", argv[0]);
    return 2;
  }
  const char* model = argv[1];
  const char* arena_path = argv[2];
  size_t size = 0;
  unsigned char* expected = ReadFile(model, &size);
  if (expected == NULL) {
    fprintf(stderr, "cannot read %s\n", model);
    return 2;
  }
  CHECK(ea_version() != NULL && strlen(ea_version()) > 0);

  /* Errors: 0/-errno with a message. */
  ea_open_params p;
  ea_open_params_init(&p);
  CHECK(p.size == sizeof p && p.wait_timeout_seconds > 0 && p.file_mode == 0600);
  ea_arena* arena = (ea_arena*)1;
  CHECK(ea_arena_open(&p, &arena) == -EINVAL);
  CHECK(arena == NULL);
  CHECK(strlen(ea_last_error()) > 0);
  p.attach_only = 1;
  p.quiet = 1;
  p.shared_path = "/nonexistent-dir/ea-capi.arena";
  CHECK(ea_arena_open(&p, &arena) < 0);
  CHECK(strstr(ea_last_error(), "/nonexistent-dir") != NULL);
  ea_open_params tiny = p;
  tiny.size = 8;
  CHECK(ea_arena_open(&tiny, &arena) == -EINVAL);

  /* A program built against an older, smaller struct: the init writes its bytes only (the
   * defaults within them), never past them. */
  union {
    ea_open_params params;
    unsigned char bytes[sizeof(ea_open_params) + 16];
  } older_struct;
  memset(&older_struct, 0xAB, sizeof older_struct);
  const size_t older_size = offsetof(ea_open_params, format);
  ea_open_params_init_sized(&older_struct.params, older_size);
  CHECK(older_struct.params.size == older_size);
  CHECK(older_struct.params.wait_timeout_seconds == 600.0 && older_struct.params.quiet == 0);
  for (size_t i = older_size; i < sizeof older_struct.bytes; ++i) {
    CHECK(older_struct.bytes[i] == 0xAB);
  }
  ea_open_params_init_sized(NULL, sizeof p); /* ignored */

  /* A data file is not a model: refused unless raw bytes are asked for, also by an older
   * caller whose struct ends before `format`, and an unknown format is refused. */
  const char* files[1] = {model};
  ea_open_params_init(&p);
  p.model_files = files;
  p.model_file_count = 1;
  p.quiet = 1;
  CHECK(p.format == EA_FORMAT_AUTO);
  CHECK(ea_arena_open(&p, &arena) == -EINVAL && arena == NULL);
  CHECK(strstr(ea_last_error(), model) != NULL);
  CHECK(strstr(ea_last_error(), "not a GGUF, safetensors or safetensors index file") != NULL);
  CHECK(strstr(ea_last_error(), "(format = EA_FORMAT_RAW)") != NULL);
  CHECK(strstr(ea_last_error(), "--format") == NULL);
  ea_open_params older_params = p;
  older_params.size = offsetof(ea_open_params, format);
  older_params.format = EA_FORMAT_RAW; /* beyond its size: not read */
  CHECK(ea_arena_open(&older_params, &arena) == -EINVAL && arena == NULL);
  p.format = 99;
  CHECK(ea_arena_open(&p, &arena) == -EINVAL && arena == NULL);
  CHECK(strstr(ea_last_error(), "format 99") != NULL);

  /* The fields added after format: defaults from init, each read and checked. */
  p.format = EA_FORMAT_RAW;
  CHECK(p.alignment == 4096 && p.peer_stall_seconds == 30.0 && p.pin_budget_bytes == 0);
  CHECK(p.reader == NULL && p.peer_transport == NULL);
  p.reader = "mmap";
  CHECK(ea_arena_open(&p, &arena) == -EINVAL && arena == NULL);
  CHECK(strstr(ea_last_error(), "reader must be auto, io_uring or pread") != NULL);
  p.reader = "pread";
  p.peer_transport = "rdma";
  CHECK(ea_arena_open(&p, &arena) == -EINVAL && arena == NULL);
  CHECK(strstr(ea_last_error(), "peer_transport must be auto, am or get") != NULL);
  p.peer_transport = NULL;
  p.gpu = "cuda:first";
  CHECK(ea_arena_open(&p, &arena) == -EINVAL && arena == NULL);
  CHECK(strstr(ea_last_error(), "gpu: GPU device \"cuda:first\"") != NULL);
  p.gpu = NULL;
  p.alignment = 3000;
  CHECK(ea_arena_open(&p, &arena) == -EINVAL && arena == NULL);
  CHECK(strstr(ea_last_error(), "power of two") != NULL);
  p.alignment = 4096;

  /* A private arena. */
  CHECK(ea_arena_open(&p, &arena) == 0);
  if (arena != NULL) {
    ea_arena_info info;
    memset(&info, 0, sizeof info);
    info.size = sizeof info;
    CHECK(ea_arena_get_info(arena, &info) == 0);
    CHECK(info.role == EA_ROLE_PRIVATE);
    CHECK(info.tensor_count == 1 && info.tensor_bytes == size);
    CHECK(info.start_line != NULL && strlen(info.start_line) > 0);
    CheckContents(arena, expected, size);
    ea_arena_close(arena);
  }

  /* A shared arena: this handle loads it, a second one attaches without the model. */
  p.shared_path = arena_path;
  ea_arena* loaded = NULL;
  CHECK(ea_arena_open(&p, &loaded) == 0);
  ea_open_params attach;
  ea_open_params_init(&attach);
  attach.shared_path = arena_path;
  attach.attach_only = 1;
  attach.quiet = 1;
  ea_arena* attached = NULL;
  CHECK(ea_arena_open(&attach, &attached) == 0);
  if (loaded != NULL && attached != NULL) {
    ea_arena_info a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    a.size = sizeof a;
    b.size = sizeof b;
    CHECK(ea_arena_get_info(loaded, &a) == 0 && a.role == EA_ROLE_LOADED);
    CHECK(ea_arena_get_info(attached, &b) == 0 && b.role == EA_ROLE_ATTACHED);
    CHECK(strcmp(b.path, arena_path) == 0 && b.identity_hash == a.identity_hash);
    CHECK(b.bytes_read == 0);
    CheckContents(loaded, expected, size);
    CheckContents(attached, expected, size);

    ea_tensor_view v;
    memset(&v, 0, sizeof v);
    v.size = sizeof v;
    CHECK(ea_arena_find(attached, "no-such-tensor", &v) == -ENOENT);
    CHECK(strstr(ea_last_error(), "no-such-tensor") != NULL);
    CHECK(ea_arena_tensor(attached, 1, &v) == -ERANGE);
    CHECK(ea_arena_tensor(NULL, 0, &v) == -EINVAL);
    v.size = 4;
    CHECK(ea_arena_tensor(attached, 0, &v) == -EINVAL);

    /* An older caller's struct (without the last field) gets the fields it knows. */
    ea_tensor_view older;
    memset(&older, 0xab, sizeof older);
    older.size = offsetof(ea_tensor_view, checksum) + sizeof(uint64_t);
    CHECK(ea_arena_tensor(attached, 0, &older) == 0);
    CHECK(older.bytes == size && older.size == offsetof(ea_tensor_view, checksum) + 8);
  }
  ea_arena_close(attached);
  ea_arena_close(loaded);
  ea_arena_close(NULL);
  CHECK(ea_arena_tensor_count(NULL) == 0);
  free(expected);
  if (failures == 0) printf("capi: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
