// The engine-facing API: one call gives an arena of a model's expert tensors.
//
//   expert_arena::ArenaOptions options;
//   options.shared_path = "/dev/shm/my-model.arena";   // empty: a private arena
//   auto arena = expert_arena::Arena::Open({.files = {"model.gguf"}}, options);
//   if (!arena.ok()) { print arena.status().ToString(); }
//   auto view = arena->Find("blk.0.ffn_up_exps.weight");
//
// With a shared path, the first engine loads the selected tensors into a file on tmpfs or
// hugetlbfs and every other engine (now, or after a restart) attaches to it without reading
// the model; see docs/arena-protocol.md. Without one, the same tensors are
// loaded into private memory with the same page rules and the same views.
//
// Thread-safety: an Arena is move-only; its views are read-only and may be used from any
// thread while the Arena lives. Destroying the Arena unregisters it from the GPU, unmaps it
// and drops this engine's USER lock; a shared file stays for the next engine.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/export.h"
#include "expert_arena/gpu_device.h"
#include "expert_arena/status.h"

namespace spdlog {
class logger;
}

namespace expert_arena {

// Whether the loader asks the kernel for 2 MiB pages on tmpfs or anonymous memory.
// kAuto asks only when free 2 MiB blocks could back at least half of the arena.
// hugetlbfs pages are reserved by the filesystem whatever this says.
enum class HugePages { kAuto, kOn, kOff };

// Where a shared arena's pages live on a host with several NUMA nodes (docs/numa.md), whoever
// touches them first. On a one-node host every choice is the same first touch.
enum class NumaPlacement {
  kAuto,        // interleave where this process may use several nodes and the kernel lets it
                // set the policy (a container without CAP_SYS_NICE may not); otherwise local
  kLocal,       // first touch: the pages land on the node of the loader's threads
  kInterleave,  // spread over every node this process may use (its cpuset's mems)
  kNode,        // bound to ArenaOptions::numa_node; refused when that node lacks the room
  kReplicate,   // one arena per node (the node in the path: m.arena -> m.node1.arena, bound
                // there), each engine attaching to its own node's: the node of the GPU it
                // registers with (its PCI slot's), else of its CPU affinity
};

// Parses "auto", "local", "interleave", "node:N" or "replicate" into *placement and *node (N,
// or -1); kInvalidArgument naming the accepted forms otherwise.
EXPERT_ARENA_EXPORT Status ParseNumaPlacement(std::string_view text, NumaPlacement* placement,
                                              int* node);
// "auto", "local", "interleave", "node:1", "replicate".
EXPERT_ARENA_EXPORT std::string NumaPlacementName(NumaPlacement placement, int node);

// How the model's files are read. kAuto recognises GGUF, safetensors and a safetensors
// index from their first bytes and refuses anything else with a message that says what the
// file looks like (empty, a Git LFS pointer, an HTML page, a damaged header). kRaw is never
// guessed: asked for, it loads each file's bytes as one tensor of dtype "u8" named after
// the file (test data, benchmarks).
enum class ModelFormat { kAuto, kGguf, kSafetensors, kRaw };
EXPERT_ARENA_EXPORT const char* ModelFormatName(ModelFormat format);

// How a loader reads the model's files: kAuto uses io_uring (O_DIRECT where the file system
// allows it) and falls back to pread, saying why, where the kernel or a container refuses it.
enum class ModelReader { kAuto, kIoUring, kPread };
// "auto", "io_uring", "pread".
EXPERT_ARENA_EXPORT const char* ModelReaderName(ModelReader reader);
// The inverse of ModelReaderName; kInvalidArgument naming the accepted words otherwise.
EXPERT_ARENA_EXPORT Result<ModelReader> ParseModelReader(std::string_view text);

// How a peer's bytes may cross (docs/cross-host.md): kAuto takes what the server offers; kAm
// only ranges the server checks and sends (a get server is refused); kGet the peer's memory
// read directly.
enum class PeerTransport { kAuto, kAm, kGet };
// "auto", "am", "get".
EXPERT_ARENA_EXPORT const char* PeerTransportName(PeerTransport transport);
// The inverse of PeerTransportName; kInvalidArgument naming the accepted words otherwise.
EXPERT_ARENA_EXPORT Result<PeerTransport> ParsePeerTransport(std::string_view text);

// Whose words a message uses for the options it names: the C++ fields, the C params
// (ea_open_params), the CLI's flags or Python's keywords.
enum class OptionWords { kCpp, kC, kCli, kPython };

// Which model and which of its tensors.
struct ModelSpec {
  // One file, several safetensors shards, a split GGUF, or a safetensors index .json.
  std::vector<std::string> files;
  // How to read them; kAuto by the contents (see ModelFormat).
  ModelFormat format = ModelFormat::kAuto;
  // Tensors whose names match this ECMAScript regex (search). Empty: the routed experts.
  std::string select;
  bool select_all = false;
  // Alignment of every tensor in the arena (a power of two, at most 2 MiB). A tensor smaller
  // than this is aligned to the smallest power of two holding it, at least 64 bytes.
  uint64_t alignment = 4096;
  // How messages about this spec name its options (the front ends set theirs).
  OptionWords words = OptionWords::kCpp;
};

struct ArenaOptions {
  // The shared arena file (on tmpfs or hugetlbfs). Empty: a private arena.
  std::string shared_path;
  HugePages huge = HugePages::kAuto;
  // Where a loader puts the pages (an attacher finds them where the loader put them).
  // Checked when the arena is opened: a node this process may not use is an error.
  NumaPlacement numa = NumaPlacement::kAuto;
  int numa_node = -1;  // for NumaPlacement::kNode
  // How long to wait for another engine that is loading the same file; infinity (or any
  // value too large for the clock) waits without a limit. Negative or NaN is refused.
  double wait_timeout_seconds = 600.0;
  // Mode of a file this engine creates; 0600 unless the operator asks for group access. Only
  // read and write bits (0666) are taken: setuid, setgid, sticky and execute bits are refused
  // (an arena holds data any engine writes through a mapping, never a program). Write for
  // every user (0002) is refused unless allow_world_writable.
  mode_t file_mode = 0600;
  // Create an arena file any user may write (file_mode with 0002), and attach to such a file.
  // Off by default: any process of any user could then change the bytes every engine reads.
  bool allow_world_writable = false;
  // Attach to a file owned by another user (refused by default).
  bool allow_foreign_owner = false;
  // Register the arena with this device (none by default; ParseGpuDevice reads "cuda:1").
  GpuDevice gpu;
  // Fail when the GPU registration fails (by default it is reported and skipped).
  bool gpu_required = false;
  // Upper bound on bytes this process pins for the arena; 0 means no bound.
  uint64_t pin_budget_bytes = 0;
  ModelReader reader = ModelReader::kAuto;
  // On a 4 KiB tmpfs (plain /dev/shm), make the file's 2 MiB pages in the background, front to
  // back, while the loader fills the pieces already made; false: all pages first, then the
  // load (what load_bench compares).
  bool pages_alongside_load = true;
  // Progress of long loads: a line redrawn on stderr when it is a terminal, or an info message
  // every 10 s through `logger` when the engine gives one.
  bool progress = true;
  // The logger for the start line and notes; null uses the "expert_arena" logger.
  std::shared_ptr<spdlog::logger> logger;
  // HOST:PORT of a peer serving this model's arena (`expert-arena serve`): a loader fills the
  // arena from the peer over UCX instead of reading the model files, checking every tensor's
  // checksum as it lands (docs/cross-host.md). Without model files the peer's table is used;
  // with them their layout must be the peer's. If the fill fails nothing is published and the
  // model files, when given, are read instead (the start line says so).
  std::string from_peer;
  // The peer's shared token. Without one the fill is refused (the model files, when given, are
  // read instead) unless peer_allow_no_token: with no token nothing proves who answers at
  // from_peer, and this process's UCX would take a worker address of that stranger's choice.
  std::string peer_token;
  // The longest wait for the peer (connect, answer, next chunk) before the fill is abandoned.
  double peer_stall_seconds = 30.0;
  // How the peer's bytes may cross (see PeerTransport).
  PeerTransport peer_transport = PeerTransport::kAuto;
  // Fill from a peer without a token (a trusted private network only; docs/cross-host.md).
  bool peer_allow_no_token = false;
};

// What the arena costs this process, from /proc/self/smaps of its mappings (Arena::Memory;
// docs/deployment.md, "Memory per engine"). RSS counts a page once per mapping and per process
// that maps it, so N engines show N times the arena; Pss shares each page among its mappings,
// so the engines' Pss sums to the arena's resident size once.
struct ArenaMemory {
  uint64_t rss_bytes = 0;      // resident pages of this process's mappings of the arena
  uint64_t pss_bytes = 0;      // this process's proportional share of them
  uint64_t shared_bytes = 0;   // of pss_bytes, the arena's own pages (pss minus private_bytes)
  uint64_t private_bytes = 0;  // pages only this process holds: copies a write made
  uint64_t mappings = 0;       // 1, or 2 once CopyOnWriteData made the views' mapping
};

enum class ArenaRole { kLoaded, kAttached, kPrivate };
EXPERT_ARENA_EXPORT const char* ArenaRoleName(ArenaRole role);

// One tensor in the arena. Views stay valid while the Arena lives.
struct TensorView {
  std::string_view name;
  std::string_view dtype;
  std::span<const uint64_t> shape;
  std::span<const std::byte> bytes;
  uint64_t file_offset = 0;  // absolute offset in the arena file (0 for a private arena)
  uint64_t checksum = 0;     // xxh3-64 of the bytes
};

// What happened when the arena was opened: the facts of the start line.
// A kernel feature newer than the floor (Linux 4.18) that this kernel lacks, and what doing
// without it cost while the arena was opened (docs/kernels.md).
struct KernelFallbackReport {
  std::string feature;   // e.g. "MADV_POPULATE_READ/WRITE"
  std::string since;     // the first kernel with it, e.g. "5.14"
  std::string answer;    // what this kernel answered, e.g. "EINVAL"
  std::string fallback;  // what is done instead
  bool used = false;     // the fallback ran during Open
  double seconds = 0;    // time spent in it during Open (0 where not measured)
  uint64_t bytes = 0;    // bytes it covered during Open
};

// Bytes of this process's mapping of the arena on one NUMA node (from /proc/self/numa_maps).
struct NumaNodeBytes {
  int node = 0;
  uint64_t bytes = 0;
};

struct ArenaReport {
  ArenaRole role = ArenaRole::kPrivate;
  std::string path;      // the shared file, empty when private
  std::string backing;   // "tmpfs", "hugetlbfs", "anonymous", "other"
  std::string identity;  // identity text of the model
  uint64_t identity_hash = 0;
  uint64_t data_bytes = 0;    // bytes of the data region
  uint64_t tensor_bytes = 0;  // bytes of the selected tensors
  uint64_t tensors = 0;
  uint64_t model_tensors = 0;  // tensors in the model, selected or not
  uint64_t model_tensor_bytes = 0;
  uint64_t mapped_bytes = 0;  // bytes this process maps (header pages + data)
  uint64_t huge_bytes = 0;    // bytes of this mapping on 2 MiB pages, read from the page tables
  uint64_t bytes_read = 0;    // model bytes this process read (headers included)
  double seconds = 0;         // from Open() to ready
  double load_seconds = 0;    // reading tensors (loaders only)
  double wait_seconds = 0;    // waiting for another engine's load
  double collapse_seconds = 0;
  std::string reader;       // "io_uring", "pread", or "" when nothing was read
  std::string reader_note;  // why io_uring was not used, when "auto" fell back to pread
  std::string huge_note;    // why 2 MiB pages were or were not asked for
  // The size of the huge pages the file lives on: 2 MiB (tmpfs, hugetlbfs pagesize=2M) or
  // 1 GiB (hugetlbfs pagesize=1G); 0 for a private arena or another filesystem.
  uint64_t page_bytes = 0;
  std::string gpu_note;     // the registration outcome
  uint64_t gpu_registered_bytes = 0;
  double gpu_seconds = 0;
  uint64_t pinned_bytes = 0;  // VmPin after registration
  uint32_t waited_for_pid = 0;
  std::string from_peer;    // the peer filled from (options.from_peer), when it did
  uint64_t peer_bytes = 0;  // bytes received from the peer (header region and data)
  std::string peer_note;    // why the fill from options.from_peer failed, when it fell back
  std::string peer_transport;  // "am" or "get": how the peer's bytes crossed, when it filled
  std::string kernel_release;                        // uname -r
  std::vector<KernelFallbackReport> kernel_missing;  // every newer feature this kernel lacks
  std::string kernel_note;  // the start line's part: the ones whose fallback ran, and the cost
  // NUMA, on a host with several nodes (empty on a one-node host): the placement asked for
  // ("interleave", "node:1", ...; "" when attached), the policy the kernel holds for the
  // mapping as numa_maps names it ("interleave:0-1", "bind:1", "default"), where the pages
  // are, and why an "auto" placement fell back to first touch.
  std::string numa;
  std::string numa_policy;
  std::vector<NumaNodeBytes> numa_nodes;
  std::string numa_note;
  // Loaders: the cgroup the arena's pages are charged to and the room it had ("" when none).
  std::string charge_note;

