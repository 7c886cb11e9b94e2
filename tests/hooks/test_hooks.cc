// The tests' side of the library's fault-injection points (src/common/fault_points.h): the
// extern "C" functions the library calls when a process defines them, and what they run.
// Linked into the test binaries only (expert_arena_test_hooks): a binary that sets a hook or
// counts plans pulls this file in, and the executable exports the functions to
// libexpert_arena.so's weak references.
#include <atomic>
#include <functional>

#include "arena/test_hooks.h"
#include "common/fault_points.h"
#include "pages/page_hooks.h"
#include "platform/ring_hooks.h"

namespace expert_arena {
namespace {

std::function<void()>& BeforePublish() {
  static std::function<void()> hook;
  return hook;
}
std::function<void()>& AfterRemoveOpened() {
  static std::function<void()> hook;
  return hook;
}
std::function<void(size_t)>& BeforePagePiece() {
  static std::function<void(size_t)> hook;
  return hook;
}
std::atomic<size_t> plans_made{0};
std::function<int()>& RingSubmit() {
  static std::function<int()> hook;
  return hook;
}

}  // namespace

namespace arena::test_hooks {

void SetBeforePublish(std::function<void()> hook) { BeforePublish() = std::move(hook); }
void SetAfterRemoveOpened(std::function<void()> hook) { AfterRemoveOpened() = std::move(hook); }
size_t PlansMade() { return plans_made.load(); }

}  // namespace arena::test_hooks

namespace platform::test_hooks {

void SetRingSubmit(std::function<int()> hook) { RingSubmit() = std::move(hook); }

}  // namespace platform::test_hooks

namespace pages::test_hooks {

void SetBeforePagePiece(std::function<void(size_t)> hook) { BeforePagePiece() = std::move(hook); }

}  // namespace pages::test_hooks
}  // namespace expert_arena

extern "C" {

void expert_arena_fault_before_publish() {
  if (expert_arena::BeforePublish()) expert_arena::BeforePublish()();
}
void expert_arena_fault_after_remove_opened() {
  if (expert_arena::AfterRemoveOpened()) expert_arena::AfterRemoveOpened()();
}
void expert_arena_fault_before_page_piece(size_t piece) {
  if (expert_arena::BeforePagePiece()) expert_arena::BeforePagePiece()(piece);
}
void expert_arena_fault_plan_made() { expert_arena::plans_made.fetch_add(1); }
int expert_arena_fault_ring_submit() {
  return expert_arena::RingSubmit() ? expert_arena::RingSubmit()() : 0;
}

}  // extern "C"
