// NameMap: every name inserted once is found with its value, a second insert of a name keeps
// the first value and says so, absent names are absent, across growth from a small start.
#include "common/name_map.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace expert_arena {
namespace {

TEST(NameMapTest, InsertFindAndDuplicatesAcrossGrowth) {
  std::vector<std::string> names;
  for (int l = 0; l < 40; ++l) {
    for (int e = 0; e < 64; ++e) {
      names.push_back("model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) +
                      ".up_proj.weight");
    }
  }
  names.push_back("");  // the empty name is a name like any other
  for (size_t expected : {size_t{0}, size_t{3}, names.size()}) {
    NameMap<uint32_t> map(expected);
    for (uint32_t i = 0; i < names.size(); ++i) {
      auto [value, inserted] = map.Insert(names[i], i);
      ASSERT_TRUE(inserted) << names[i];
      ASSERT_EQ(*value, i);
    }
    EXPECT_EQ(map.size(), names.size());
    for (uint32_t i = 0; i < names.size(); ++i) {
      const std::string again = names[i];  // another string with the same bytes
      auto [value, inserted] = map.Insert(again, 99999);
      EXPECT_FALSE(inserted) << again;
      EXPECT_EQ(*value, i);
      ASSERT_NE(map.Find(again), nullptr);
      EXPECT_EQ(*map.Find(again), i);
    }
    EXPECT_EQ(map.size(), names.size());
    EXPECT_FALSE(map.Contains("model.layers.40.mlp.experts.0.up_proj.weight"));
    EXPECT_FALSE(map.Contains("model.layers.0.mlp.experts.0.up_proj.weigh"));
  }
}

}  // namespace
}  // namespace expert_arena
