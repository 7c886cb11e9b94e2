#include "pages/page_hooks.h"

namespace expert_arena::pages::test_hooks {
namespace {
std::function<void(size_t)>& BeforePagePiece() {
  static std::function<void(size_t)> hook;
  return hook;
}
}  // namespace

void SetBeforePagePiece(std::function<void(size_t)> hook) { BeforePagePiece() = std::move(hook); }
void RunBeforePagePiece(size_t piece) {
  if (BeforePagePiece()) BeforePagePiece()(piece);
}

}  // namespace expert_arena::pages::test_hooks
