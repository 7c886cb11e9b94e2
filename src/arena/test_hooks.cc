#include "arena/test_hooks.h"

#include <atomic>

namespace expert_arena::arena::test_hooks {
namespace {
std::function<void()>& BeforePublish() {
  static std::function<void()> hook;
  return hook;
}
std::function<void()>& AfterRemoveOpened() {
  static std::function<void()> hook;
  return hook;
}
}  // namespace

void SetBeforePublish(std::function<void()> hook) { BeforePublish() = std::move(hook); }
void RunBeforePublish() {
  if (BeforePublish()) BeforePublish()();
}

void SetAfterRemoveOpened(std::function<void()> hook) { AfterRemoveOpened() = std::move(hook); }
void RunAfterRemoveOpened() {
  if (AfterRemoveOpened()) AfterRemoveOpened()();
}

namespace {
std::atomic<size_t> plans_made{0};
}  // namespace

size_t PlansMade() { return plans_made.load(); }
void CountPlan() { plans_made.fetch_add(1); }

}  // namespace expert_arena::arena::test_hooks
