// The V2 arena format: round trips, multi-page tables, and every way a header can lie.
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "common/units.h"
#include "format/arena_format.h"
#include "test_util.h"

namespace expert_arena::format {
namespace {

// q8_0 tensors of about `bytes_each` bytes (whole 34-byte blocks of 32 elements: a tensor's
// bytes are what its dtype and shape take).
ArenaTable MakeTable(size_t tensors, uint64_t bytes_each) {
  ArenaTable table;
  table.sources.push_back({"/models/m.gguf", 123456789, 42});
  for (size_t i = 0; i < tensors; ++i) {
    TensorRecord t;
    t.name =
        "blk." + std::to_string(i / 128) + ".ffn_up_exps." + std::to_string(i % 128) + ".weight";
    t.dtype = "q8_0";
    t.shape = {bytes_each / 34 * 32};
    t.bytes = bytes_each / 34 * 34;
    t.source_offset = 1000 + i * bytes_each;
    t.checksum = 0x1234 + i;
    table.tensors.push_back(t);
  }
  EXPECT_OK(AssignArenaOffsets(table));
  ComputeIdentity(table);
  return table;
}

std::vector<std::byte> Encode(const ArenaTable& table, ArenaLayout* layout_out) {
  auto layout = ComputeLayout(table, kHugePageBytes);
  EXPECT_TRUE(layout.ok());
  std::vector<std::byte> header(layout->header_bytes);
  EXPECT_OK(EncodeHeader(table, *layout, FileState::kPublished, 77, 88, 1, 2, header));
  *layout_out = *layout;
  return header;
}

TEST(FormatTest, RoundTrip) {
  ArenaTable table = MakeTable(10, 5000);
  ArenaLayout layout;
  auto header = Encode(table, &layout);
  EXPECT_EQ(layout.header_bytes, kHugePageBytes);
  EXPECT_EQ(layout.data_bytes % kHugePageBytes, 0u);
  ArenaTable decoded;
  HeaderSummary summary;
  ASSERT_OK(DecodeHeader(header, layout.file_bytes, "x", &decoded, &summary));
  EXPECT_EQ(summary.loader_pid, 77u);
  EXPECT_EQ(summary.state, FileState::kPublished);
  ASSERT_EQ(decoded.tensors.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(decoded.tensors[i].name, table.tensors[i].name);
    EXPECT_EQ(decoded.tensors[i].dtype, "q8_0");
    EXPECT_EQ(decoded.tensors[i].shape, table.tensors[i].shape);
    EXPECT_EQ(decoded.tensors[i].arena_offset, table.tensors[i].arena_offset);
    EXPECT_EQ(decoded.tensors[i].arena_offset % 4096, 0u);
    EXPECT_EQ(decoded.tensors[i].checksum, table.tensors[i].checksum);
  }
  EXPECT_EQ(decoded.identity_hash, table.identity_hash);
  EXPECT_EQ(decoded.sources[0].path, "/models/m.gguf");
}

TEST(FormatTest, TableOfThirtySixThousandTensorsTakesSeveralPages) {
  // A 94-layer, 128-expert model stored per expert, three matrices each.
  ArenaTable table = MakeTable(94 * 128 * 3, 64);
  ArenaLayout layout;
  auto header = Encode(table, &layout);
  EXPECT_GT(layout.header_bytes, kHugePageBytes);
  EXPECT_EQ(layout.header_bytes % kHugePageBytes, 0u);
  ArenaTable decoded;
  ASSERT_OK(DecodeHeader(header, layout.file_bytes, "x", &decoded, nullptr));
  EXPECT_EQ(decoded.tensors.size(), table.tensors.size());
  EXPECT_EQ(decoded.tensors.back().name, table.tensors.back().name);
}

TEST(FormatTest, IdentityChangesWithTheSourceFile) {
  ArenaTable a = MakeTable(3, 100);
  ArenaTable b = a;
  b.sources[0].mtime_ns += 1;
  b.identity_text.clear();
  ComputeIdentity(b);
  EXPECT_NE(a.identity_hash, b.identity_hash);
}

class CorruptHeaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    table_ = MakeTable(4, 5000);
    header_ = Encode(table_, &layout_);
  }
  HeaderFixed Fixed() {
    HeaderFixed f;
    std::memcpy(&f, header_.data(), sizeof f);
    return f;
  }
  // Rewrites the fixed header and its checksum, as a hostile writer would.
  void Store(HeaderFixed f) {
    f.header_checksum = 0;
    std::vector<std::byte> tmp(sizeof f);
    std::memcpy(tmp.data(), &f, sizeof f);
    f.header_checksum = Checksum(tmp);
    std::memcpy(header_.data(), &f, sizeof f);
  }
  std::string DecodeError(uint64_t file_size) {
    ArenaTable out;
    Status s = DecodeHeader(header_, file_size, "/dev/shm/bad.arena", &out, nullptr);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("/dev/shm/bad.arena"), std::string::npos) << s.message();
    return s.message();
  }
  ArenaTable table_;
  ArenaLayout layout_;
  std::vector<std::byte> header_;
};

