// Tensor streaming between engines over shared segments (docs/streaming.md).
//
//   // Producer side (one per engine process):
//   auto producer = expert_arena::StreamProducer::Create({.logical_name = "prefill"});
//   auto descriptor = producer->Put("req-17", bytes, {.dtype = "bf16", .shape = {4, 4096}});
//   send(*descriptor);                      // over the engine's own channel
//   ...
//   producer->Abort("req-17");              // the request was cancelled
//
//   // Consumer side (any process on the host):
//   auto consumer = expert_arena::StreamConsumer::Create({});
//   auto tensor = consumer->Open(received);  // zero-copy view of the producer's segment
//   copy_to_device(tensor->bytes());
//   auto copied = expert_arena::CopyToDeviceAsync(device, tensor->bytes(), dst, stream);
//   tensor->ReleaseAfter(std::move(copied).value());  // or Release(), or ReleaseWhen(pred)
//
// Segments are files in a shared directory (default /dev/shm) named
// "ea-stream-<logical>-<pid>-<starttime>-<random>-<seq>", so two servers with the same logical
// name never touch each other's files. The release state of every block lives in its
// segment, so the space comes back when every reader has released it, without the engine
// relaying acknowledgements; the producer reclaims it on its own thread when it reserves.
// A producer's segments carry an OFD lock held by the producer: `Sweep` (run at producer
// start and by `expert-arena sweep`) removes the segments whose owner is gone. At the cap a
// tensor spills to a plain file in the spill directory (the consumer reads it through the
// same Open call) unless strict mode asks for a bounded wait and a clear error instead.
//
// Thread-safety: StreamProducer and StreamConsumer are move-only handles whose methods may
// be called from any thread concurrently. Reservations and StreamTensors are move-only and
// used by one thread at a time; they keep their producer's or consumer's state alive.
//
// fork(): a producer or consumer belongs to the process that created it. In a forked child
// its methods fail with kInvalidArgument ("StreamProducer was created in process P; a forked
// child (process C) must create its own"), and dropping it, or a Reservation or StreamTensor
// the child inherited, touches nothing shared: no segment is unlinked, no block freed or
// released, no reader's share spent (the parent's objects go on as if no fork happened). The
// child may create its own producer and consumer. fork() waits for the short critical
// sections of other threads' stream calls, so the child's copy is consistent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/export.h"
#include "expert_arena/gpu.h"
#include "expert_arena/status.h"

namespace spdlog {
class logger;
}

namespace expert_arena {

// Where a tensor is: the small byte string a producer hands to consumers. Encode() gives the
// wire form (magic "EATD", a version, then the fields, then an xxh3 checksum); Decode()
// validates everything a peer could get wrong or forge before anything is mapped, and refuses
// a key that is empty or, like the dtype, holds a control byte, so the strings of a decoded
// descriptor are safe to print.
struct EXPERT_ARENA_EXPORT TensorDescriptor {
  std::string segment;      // a file name (never a path) in the stream or spill directory
  bool spilled = false;     // in the spill directory rather than the stream directory
  uint32_t slot = 0;        // the block's entry in the segment's block table
  uint64_t generation = 0;  // of that entry when the block was reserved
  uint64_t offset = 0;      // of the bytes in the segment file
  uint64_t length = 0;      // bytes
  std::string dtype;
  std::vector<uint64_t> shape;
  std::string key;  // the request key that owns the block
  // Set by a producer that listens for consumers on other hosts (StreamOptions::listen); a
  // consumer on another host (another boot id, or the segment not in its directory) fetches
  // the bytes from there (docs/cross-host.md).
  std::string remote;              // "ADDR:PORT" of the producer's stream server
  uint64_t producer_instance = 0;  // that server's instance id (a restarted producer differs)
  std::string boot_id;             // the producer host's /proc/sys/kernel/random/boot_id
  // Set by a listening producer with a listen_token: HMAC-SHA256 keyed by the token over every
  // byte before it (32 bytes; empty: none), so that a descriptor rewritten on its way (another
  // address, another block) is refused by a consumer holding the token, and by the producer.
  std::string mac;

