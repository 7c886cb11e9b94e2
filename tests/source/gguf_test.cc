// The GGUF reader: metadata of every type, every ggml type's size, round trips into an arena,
// and every way a header can lie.
#include <cstring>
#include <numeric>

#include "expert_arena/arena.h"
#include "format/arena_table.h"
#include "generators/gguf_writer.h"
#include "format/dtypes.h"
#include "source/gguf_reader.h"
#include "source/model_source.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena::source {
namespace {

using testing::ScopedDir;

// Byte k of tensor i: a pattern that differs between tensors and offsets.
std::byte PatternByte(size_t tensor, uint64_t k) {
  return static_cast<std::byte>((k * 131 + tensor * 71 + (k >> 9)) & 0xff);
}

Status FillPattern(size_t tensor, uint64_t offset, std::span<std::byte> out) {
  for (size_t k = 0; k < out.size(); ++k) out[k] = PatternByte(tensor, offset + k);
  return Status::Ok();
}

TEST(GgmlTypesTest, TableMatchesGgml) {
  struct Expect {
    uint32_t id;
    const char* name;
    uint32_t elems;
    uint32_t bytes;
  };
  const Expect expected[] = {
      {0, "f32", 1, 4},         {1, "f16", 1, 2},         {2, "q4_0", 32, 18},
      {3, "q4_1", 32, 20},      {6, "q5_0", 32, 22},      {7, "q5_1", 32, 24},
      {8, "q8_0", 32, 34},      {9, "q8_1", 32, 36},      {10, "q2_k", 256, 84},
      {11, "q3_k", 256, 110},   {12, "q4_k", 256, 144},   {13, "q5_k", 256, 176},
      {14, "q6_k", 256, 210},   {15, "q8_k", 256, 292},   {16, "iq2_xxs", 256, 66},
      {17, "iq2_xs", 256, 74},  {18, "iq3_xxs", 256, 98}, {19, "iq1_s", 256, 50},
      {20, "iq4_nl", 32, 18},   {21, "iq3_s", 256, 110},  {22, "iq2_s", 256, 82},
      {23, "iq4_xs", 256, 136}, {24, "i8", 1, 1},         {25, "i16", 1, 2},
      {26, "i32", 1, 4},        {27, "i64", 1, 8},        {28, "f64", 1, 8},
      {29, "iq1_m", 256, 56},   {30, "bf16", 1, 2},       {34, "tq1_0", 256, 54},
      {35, "tq2_0", 256, 66},   {39, "mxfp4", 32, 17},    {40, "nvfp4", 64, 36},
      {41, "q1_0", 128, 18},    {42, "q2_0", 64, 18},
  };
  for (const Expect& e : expected) {
    const GgmlType* t = FindGgmlType(e.id);
    ASSERT_NE(t, nullptr) << e.name;
    EXPECT_STREQ(t->name, e.name);
    EXPECT_EQ(t->block_elems, e.elems) << e.name;
    EXPECT_EQ(t->block_bytes, e.bytes) << e.name;
    EXPECT_EQ(FindGgmlTypeByName(e.name), t);
  }
  for (uint32_t removed : {4u, 5u, 31u, 32u, 33u, 36u, 37u, 38u, 1000u}) {
    EXPECT_EQ(FindGgmlType(removed), nullptr) << removed;
  }
  std::string why;
  const uint64_t ne[] = {4096, 14336, 8};
  EXPECT_EQ(*GgmlTensorBytes(*FindGgmlType(12), ne, &why), 4096ull / 256 * 144 * 14336 * 8);
  const uint64_t bad[] = {100, 2};
  EXPECT_FALSE(GgmlTensorBytes(*FindGgmlType(8), bad, &why).has_value());
  EXPECT_NE(why.find("not a multiple"), std::string::npos) << why;
  const uint64_t huge[] = {1ull << 40, 1ull << 40};
  EXPECT_FALSE(GgmlTensorBytes(*FindGgmlType(0), huge, &why).has_value());
}

TEST(GgufReaderTest, EveryMetadataTypeRoundTrips) {
  for (uint32_t version : {2u, 3u}) {
    ScopedDir dir("gguf-meta");
    GgufWriter w(version);
    w.AddString("general.architecture", "test");
    w.Add("u8", GgufWriter::Scalar(GgufValueType::kU8, 200));
    w.Add("i8", GgufWriter::Scalar(GgufValueType::kI8, 0, -100));
    w.Add("u16", GgufWriter::Scalar(GgufValueType::kU16, 60000));
    w.Add("i16", GgufWriter::Scalar(GgufValueType::kI16, 0, -30000));
    w.AddU32("u32", 4000000000u);
    w.AddI32("i32", -2000000000);
    w.AddF32("f32", 1.5f);
    w.AddBool("bool", true);
    w.AddU64("u64", 1ull << 60);
    w.Add("i64", GgufWriter::Scalar(GgufValueType::kI64, 0, -(1ll << 60)));
    w.Add("f64", GgufWriter::Scalar(GgufValueType::kF64, 0, 0, 2.25));
    w.Add("strings", GgufWriter::Array(GgufValueType::kString,
                                       {GgufWriter::String("a"), GgufWriter::String(""),
                                        GgufWriter::String("long string")}));
    w.Add("ints",
          GgufWriter::Array(GgufValueType::kI32, {GgufWriter::Scalar(GgufValueType::kI32, 0, 7),
                                                  GgufWriter::Scalar(GgufValueType::kI32, 0, -7)}));
    w.Add("nested",
          GgufWriter::Array(GgufValueType::kArray,
                            {GgufWriter::Array(GgufValueType::kU8,
                                               {GgufWriter::Scalar(GgufValueType::kU8, 1)})}));
    w.Add("empty", GgufWriter::Array(GgufValueType::kF32, {}));
    w.SetAlignment(64);
    ASSERT_OK(w.AddTensor("t", *FindGgmlType(0), {16}));
    std::string path = dir.File("m.gguf");
    ASSERT_OK(w.WriteFile(path, FillPattern));

    ASSERT_OK_AND_ASSIGN(GgufFile f, ReadGguf(path));
    EXPECT_EQ(f.version, version);
    EXPECT_EQ(f.alignment, 64u);
    EXPECT_EQ(f.data_offset % 64, 0u);
    EXPECT_EQ(f.Find("general.architecture")->str, "test");
    EXPECT_EQ(f.Find("u8")->u, 200u);
    EXPECT_EQ(f.Find("i8")->i, -100);
    EXPECT_EQ(f.Find("u16")->u, 60000u);
    EXPECT_EQ(f.Find("i16")->i, -30000);
    EXPECT_EQ(f.Find("u32")->u, 4000000000u);
    EXPECT_EQ(f.Find("i32")->i, -2000000000);
    EXPECT_EQ(f.Find("f32")->f, 1.5);
    EXPECT_EQ(f.Find("bool")->u, 1u);
    EXPECT_EQ(f.Find("u64")->u, 1ull << 60);
    EXPECT_EQ(f.Find("i64")->i, -(1ll << 60));
    EXPECT_EQ(f.Find("f64")->f, 2.25);
    const GgufValue* strings = f.Find("strings");
    ASSERT_EQ(strings->count, 3u);
    EXPECT_EQ(strings->elements[2].str, "long string");
    EXPECT_EQ(f.Find("ints")->elements[1].i, -7);
    EXPECT_EQ(f.Find("nested")->elements[0].elements[0].u, 1u);
    EXPECT_EQ(f.Find("empty")->count, 0u);
    ASSERT_EQ(f.tensors.size(), 1u);
    EXPECT_EQ(f.tensors[0].absolute_offset, f.data_offset);
    EXPECT_EQ(f.tensors[0].bytes, 64u);
    EXPECT_GT(f.header_bytes_read, 0u);
  }
}

TEST(GgufReaderTest, LargeArraysAreCountedNotKept) {
  ScopedDir dir("gguf-bigarray");
  GgufWriter w;
  std::vector<GgufValue> many(kMaxKeptArrayElements + 10, GgufWriter::String("tok"));
  w.Add("tokenizer.ggml.tokens", GgufWriter::Array(GgufValueType::kString, many));
  ASSERT_OK(w.AddTensor("x", *FindGgmlType(0), {8}));
  std::string path = dir.File("m.gguf");
  ASSERT_OK(w.WriteFile(path, FillPattern));
  ASSERT_OK_AND_ASSIGN(GgufFile f, ReadGguf(path));
  EXPECT_EQ(f.Find("tokenizer.ggml.tokens")->count, kMaxKeptArrayElements + 10);
  EXPECT_EQ(f.Find("tokenizer.ggml.tokens")->elements.size(), kMaxKeptArrayElements);
  EXPECT_EQ(f.tensors[0].name, "x");
}

// Metadata past kMetadataBudgetBytes is read and checked but not kept: six u8 arrays of
// kMaxKeptArrayElements values (each value a GgufValue when kept) fill the budget; the
// general.alignment (256, not the default 32) after them is still kept and places the data.
TEST(GgufReaderTest, MetadataPastTheBudgetIsReadNotKept) {
  ScopedDir dir("gguf-budget");
  GgufWriter w;
  const std::vector<GgufValue> bytes(kMaxKeptArrayElements,
                                     GgufWriter::Scalar(GgufValueType::kU8, 7));
  for (int i = 0; i < 6; ++i) {
    w.Add("big." + std::to_string(i), GgufWriter::Array(GgufValueType::kU8, bytes));
  }
  w.SetAlignment(256);
  w.Add("after.the.budget", GgufWriter::String("not kept"));
  ASSERT_OK(w.AddTensor("x", *FindGgmlType(0), {8}));
  std::string path = dir.File("m.gguf");
  ASSERT_OK(w.WriteFile(path, FillPattern));
  ASSERT_OK_AND_ASSIGN(GgufFile f, ReadGguf(path));
  ASSERT_NE(f.Find("big.0"), nullptr);
  EXPECT_EQ(f.Find("big.0")->elements.size(), kMaxKeptArrayElements);
  EXPECT_EQ(f.Find("big.5"), nullptr);
  EXPECT_EQ(f.Find("after.the.budget"), nullptr);
  EXPECT_GE(f.metadata_not_kept, 2u);
  ASSERT_NE(f.Find("general.alignment"), nullptr);
  EXPECT_EQ(f.alignment, 256u);
  EXPECT_EQ(f.data_offset % 256, 0u);
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors[0].absolute_offset, f.data_offset);
}

