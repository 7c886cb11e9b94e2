// A private arena: the same tensors, views and page rules in anonymous memory, for an engine
// started without --shared-expert-arena.
#include <spdlog/spdlog.h>

#include "arena/arena_impl.h"
#include "arena/page_backing.h"
#include "common/units.h"
#include "load/loader.h"
#include "platform/mapping.h"

namespace expert_arena::arena {

Result<std::unique_ptr<Arena::Impl>> OpenPrivate(source::ModelPlan plan,
                                                 const ArenaOptions& options, spdlog::logger& log) {
  auto impl = std::make_unique<Arena::Impl>();
  impl->table = std::move(plan.table);
  EA_ASSIGN_OR_RETURN(impl->mapping,
                      platform::Mapping::MapAnonymous(impl->table.data_bytes, kHugePageBytes));
  double collapse_seconds = 0;
  // Anonymous memory: MADV_HUGEPAGE then fault in; MADV_COLLAPSE mends what faulting left on
  // 4 KiB pages (the fault path does not compact when THP defrag is off).
  HugeDecision huge = ApplyHugePages(options.huge, PageSource::kAnonymous, impl->mapping.data(),
                                     impl->mapping.size(), "private arena", &collapse_seconds);
  EA_RETURN_IF_ERROR(platform::AdviseRange(impl->mapping.data(), impl->mapping.size(),
                                           platform::Advice::kPopulateWrite, "private arena"));
  load::LoadRequest request;
  request.data = impl->mapping.bytes();
  request.reader = options.reader;
  request.progress = options.progress;
  request.logger = &log;
  EA_ASSIGN_OR_RETURN(load::LoadResult loaded, load::LoadTensors(request, impl->table));
  if (!MapWritableForGpu(options)) EA_RETURN_IF_ERROR(impl->mapping.MakeReadOnly());
  impl->report.role = ArenaRole::kPrivate;
  impl->report.backing = "anonymous";
  impl->report.huge_note = huge.note;
  impl->report.collapse_seconds = collapse_seconds;
  impl->report.load_seconds = loaded.seconds;
  impl->report.reader = loaded.reader;
  impl->report.reader_note = loaded.note;
  impl->report.bytes_read = loaded.bytes_read + plan.metadata_bytes_read;
  return impl;
}

}  // namespace expert_arena::arena