  // With `mac_key` not empty, the descriptor carries a MAC keyed by it (the stored `mac`
  // otherwise, so Encode() of a decoded descriptor gives back its bytes).
  std::string Encode(std::string_view mac_key = {}) const;
  static Result<TensorDescriptor> Decode(std::string_view bytes);
  // Whether `encoded` (a descriptor that Decode accepts) carries a MAC that holds for `key`.
  static bool MacMatches(std::string_view encoded, std::string_view key);
};

// The shape and type that travel with a tensor; the library does not interpret them.
struct TensorInfo {
  std::string dtype = "u8";
  std::vector<uint64_t> shape;
};

// One tensor of a PutMany: the bytes are read during the call only.
struct PutItem {
  std::string_view key;
  std::span<const std::byte> bytes;
  TensorInfo info;
};

struct StreamOptions {
  // The shared directory segments live in (tmpfs for speed; hugetlbfs works too).
  std::string directory = "/dev/shm";
  // Part of every segment name, for operators ([A-Za-z0-9_.-]{1,48}, no "..").
  std::string logical_name = "stream";
  // Data bytes of one segment (a multiple of 2 MiB). The file adds a 2 MiB header region.
  uint64_t segment_bytes = 256ull << 20;
  // At most this many segments' worth of files: max_segments x segment file bytes, dedicated
  // segments for oversized tensors included.
  uint32_t max_segments = 32;
  // Alignment of every tensor in a segment (a power of two, 64 B .. 2 MiB).
  uint64_t block_alignment = 4096;
  // Where tensors go when the cap is reached (created 0700 when missing).
  std::string spill_directory = "/var/tmp";
  // Strict mode: at the cap wait up to strict_wait_seconds for readers to release, then fail
  // with kNoSpace instead of spilling.
  bool strict = false;
  double strict_wait_seconds = 1.0;
  // 2 MiB pages for segments (collapsed while empty, like the arena): see HugePages.
  HugePages huge = HugePages::kAuto;
  // Where segments' pages live on a host with several NUMA nodes (docs/numa.md), whichever
  // thread or process touches them first. kAuto (the default): the producer's own node, the
  // one node its CPU affinity is on at Create (first touch when its CPUs span several nodes,
  // or where the kernel refuses the policy; the start line says why). kLocal: first touch.
  // kInterleave: over the nodes this process may use. kNode: bound to numa_node, refused at
  // Create when this process may not allocate there. kReplicate is refused. One node: as today.
  NumaPlacement numa = NumaPlacement::kAuto;
  int numa_node = -1;  // for NumaPlacement::kNode
  // A device to register each regular segment with in this process (none by default), within
  // pin_budget_bytes (0: no bound; the budget is shared by every registration of the process,
  // see src/gpu/gpu.h). Dedicated one-shot segments and spill files are never pinned.
  GpuDevice gpu;
  uint64_t pin_budget_bytes = 4ull << 30;
  // Put() copies tensors of 8 MiB and more with up to this many threads (0: a quarter of the
  // cores, 1 to 4); one thread is latency-bound below the memory bus on large hosts.
  uint32_t copy_threads = 0;
  // Put() copies tensors of at least this many bytes with non-temporal (streaming) stores,
  // which skip reading the destination into the cache: the bytes are read next by another
  // process or a device, and a tensor this large would only evict the cache. 0: a quarter of
  // the last-level cache (8 MiB when sysfs does not say); UINT64_MAX: never (plain memcpy).
  uint64_t non_temporal_copy_from = 0;
  // Grow ahead: when a reserve leaves less free than a quarter of a segment plus that
  // reserve's size, and the cap allows another segment, a background thread creates it
  // (fallocate, 2 MiB pages, populate), so the reserve that needs it waits for what is left of
  // that work instead of all of it. Existing mappings never move either way.
  bool grow_ahead = true;
  // The fragmentation warning is logged for the first failure, then at most once per this
  // many seconds with the number of failures since the last one; Stats() counts every one.
  double warning_interval_seconds = 10.0;
  // Remove segments of dead owners in directory and spill_directory at creation.
  bool sweep_at_start = true;
  // Leases: a consumer process that died or exited without releasing loses its holds, and
  // the blocks it held their shares, once the producer notices: when space is short, in
  // Reclaim() and Pending(), and at most this often from Reserve/Put and Stats() (each check
  // tries one OFD lock per consumer entry in use).
  double lease_check_seconds = 1.0;
  // Across hosts (docs/cross-host.md): "ADDR:PORT" to serve this producer's tensors to
  // consumers on other hosts over UCX (port 0: any free port, see remote_address()). Empty
  // (the default): nothing listens. Descriptors then carry the address, so a consumer on
  // another host opens them with the same Open call.
  std::string listen;
  // When not empty, a remote consumer must present it (ConsumerOptions::remote_token) before
  // any byte is served.
  std::string listen_token;
  // Listen on an address other than loopback without a listen_token. Refused by default: any
  // host that reaches the address would be admitted (docs/cross-host.md); with this set, a
  // warning says so. For a trusted private network.
  bool listen_allow_no_token = false;
  // A remote consumer's share of a block is held for it while its endpoint lives and for at
  // most this many seconds after the block was served (then spent, as a release would).
  double remote_lease_seconds = 60.0;
  // Logger for the start line, growth, fragmentation and spill notes; null: "expert_arena".
  std::shared_ptr<spdlog::logger> logger;
};

struct ConsumerOptions {
  // Must name the same directories as the producers' (descriptors carry names only).
  std::string directory = "/dev/shm";
  std::string spill_directory = "/var/tmp";
  GpuDevice gpu;
  uint64_t pin_budget_bytes = 4ull << 30;
  // Map segments owned by another user (refused by default).
  bool allow_foreign_owner = false;
  // Descriptors of a producer on another host: the token its listen_token asks for, and the
  // bound on one remote open (connection, transfer) when the producer stops answering.
  std::string remote_token;
  double remote_timeout_seconds = 30.0;
  // Open descriptors of a producer without a token. Refused by default: with no token nothing
  // proves who answers at the descriptor's address, and this process's UCX would take a worker
  // address of that stranger's choice (docs/cross-host.md). For a trusted private network.
  bool remote_allow_no_token = false;
  std::shared_ptr<spdlog::logger> logger;
};

struct StreamStats {
  uint64_t total_bytes = 0;  // data bytes of all segments
  uint64_t free_bytes = 0;
  uint64_t largest_free_block = 0;
  uint64_t segments = 0;  // regular + dedicated
  uint64_t dedicated_segments = 0;
  uint64_t live_blocks = 0;             // reserved, published or aborted-but-held blocks
  uint64_t pinned_bytes = 0;            // registered with the GPU by this process
  uint64_t spills = 0;                  // tensors spilled so far
  uint64_t spill_files = 0;             // spill files still present
  uint64_t fragmentation_failures = 0;  // reserves that failed while free bytes covered them
  uint64_t reclaimed_blocks = 0;
  uint64_t dead_readers_cleared = 0;
  uint64_t segments_grown_ahead = 0;  // created by the grow-ahead thread
  // Where segments are placed (StreamOptions::numa resolved at Create): "node:1 (the
  // producer's node)", "interleave over nodes 0-1", "local (first touch)", and after "; "
  // why a policy the kernel refused was not applied.
  std::string numa;
  // The node every segment is on (the producer's own, node:N, or the only one); -1 when they
  // are interleaved or on first touch across several nodes.
  int numa_node = -1;
  // A listening producer's front door (docs/cross-host.md): consumers admitted; refused
  // (limits, throttling); timed out (no handshake in time, or a transfer not taken within the
  // lease); dropped (garbage, a hang-up mid-handshake); failed token proofs.
  uint64_t remote_admitted = 0;
  uint64_t remote_refused = 0;
  uint64_t remote_timed_out = 0;
  uint64_t remote_dropped = 0;
  uint64_t remote_auth_failed = 0;
  // Times the network process (the listener's UCX side, a process of its own) was started
  // again after it ended; the counts above include those of the ended ones.
  uint64_t remote_restarts = 0;
};

// A block a producer still holds for its readers (StreamProducer::Pending).
struct PendingBlock {
  std::string key;
  std::string state;          // "writing", "published" or "aborted" (freed once unheld)
  double age_seconds = 0;     // since it was reserved
  uint32_t readers_left = 0;  // releases still expected (published blocks)
  uint32_t holders = 0;       // consumer processes holding a view of it now
  uint64_t bytes = 0;         // of the tensor
  std::string segment;        // file name in the stream or spill directory
  bool spilled = false;
  // Consumers on other hosts holding it through this producer's stream server (each until its
  // release, its endpoint fails or remote_lease_seconds pass); `holders` counts this
  // process once for all of them.
  uint32_t remote_holders = 0;
};

class StreamProducer;
class StreamConsumer;

// Space reserved for one tensor. Write into bytes(), then Publish(). Dropping it unpublished
// gives the space back.
class EXPERT_ARENA_EXPORT Reservation {
 public:
  Reservation(Reservation&& other) noexcept;
  Reservation& operator=(Reservation&& other) noexcept;
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  ~Reservation();