// Every known ggml type: a tensor of two blocks by three rows lands in the arena byte for
// byte, at the offset the writer placed it (data section + tensor offset).
TEST(GgufReaderTest, EveryGgmlTypeRoundTripsIntoAnArena) {
  ScopedDir dir("gguf-types");
  GgufWriter w;
  std::vector<uint64_t> expected_bytes;
  for (const GgmlType& type : AllGgmlTypes()) {
    std::string name = "blk.0.ffn_up_exps." + std::string(type.name);
    ASSERT_OK(w.AddTensor(name, type, {type.block_elems * 2ull, 3}));
    expected_bytes.push_back(type.block_bytes * 2ull * 3);
  }
  std::string path = dir.File("types.gguf");
  ASSERT_OK(w.WriteFile(path, FillPattern));
  const uint64_t data_offset = w.data_offset();

  ModelSpec spec;
  spec.files = {path};
  ASSERT_OK_AND_ASSIGN(Arena arena, Arena::Open(spec, {}));
  ASSERT_EQ(arena.tensor_count(), AllGgmlTypes().size());
  for (size_t i = 0; i < w.tensors().size(); ++i) {
    const GgufTensorInfo& t = w.tensors()[i];
    auto view = arena.Find(t.name);
    ASSERT_TRUE(view.has_value()) << t.name;
    EXPECT_EQ(view->dtype, t.type->name);
    ASSERT_EQ(view->bytes.size(), expected_bytes[i]) << t.name;
    ASSERT_EQ(view->shape.size(), 2u);
    EXPECT_EQ(view->shape[0], t.type->block_elems * 2ull);  // ggml order, ne[0] first
    EXPECT_EQ(view->shape[1], 3u);
    auto want = testing::ReadRange(path, data_offset + t.offset, expected_bytes[i]);
    EXPECT_EQ(std::memcmp(view->bytes.data(), want.data(), want.size()), 0) << t.name;
    // 4 KiB-aligned, or (smaller than 4 KiB) aligned to the power of two that holds it.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(view->bytes.data()) %
                  format::TensorAlignment(4096, expected_bytes[i]),
              0u)
        << t.name;
  }
}

