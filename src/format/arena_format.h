// The V2 arena file: its on-disk layout, encoding and validation.
//
//   [0, header_bytes)            header region, whole 2 MiB pages:
//       HeaderFixed              magic, version, sizes, state, loader, identity, checksums
//       SourceEntry[]            the model's source files
//       TensorEntry[]            the tensor table
//       strings                  names, dtypes, paths; the writer follows each with a NUL
//                                outside its (offset, length), so one read in place is a C
//                                string (validation requires one after every name and
//                                dtype of a file with a name index)
//       name index               u32 slots, open addressing by xxh3-64 of the name (Find)
//   [header_bytes, file_bytes)   data region, 2 MiB-aligned in the file and in memory
//
// All integers are little-endian (the library is built for little-endian hosts only). The
// header region takes as many 2 MiB pages as the table needs: a 94-layer, 128-expert model
// stored per expert has ~36,000 tensors, about 6 MiB of table.
//
// The `state` word is written last by the loader (kPublished), after the data, the table and
// the header checksum. Readers trust nothing in a header until ValidateHeader accepted it
// against the real file size: every count, offset and length is checked for overflow and
// bounds, so no header can make a process touch bytes outside its mapping.
//
// See docs/arena_format.md for the field-by-field description.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

#include "expert_arena/status.h"
#include "format/arena_table.h"