  std::span<std::byte> bytes() const;
  bool spilled() const;
  // Makes the block readable by `readers` releases (each consumer that will Open it releases
  // once) and returns the encoded descriptor. Fails with kBusy naming the key when the key
  // was aborted while the bytes were written (the space is then given back). Refuses, with
  // kInvalidArgument and the block still unpublished, a dtype with a control byte or longer
  // than 1024 bytes, or more than 16 dimensions (what a descriptor carries).
  Result<std::string> Publish(const TensorInfo& info, uint32_t readers = 1);

  struct State;

 private:
  friend class StreamProducer;
  explicit Reservation(std::unique_ptr<State> state);
  // Gives the space back when the reservation was neither published nor used.
  void GiveBack() noexcept;
  std::unique_ptr<State> state_;
};

class EXPERT_ARENA_EXPORT StreamProducer {
 public:
  // Checks the directory's filesystem against max_segments x segment size (fails fast when it
  // can never fit, warns when it does not fit in what is free now) and sweeps dead owners'
  // segments. The first segment is made by the first reserve: creating commits nothing.
  static Result<StreamProducer> Create(const StreamOptions& options);

  StreamProducer(StreamProducer&& other) noexcept;
  StreamProducer& operator=(StreamProducer&& other) noexcept;
  StreamProducer(const StreamProducer&) = delete;
  StreamProducer& operator=(const StreamProducer&) = delete;
  // Unlinks this producer's segments and spill files; consumers that mapped them keep their
  // views until they release them. A Reservation still alive holds the producer's state, so
  // the segments (and their files) stay until the last Reservation is gone.
  ~StreamProducer();