// ---- damaged and hostile files ------------------------------------------------------------

// A valid two-tensor file to damage.
struct Sample {
  std::vector<std::byte> header;
  std::vector<std::byte> file;
};

Sample MakeSample(GgufWriter& w) {
  Sample s;
  s.header = w.EncodeHeader();
  s.file = s.header;
  s.file.resize(w.file_bytes(), std::byte{0x5a});
  return s;
}

Status PlanBytes(const ScopedDir& dir, const std::vector<std::byte>& bytes,
                 const std::string& name = "bad.gguf") {
  std::string path = dir.File(name);
  testing::WriteFileBytes(path, bytes);
  ModelSpec spec;
  spec.files = {path};
  spec.select_all = true;
  auto plan = PlanModel(spec);
  return plan.ok() ? Status::Ok() : plan.status();
}

void ExpectError(const Status& s, std::initializer_list<std::string> words) {
  ASSERT_FALSE(s.ok());
  for (const std::string& w : words) {
    EXPECT_NE(s.message().find(w), std::string::npos)
        << "missing '" << w << "' in: " << s.message();
  }
}

GgufWriter TwoTensors() {
  GgufWriter w;
  w.AddString("general.architecture", "test");
  EXPECT_OK(w.AddTensor("blk.0.ffn_gate_exps.weight", *FindGgmlType(0), {32, 4}));
  EXPECT_OK(w.AddTensor("blk.0.ffn_up_exps.weight", *FindGgmlType(8), {64, 4}));
  return w;
}

