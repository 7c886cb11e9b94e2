// The C interface from outside the library: a C program that includes only
// expert_arena.h and links only libexpert_arena.so, and the Python ctypes example.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "test_util.h"

namespace expert_arena::testing {
namespace {

// Why python3 cannot load the library under test, or "" when it can.
std::string PythonSkipReason() {
#ifdef EA_SANITIZED_LIBRARY
  return "sanitizer build: python3 cannot load an instrumented libexpert_arena.so (the "
         "sanitizer runtime must come first)";
#else
  if (access(EA_PYTHON3, X_OK) != 0) return std::string("no python3 at ") + EA_PYTHON3;
  return "";
#endif
}

TEST(CApiTest, CProgramPassesEveryCheck) {
  ScopedDataFile model(3 * 1024 * 1024 + 123, 42);
  ScopedPath arena("capi.arena");
  Child c = SpawnProgram(BinDir() + "/capi_c_program", {model.path(), arena.path()});
  EXPECT_EQ(c.Wait(60), 0);
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

// attach_arena.py reads a tensor's bytes through ctypes and compares them with the model
// file at the offset `expert-arena info --json` names.
TEST(CApiTest, PythonCtypesExampleReadsTheSourceBytes) {
  if (std::string why = PythonSkipReason(); !why.empty()) GTEST_SKIP() << why;
  ScopedDataFile model(5 * 1024 * 1024 + 7, 43);
  ScopedPath arena("ctypes.arena");
  Child load = SpawnProgram(BinDir() + "/expert-arena", {"load", "--format", "raw", "--model",
                                                         model.path(), "--arena", arena.path()});
  ASSERT_EQ(load.Wait(60), 0);
  Child py = SpawnProgram(EA_PYTHON3, {EA_ATTACH_SCRIPT, "--lib", EA_LIBRARY, arena.path(),
                                       "--check", BinDir() + "/expert-arena"});
  EXPECT_EQ(py.Wait(60), 0) << py.Output();
  EXPECT_NE(py.Output().find("attached"), std::string::npos) << py.Output();
  EXPECT_NE(py.Output().find("equal the model file"), std::string::npos) << py.Output();
}

// The same on a GGUF model: an expert tensor that starts deep inside the model file.
TEST(CApiTest, PythonCtypesExampleReadsAnExpertOfAGgufModel) {
  if (std::string why = PythonSkipReason(); !why.empty()) GTEST_SKIP() << why;
  ScopedPath model("model.gguf", "/tmp");
  Child gen =
      SpawnProgram(BinDir() + "/expert-arena",
                   {"gen-model", "--format", "gguf", "--out", model.path(), "--layers", "2",
                    "--experts", "4", "--hidden", "128", "--ffn", "256", "--dtype", "q8_0"});
  ASSERT_EQ(gen.Wait(60), 0);
  ScopedPath arena("ctypes-gguf.arena");
  Child load = SpawnProgram(BinDir() + "/expert-arena",
                            {"load", "--model", model.path(), "--arena", arena.path()});
  ASSERT_EQ(load.Wait(60), 0);
  Child py = SpawnProgram(EA_PYTHON3,
                          {EA_ATTACH_SCRIPT, "--lib", EA_LIBRARY, arena.path(), "--tensor",
                           "blk.1.ffn_down_exps.weight", "--check", BinDir() + "/expert-arena"});
  EXPECT_EQ(py.Wait(60), 0) << py.Output();
  EXPECT_NE(py.Output().find("tensor blk.1.ffn_down_exps.weight: q8_0 [256, 128, 4]"),
            std::string::npos)
      << py.Output();
  EXPECT_NE(py.Output().find("equal the model file"), std::string::npos) << py.Output();
}

TEST(CApiTest, PythonCtypesExampleReportsAMissingArena) {
  if (std::string why = PythonSkipReason(); !why.empty()) GTEST_SKIP() << why;
  ScopedPath arena("absent.arena");
  Child py = SpawnProgram(EA_PYTHON3, {EA_ATTACH_SCRIPT, "--lib", EA_LIBRARY, arena.path()});
  EXPECT_EQ(py.Wait(60), 1);
}

}  // namespace
}  // namespace expert_arena::testing