  // The one start line an operator reads.
  EXPERT_ARENA_EXPORT std::string StartLine() const;
};

// Engine-made arenas (docs/engine-arenas.md): tensors an engine made itself (fused, transposed,
// repacked, quantized), published under the same protocol as a model's.
//
// One tensor the engine declares. `dtype` is the engine's name for its element type (the
// Python package uses safetensors' names: "F32", "BF16", "I64", ...), printed and compared,
// never interpreted by the library.
struct EngineTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t bytes = 0;
  uint64_t alignment = 0;  // of its offset (a power of two up to 2 MiB); 0: the spec's
};

// A declared tensor's place in the mapping, writable while the engine fills it.
struct WritableTensor {
  std::string_view name;
  std::string_view dtype;
  std::span<const uint64_t> shape;
  std::span<std::byte> bytes;
  // With EngineArenaSpec::pages_as_written: makes the pages under `bytes` (and waits for
  // them); call it before writing them. An error (a filesystem that filled up meanwhile) is
  // returned here, never a SIGBUS at the write. Returns at once where the pages were made
  // before fill.
  std::function<Status()> make_pages;
};

struct EngineArenaSpec {
  // What makes these tensors what they are, beyond the checkpoint: the engine and its version,
  // the transform's settings, dtype, quantization, rank and world size. Another identity is
  // another arena (replaced when unused, refused when in use). Required.
  std::string identity;
  // The checkpoint files (or directories of them) the tensors are made from: the library
  // fingerprints them (path, size, modification time, and a safetensors file's header bytes),
  // so a changed checkpoint is another arena. May be empty (the identity says it all).
  std::vector<std::string> files;
  // Default alignment of every tensor (a power of two up to 2 MiB).
  uint64_t alignment = 4096;
  // Called only in the engine that wins the arena (no published arena of this identity; the
  // others wait for it, then attach), and only while it holds the file: builds whatever it
  // needs and returns the table. An error (or an exception) publishes nothing.
  std::function<Result<std::vector<EngineTensor>>()> declare;
  // Then fills every declared tensor in place (no second copy), before the library checksums
  // and publishes them. The views are valid only during the call.
  std::function<Status(std::span<const WritableTensor>)> fill;
  // Publish only what runs (docs/engine-arenas.md): the arena this engine builds is filled and
  // checked, then left "built" while the engine binds itself to its views and runs its first
  // forwards on them; Arena::Confirm publishes it (the waiting engines attach then) and
  // Arena::Abandon records the failure. An engine that dies before either leaves a build the
  // next engine does not trust: it rebuilds it once, and after a second failure of the same
  // identity every engine is refused with the first failure (no crash loop). false: published
  // as soon as it is filled.
  bool confirm_after_run = false;
  // The pages are made as fill asks for them (WritableTensor::make_pages before each tensor is
  // written; up to 320 MiB ahead), not all before fill: an engine that lets go of its own copy
  // of each tensor once it is written holds the model about once at the build's peak rather
  // than twice. Applies where the pages are made in pieces (tmpfs on 4 KiB pages with room for
  // the file); elsewhere (hugetlbfs, tmpfs huge=) they are made before fill as without it.
  bool pages_as_written = false;
  // With pages_as_written: the bytes of the engine's own memory that fill frees as it writes
  // (its copy of each tensor let go once written; 0: none). A memory cgroup's limit is then
  // checked against what the build holds at its peak (the arena's pages less these, plus the
  // largest tensor and the pages made ahead of the writes) rather than the whole arena on top
  // of the engine's memory. Read once declare returned (declare may set it). Overstating it
  // turns a refusal into an OOM kill part-way: count only what is freed for certain.
  uint64_t freed_as_written = 0;
  // With pages_as_written, on tmpfs on 4 KiB pages (no GPU registration, no interleave): the
  // engine writes into 4 KiB pages and the arena's 2 MiB pages are made after the build, on a
  // thread at nice 19 (MADV_COLLAPSE), not before each write. On a VM whose host takes free
  // memory back a 2 MiB page costs 1-2 s/GiB to make: the build ends that much sooner, and the
  // engine reads a part of the arena on 4 KiB pages, and is slowed where a page is being made,
  // until the thread is done (docs/engine-arenas.md). An engine that attaches with it makes the
  // 2 MiB pages the file still lacks (its builder stopped before making them all). false: each
  // piece's 2 MiB pages are made before the engine writes into it (the build waits for them).
  bool huge_after_build = true;
};