TEST(GgufDamageTest, Truncated) {
  ScopedDir dir("gguf-trunc");
  GgufWriter w = TwoTensors();
  Sample s = MakeSample(w);
  // Cut inside the data: the last tensor runs past the end. The message says "truncated" and
  // the size the table asks for (the whole file's), so a cut download is told from a bad header.
  std::vector<std::byte> cut(s.file.begin(), s.file.end() - 10);
  ExpectError(PlanBytes(dir, cut),
              {"bad.gguf", "truncated: the file has " + std::to_string(cut.size()) +
                               " bytes but its tensor table needs " + std::to_string(s.file.size()),
               "blk.0.ffn_up_exps.weight", "past the end", "fetch or copy the file again"});
  // Cut inside the tensor infos.
  std::vector<std::byte> header_cut(s.file.begin(), s.file.begin() + s.header.size() - 40);
  ExpectError(PlanBytes(dir, header_cut), {"bad.gguf", "truncated: file ends inside"});
  // Only the magic.
  std::vector<std::byte> magic(s.file.begin(), s.file.begin() + 6);
  ExpectError(PlanBytes(dir, magic), {"bad.gguf", "truncated: file ends inside"});
}

TEST(GgufDamageTest, HugeCountsAndLengths) {
  ScopedDir dir("gguf-huge");
  {
    GgufWriter w = TwoTensors();
    w.tensor_count_override = 1ull << 60;
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"bad.gguf", "tensors", "more than the file"});
  }
  {
    GgufWriter w = TwoTensors();
    w.kv_count_override = UINT64_MAX;
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"bad.gguf", "metadata entries"});
  }
  {
    // A string length past the end of the file.
    GgufWriter w = TwoTensors();
    Sample s = MakeSample(w);
    uint64_t huge = 1ull << 50;
    std::memcpy(s.file.data() + 24, &huge, 8);  // the first key's length
    ExpectError(PlanBytes(dir, s.file), {"bad.gguf", "claims"});
  }
  {
    // An array claiming more elements than the file holds.
    GgufWriter w;
    w.Add("arr",
          GgufWriter::Array(GgufValueType::kU64, {GgufWriter::Scalar(GgufValueType::kU64, 1)}));
    Sample s = MakeSample(w);
    // magic 4 + version 4 + counts 16 + key (8 + 3) + type 4 + element type 4 -> count at 43
    uint64_t count = 1ull << 40;
    std::memcpy(s.file.data() + 43, &count, 8);
    ExpectError(PlanBytes(dir, s.file), {"bad.gguf", "metadata \"arr\"", "elements"});
  }
}