  // Space for `bytes` owned by `key`: in a segment, a new segment (up to the cap), a dedicated
  // segment for a tensor larger than a segment, or a spill file at the cap (strict mode: a
  // bounded wait, then kNoSpace). A key is any non-empty string of at most 1024 bytes
  // without control bytes (below 0x20, or 0x7f; consumers print keys): others are refused
  // with kInvalidArgument before anything is reserved.
  Result<Reservation> Reserve(std::string_view key, uint64_t bytes);
  // Reserve + copy + Publish. The key and `info` (a dtype without control bytes of at most
  // 1024 bytes, at most 16 dimensions) are checked before anything is reserved.
  Result<std::string> Put(std::string_view key, std::span<const std::byte> bytes,
                          const TensorInfo& info, uint32_t readers = 1);
  // Put of several tensors, all or none: every key and info is checked first, then the space
  // of each is reserved and its bytes copied, then all are published under one lock (a
  // consumer never sees part of the batch). When a step fails nothing is published, the space
  // reserved so far is given back, and the error names the item's index and key. Each item
  // gets its own descriptor, in order, each for `readers` releases.
  Result<std::vector<std::string>> PutMany(std::span<const PutItem> items, uint32_t readers = 1);
  // Frees exactly the blocks `key` owns (exact match), each once the readers holding it now
  // have released it; blocks still being written are refused at Publish. Returns how many
  // blocks were marked. Safe while other keys are written.
  Result<uint64_t> Abort(std::string_view key);
  // Reclaims every block whose readers have all released, and ends the leases of dead
  // readers (their holds, and the shares of the blocks they held). Reserve does this on its
  // own when it needs space; tools and tests call it to settle.
  Status Reclaim();
  // Every block not yet given back (after the same settling as Reclaim), oldest first: its
  // key, state, age, the releases still expected and the consumer processes holding it.
  Result<std::vector<PendingBlock>> Pending();
  // The allocator's figures (after settling moved blocks and, at most every
  // lease_check_seconds, dead readers' leases). In a forked child it fails as every other call
  // does there (kInvalidArgument naming the fork): the figures would be the parent's.
  Result<StreamStats> Stats();
  // Ok in the process that created the producer; in a forked child the error every other call
  // returns there (kInvalidArgument naming the fork and the creator's pid).
  Status CheckProcess() const;
  // The names of this producer's segment files (for tools and tests).
  std::vector<std::string> SegmentPaths();
  // Bytes of this producer's segment mappings (regular and dedicated) on each memory node,
  // read from /proc/self/numa_maps (every page: segments are populated when made); every node
  // with memory is listed, 0 where nothing is. Empty without numa_maps (no CONFIG_NUMA).
  std::vector<NumaNodeBytes> SegmentNodeBytes();
  const std::string& instance_name() const;
  // "ADDR:PORT" the producer serves remote consumers on ("" without StreamOptions::listen).
  std::string remote_address() const;

