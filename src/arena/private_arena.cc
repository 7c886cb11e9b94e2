// A private arena: the same tensors, views and page rules in anonymous memory, for an engine
// started without --shared-expert-arena.
#include <spdlog/spdlog.h>

#include <chrono>

#include "arena/arena_impl.h"
#include "arena/numa_placement.h"
#include "pages/page_backing.h"
#include "common/units.h"
#include "load/loader.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

namespace expert_arena::arena {

using pages::ApplyHugePages;
using pages::BackgroundPages;
using pages::DecideHugePages;
using pages::HugeDecision;
using pages::PageSource;

Result<std::unique_ptr<Arena::Impl>> OpenPrivate(source::ModelPlan plan,
                                                 const ArenaOptions& options, spdlog::logger& log) {
  auto impl = std::make_unique<Arena::Impl>();
  impl->table = std::move(plan.table);
  EA_ASSIGN_OR_RETURN(impl->mapping,
                      platform::Mapping::MapAnonymous(impl->table.data_bytes, kHugePageBytes));
  // The mapping's own policy, before its first fault (docs/numa.md).
  EA_ASSIGN_OR_RETURN(PagePlacement placement, ResolvePlacement(options));
  if (placement.policy != platform::MemPolicy::kDefault) {
    Status bound = platform::BindRange(impl->mapping.data(), impl->mapping.size(),
                                       placement.policy, placement.nodes, "private arena");
    if (!bound.ok() && placement.required) return bound.WithContext("--numa " + placement.asked);
    if (!bound.ok()) impl->report.numa_note = "first touch (--numa auto: " + bound.message() + ")";
  }
  impl->report.numa = placement.asked;
  double collapse_seconds = 0;
  load::LoadRequest request;
  request.data = impl->mapping.bytes();
  request.reader = ModelReaderName(options.reader);
  request.progress = options.progress;
  request.logger = &log;
  request.logger_is_engines = options.logger != nullptr;
  HugeDecision huge;
  Result<load::LoadResult> loaded = Internal("private arena: not loaded");
  if (options.pages_alongside_load) {
    // Pages faulted in (and collapsed, when asked) piece by piece, front to back, while the
    // loader fills the pieces already made (BackgroundPages).
    auto blocks = platform::FreeHugeBlocks();
    huge = DecideHugePages(options.huge, PageSource::kAnonymous, impl->mapping.size(),
                           blocks.ok() ? *blocks : 0);
    if (huge.ask) {
      Status advise = platform::AdviseRange(impl->mapping.data(), impl->mapping.size(),
                                            platform::Advice::kHugePage, "private arena");
      if (!advise.ok()) huge.note += "; " + advise.message();
    }
    BackgroundPages pages(nullptr, impl->mapping.data(), impl->mapping.size(), "private arena",
                          huge.ask);
    request.ready_front = &pages.front();
    loaded = load::LoadTensors(request, impl->table);
    const auto load_done = std::chrono::steady_clock::now();
    EA_RETURN_IF_ERROR(loaded.status());  // the pages stop (destructor); their error is here
    EA_RETURN_IF_ERROR(pages.Finish());
    if (huge.ask) collapse_seconds = pages.seconds();
    huge.note += pages.Note(load_done);
  } else {
    // Anonymous memory: MADV_HUGEPAGE then fault in; MADV_COLLAPSE mends what faulting left on
    // 4 KiB pages (the fault path does not compact when THP defrag is off).
    huge = ApplyHugePages(options.huge, PageSource::kAnonymous, impl->mapping.data(),
                          impl->mapping.size(), "private arena", &collapse_seconds);
    EA_RETURN_IF_ERROR(platform::AdviseRange(impl->mapping.data(), impl->mapping.size(),
                                             platform::Advice::kPopulateWrite, "private arena"));
    loaded = load::LoadTensors(request, impl->table);
    EA_RETURN_IF_ERROR(loaded.status());
  }
  if (!MapWritableForGpu(options)) EA_RETURN_IF_ERROR(impl->mapping.MakeReadOnly());
  impl->report.role = ArenaRole::kPrivate;
  impl->report.backing = "anonymous";
  impl->report.huge_note = huge.note;
  impl->report.collapse_seconds = collapse_seconds;
  impl->report.load_seconds = loaded->seconds;
  impl->report.reader = loaded->reader;
  impl->report.reader_note = loaded->note;
  impl->report.bytes_read = loaded->bytes_read + plan.metadata_bytes_read;
  return impl;
}

}  // namespace expert_arena::arena