TEST(GgufDamageTest, OffsetsPastTheEndAndOverflow) {
  ScopedDir dir("gguf-offsets");
  for (uint64_t offset : {uint64_t{1} << 20, UINT64_MAX - 31}) {
    GgufWriter w;
    w.AddTensorInfo("blk.0.ffn_down_exps.weight", 0, {8}, offset, 32);
    std::vector<std::byte> file = w.EncodeHeader();
    file.resize(file.size() + 64);
    ExpectError(PlanBytes(dir, file), {"bad.gguf", "blk.0.ffn_down_exps.weight"});
  }
  {
    // A shape whose byte size overflows 64 bits.
    GgufWriter w;
    w.AddTensorInfo("big", 0, {1ull << 40, 1ull << 40}, 0, 0);
    ExpectError(PlanBytes(dir, w.EncodeHeader()), {"bad.gguf", "big", "overflow"});
  }
}

TEST(GgufDamageTest, OverlappingTensors) {
  ScopedDir dir("gguf-overlap");
  GgufWriter w;
  w.AddTensorInfo("a", 0, {64}, 0, 256);
  w.AddTensorInfo("b", 0, {64}, 128, 256);
  Sample s = MakeSample(w);
  ExpectError(PlanBytes(dir, s.file), {"bad.gguf", "overlaps", "tensor b", "tensor a"});
}

// Found by fuzz_gguf: an empty tensor sorted between two overlapping ones hid the overlap.
TEST(GgufDamageTest, EmptyTensorDoesNotHideAnOverlap) {
  ScopedDir dir("gguf-overlap-empty");
  GgufWriter w;
  w.AddTensorInfo("a", 0, {64}, 0, 256);
  w.AddTensorInfo("empty", 0, {0}, 64, 0);
  w.AddTensorInfo("b", 0, {64}, 128, 256);
  Sample s = MakeSample(w);
  ExpectError(PlanBytes(dir, s.file), {"bad.gguf", "overlaps", "tensor b", "tensor a"});
}

// A name that would drive the terminal of whoever reads the message or `info` is refused
// before any message prints it.
TEST(GgufDamageTest, ControlByteInATensorNameIsRefused) {
  ScopedDir dir("gguf-name");
  GgufWriter w;
  w.AddTensorInfo("blk.0\x1b[2J", 0, {64}, 0, 256);
  Sample s = MakeSample(w);
  Status st = PlanBytes(dir, s.file);
  ExpectError(st, {"bad.gguf", "tensor 0: the name holds the control byte 0x1b at byte 5"});
  EXPECT_EQ(st.message().find('\x1b'), std::string::npos) << st.message();
}

TEST(GgufDamageTest, UnknownTypeNamesIdFileAndTensor) {
  ScopedDir dir("gguf-type");
  for (uint32_t id : {4u, 99u}) {
    GgufWriter w;
    w.AddTensorInfo("blk.3.ffn_up_exps.weight", id, {32}, 0, 32);
    Sample s = MakeSample(w);
    Status st = PlanBytes(dir, s.file);
    ExpectError(st, {"bad.gguf", "blk.3.ffn_up_exps.weight",
                     ("unknown ggml type id " + std::to_string(id)).c_str()});
  }
}

