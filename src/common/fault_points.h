// Fault-injection points of the multi-process tests, where the library runs nothing of the
// tests. Each point is a weak, undefined extern "C" function: in every process but a test's
// (which links tests/hooks, where they are defined and where a test sets what they run) the
// dynamic linker leaves it null and the point does nothing. libexpert_arena.so defines none of
// them (tests/package/shipped_symbols.sh checks it).
#pragma once

#include <cstddef>

extern "C" {
// After an arena's data is loaded and checked, just before its header is published.
[[gnu::weak]] void expert_arena_fault_before_publish();
// In RemoveArenaFile after it opened the file, before it takes the locks.
[[gnu::weak]] void expert_arena_fault_after_remove_opened();
// In a BackgroundPages worker before it makes piece `piece` (from several threads at once).
[[gnu::weak]] void expert_arena_fault_before_page_piece(size_t piece);
// Each time this process plans a model for a shared arena.
[[gnu::weak]] void expert_arena_fault_plan_made();
// Before each io_uring submit (platform/io_ring.cc): a negative errno fails that submit as the
// kernel would, before the kernel takes any of the queued requests; 0 lets it run.
[[gnu::weak]] int expert_arena_fault_ring_submit();
}

namespace expert_arena::fault_points {

inline void BeforePublish() {
  if (expert_arena_fault_before_publish != nullptr) expert_arena_fault_before_publish();
}
inline void AfterRemoveOpened() {
  if (expert_arena_fault_after_remove_opened != nullptr) expert_arena_fault_after_remove_opened();
}
inline void BeforePagePiece(size_t piece) {
  if (expert_arena_fault_before_page_piece != nullptr) expert_arena_fault_before_page_piece(piece);
}
inline void PlanMade() {
  if (expert_arena_fault_plan_made != nullptr) expert_arena_fault_plan_made();
}
inline int RingSubmit() {
  return expert_arena_fault_ring_submit != nullptr ? expert_arena_fault_ring_submit() : 0;
}

}  // namespace expert_arena::fault_points
