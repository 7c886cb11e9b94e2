// What fills a fresh arena file (docs/arena-protocol.md, "The steps"): the shared-arena
// protocol decides who loads; the engine that does runs LoadFresh, which allocates and maps the
// file, writes its loading header, hands the data region to a filler, checks and publishes.
// Where the bytes come from is the filler's alone: the model files (ModelFilesFiller, the
// loader), an engine's own writer (engine-made arenas, engine_arena.cc) or a peer
// (peer_fill.cc). LoadFresh does not know which.
#pragma once

#include "expert_arena/status.h"
#include "format/arena_table.h"
#include "load/loader.h"
#include "source/model_source.h"

namespace expert_arena::arena {

class ArenaFiller {
 public:
  virtual ~ArenaFiller() = default;
  // The plan of the arena (its table: tensors, offsets, identity). Called by the engine that
  // has to know it, at most once per attempt: before the protocol when no published arena can
  // be matched without it, or when the protocol finds nothing to attach to.
  virtual Result<source::ModelPlan> Plan() = 0;
  // Writes every tensor of `table` into request.data (the data region of the new file, laid
  // out by `table`) and leaves every tensor's checksum in `table` set and true of the bytes.
  // With request.ready_front, writes only below the front. Whatever it returns but ok, the file
  // is removed and nothing is published.
  virtual Result<load::LoadResult> Fill(const load::LoadRequest& request,
                                        format::ArenaTable& table) = 0;
  // Whether the pages are made as the filler asks for them (request.permit_pages), not all
  // before Fill: an engine's writer that lets go of its own copy of each tensor once written.
  virtual bool PagesAsWritten() const { return false; }
  // EngineArenaSpec::huge_after_build.
  virtual bool HugeAfterBuild() const { return false; }
  // With PagesAsWritten: the bytes of its own memory it frees as it writes (the memory check
  // counts the build's peak, not the arena on top of them).
  virtual uint64_t FreedAsWritten() const { return 0; }
};

// The model files of a spec, read by the loader (load::LoadTensors).
class ModelFilesFiller final : public ArenaFiller {
 public:
  explicit ModelFilesFiller(const ModelSpec& spec) : spec_(spec) {}
  Result<source::ModelPlan> Plan() override { return source::PlanModel(spec_); }
  Result<load::LoadResult> Fill(const load::LoadRequest& request,
                                format::ArenaTable& table) override {
    return load::LoadTensors(request, table);
  }

 private:
  const ModelSpec& spec_;
};

}  // namespace expert_arena::arena