TEST(GgufDamageTest, OtherLies) {
  ScopedDir dir("gguf-lies");
  {
    GgufWriter w;
    w.AddTensorInfo("five_dims", 0, {1, 1, 1, 1, 1}, 0, 4);
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"five_dims", "dimensions"});
  }
  {
    GgufWriter w;
    w.AddTensorInfo("misaligned", 0, {4}, 16, 16);
    ExpectError(PlanBytes(dir, MakeSample(w).file),
                {"misaligned", "not a multiple of the alignment"});
  }
  {
    GgufWriter w;
    w.AddU32("general.alignment", 48);
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"general.alignment", "power of two"});
  }
  {
    GgufWriter w;
    w.AddString("general.alignment", "32");
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"general.alignment", "u32"});
  }
  {
    GgufWriter w;
    w.AddTensorInfo("dup", 0, {8}, 0, 32);
    w.AddTensorInfo("dup", 0, {8}, 32, 32);
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"dup", "twice"});
  }
  {
    GgufWriter w(1);
    Status st = PlanBytes(dir, MakeSample(w).file);
    ExpectError(st, {"version 1"});
  }
  {
    GgufWriter w(7);
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"version 7"});
  }
  {
    GgufWriter w;
    w.Add("flag", GgufWriter::Scalar(GgufValueType::kBool, 2));
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"flag", "bool"});
  }
  {
    GgufWriter w;
    w.Add("weird", GgufWriter::Scalar(static_cast<GgufValueType>(77), 0));
    ExpectError(PlanBytes(dir, MakeSample(w).file), {"weird", "unknown value type 77"});
  }
}

// A metadata key is the file's: a message that names it shows it escaped, so that a hostile
// key cannot drive the terminal of whoever reads the error nor forge log lines.
TEST(GgufDamageTest, MetadataKeyMessagesNeverHoldControlBytes) {
  ScopedDir dir("gguf-key-control");
  const std::string key = "k\x1b[31m\r\n\x07\x7f";
  const std::string shown = "k\\x1b[31m\\x0d\\x0a\\x07\\x7f";
  auto expect_clean = [&](const Status& st, const char* words) {
    ExpectError(st, {"bad.gguf", shown.c_str(), words});
    for (char c : st.message()) {
      const auto byte = static_cast<unsigned char>(c);
      EXPECT_TRUE(byte >= 0x20 && byte != 0x7f) << "control byte in: " << st.message();
    }
  };
  // Where the key's value starts: magic, version, the two counts, the key's length and bytes.
  const size_t value_type_at = 4 + 4 + 16 + 8 + key.size();
  {
    GgufWriter w;
    w.AddU32(key, 1);
    w.AddU32(key, 2);
    expect_clean(PlanBytes(dir, MakeSample(w).file), "appears twice");
  }
  {
    GgufWriter w;
    w.Add(key, GgufWriter::Scalar(static_cast<GgufValueType>(77), 0));
    expect_clean(PlanBytes(dir, MakeSample(w).file), "unknown value type 77");
  }
  {
    GgufWriter w;
    w.Add(key, GgufWriter::Scalar(GgufValueType::kBool, 2));
    expect_clean(PlanBytes(dir, MakeSample(w).file), "neither 0 nor 1");
  }
  {
    // The file ends inside the key's type, then inside its value.
    GgufWriter w;
    w.AddU32(key, 1);
    Sample s = MakeSample(w);
    for (size_t cut : {value_type_at + 2, value_type_at + 4 + 2}) {
      std::vector<std::byte> bytes(s.file.begin(), s.file.begin() + cut);
      expect_clean(PlanBytes(dir, bytes), "file ends inside");
    }
  }
  {
    // A string value longer than the file.
    GgufWriter w;
    w.AddString(key, "value");
    Sample s = MakeSample(w);
    uint64_t huge = 1ull << 40;
    std::memcpy(s.file.data() + value_type_at + 4, &huge, 8);
    expect_clean(PlanBytes(dir, s.file), "claims 1099511627776 bytes");
  }
  {
    // Arrays: an unknown element type, more elements than the file holds, nested too deep.
    GgufWriter w;
    w.Add(key, GgufWriter::Array(static_cast<GgufValueType>(99), {}));
    expect_clean(PlanBytes(dir, MakeSample(w).file), "unknown array element type 99");
    GgufWriter w2;
    w2.Add(key,
           GgufWriter::Array(GgufValueType::kU64, {GgufWriter::Scalar(GgufValueType::kU64, 1)}));
    Sample s = MakeSample(w2);
    uint64_t count = 1ull << 40;
    std::memcpy(s.file.data() + value_type_at + 4 + 4, &count, 8);
    expect_clean(PlanBytes(dir, s.file), "elements");
    GgufValue nested = GgufWriter::Scalar(GgufValueType::kU8, 1);
    for (int depth = 0; depth < 10; ++depth) {
      nested = GgufWriter::Array(nested.type, {nested});
    }
    GgufWriter w3;
    w3.Add(key, nested);
    expect_clean(PlanBytes(dir, MakeSample(w3).file), "nested too deep");
  }
  {
    // A key of 100 KiB full of escapes is refused by its length, without being quoted.
    GgufWriter w;
    w.AddU32(std::string(100 * 1024, '\x1b'), 1);
    Status st = PlanBytes(dir, MakeSample(w).file);
    ExpectError(st, {"bad.gguf", "the key of metadata entry 0 claims 102400 bytes"});
    EXPECT_EQ(st.message().find('\x1b'), std::string::npos) << st.message();
  }
  {
    // A long key is cut short in the message.
    GgufWriter w;
    w.Add(std::string(1000, 'k') + "\x1b", GgufWriter::Scalar(static_cast<GgufValueType>(77), 0));
    Status st = PlanBytes(dir, MakeSample(w).file);
    ExpectError(st, {"bad.gguf", "unknown value type 77"});
    EXPECT_LT(st.message().size(), 400u) << st.message();
    EXPECT_EQ(st.message().find('\x1b'), std::string::npos) << st.message();
  }
}

