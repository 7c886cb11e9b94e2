#include "arena/test_hooks.h"

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
std::function<void(size_t)>& BeforePagePiece() {
  static std::function<void(size_t)> hook;
  return hook;
}
}  // namespace

void SetBeforePagePiece(std::function<void(size_t)> hook) { BeforePagePiece() = std::move(hook); }
void RunBeforePagePiece(size_t piece) {
  if (BeforePagePiece()) BeforePagePiece()(piece);
}

void SetBeforePublish(std::function<void()> hook) { BeforePublish() = std::move(hook); }
void RunBeforePublish() {
  if (BeforePublish()) BeforePublish()();
}

void SetAfterRemoveOpened(std::function<void()> hook) { AfterRemoveOpened() = std::move(hook); }
void RunAfterRemoveOpened() {
  if (AfterRemoveOpened()) AfterRemoveOpened()();
}

}  // namespace expert_arena::arena::test_hooks