TEST_F(CorruptHeaderTest, WrongMagic) {
  header_[0] = std::byte{'X'};
  EXPECT_NE(DecodeError(layout_.file_bytes).find("bad magic"), std::string::npos);
}

TEST_F(CorruptHeaderTest, FlippedByteFailsTheChecksum) {
  header_[100] ^= std::byte{1};
  EXPECT_NE(DecodeError(layout_.file_bytes).find("checksum"), std::string::npos);
}

TEST_F(CorruptHeaderTest, FlippedTableByteFailsTheTableChecksum) {
  header_[sizeof(HeaderFixed) + 40] ^= std::byte{1};
  EXPECT_NE(DecodeError(layout_.file_bytes).find("table checksum"), std::string::npos);
}

TEST_F(CorruptHeaderTest, TruncatedFile) {
  EXPECT_NE(DecodeError(layout_.file_bytes - kHugePageBytes).find("file has"), std::string::npos);
}

TEST_F(CorruptHeaderTest, DataRegionPastTheEnd) {
  HeaderFixed f = Fixed();
  f.data_bytes = UINT64_MAX - kHugePageBytes + 1;  // overflows header + data
  Store(f);
  DecodeError(layout_.file_bytes);
}

TEST_F(CorruptHeaderTest, HugeTensorCount) {
  HeaderFixed f = Fixed();
  f.tensor_count = UINT64_MAX / 64;
  Store(f);
  EXPECT_NE(DecodeError(layout_.file_bytes).find("outside"), std::string::npos);
}

TEST_F(CorruptHeaderTest, TensorPointsPastTheData) {
  HeaderFixed f = Fixed();
  TensorEntry e;
  std::memcpy(&e, header_.data() + f.tensors_offset, sizeof e);
  e.arena_offset = f.data_bytes - 10;
  e.bytes = 100;
  std::memcpy(header_.data() + f.tensors_offset, &e, sizeof e);
  f.table_checksum = Checksum(
      {header_.data() + f.sources_offset, f.strings_offset + f.strings_bytes - f.sources_offset});
  Store(f);
  EXPECT_NE(DecodeError(layout_.file_bytes).find("past the end"), std::string::npos);
}