// A part of an arena's data region: [offset, offset + bytes), offsets as Arena::data()'s.
struct ArenaRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

class EXPERT_ARENA_EXPORT Arena {
 public:
  // Loads the model's selected tensors, or attaches to a shared file another engine loaded.
  // Fails with a message naming the file and the cause: a file of another model in use, a
  // filesystem too small, a timeout waiting for another loader, a damaged model.
  static Result<Arena> Open(const ModelSpec& model, const ArenaOptions& options);

  // Attaches to a published shared file without knowing the model (tools, C and Python
  // clients). Never loads; fails when the file is absent, not published, or damaged.
  static Result<Arena> AttachExisting(const std::string& path, const ArenaOptions& options);

  // An arena of tensors the engine makes (EngineArenaSpec): attaches when one of this identity
  // and these checkpoint files is published at options.shared_path (waiting for an engine
  // that builds it), else this engine declares, fills and publishes it; role kLoaded then.
  // A build that fails, throws or is killed publishes nothing. Needs a shared_path.
  static Result<Arena> OpenEngine(const EngineArenaSpec& spec, const ArenaOptions& options);

  Arena(Arena&& other) noexcept;
  Arena& operator=(Arena&& other) noexcept;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();

  ArenaRole role() const;
  const ArenaReport& report() const;
  size_t tensor_count() const;
  // Tensor `index` of tensor_count(); past the last, an empty view (no name, no bytes).
  TensorView tensor(size_t index) const;
  std::optional<TensorView> Find(std::string_view name) const;
  // The whole data region.
  std::span<const std::byte> data() const;