  struct Impl;

 private:
  explicit StreamProducer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// A consumer's zero-copy view of one tensor. Release() (or the destructor) returns this
// reader's share; ReleaseWhen() defers it until `ready` returns true (a device copy from
// these bytes finished), checked by the consumer's calls and PollReleases(). bytes() and
// descriptor() are empty once the tensor is released (or moved from).
class EXPERT_ARENA_EXPORT StreamTensor {
 public:
  StreamTensor(StreamTensor&& other) noexcept;
  StreamTensor& operator=(StreamTensor&& other) noexcept;
  StreamTensor(const StreamTensor&) = delete;
  StreamTensor& operator=(const StreamTensor&) = delete;
  ~StreamTensor();

  // Empty after Release() (and in a moved-from tensor), as descriptor() is.
  std::span<const std::byte> bytes() const;
  // The same bytes through this process's copy-on-write (MAP_PRIVATE) mapping of the segment,
  // made once per mapped segment, by the first call for one of its blocks: reads see the
  // producer's bytes, and a write (which nothing should do) copies the page it touches into
  // this process and never reaches the segment, the producer or another reader. What such a
  // write changed is discarded when this process's last view of the block is released. With
  // a GPU asked for, registered read-only next to bytes() (pages a write copied are not the
  // pinned ones: a device copy then reads the producer's bytes). These are what the Python
  // package's views point into. Thread-safe. Fails when the mapping cannot be made, and in a
  // forked child for a segment the parent had not mapped so.
  Result<std::span<std::byte>> private_bytes() const;
  const TensorDescriptor& descriptor() const;
  void Release();
  void ReleaseWhen(std::function<bool()> ready);
  // Gives the hold back without spending this reader's share: the descriptor opens again
  // (what a failed OpenMany does with the views it opened).
  void GiveBack();
  // True when the bytes were fetched from a producer on another host into this process's
  // own memory (docs/cross-host.md); false for the zero-copy view of a local segment.
  bool remote() const;
  // Releases once the device copy recorded by `copied` is done (or failed: a failed copy no
  // longer reads these bytes).
  void ReleaseAfter(CopyEvent copied);

  struct State;

