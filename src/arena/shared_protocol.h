// The steps of the shared-arena protocol (shared_arena.cc; docs/arena-protocol.md, "The
// steps"). OpenShared is a retry loop over them:
//
//   OpenArenaFile -> WaitForFill -> ReadFindings -> Classify -> one of
//     Attach | Replace (then again) | LoadFresh (with the want's filler) | refuse |
//     plan without a lock (then again) | plan under FILL (then Classify again) |
//     wait for the file's creator (then again)
//
// Each step is a function of its own so that it can be tested alone (tests/arena/
// shared_protocol_test.cc); the multi-process behaviour is tested through OpenShared
// (arena_protocol_test.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "arena/arena_filler.h"
#include "arena/arena_impl.h"
#include "expert_arena/arena.h"
#include "format/arena_format.h"
#include "format/arena_table.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

namespace spdlog {
class logger;
}

namespace expert_arena::arena {

using ProtocolClock = std::chrono::steady_clock;

// The arena file as opened: read_only when this user may only read it (it then only attaches).
struct ArenaFile {
  std::string path;  // options.shared_path
  bool absent = false;  // no file at the path, and this engine may not create one yet
  platform::UniqueFd fd;
  platform::FileStat st;
  bool read_only = false;
};

// Refuses an arena file whose mode has setuid, setgid, sticky or execute bits, and one any
// user may write (0002) unless allow_world_writable; the message names the fix.
Status CheckArenaFileMode(const std::string& path, uint32_t mode, bool allow_world_writable);

// Opens (with `create`: creates) the file at options.shared_path for reading and writing, or
// for reading only when that is all this user may do; checks that it is a regular file of this
// user (or allow_foreign_owner). `absent` when there is no file and `absent_ok` (the engine
// then plans, and opens again creating it); an error naming the path otherwise.
Result<ArenaFile> OpenArenaFile(const ArenaOptions& options, bool create, bool absent_ok);

// What the wait for FILL said, for the report and the messages of later rounds.
struct FillWait {
  ProtocolClock::time_point start;     // OpenShared's start
  ProtocolClock::time_point deadline;  // start + options.wait_timeout_seconds
  bool said_waiting = false;
  uint32_t waited_for = 0;  // the loader's pid, when it is in this PID namespace
  std::string waiting_for = "pid unknown";
  ProtocolClock::time_point wait_start{};
  double Seconds() const;  // waited so far, 0 when this engine did not wait
};

// Takes FILL (exclusive; shared on a read-only descriptor: such an engine only attaches),
// waiting for a loader that holds it (named once in the log) up to wait.deadline. true: FILL is
// held, the path still names the file, and file.st is fresh. false: the path was given to
// another file meanwhile; open it again.
Result<bool> WaitForFill(ArenaFile& file, FillWait& wait, spdlog::logger& log);

// Why the build recorded in `summary` (state kBuilt or kFailed) did not publish: the failure its
// engine recorded, or, for a build left built and never confirmed (its engine gone: FILL was
// free), who built it.
std::string BuildFailure(const format::HeaderSummary& summary);

// What the engine holding FILL found in the file. A published header of this format version is
// validated where it will be used: in a mapping of the whole file (`whole`, with `view` of its
// table in place; nothing copied, no page populated).
struct FileFindings {
  uint64_t size = 0;
  bool read_only = false;
  format::HeaderSummary summary;
  Status decoded = Status::Ok();  // the published header's validation
  uint64_t header_bytes = 0;
  std::optional<platform::Mapping> whole;
  std::optional<format::TableView> view;
  // Only for a model not planned yet: whether the published arena records the fingerprint of
  // planning inputs that hash the same on disk now (source/model_fingerprint.h).
  bool fingerprint_matches = false;
  // A read-only engine that found an empty file: its creator may not have taken FILL yet.
  bool creator_grace = false;
};
FileFindings ReadFindings(const ArenaFile& file, const platform::FilesystemInfo& fs,
                          bool writable, const std::string& path);

// Why a present file cannot be used as it is (by `plan`, when given), or "" when it can.
std::string WhyNotReusable(const format::HeaderSummary& summary, const Status& decoded,
                           const source::ModelPlan* plan, uint64_t file_size);

// What to do with the file, decided holding FILL.
enum class Step {
  kAttach,          // a published arena of the model: map it
  kPlanUnlocked,    // the model must be planned to know: drop the locks, plan, open again
  kPlanHere,        // an empty file for an engine-made arena: plan now, holding FILL; Classify again
  kWaitForCreator,  // a read-only engine found an empty file: wait a moment, open again
  kRefuse,          // `refusal` says why
  kReplace,         // another arena: unlink it when no engine maps it, open again
  kLoad,            // an empty file and FILL: this engine loads it (LoadFresh)
};
const char* StepName(Step step);

struct Decision {
  Step step = Step::kRefuse;
  Status refusal = Status::Ok();  // kRefuse
  std::string held;               // kReplace: what the file held, for the log
  // kReplace of a failed build of this engine-made arena (built, never confirmed, or failed):
  // its attempt (1) and its first failure, carried into the rebuild's header.
  uint32_t failed_attempt = 0;
  std::string first_failure;
  // kReplace and kLoad need USER exclusively: the refusal when another engine maps the file.
  std::string busy;
};

// `want` is null for AttachExisting (whatever is published). A pure function of its arguments
// (and, for messages, of the file's access as platform::DescribeFileAccess says it).
Decision Classify(const ModelWant* want, const FileFindings& found, const std::string& path);

// Takes USER exclusively for a replace or a load; kBusy with `busy` when another engine maps
// the file.
Status TakeUserExclusive(const ArenaFile& file, const std::string& busy);

// Unlinks the stale file (USER held exclusively), saying what it held. The caller opens again.
Status Replace(const std::string& path, const std::string& held, spdlog::logger& log);

// Maps the published file (holding FILL), takes USER shared and lets FILL go. `huge` (auto or
// on; EngineArenaSpec::huge_after_build): on plain tmpfs the 2 MiB pages the file lacks are made
// in the background (LateCollapse).
Result<std::unique_ptr<Arena::Impl>> Attach(ArenaFile file, FileFindings found,
                                            const platform::FilesystemInfo& fs, bool writable,
                                            HugePages huge, const FillWait& wait,
                                            const std::string& path);

// Loads the empty file (holding FILL and USER exclusively) by `plan` with `filler`: layout,
// cgroup charge, NUMA placement, pages, the loading header, the fill, the check that the writes
// reached the file, publish. On any failure the file is unlinked (nobody else maps it) and
// nothing is published. `plan`'s table is moved into the arena. With `deferred` (an
// engine-made arena published only after its engine ran on it), the filled file is left in
// state kBuilt with that build record, FILL still held: ConfirmBuild publishes it,
// AbandonBuild records the failure, and an engine that dies leaves it built, never confirmed.
Result<std::unique_ptr<Arena::Impl>> LoadFresh(ArenaFile file, source::ModelPlan& plan,
                                               ArenaFiller& filler, const ArenaOptions& options,
                                               const platform::FilesystemInfo& fs,
                                               const FillWait& wait, spdlog::logger& log,
                                               const DeferredPublish* deferred = nullptr);

}  // namespace expert_arena::arena