// Random corruption of a valid file: every outcome is a clean error or a valid plan whose
// tensors lie inside the file (run under ASan in CI for out-of-bounds reads).
TEST(GgufDamageTest, RandomByteFlipsNeverEscapeTheFile) {
  ScopedDir dir("gguf-fuzz");
  GgufWriter w = TwoTensors();
  w.Add("arr", GgufWriter::Array(GgufValueType::kString, {GgufWriter::String("x")}));
  Sample s = MakeSample(w);
  uint64_t state = 12345;
  for (int round = 0; round < 300; ++round) {
    std::vector<std::byte> file = s.file;
    for (int k = 0; k < 3; ++k) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      size_t at = (state >> 33) % s.header.size();
      file[at] = static_cast<std::byte>(state >> 24);
    }
    std::string path = dir.File("fuzz.gguf");
    testing::WriteFileBytes(path, file);
    auto parsed = ReadGguf(path);
    if (!parsed.ok()) continue;
    for (const GgufTensorInfo& t : parsed->tensors) {
      EXPECT_LE(t.absolute_offset + t.bytes, file.size());
    }
  }
}

// Raw bytes only when asked for (model_format_test has every refusal).
TEST(GgufDamageTest, NotGgufIsRefusedUnlessRawIsAskedFor) {
  ScopedDir dir("gguf-raw");
  std::vector<std::byte> bytes(1000, std::byte{7});
  std::string path = dir.File("blob.bin");
  testing::WriteFileBytes(path, bytes);
  ModelSpec spec;
  spec.files = {path};
  EXPECT_FALSE(PlanModel(spec).ok());
  spec.format = ModelFormat::kRaw;
  ASSERT_OK_AND_ASSIGN(ModelPlan plan, PlanModel(spec));
  EXPECT_EQ(plan.format, "raw");
  ASSERT_EQ(plan.table.tensors.size(), 1u);
  EXPECT_EQ(plan.table.tensors[0].bytes, 1000u);
}

}  // namespace
}  // namespace expert_arena::source
