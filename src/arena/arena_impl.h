// Arena::Impl: what an open arena owns, in the order it must be torn down (members are
// destroyed bottom-up: GPU registration first, then the mapping, then the fd whose open file
// description holds this engine's USER lock).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>

#include "arena/arena_filler.h"
#include "expert_arena/arena.h"
#include "format/arena_format.h"
#include "format/arena_table.h"
#include "pages/page_backing.h"
#include "gpu/gpu.h"
#include "load/loader.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "source/model_source.h"

namespace spdlog {
class logger;
}

namespace expert_arena {

struct Arena::Impl {
  platform::UniqueFd fd;      // holds USER (shared) for a shared arena
  platform::Mapping mapping;  // the whole file, or anonymous memory
  // Arena::CopyOnWriteData's MAP_PRIVATE mapping of the whole file, made on first use.
  std::mutex copy_on_write_mutex;
  platform::Mapping copy_on_write;
  uint64_t data_offset = 0;  // header bytes for a shared arena, 0 when private
  // A private arena: the whole table, names indexed in by_name. A shared one: the scalars of
  // the table only; its tensors are read in place from the header in the mapping (`view`,
  // O(1) heap and Find whatever the tensor count).
  format::ArenaTable table;
  std::optional<format::TableView> view;
  std::unordered_map<std::string_view, size_t> by_name;
  std::unique_ptr<gpu::Registration> registration;
  // The copy-on-write mapping registered read-only with the same device (when the arena is
  // registered), so that device copies from Python views are DMA too. Freed before it.
  std::unique_ptr<gpu::Registration> copy_on_write_registration;
  ArenaReport report;
  // An engine-made arena built with EngineArenaSpec::confirm_after_run, until Arena::Confirm
  // or Arena::Abandon: the file is in state kBuilt and `fd` still holds FILL, so every other
  // engine waits.
  bool awaiting_confirm = false;
  uint32_t build_attempt = 0;
  std::string first_failure;  // of the failed build this one replaced
  uint64_t mapping_alignment = 0;
  // The 2 MiB pages of an engine-made arena on 4 KiB tmpfs, made after its build (see
  // pages::LateCollapse). Last: stopped and joined before anything above goes.
  std::unique_ptr<pages::LateCollapse> late_collapse;

  std::span<const std::byte> data() const {
    return {mapping.data() + data_offset, table.data_bytes};
  }
  void IndexNames();
  static Arena Make(std::unique_ptr<Impl> impl);
};

namespace arena {

// How an engine-made arena built by this engine is published (EngineArenaSpec::
// confirm_after_run): only once its engine confirmed that it ran on it. `attempt` 2 is the
// rebuild after a failed build of the same identity, whose message is `first_failure`.
struct DeferredPublish {
  uint32_t attempt = 1;
  std::string first_failure;
};

// Publishes an arena awaiting its engine's confirmation (state kPublished, FILL let go); a
// no-op for any other arena. Fails with the mapping's error naming the file.
Status ConfirmBuild(Arena::Impl& impl);
// Records that the engine's run on an arena awaiting confirmation failed with `reason` (state
// kFailed, FILL let go): the next engine of the identity rebuilds it once, and the one after a
// second failure is refused with the first failure. A no-op for any other arena.
Status AbandonBuild(Arena::Impl& impl, std::string_view reason);

// What an engine asks OpenShared for: a model (its spec, and its plan once made: a model with
// a fingerprint is planned only when no published arena matches it), or, with a null `want`
// (AttachExisting), whatever is published.
struct ModelWant {
  const ModelSpec* spec = nullptr;
  std::optional<source::ModelPlan> plan;
  uint64_t fingerprint_bytes_read = 0;  // read to match an arena's fingerprint
  // An engine-made arena (engine_arena.cc): a published arena is this one when its identity
  // hash is engine_identity (nothing is planned to know it); otherwise the engine that holds
  // FILL on an empty file plans then and there (it builds its tensors while the others wait).
  uint64_t engine_identity = 0;
  // Plans the arena (MakePlan) and fills it when this engine loads (LoadFresh): the model
  // files, the engine's own writer, or a peer (arena_filler.h). Required.
  ArenaFiller* filler = nullptr;
  // An engine-made arena published only after its engine ran on it (ConfirmBuild); the
  // attempt and first failure are those of the failed build the protocol replaced.
  std::optional<DeferredPublish> deferred;
  Status MakePlan();
};

// The table and fill of an engine-made arena (engine_arena.cc): the library's fingerprint of
// the checkpoint files, and the identity hash of (spec.identity, that fingerprint).
struct EngineIdentity {
  uint64_t hash = 0;
  std::string text;                         // for messages: the engine's identity, escaped
  std::vector<format::SourceRecord> sources;  // the checkpoint files, as fingerprinted
  uint64_t bytes_read = 0;                  // header bytes read to fingerprint them
};
Result<EngineIdentity> IdentifyEngineArena(const EngineArenaSpec& spec);
// Calls spec.declare and turns its answer into a plan (names, dtypes, shapes, sizes and
// alignments checked; offsets assigned).
Result<source::ModelPlan> PlanEngineArena(const EngineArenaSpec& spec, const EngineIdentity& id);
// Calls spec.fill with the writable views of `table`'s tensors in `request.data`, then sets
// every tensor's checksum.
Result<load::LoadResult> FillEngineArena(const EngineArenaSpec& spec,
                                         const load::LoadRequest& request,
                                         format::ArenaTable& table);

// An engine-made arena's filler: PlanEngineArena and FillEngineArena of one spec.
class EngineFiller final : public ArenaFiller {
 public:
  EngineFiller(const EngineArenaSpec& spec, const EngineIdentity& id) : spec_(spec), id_(id) {}
  Result<source::ModelPlan> Plan() override { return PlanEngineArena(spec_, id_); }
  Result<load::LoadResult> Fill(const load::LoadRequest& request,
                                format::ArenaTable& table) override {
    return FillEngineArena(spec_, request, table);
  }
  bool PagesAsWritten() const override { return spec_.pages_as_written; }
  bool HugeAfterBuild() const override { return spec_.huge_after_build; }
  uint64_t FreedAsWritten() const override {
    return spec_.pages_as_written ? spec_.freed_as_written : 0;
  }

 private:
  const EngineArenaSpec& spec_;
  const EngineIdentity& id_;
};

// The shared-file protocol (shared_arena.cc). `want` is null for AttachExisting.
Result<std::unique_ptr<Arena::Impl>> OpenShared(ModelWant* want, const ArenaOptions& options,
                                                spdlog::logger& log);

// A private arena in anonymous memory (private_arena.cc).
Result<std::unique_ptr<Arena::Impl>> OpenPrivate(source::ModelPlan plan,
                                                 const ArenaOptions& options, spdlog::logger& log);

// Whether the arena is mapped (and stays) writable: when a GPU registration is asked for.
// cudaHostRegister of a PROT_READ range needs cudaHostRegisterReadOnly, which some GPUs do
// not support; every other arena is read-only once published.
bool MapWritableForGpu(const ArenaOptions& options);

// Registers the mapping with the GPU named in options (read-only registration when the
// mapping is read-only) and records the outcome in the report. Skips are reported; an error
// only when options.gpu_required.
Status RegisterWithGpu(Arena::Impl& impl, const ArenaOptions& options, spdlog::logger& log);

// Fills report.huge_bytes (and the pinned bytes) from /proc/self.
void MeasureBacking(Arena::Impl& impl);

}  // namespace arena
}  // namespace expert_arena