 private:
  friend class StreamConsumer;
  explicit StreamTensor(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

struct ConsumerStats {
  uint64_t mapped_segments = 0;
  uint64_t mapped_bytes = 0;
  uint64_t pinned_bytes = 0;
  uint64_t open_views = 0;
  uint64_t deferred_releases = 0;  // waiting on their ready predicate
  uint64_t dropped_segments = 0;   // unmapped after their file was unlinked
};

class EXPERT_ARENA_EXPORT StreamConsumer {
 public:
  static Result<StreamConsumer> Create(const ConsumerOptions& options);

  StreamConsumer(StreamConsumer&& other) noexcept;
  StreamConsumer& operator=(StreamConsumer&& other) noexcept;
  StreamConsumer(const StreamConsumer&) = delete;
  StreamConsumer& operator=(const StreamConsumer&) = delete;
  // Waits for deferred releases (their predicates) and releases what is still held.
  ~StreamConsumer();

  // Validates the descriptor (name inside the directory, offset and length inside the
  // segment, the block's entry and generation), maps the segment once (cached) and takes a
  // hold on the block. Refuses an aborted or fully released block with a clear message.
  Result<StreamTensor> Open(std::string_view descriptor);
  // Open of several descriptors, all or none: when one fails, the views opened before it are
  // given back without spending their shares (each descriptor opens again, also with
  // readers=1), and the error names the item's index.
  Result<std::vector<StreamTensor>> OpenMany(std::span<const std::string_view> descriptors);
  // Retires deferred releases whose predicate is ready; drops mappings of segments that were
  // unlinked and have no views left. Returns how many deferred releases are still waiting.
  uint64_t PollReleases();
  ConsumerStats Stats();

  struct Impl;

 private:
  explicit StreamConsumer(std::shared_ptr<Impl> impl);
  // What the destructor does: waits for deferred releases, then releases what is held.
  void Drain() noexcept;
  std::shared_ptr<Impl> impl_;
};

// One stream segment or spill file found by a sweep or inspected by a tool.
struct SegmentInfo {
  std::string path;
  bool ours = false;    // has the stream segment magic and a version we read
  std::string problem;  // why it is not readable as a segment, when it is not
  uint32_t owner_pid = 0;
  uint64_t owner_start_time = 0;
  // The owner's PID namespace (inode of /proc/<pid>/ns/pid), 0 when not recorded; owner_pid
  // is a pid of that namespace. owner_pid_local: it is this process's namespace (or unknown).
  uint64_t owner_pid_namespace = 0;
  bool owner_pid_local = true;
  // "pid 42", or "pid 1 of another PID namespace (pid:[...]), not a process here".
  std::string owner_text;
  uint32_t owner_uid = 0;
  bool owner_alive = false;  // the owner's lock is held
  bool dedicated = false;
  bool spill = false;
  std::string logical_name;
  uint64_t file_bytes = 0;
  uint64_t data_bytes = 0;
  uint32_t slots = 0;
  uint64_t live_blocks = 0;
  uint64_t live_bytes = 0;
  uint64_t published_blocks = 0;
  uint64_t aborted_blocks = 0;
  uint32_t readers = 0;  // reader entries in use
  // Data bytes no live block's tensor holds, and the longest run of them between live blocks
  // (the largest tensor a producer could still place here). A block's padding up to the
  // stream's block alignment counts as free: the alignment is not recorded in the file.
  uint64_t free_bytes = 0;
  uint64_t largest_free_bytes = 0;
};

// Reads a segment's header and block table without taking anything.
EXPERT_ARENA_EXPORT Result<SegmentInfo> InspectSegment(const std::string& path);
// True when the file at `path` starts with the stream segment magic.
EXPERT_ARENA_EXPORT bool IsStreamSegment(const std::string& path);

struct SweepReport {
  std::vector<std::string> removed;  // paths of dead owners' segments, unlinked
  std::vector<std::string> live;     // paths whose owner is alive, left alone
  std::vector<std::string> notes;    // files left alone and why (another user's, unreadable)
};

// Removes the stream segments in `directory` whose owner process is gone: the owner holds an
// OFD lock on each of its files, so a lock we can take means a dead owner, whatever pid was
// reused. Never touches another user's files, nor files that are not stream segments.
EXPERT_ARENA_EXPORT Result<SweepReport> SweepStreamDirectory(const std::string& directory);

}  // namespace expert_arena