// A tensor name with a control byte (an escape sequence for the terminal of whoever runs
// `expert-arena info`) is refused, and the message does not quote it.
TEST_F(CorruptHeaderTest, ControlByteInATensorName) {
  HeaderFixed f = Fixed();
  TensorEntry e;
  std::memcpy(&e, header_.data() + f.tensors_offset, sizeof e);
  header_[f.strings_offset + e.name_offset + 1] = std::byte{0x1b};
  f.table_checksum = Checksum(
      {header_.data() + f.sources_offset, f.strings_offset + f.strings_bytes - f.sources_offset});
  Store(f);
  std::string error = DecodeError(layout_.file_bytes);
  EXPECT_NE(error.find("tensor 0: the name holds the control byte 0x1b at byte 1"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find('\x1b'), std::string::npos);
}

// Tensors but no source file: every tensor names a source that is not there.
TEST_F(CorruptHeaderTest, TensorsWithoutSources) {
  HeaderFixed f = Fixed();
  f.source_count = 0;
  Store(f);
  std::string error = DecodeError(layout_.file_bytes);
  EXPECT_NE(error.find("names source 0 of 0"), std::string::npos) << error;
}

TEST(TensorNameTest, EmptyAndControlBytesAreRefusedPrintableUtf8IsNot) {
  EXPECT_EQ(TensorNameProblem("blk.0.ffn_up_exps.weight"), "");
  EXPECT_EQ(TensorNameProblem("model.layers.0.mlp.experts.\xc3\xa9"), "");  // UTF-8
  EXPECT_EQ(TensorNameProblem(""), "the name is empty");
  EXPECT_EQ(TensorNameProblem(std::string("a\0b", 3)),
            "the name holds the control byte 0x00 at byte 1 of 3");
  EXPECT_EQ(TensorNameProblem("a\x7f"), "the name holds the control byte 0x7f at byte 1 of 2");
  EXPECT_EQ(TensorNameProblem("tab\there"), "the name holds the control byte 0x09 at byte 3 of 8");
}

// A table edited by hand, every checksum computed again, as a hostile or careless editor of the
// file would: the checksums prove nothing, the table is checked against itself.
class EditedTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    table_ = MakeTable(4, 5000);
    table_.tensors[1].name = "blk.0.ffn_gate_exps.weight";
    table_.tensors[2].name = "blk.0.ffn_up_exps.weight";
    table_.identity_text.clear();
    ComputeIdentity(table_);
  }
  // Encodes `table` (checksums computed) and decodes it: the error, or "" when accepted.
  std::string DecodeError(const ArenaTable& table) {
    auto layout = ComputeLayout(table, kHugePageBytes);
    EXPECT_TRUE(layout.ok());
    std::vector<std::byte> header(layout->header_bytes);
    EXPECT_OK(EncodeHeader(table, *layout, FileState::kPublished, 77, 88, 1, 2, header));
    Status decoded = DecodeHeader(header, layout->file_bytes, "/dev/shm/edited.arena", nullptr,
                                  nullptr);
    auto view = TableView::Open(header, layout->file_bytes, "/dev/shm/edited.arena");
    EXPECT_EQ(decoded.ok(), view.ok()) << "attach reads what verify reads";
    if (decoded.ok()) return "";
    EXPECT_EQ(decoded.code(), StatusCode::kCorrupt);
    EXPECT_NE(decoded.message().find("/dev/shm/edited.arena"), std::string::npos);
    return decoded.message();
  }
  ArenaTable table_;
};

TEST_F(EditedTableTest, TheTableAsMadeIsAccepted) { EXPECT_EQ(DecodeError(table_), ""); }

// The gate and the up projection swap places: every range is still aligned and apart, but each
// name would give the other's bytes. Only the identity, recomputed from the table, tells.
TEST_F(EditedTableTest, SwappedOffsetsFailTheStoredIdentity) {
  std::swap(table_.tensors[1].arena_offset, table_.tensors[2].arena_offset);
  std::string error = DecodeError(table_);
  EXPECT_NE(error.find("identity hash mismatch"), std::string::npos) << error;
  EXPECT_NE(error.find("the table was changed after it was made"), std::string::npos) << error;
}

// The up projection given the gate's offset (the edit that was found): refused.
TEST_F(EditedTableTest, TheSameOffsetTwiceIsRefused) {
  table_.tensors[2].arena_offset = table_.tensors[1].arena_offset;
  EXPECT_NE(DecodeError(table_), "");
}

