// The V2 arena format: round trips, multi-page tables, and every way a header can lie.
#include <cstring>
#include <optional>
#include <vector>

#include "common/units.h"
#include "format/arena_format.h"
#include "test_util.h"

namespace expert_arena::format {
namespace {

ArenaTable MakeTable(size_t tensors, uint64_t bytes_each) {
  ArenaTable table;
  table.sources.push_back({"/models/m.gguf", 123456789, 42});
  for (size_t i = 0; i < tensors; ++i) {
    TensorRecord t;
    t.name =
        "blk." + std::to_string(i / 128) + ".ffn_up_exps." + std::to_string(i % 128) + ".weight";
    t.dtype = "q8_0";
    t.shape = {4096, 1536};
    t.bytes = bytes_each;
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