namespace expert_arena::format {

inline constexpr char kMagic[8] = {'E', 'X', 'P', 'A', 'R', 'E', 'N', 'A'};
inline constexpr uint32_t kFormatVersion = 2;
inline constexpr uint64_t kHeaderPageBytes = 2ull * 1024 * 1024;
inline constexpr size_t kIdentityTextBytes = 512;

// kBuilt and kFailed are an engine-made arena's states between its fill and its publication
// (docs/arena-protocol.md, "Publish only what runs"): kBuilt, filled and checked, while the
// building engine (holding FILL) runs its first forwards on the arena's views; kFailed, the
// building engine said its run failed (build_failure says why). Readers that predate them see
// an unpublished file and replace it.
enum class FileState : uint32_t {
  kEmpty = 0,
  kLoading = 1,
  kPublished = 2,
  kBuilt = 3,
  kFailed = 4,
};

// Bytes of HeaderFixed::build_failure (the message is cut to fit, escaped).
inline constexpr size_t kBuildFailureBytes = 240;

struct HeaderFixed {
  char magic[8];
  uint32_t version;
  uint32_t fixed_bytes;   // sizeof(HeaderFixed) as written
  uint64_t header_bytes;  // the header region: a multiple of 2 MiB
  uint64_t data_bytes;    // the data region
  uint64_t file_bytes;    // the whole file (>= header_bytes + data_bytes)
  uint32_t state;         // FileState
  uint32_t loader_pid;
  uint64_t loader_start_ticks;  // /proc/<pid>/stat starttime of the loader
  uint64_t identity_hash;
  char identity_text[kIdentityTextBytes];  // NUL-padded
  uint64_t alignment;
  uint64_t source_count;
  uint64_t tensor_count;
  uint64_t sources_offset;  // from the file start, inside the header region
  uint64_t tensors_offset;
  uint64_t strings_offset;
  uint64_t strings_bytes;
  uint64_t model_bytes_total;
  uint64_t model_tensors_total;
  uint64_t created_unix_ns;
  uint64_t published_unix_ns;
  uint32_t source_entry_bytes;
  uint32_t tensor_entry_bytes;
  uint64_t table_checksum;   // xxh3-64 of [sources_offset, strings_offset + strings_bytes)
  uint64_t header_checksum;  // xxh3-64 of this struct with header_checksum = 0
  // Added inside the former reserved bytes (zero in files written before them; readers then
  // plan the model to decide and index names themselves).
  uint64_t fingerprint;          // of the model's planning inputs (source/model_fingerprint.h)
  uint64_t name_index_offset;    // from the file start, 8-aligned, after the strings
  uint64_t name_index_slots;     // a power of two > tensor_count, or 0: no index
  uint64_t name_index_checksum;  // xxh3-64 of the slots
  // The inode of the loader's PID namespace (/proc/self/ns/pid), so that an engine in another
  // container does not take loader_pid for one of its own processes; 0: not recorded.
  uint64_t loader_pid_namespace;
  // The build record of an engine-made arena built after a failed build of the same identity
  // (docs/arena_format.md): zero in other files and in files written before it.
  uint32_t build_attempt;        // 1 for the first build; 2 for the rebuild after a failure
  uint32_t build_failure_bytes;  // of build_failure, at most kBuildFailureBytes
  char build_failure[kBuildFailureBytes];  // the first failure's message, escaped, no NUL
  uint8_t reserved[48];
};

struct SourceEntry {
  uint64_t path_offset;  // into the strings
  uint32_t path_bytes;
  uint32_t reserved;
  uint64_t size;
  int64_t mtime_ns;
};

struct TensorEntry {
  uint64_t name_offset;  // into the strings
  uint32_t name_bytes;
  uint32_t dtype_bytes;
  uint64_t dtype_offset;
  uint32_t n_dims;
  uint32_t source_index;
  uint64_t shape[kMaxDims];
  uint64_t source_offset;
  uint64_t arena_offset;  // from the start of the data region
  uint64_t bytes;
  uint64_t checksum;
};

static_assert(sizeof(HeaderFixed) == 1024);
static_assert(sizeof(SourceEntry) == 32);
static_assert(sizeof(TensorEntry) == 128);
static_assert(std::is_trivially_copyable_v<HeaderFixed>);
static_assert(std::is_trivially_copyable_v<TensorEntry>);
static_assert(offsetof(HeaderFixed, state) == 40, "state is read alone by waiting engines");
static_assert(offsetof(HeaderFixed, build_attempt) == 728, "the build record is a later field");

struct ArenaLayout {
  uint64_t header_bytes = 0;
  uint64_t data_bytes = 0;
  uint64_t file_bytes = 0;
};

// The header region and file size for `table` (data_bytes already assigned). `page_bytes`
// is the backing's page size (2 MiB, or 1 GiB on such a hugetlbfs); the file is rounded to it.
Result<ArenaLayout> ComputeLayout(const ArenaTable& table, uint64_t page_bytes);

// Writes the header region for `table` into `header` (header.size() == layout.header_bytes)
// with the given state. The header checksum covers the state, so a header is re-encoded
// when it is published.
Status EncodeHeader(const ArenaTable& table, const ArenaLayout& layout, FileState state,
                    uint32_t loader_pid, uint64_t loader_start_ticks, uint64_t created_unix_ns,
                    uint64_t published_unix_ns, std::span<std::byte> header,
                    uint64_t loader_pid_namespace = 0);

// What a header says about the file, read without trusting it.
struct HeaderSummary {
  bool our_magic = false;
  uint32_t version = 0;
  FileState state = FileState::kEmpty;
  uint32_t loader_pid = 0;
  uint64_t loader_start_ticks = 0;
  uint64_t loader_pid_namespace = 0;
  uint64_t identity_hash = 0;
  std::string identity_text;
  ArenaLayout layout;
  bool engine_made = false;  // EngineMade() of the fixed header
  uint32_t build_attempt = 0;
  std::string build_failure;  // escaped again when read: a file is not trusted
};
// Rewrites the state and the build record of a header in place (`header` holds at least the
// fixed part, whose checksum is recomputed; the table is not touched): how an engine-made
// arena's builder publishes the arena it ran on (kPublished, with its publication time) or
// records that its run failed (kFailed, with the first failure's message, escaped and cut to
// kBuildFailureBytes). An error when `header` is not a header of this format.
Status SetBuildState(std::span<std::byte> header, FileState state, uint64_t published_unix_ns,
                     uint32_t build_attempt, std::string_view build_failure);

// Reads the fixed part only (bytes may be shorter than the struct: a torn or tiny file).
HeaderSummary SummarizeHeader(std::span<const std::byte> bytes);

// Checks the fixed header against the real file size and decodes it fully: magic, version,
// sizes, checksums, and every table entry's strings and data range. Then what the table says
// is checked against itself (ValidateTableContents in arena_format.cc), because the checksums
// prove only that whoever wrote the file computed them: the identity hash recomputed from the
// table (a model's; see EngineMade), every data range aligned and overlapping no other, every
// dtype a known one whose size for the shape is the tensor's bytes (an engine's: printable).
// `path` names the file in messages. On success `table` holds the decoded table.
Status DecodeHeader(std::span<const std::byte> header_region, uint64_t file_size,
                    const std::string& path, ArenaTable* table, HeaderSummary* summary);

uint64_t Checksum(std::span<const std::byte> bytes);

// Whether an engine made the table (arena/engine_arena.cc): its identity hash names the
// engine's spec (identity text, checkpoint files), not the table, so it cannot be recomputed
// from the table, and its dtypes are the engine's words. PlanEngineArena records that hash as
// the fingerprint too; a model's fingerprint hashes its planning inputs and is never its
// identity. An engine that wants a model must refuse such a file (the identity check that
// ties a model's table to its hash was not made).
bool EngineMade(const HeaderFixed& fixed);

// The identity ComputeIdentity gives the table of a validated header region, read in place.
uint64_t StoredTableIdentity(std::span<const std::byte> header_region, const HeaderFixed& fixed);

// The hash the name index is keyed by.
uint64_t NameHash(std::string_view name);

// A published header region validated like DecodeHeader, then read in place: nothing is
// copied, so opening one costs no heap whatever the tensor count, and Find is O(1) through the
// stored name index. A file written before the name index (in_place() false) is validated
// and its sources read, but its tensors are to be decoded (DecodeHeader): its strings are not
// NUL-terminated and it has no index. Every
// accessor re-checks its offsets against the sizes validated on open, so bytes changed under
// a mapping afterwards give wrong names at worst, never a read outside the region.
// The region must outlive the view and start 8-byte aligned.
class TableView {
 public:
  TableView() = default;
  static Result<TableView> Open(std::span<const std::byte> region, uint64_t file_size,
                                const std::string& path);

  const HeaderFixed& fixed() const { return fixed_; }
  size_t tensor_count() const { return fixed_.tensor_count; }
  size_t source_count() const { return fixed_.source_count; }
  TensorEntry entry(size_t index) const;  // a copy
  std::string_view name(size_t index) const;
  std::string_view dtype(size_t index) const;
  std::span<const uint64_t> shape(size_t index) const;
  SourceRecord source(size_t index) const;
  // Names and dtypes are NUL-terminated in place, and Find works (the file has a name index).
  bool in_place() const { return slots_ != nullptr; }
  std::optional<size_t> Find(std::string_view name) const;
  // The scalar fields of the table (no sources, no tensors).
  ArenaTable Summary() const;

 private:
  std::string_view String(uint64_t offset, uint64_t bytes) const;
  HeaderFixed fixed_{};
  const std::byte* base_ = nullptr;
  const uint32_t* slots_ = nullptr;
};

}  // namespace expert_arena::format