TEST_F(EditedTableTest, OverlappingTensorsAreRefusedEvenWithTheIdentityRecomputed) {
  table_.tensors[2].arena_offset = table_.tensors[1].arena_offset;
  ComputeIdentity(table_);
  std::string error = DecodeError(table_);
  EXPECT_NE(error.find("tensors blk.0.ffn_gate_exps.weight (data offset " +
                       std::to_string(table_.tensors[1].arena_offset)),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("and blk.0.ffn_up_exps.weight"), std::string::npos) << error;
  EXPECT_NE(error.find("overlap"), std::string::npos) << error;
  // Half way into the one before it.
  table_.tensors[2].arena_offset = table_.tensors[1].arena_offset + 4096;
  ComputeIdentity(table_);
  EXPECT_NE(DecodeError(table_).find("overlap"), std::string::npos);
  // Out of table order (sorted by offset to be found): the first tensor over the last.
  ArenaTable reordered = MakeTable(4, 5000);
  reordered.tensors[0].arena_offset = reordered.tensors[3].arena_offset;
  ComputeIdentity(reordered);
  error = DecodeError(reordered);
  EXPECT_NE(error.find("blk.0.ffn_up_exps.0.weight"), std::string::npos) << error;
  EXPECT_NE(error.find("blk.0.ffn_up_exps.3.weight"), std::string::npos) << error;
  EXPECT_NE(error.find("overlap"), std::string::npos) << error;
}

TEST_F(EditedTableTest, AnOffsetOffTheAlignmentIsRefused) {
  table_.tensors[3].arena_offset += 64;
  ComputeIdentity(table_);
  std::string error = DecodeError(table_);
  EXPECT_NE(error.find("tensor blk.0.ffn_up_exps.3.weight at data offset"), std::string::npos)
      << error;
  EXPECT_NE(error.find("not aligned to 4096 bytes"), std::string::npos) << error;
}

TEST_F(EditedTableTest, AnUnknownDtypeOrOneThatDoesNotMakeTheBytesIsRefused) {
  ArenaTable unknown = table_;
  unknown.tensors[0].dtype = "q9_\x1b";
  ComputeIdentity(unknown);
  std::string error = DecodeError(unknown);
  EXPECT_NE(error.find("tensor blk.0.ffn_up_exps.0.weight: dtype \"q9_\\x1b\" is not a GGUF, "
                       "safetensors or raw type"),
            std::string::npos)
      << error;
  ArenaTable wider = table_;
  wider.tensors[0].dtype = "f32";  // the same bytes read as 4-byte floats: another shape
  ComputeIdentity(wider);
  error = DecodeError(wider);
  EXPECT_NE(error.find("tensor blk.0.ffn_up_exps.0.weight: 4998 bytes, but f32 of its shape "
                       "takes 18816"),
            std::string::npos)
      << error;
  ArenaTable safetensors = table_;
  safetensors.tensors[0].dtype = "U8";
  safetensors.tensors[0].shape = {4998};
  ComputeIdentity(safetensors);
  EXPECT_EQ(DecodeError(safetensors), "");
}

// An engine-made table (the fingerprint is the identity hash) names dtypes in the engine's
// words and its identity hashes the engine's spec, not the table: only the structure is
// checked, overlaps included.
TEST_F(EditedTableTest, AnEngineMadeTableIsCheckedForOverlapsNotForItsIdentity) {
  ArenaTable engine = table_;
  engine.identity_hash = engine.fingerprint = 0x5eed;
  engine.tensors[0].dtype = "torch.float8_e4m3fn";
  EXPECT_EQ(DecodeError(engine), "");
  engine.tensors[2].arena_offset = engine.tensors[1].arena_offset;
  EXPECT_NE(DecodeError(engine).find("overlap"), std::string::npos);
  engine.tensors[2].arena_offset = table_.tensors[2].arena_offset;
  engine.tensors[0].dtype = "";
  EXPECT_NE(DecodeError(engine).find("is not 1 to 32 printable bytes"), std::string::npos);
}

