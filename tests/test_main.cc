// main() of every test binary: a child role when --ea-child-role=NAME is the first argument,
// the GoogleTest suite otherwise.
#include <gtest/gtest.h>

namespace expert_arena::testing {
int RunChildRoleIfAsked(int argc, char** argv, bool* ran);
}

int main(int argc, char** argv) {
  bool ran = false;
  int code = expert_arena::testing::RunChildRoleIfAsked(argc, argv, &ran);
  if (ran) return code;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
