// The safetensors reader: every dtype, single and sharded models, and damaged headers.
#include <cstring>
#include <filesystem>

#include "expert_arena/arena.h"
#include "generators/safetensors_writer.h"
#include "generators/synthetic_model.h"
#include "format/dtypes.h"
#include "source/model_source.h"
#include "source/safetensors_reader.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena::source {
namespace {

using testing::ScopedDir;

Status FillPattern(size_t tensor, uint64_t offset, std::span<std::byte> out) {
  for (size_t k = 0; k < out.size(); ++k) {
    out[k] = static_cast<std::byte>(((offset + k) * 29 + tensor * 101) & 0xff);
  }
  return Status::Ok();
}

void ExpectError(const Status& s, std::initializer_list<const char*> words) {
  ASSERT_FALSE(s.ok()) << "expected an error with " << *words.begin();
  for (const char* w : words) {
    EXPECT_NE(s.message().find(w), std::string::npos)
        << "missing '" << w << "' in: " << s.message();
  }
}

Status Plan(const std::vector<std::string>& files, bool all = true) {
  ModelSpec spec;
  spec.files = files;
  spec.select_all = all;
  auto plan = PlanModel(spec);
  return plan.ok() ? Status::Ok() : plan.status();
}

// Every arena tensor equals the file bytes at the offset the header defines, computed by the
// test's own JSON parse of each file.
void ExpectArenaMatchesFiles(const Arena& arena, const std::vector<std::string>& files) {
  size_t seen = 0;
  for (const std::string& file : files) {
    for (const auto& [name, t] : testing::ParseSafetensorsIndependently(file)) {
      auto view = arena.Find(name);
      if (!view) continue;
      ++seen;
      ASSERT_EQ(view->bytes.size(), t.bytes) << name;
      EXPECT_EQ(view->dtype, t.dtype);
      auto want = testing::ReadRange(file, t.offset, t.bytes);
      EXPECT_EQ(std::memcmp(view->bytes.data(), want.data(), t.bytes), 0) << name;
    }
  }
  EXPECT_EQ(seen, arena.tensor_count());
}

TEST(SafetensorsTest, EveryDtypeRoundTrips) {
  ScopedDir dir("st-dtypes");
  SafetensorsWriter w;
  w.AddMetadata("format", "pt");
  for (const SafetensorsDtype& d : AllSafetensorsDtypes()) {
    ASSERT_OK(w.AddTensor(std::string("model.layers.0.mlp.experts.0.") + d.name, d.name, {3, 8}));
  }
  std::string path = dir.File("model.safetensors");
  ASSERT_OK(w.WriteFile(path, FillPattern));
  ASSERT_OK_AND_ASSIGN(SafetensorsFile f, ReadSafetensors(path));
  EXPECT_EQ(f.metadata.at("format"), "pt");
  EXPECT_EQ(f.data_offset % 8, 0u);
  ASSERT_EQ(f.tensors.size(), AllSafetensorsDtypes().size());

  ASSERT_OK_AND_ASSIGN(Arena arena, Arena::Open({.files = {path}}, {}));
  ASSERT_EQ(arena.tensor_count(), AllSafetensorsDtypes().size());
  ExpectArenaMatchesFiles(arena, {path});
  auto f8 = arena.Find("model.layers.0.mlp.experts.0.F8_E4M3");
  ASSERT_TRUE(f8);
  EXPECT_EQ(f8->bytes.size(), 24u);
  EXPECT_EQ(f8->shape[0], 3u);  // as in the header
  EXPECT_EQ(f8->shape[1], 8u);
  EXPECT_EQ(arena.Find("model.layers.0.mlp.experts.0.BOOL")->bytes.size(), 24u);
  EXPECT_EQ(arena.Find("model.layers.0.mlp.experts.0.F4")->bytes.size(), 12u);
  EXPECT_EQ(arena.Find("model.layers.0.mlp.experts.0.F64")->bytes.size(), 192u);
}

TEST(SafetensorsTest, ShardedModelFromIndexDirectoryOrFiles) {
  ScopedDir dir("st-sharded");
  SyntheticModelOptions o;
  o.format = "safetensors";
  o.out = dir.File("model");
  o.layers = 3;
  o.experts = 4;
  o.hidden = 32;
  o.ffn = 48;
  o.dtype = "bf16";
  o.shards = 3;
  ASSERT_OK_AND_ASSIGN(SyntheticModelReport report, WriteSyntheticModel(o));
  ASSERT_EQ(report.files.size(), 4u);  // three shards and the index
  std::vector<std::string> shards(report.files.begin(), report.files.begin() + 3);

  const std::string index = o.out + "/model.safetensors.index.json";
  for (const std::vector<std::string>& files :
       {std::vector<std::string>{index}, std::vector<std::string>{o.out}, shards}) {
    ModelSpec spec;
    spec.files = files;
    ASSERT_OK_AND_ASSIGN(ModelPlan plan, PlanModel(spec));
    EXPECT_EQ(plan.format, "safetensors");
    EXPECT_EQ(plan.table.sources.size(), 3u);
    EXPECT_EQ(plan.table.tensors.size(), 3u * 4 * 3);  // the routed experts
    EXPECT_EQ(plan.table.model_tensors_total, 1u + 3 * (2 + 4 * 3));
    EXPECT_EQ(plan.table.model_bytes_total, report.tensor_bytes);
    ASSERT_OK_AND_ASSIGN(Arena arena, Arena::Open(spec, {}));
    ExpectArenaMatchesFiles(arena, shards);
  }
}

TEST(SafetensorsTest, IndexErrors) {
  ScopedDir dir("st-index");
  SafetensorsWriter w;
  ASSERT_OK(w.AddTensor("a.experts.0.w1", "F32", {4}));
  ASSERT_OK(w.WriteFile(dir.File("s1.safetensors"), FillPattern));
  auto write_index = [&](const std::string& text) {
    std::vector<std::byte> bytes(text.size());
    std::memcpy(bytes.data(), text.data(), text.size());
    testing::WriteFileBytes(dir.File("model.safetensors.index.json"), bytes);
    return dir.File("model.safetensors.index.json");
  };
  ExpectError(Plan({write_index(R"({"weight_map": {"a.experts.0.w1": "../etc/passwd"}})")}),
              {"index.json", "not a file name"});
  ExpectError(Plan({write_index(R"({"weight_map": {"b": "s1.safetensors"}})")}),
              {"index.json", "tensor b", "does not hold it"});
  ExpectError(Plan({write_index(R"({"weight_map": {"a.experts.0.w1": "missing.safetensors"}})")}),
              {"missing.safetensors"});
  ExpectError(Plan({write_index(R"({"weight_map": [1, 2]})")}), {"weight_map"});
  // A second shard: a name mapped to the shard that does not hold it; a name held by both
  // shards (mapped to either) is refused when the model is planned, naming both.
  SafetensorsWriter w2;
  ASSERT_OK(w2.AddTensor("a.experts.1.w1", "F32", {4}));
  ASSERT_OK(w2.WriteFile(dir.File("s2.safetensors"), FillPattern));
  ExpectError(
      Plan({write_index(
          R"({"weight_map": {"a.experts.0.w1": "s1.safetensors", "a.experts.1.w1": "s1.safetensors"}})")}),
      {"index.json", "tensor a.experts.1.w1", "does not hold it"});
  SafetensorsWriter both;
  ASSERT_OK(both.AddTensor("a.experts.0.w1", "F32", {4}));
  ASSERT_OK(both.AddTensor("a.experts.1.w1", "F32", {4}));
  ASSERT_OK(both.WriteFile(dir.File("s2.safetensors"), FillPattern));
  ExpectError(
      Plan({write_index(
          R"({"weight_map": {"a.experts.0.w1": "s1.safetensors", "a.experts.1.w1": "s2.safetensors"}})")}),
      {"a.experts.0.w1", "appears in both", "s1.safetensors", "s2.safetensors"});
  {
    SafetensorsWriter s1;  // s1 also holds a tensor only it has, so the index can name it
    ASSERT_OK(s1.AddTensor("a.experts.0.w1", "F32", {4}));
    ASSERT_OK(s1.AddTensor("a.experts.2.w1", "F32", {4}));
    ASSERT_OK(s1.WriteFile(dir.File("s1.safetensors"), FillPattern));
    ExpectError(
        Plan({write_index(
            R"({"weight_map": {"a.experts.0.w1": "s2.safetensors", "a.experts.1.w1": "s2.safetensors", "a.experts.2.w1": "s1.safetensors"}})")}),
        {"a.experts.0.w1", "appears in both", "s1.safetensors", "s2.safetensors"});
    ExpectError(
        Plan({write_index(
            R"({"weight_map": {"a.experts.0.w1": "s2.safetensors", "a.experts.1.w1": "s1.safetensors", "a.experts.2.w1": "s1.safetensors"}})")}),
        {"index.json", "tensor a.experts.1.w1", "does not hold it"});
    ASSERT_OK(w.WriteFile(dir.File("s1.safetensors"), FillPattern));
  }
  ExpectError(Plan({write_index(R"({not json)")}), {"index.json", "not valid JSON"});
  EXPECT_OK(Plan(
      {write_index(R"({"metadata": {}, "weight_map": {"a.experts.0.w1": "s1.safetensors"}})")}));
}

// A file with `json` as its header and `data_bytes` of data.
std::string WriteRaw(const ScopedDir& dir, const std::string& json, uint64_t data_bytes,
                     std::optional<uint64_t> length = std::nullopt) {
  std::vector<std::byte> bytes(8 + json.size() + data_bytes, std::byte{1});
  uint64_t n = length.value_or(json.size());
  std::memcpy(bytes.data(), &n, 8);
  std::memcpy(bytes.data() + 8, json.data(), json.size());
  std::string path = dir.File("bad.safetensors");
  testing::WriteFileBytes(path, bytes);
  return path;
}

// Found by fuzz_safetensors_sharded: names from a hostile index or header reached the error
// messages with their control bytes ("tensor \x1b[31m... is mapped to ..."), so the model
// could drive the terminal of whoever read the error. Weight-map keys are tensor names and are
// refused like them; shard names with a control byte are not plain file names; dtypes and
// metadata keys are quoted escaped (EscapeForMessage).
TEST(SafetensorsTest, IndexAndHeaderMessagesNeverQuoteControlBytes) {
  ScopedDir dir("st-index-control");
  SafetensorsWriter w;
  ASSERT_OK(w.AddTensor("a.experts.0.w1", "F32", {4}));
  ASSERT_OK(w.WriteFile(dir.File("s1.safetensors"), FillPattern));
  auto write_file = [&](const std::string& name, const std::string& text) {
    std::vector<std::byte> bytes(text.size());
    std::memcpy(bytes.data(), text.data(), text.size());
    testing::WriteFileBytes(dir.File(name), bytes);
    return dir.File(name);
  };
  auto expect_clean = [](const Status& s) {
    ASSERT_FALSE(s.ok());
    for (char c : s.message()) {
      const auto byte = static_cast<unsigned char>(c);
      EXPECT_TRUE(byte >= 0x20 && byte != 0x7f) << "control byte in: " << s.message();
    }
  };
  const std::string index = "model.safetensors.index.json";
  Status s = Plan({write_file(index, R"({"weight_map": {"\u001b[31mred": "s1.safetensors"}})")});
  ExpectError(s, {"index.json", "a weight_map key", "control byte 0x1b at byte 0"});
  expect_clean(s);
  s = Plan({write_file(index, R"({"weight_map": {"a.experts.0.w1": "s\u001b1.safetensors"}})")});
  ExpectError(s, {"index.json", "names s\\x1b1.safetensors, not a file name"});
  expect_clean(s);
  // A header's dtype and metadata key, through a shard.
  write_file(index, R"({"weight_map": {"t": "bad.safetensors"}})");
  WriteRaw(dir, R"({"t":{"dtype":"\u001b]0;x\u0007","shape":[2],"data_offsets":[0,2]}})", 16);
  s = Plan({dir.File(index)});
  ExpectError(s, {"unknown dtype \\x1b]0;x\\x07"});
  expect_clean(s);
  WriteRaw(dir, R"({"__metadata__":{"\u001b[2J":1}})", 0);
  s = Plan({dir.File("bad.safetensors")});
  ExpectError(s, {"__metadata__ \\x1b[2J is not a string"});
  expect_clean(s);
}

TEST(SafetensorsDamageTest, EachLieIsAClearError) {
  ScopedDir dir("st-damage");
  auto plan = [&](const std::string& json, uint64_t data, std::optional<uint64_t> length = {}) {
    std::string path = WriteRaw(dir, json, data, length);
    // Detection trusts the length only when it fits; read directly to see the reader's error.
    auto f = ReadSafetensors(path);
    return f.ok() ? Status::Ok() : f.status();
  };
  const std::string ok = R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  EXPECT_OK(plan(ok, 16));
  ExpectError(plan(ok, 16, 1ull << 40), {"bad.safetensors", "header length", "limit"});
  ExpectError(plan(ok, 16, ok.size() + 100), {"bad.safetensors", "past the end"});
  ExpectError(plan(ok, 8), {"bad.safetensors", "tensor t", "past the end of the data"});
  ExpectError(plan(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 16),
              {"tensor t", "span 12 bytes", "takes 16"});
  ExpectError(plan(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", 16),
              {"tensor t", "backwards"});
  ExpectError(plan(R"({"t":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}})", 16),
              {"tensor t", "shape"});
  ExpectError(plan(R"({"t":{"dtype":"Q9","shape":[2],"data_offsets":[0,2]}})", 16),
              {"tensor t", "unknown dtype Q9"});
  ExpectError(
      plan(
          R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,0]}})",
          16),
      {"tensor t", "overflow"});
  ExpectError(plan(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                   R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                   32),
              {"bad.safetensors", "overlaps", "tensor b", "tensor a"});
  // Found by fuzz_safetensors' sibling fuzz_gguf: an empty tensor sorted between two
  // overlapping ones hid the overlap.
  ExpectError(plan(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                   R"("e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},)"
                   R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                   32),
              {"bad.safetensors", "overlaps", "tensor b", "tensor a"});
  ExpectError(plan(R"({"t":{"dtype":"F32","shape":[2]}})", 16), {"tensor t", "data_offsets"});
  ExpectError(plan("{\"t\\u001b[2J\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16),
              {"bad.safetensors", "a tensor key: the name holds the control byte 0x1b at byte 1"});
  ExpectError(plan(R"([1,2,3])", 16), {"not a JSON object"});
  ExpectError(plan(R"({"t": )", 16), {"not valid JSON"});
  ExpectError(plan(R"({"__metadata__":{"k":1}})", 0), {"__metadata__"});

  // Truncated: the data ends before the last tensor does.
  SafetensorsWriter w;
  ASSERT_OK(w.AddTensor("model.layers.0.mlp.experts.1.up_proj.weight", "BF16", {64, 64}));
  std::string path = dir.File("trunc.safetensors");
  ASSERT_OK(w.WriteFile(path, FillPattern));
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);
  ExpectError(Plan({path}), {"trunc.safetensors", "model.layers.0.mlp.experts.1.up_proj.weight"});
}

TEST(ModelSourceTest, MixedFormatsAreRefused) {
  ScopedDir dir("mixed");
  SyntheticModelOptions o{.format = "gguf",
                          .out = dir.File("m.gguf"),
                          .layers = 1,
                          .experts = 2,
                          .hidden = 32,
                          .ffn = 32};
  ASSERT_OK(WriteSyntheticModel(o));
  SyntheticModelOptions s = o;
  s.format = "safetensors";
  s.out = dir.File("m.safetensors");
  ASSERT_OK(WriteSyntheticModel(s));
  ExpectError(Plan({o.out, s.out}), {"different formats", "m.gguf", "m.safetensors"});
  // The same tensor in two files of one model.
  ExpectError(Plan({o.out, o.out}), {"appears in both"});
}

}  // namespace
}  // namespace expert_arena::source
