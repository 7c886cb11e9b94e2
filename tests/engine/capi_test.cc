// The C interface from outside the library: C programs that include only expert_arena.h
// and link only libexpert_arena.so (capi_c_program: arenas; capi_stream_c_program: streaming).
// Python's ctypes use of the same library is tested in tests/python/test_capi_ctypes.py.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "test_util.h"

namespace expert_arena::testing {
namespace {

TEST(CApiTest, CProgramPassesEveryCheck) {
  ScopedDataFile model(3 * 1024 * 1024 + 123, 42);
  ScopedPath arena("capi.arena");
  Child c = SpawnProgram(BinDir() + "/capi_c_program", {model.path(), arena.path()});
  EXPECT_EQ(c.Wait(60), 0);
  EXPECT_NE(c.Output().find("all checks passed"), std::string::npos) << c.Output();
}

// An engine-made arena from C: a failing declare publishes nothing; the first engine builds,
// a second process attaches without declaring or filling.
TEST(CApiTest, CProgramBuildsAnEngineArenaAndAnotherAttaches) {
  ScopedDataFile checkpoint(4096, 7);
  ScopedPath arena("capi-engine.arena");
  Child failing = SpawnProgram(BinDir() + "/capi_c_program",
                               {"--engine-fail", arena.path(), checkpoint.path()});
  EXPECT_EQ(failing.Wait(60), 0) << failing.Output();
  Child first = SpawnProgram(BinDir() + "/capi_c_program",
                             {"--engine", arena.path(), checkpoint.path()});
  EXPECT_EQ(first.Wait(60), 0);
  EXPECT_NE(first.Output().find("role loaded declared 1 filled 1"), std::string::npos)
      << first.Output();
  Child second = SpawnProgram(BinDir() + "/capi_c_program",
                              {"--engine", arena.path(), checkpoint.path()});
  EXPECT_EQ(second.Wait(60), 0);
  EXPECT_NE(second.Output().find("role attached declared 0 filled 0"), std::string::npos)
      << second.Output();
}

// A C engine built against a later header declares its tensors in a larger struct (size set
// to it): the library steps through the array by that size and reads both tensors right.
TEST(CApiTest, CProgramWithAGrownTensorStructBuildsAnEngineArena) {
  ScopedDataFile checkpoint(4096, 7);
  ScopedPath arena("capi-engine-grown.arena");
  Child c = SpawnProgram(BinDir() + "/capi_c_program",
                         {"--engine-grown", arena.path(), checkpoint.path()});
  EXPECT_EQ(c.Wait(60), 0) << c.Output();
  EXPECT_NE(c.Output().find("role loaded declared 1 filled 1"), std::string::npos) << c.Output();
  EXPECT_NE(c.Output().find("all checks passed"), std::string::npos) << c.Output();
}

// Each file that is not a model, opened by a C program with the default format into a shared
// arena: refused with a negative errno and a message naming the file and what it is; nothing
// is left in the arena's directory.
TEST(CApiTest, CProgramSeesFilesThatAreNotModelsRefused) {
  ScopedArenaDir files("capi-not-a-model");
  ScopedArenaDir arenas("capi-refused");
  for (const NotAModel& c : NotAModels()) {
    SCOPED_TRACE(c.name);
    const std::string path = files.File(c.name);
    {
      std::ofstream out(path, std::ios::binary);
      out << c.bytes;
    }
    Child child = SpawnProgram(BinDir() + "/capi_c_program",
                               {"--refused", path, arenas.File("m.arena"), c.words});
    EXPECT_EQ(child.Wait(60), 0) << child.Output();
    EXPECT_NE(child.Output().find("all checks passed"), std::string::npos) << child.Output();
    EXPECT_TRUE(arenas.entries().empty());
  }
}

// The C interface of tensor streaming (expert_arena_stream.h), as a C program uses it, one
// group of checks per test: the params and struct sizes; put, open and reserve; pending
// blocks and fork; strict mode and spill; threads; and processes (the same program as a
// consumer child, a producer child whose tensor outlives its exit, and a killed producer
// whose segments a sweep removes). Private directories, empty at the end.
class CStreamProgramTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CStreamProgramTest, PassesItsChecks) {
  ScopedArenaDir dir("capi-stream");
  ScopedArenaDir spill("capi-stream-spill");
  Child c = SpawnProgram(BinDir() + "/capi_stream_c_program",
                         {"check", GetParam(), dir.path(), spill.path()});
  EXPECT_EQ(c.Wait(60), 0) << c.Output();
  EXPECT_NE(c.Output().find("all checks of " + GetParam() + " passed"), std::string::npos)
      << c.Output();
  EXPECT_TRUE(dir.entries().empty());
  EXPECT_TRUE(spill.entries().empty());
}

INSTANTIATE_TEST_SUITE_P(Groups, CStreamProgramTest,
                         ::testing::Values("params", "put-open-reserve", "pending-fork",
                                           "strict-spill", "threads", "processes"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& ch : name) {
                             if (ch == '-') ch = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace expert_arena::testing