TEST_F(CorruptHeaderTest, ShortHeader) {
  ArenaTable out;
  Status s = DecodeHeader(std::span<const std::byte>(header_).first(100), 100, "f", &out, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
}


// The table read in place: the same tensors as DecodeHeader, every name found through the
// stored index in O(1), absent names not found, and the fingerprint carried.
TEST(TableViewTest, ReadsInPlaceAndFindsEveryName) {
  ArenaTable table = MakeTable(5000, 100);
  table.fingerprint = 0xfeedface;
  ArenaLayout layout;
  auto header = Encode(table, &layout);
  ASSERT_OK_AND_ASSIGN(TableView view, TableView::Open(header, layout.file_bytes, "x"));
  ASSERT_TRUE(view.in_place());
  ASSERT_EQ(view.tensor_count(), table.tensors.size());
  EXPECT_EQ(view.fixed().fingerprint, 0xfeedfaceu);
  EXPECT_NE(view.fixed().name_index_slots, 0u);
  EXPECT_GT(view.fixed().name_index_slots, 2 * table.tensors.size());
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    ASSERT_EQ(view.name(i), table.tensors[i].name);
    EXPECT_EQ(view.name(i).data()[view.name(i).size()], '\0') << "a C string in place";
    EXPECT_EQ(view.dtype(i), "q8_0");
    EXPECT_EQ(std::vector<uint64_t>(view.shape(i).begin(), view.shape(i).end()),
              table.tensors[i].shape);
    EXPECT_EQ(view.entry(i).arena_offset, table.tensors[i].arena_offset);
    auto found = view.Find(table.tensors[i].name);
    ASSERT_TRUE(found.has_value()) << table.tensors[i].name;
    EXPECT_EQ(*found, i);
  }
  EXPECT_FALSE(view.Find("blk.0.ffn_up_exps.9999.weight").has_value());
  EXPECT_FALSE(view.Find("").has_value());
  EXPECT_EQ(view.source(0).path, "/models/m.gguf");
  EXPECT_EQ(view.Summary().identity_hash, table.identity_hash);
  ArenaTable decoded;
  ASSERT_OK(DecodeHeader(header, layout.file_bytes, "x", &decoded, nullptr));
  EXPECT_EQ(decoded.fingerprint, 0xfeedfaceu);
}

// A file written before the name index (zero in the former reserved bytes) is still valid: it
// is decoded (the view says it cannot be read in place).
TEST(TableViewTest, FileWithoutANameIndexIsDecoded) {
  ArenaTable table = MakeTable(300, 100);
  ArenaLayout layout;
  auto header = Encode(table, &layout);
  HeaderFixed f;
  std::memcpy(&f, header.data(), sizeof f);
  f.name_index_offset = f.name_index_slots = f.name_index_checksum = 0;
  f.header_checksum = 0;
  f.header_checksum = Checksum({reinterpret_cast<const std::byte*>(&f), sizeof f});
  std::memcpy(header.data(), &f, sizeof f);
  ASSERT_OK_AND_ASSIGN(TableView view, TableView::Open(header, layout.file_bytes, "x"));
  EXPECT_FALSE(view.in_place());
  ArenaTable decoded;
  ASSERT_OK(DecodeHeader(header, layout.file_bytes, "x", &decoded, nullptr));
  ASSERT_EQ(decoded.tensors.size(), table.tensors.size());
  EXPECT_EQ(decoded.tensors[299].name, table.tensors[299].name);
}

TEST_F(CorruptHeaderTest, DamagedNameIndexIsRefused) {
  HeaderFixed f = Fixed();
  header_[f.name_index_offset + 4 * 3] ^= std::byte{0x5a};
  EXPECT_NE(DecodeError(layout_.file_bytes).find("name index checksum"), std::string::npos);
  // Slots that are no power of two, or an index outside the header region.
  f.name_index_slots = 1000;
  Store(f);
  EXPECT_NE(DecodeError(layout_.file_bytes).find("name index"), std::string::npos);
  f = Fixed();
  f.name_index_slots = 1ull << 60;
  Store(f);
  EXPECT_NE(DecodeError(layout_.file_bytes).find("name index"), std::string::npos);
  // TableView refuses what DecodeHeader refuses.
  EXPECT_FALSE(TableView::Open(header_, layout_.file_bytes, "x").ok());
}

}  // namespace
}  // namespace expert_arena::format