  // The data region again (same offsets as data()) in a copy-on-write mapping of this process,
  // for languages that cannot hand out read-only memory (Python buffers, torch tensors): reads
  // see the arena's pages, uncopied; a write copies the page it touches into this process and
  // never reaches the file, the GPU-registered mapping or another engine. Made on first call
  // (thread-safe), unmapped with the Arena; registered read-only with the arena's GPU, if any
  // (pinned for writing, every page would be copied; a failure is a warning). Unless the
  // arena's own mapping is registered with a GPU, the new mapping is populated (the file's
  // pages, uncopied) and the arena's own data pages leave this process's page tables (they stay
  // in the file; a read through data() faults them in again), so that RSS counts the arena
  // once, not once per mapping. On hugetlbfs it
  // is MAP_NORESERVE (else the kernel reserves a huge page per page of the arena): a write takes
  // a free huge page, SIGBUS when the pool has none. A private arena has no file to map again:
  // its own memory is made writable and returned (a write changes this process's arena only).
  // Fails with the mmap error naming the file.
  Result<std::span<std::byte>> CopyOnWriteData() const;

  // The parts of CopyOnWriteData's mapping that are this process's private copies: pages a
  // write through a view copied into this process, which it reads from then on instead of the
  // arena's bytes that every other engine reads. Decided by what the pages are (private
  // anonymous pages where the file's pages were, from the page tables), not by pointers: a
  // write keeps every address. `changed_only`: only the pages (of the system's page size)
  // whose bytes now differ from the arena's; a write of the values already there copies a
  // page too. Empty before the first CopyOnWriteData() and for a private arena (no shared
  // bytes to differ from). Reads /proc/self/pagemap (PAGEMAP_SCAN where the kernel has it).
  // [offset, offset + length) of the data region only, when given (clipped to it).
  Result<std::vector<ArenaRange>> PrivateCopies(bool changed_only = false, uint64_t offset = 0,
                                                uint64_t length = UINT64_MAX) const;

  // This process's memory for the arena now (ArenaMemory), read from /proc/self/smaps; an
  // error naming the file where it cannot be read.
  Result<ArenaMemory> Memory() const;

  // An engine-made arena this engine built with EngineArenaSpec::confirm_after_run, neither
  // confirmed nor abandoned yet: the other engines wait for it.
  bool awaiting_confirm() const;
  // Publishes such an arena once the engine ran on its views; a no-op for any other arena.
  // Fails with the mapping's error naming the file (the arena then stays unpublished).
  Status Confirm();
  // Records that the engine failed on such an arena: `reason` (escaped, cut to 240 bytes) is
  // what the next engines report; the file is rebuilt once, then refused. A no-op for any other
  // arena. Close the arena afterwards: while this engine maps it, nobody can rebuild it.
  Status Abandon(std::string_view reason);

  struct Impl;

 private:
  explicit Arena(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace expert_arena
