// Writes the seed corpus of the fuzz targets with the project's own writers (GgufWriter,
// SafetensorsWriter, EncodeHeader, TensorDescriptor::Encode): small valid inputs plus the
// damaged cases of the unit tests. Its output is checked in under tests/fuzz/corpus/;
// regenerate with
//   build/bin/fuzz_make_seeds tests/fuzz/corpus
// Next to these: crash-* (minimized inputs of bugs found by fuzzing) and fuzz-* (corpus
// entries that a long run reached, kept by libFuzzer -merge=1 so a short CI run starts there).
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "expert_arena/stream.h"
#include "format/arena_format.h"
#include "remote/front_door.h"
#include "generators/gguf_writer.h"
#include "generators/safetensors_writer.h"
#include "format/dtypes.h"
#include "stream/segment_format.h"

using namespace expert_arena;
using source::GgufValueType;
using source::GgufWriter;
using source::SafetensorsWriter;

namespace {

std::filesystem::path g_out;

void Write(const std::string& target, const std::string& name, const void* data, size_t size) {
  std::filesystem::create_directories(g_out / target);
  std::ofstream out(g_out / target / ("seed-" + name), std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) {
    std::fprintf(stderr, "cannot write %s/%s\n", target.c_str(), name.c_str());
    std::exit(1);
  }
}
void Write(const std::string& target, const std::string& name, const std::vector<std::byte>& b) {
  Write(target, name, b.data(), b.size());
}
void Write(const std::string& target, const std::string& name, const std::string& s) {
  Write(target, name, s.data(), s.size());
}

void Check(const Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    std::exit(1);
  }
}

// The header followed by the data section, tensor bytes a simple pattern.
std::vector<std::byte> GgufBytes(const GgufWriter& w) {
  std::vector<std::byte> file = w.EncodeHeader();
  uint64_t end = w.file_bytes();
  for (uint64_t i = file.size(); i < end; ++i) file.push_back(std::byte(i * 7));
  return file;
}

void GgufSeeds() {
  const std::string t = "gguf";
  const source::GgmlType& f32 = *source::FindGgmlTypeByName("f32");
  const source::GgmlType& q8 = *source::FindGgmlTypeByName("q8_0");
  GgufWriter w;
  w.AddString("general.architecture", "synthmoe");
  w.AddU32("synthmoe.block_count", 1);
  w.AddU64("u64", 7);
  w.AddI32("i32", -3);
  w.AddF32("f32", 1.5f);
  w.AddBool("flag", true);
  w.Add("arr",
        GgufWriter::Array(GgufValueType::kU32, {GgufWriter::Scalar(GgufValueType::kU32, 1),
                                                GgufWriter::Scalar(GgufValueType::kU32, 2)}));
  w.Add("strs", GgufWriter::Array(GgufValueType::kString, {GgufWriter::String("a")}));
  Check(w.AddTensor("token_embd.weight", f32, {4, 2}));
  Check(w.AddTensor("blk.0.ffn_up_exps.weight", q8, {32, 2, 2}));
  Check(w.AddTensor("blk.0.ffn_down_exps.weight", f32, {2, 4, 2}));
  std::vector<std::byte> valid = GgufBytes(w);
  Write(t, "valid-v3", valid);
  GgufWriter v2(2);
  v2.SetAlignment(64);
  Check(v2.AddTensor("blk.1.ffn_gate_exps.weight", f32, {8, 2}));
  Write(t, "valid-v2-align64", GgufBytes(v2));
  // The damaged cases of tests/source/gguf_test.cc.
  Write(t, "truncated-data", std::vector<std::byte>(valid.begin(), valid.end() - 10));
  Write(t, "truncated-infos",
        std::vector<std::byte>(valid.begin(), valid.begin() + w.EncodeHeader().size() - 40));
  Write(t, "magic-only", std::vector<std::byte>(valid.begin(), valid.begin() + 6));
  {
    GgufWriter d = w;
    d.tensor_count_override = 1ull << 60;
    Write(t, "huge-tensor-count", GgufBytes(d));
  }
  {
    GgufWriter d = w;
    d.kv_count_override = UINT64_MAX;
    Write(t, "huge-kv-count", GgufBytes(d));
  }
  {
    GgufWriter d;
    d.AddTensorInfo("blk.0.ffn_down_exps.weight", 0, {8}, UINT64_MAX - 31, 32);
    std::vector<std::byte> file = d.EncodeHeader();
    file.resize(file.size() + 64);
    Write(t, "offset-overflow", file);
  }
  {
    GgufWriter d;
    d.AddTensorInfo("big", 0, {1ull << 40, 1ull << 40}, 0, 0);
    Write(t, "size-overflow", d.EncodeHeader());
  }
  {
    GgufWriter d;
    d.AddTensorInfo("a", 0, {64}, 0, 256);
    d.AddTensorInfo("b", 0, {64}, 128, 256);
    Write(t, "overlap", GgufBytes(d));
    // Found by fuzzing: an empty tensor sorted between the two hid the overlap.
    GgufWriter e;
    e.AddTensorInfo("a", 0, {64}, 0, 256);
    e.AddTensorInfo("empty", 0, {0}, 64, 0);
    e.AddTensorInfo("b", 0, {64}, 128, 256);
    Write(t, "overlap-hidden-by-empty", GgufBytes(e));
  }
  {
    GgufWriter d;
    d.AddTensorInfo("blk.3.ffn_up_exps.weight", 99, {32}, 0, 32);
    Write(t, "unknown-type", GgufBytes(d));
  }
  {
    GgufWriter d;
    d.AddTensorInfo("dup", 0, {8}, 0, 32);
    d.AddTensorInfo("dup", 0, {8}, 32, 32);
    Write(t, "duplicate-name", GgufBytes(d));
  }
  {
    GgufWriter d;
    d.AddU32("general.alignment", 48);
    Write(t, "alignment-48", GgufBytes(d));
  }
  {
    GgufWriter d;
    d.Add("weird", GgufWriter::Scalar(static_cast<GgufValueType>(77), 0));
    Write(t, "unknown-value-type", GgufBytes(d));
  }
}

std::vector<std::byte> SafetensorsBytes(const SafetensorsWriter& w) {
  std::vector<std::byte> file = w.EncodeHeader();
  uint64_t end = w.file_bytes();
  for (uint64_t i = file.size(); i < end; ++i) file.push_back(std::byte(i * 5));
  return file;
}

std::vector<std::byte> RawSafetensors(const std::string& json, uint64_t data_bytes) {
  std::vector<std::byte> bytes(8 + json.size() + data_bytes, std::byte{1});
  uint64_t n = json.size();
  std::memcpy(bytes.data(), &n, 8);
  std::memcpy(bytes.data() + 8, json.data(), json.size());
  return bytes;
}

void SafetensorsSeeds() {
  const std::string t = "safetensors";
  SafetensorsWriter w;
  w.AddMetadata("format", "pt");
  Check(w.AddTensor("model.embed_tokens.weight", "F32", {2, 4}));
  Check(w.AddTensor("model.layers.0.mlp.experts.0.up_proj.weight", "BF16", {4, 4}));
  Check(w.AddTensor("model.layers.0.mlp.experts.1.up_proj.weight", "F8_E4M3", {4, 4}));
  Check(w.AddTensor("empty", "I64", {0}));
  Write(t, "valid", SafetensorsBytes(w));
  // The damaged cases of tests/source/safetensors_test.cc.
  const std::string shape = R"("shape":[2,2])";
  Write(t, "span-mismatch",
        RawSafetensors(R"({"t":{"dtype":"F32",)" + shape + R"(,"data_offsets":[0,12]}})", 16));
  Write(t, "backwards",
        RawSafetensors(R"({"t":{"dtype":"F32",)" + shape + R"(,"data_offsets":[16,0]}})", 16));
  Write(t, "past-end",
        RawSafetensors(R"({"t":{"dtype":"F32",)" + shape + R"(,"data_offsets":[0,16]}})", 8));
  Write(t, "unknown-dtype",
        RawSafetensors(R"({"t":{"dtype":"Q9","shape":[2],"data_offsets":[0,2]}})", 16));
  Write(t, "shape-overflow",
        RawSafetensors(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],)"
                       R"("data_offsets":[0,0]}})",
                       16));
  Write(t, "overlap",
        RawSafetensors(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                       R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                       32));
  Write(t, "overlap-hidden-by-empty",
        RawSafetensors(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                       R"("e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},)"
                       R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                       32));
  Write(t, "bad-metadata", RawSafetensors(R"({"__metadata__":{"k":1}})", 0));
  Write(t, "not-object", RawSafetensors("[1,2,3]", 16));
  {
    SafetensorsWriter d = w;
    d.header_length_override = 1ull << 40;
    Write(t, "huge-header-length", SafetensorsBytes(d));
  }

  const std::string i = "safetensors_index";
  Write(i, "valid",
        std::string(R"({"metadata": {"total_size": 64}, "weight_map": )"
                    R"({"a.experts.0.w1": "s1.safetensors", "b": "s2.safetensors"}})"));
  Write(i, "dotdot", std::string(R"({"weight_map": {"a.experts.0.w1": "../etc/passwd"}})"));
  Write(i, "not-map", std::string(R"({"weight_map": [1, 2]})"));
  Write(i, "not-json", std::string(R"({not json)"));
  Write(i, "not-string", std::string(R"({"weight_map": {"a": 3}})"));
}

// fuzz_safetensors_sharded: INDEX, then each shard after "\n#shard#\n" (s1, s2, s3).
std::vector<std::byte> ShardedInput(const std::string& index,
                                    const std::vector<std::vector<std::byte>>& shards) {
  const std::string separator = "\n#shard#\n";
  std::vector<std::byte> input(reinterpret_cast<const std::byte*>(index.data()),
                               reinterpret_cast<const std::byte*>(index.data()) + index.size());
  for (const auto& shard : shards) {
    for (char c : separator) input.push_back(std::byte(c));
    input.insert(input.end(), shard.begin(), shard.end());
  }
  return input;
}

std::vector<std::byte> Shard(const std::vector<std::pair<std::string, std::string>>& tensors) {
  SafetensorsWriter w;
  for (const auto& [name, dtype] : tensors) Check(w.AddTensor(name, dtype, {2, 2}));
  return SafetensorsBytes(w);
}

void ShardedSeeds() {
  const std::string t = "safetensors_sharded";
  const std::string e0 = "model.layers.0.mlp.experts.0.up_proj.weight";
  const std::string e1 = "model.layers.0.mlp.experts.1.up_proj.weight";
  const std::string emb = "model.embed_tokens.weight";
  auto s1 = Shard({{emb, "F32"}, {e0, "BF16"}});
  auto s2 = Shard({{e1, "F8_E4M3"}});
  auto s3 = Shard({{"lm_head.weight", "F16"}});
  const std::string map3 = "\"" + emb + "\": \"s1.safetensors\", \"" + e0 +
                           "\": \"s1.safetensors\", \"" + e1 +
                           "\": \"s2.safetensors\", \"lm_head.weight\": \"s3.safetensors\"";
  const std::string index3 = R"({"metadata": {"total_size": 68}, "weight_map": {)" + map3 + "}}";
  Write(t, "valid-3-shards", ShardedInput(index3, {s1, s2, s3}));
  Write(t, "valid-1-shard",
        ShardedInput(R"({"weight_map": {")" + emb + R"(": "s1.safetensors", ")" + e0 +
                         R"(": "s1.safetensors"}})",
                     {s1}));
  // A tensor of a shard that the index does not name is loaded too.
  Write(t, "unmapped-tensor",
        ShardedInput(R"({"weight_map": {")" + emb + R"(": "s1.safetensors"}})", {s1}));
  Write(t, "missing-shard", ShardedInput(index3, {s1, s2}));
  Write(t, "wrong-shard",
        ShardedInput(R"({"weight_map": {")" + e1 + R"(": "s1.safetensors"}})", {s1, s2}));
  Write(
      t, "tensor-in-two-shards",
      ShardedInput(R"({"weight_map": {")" + emb + R"(": "s1.safetensors", "x": "s2.safetensors"}})",
                   {s1, Shard({{"x", "F32"}, {emb, "F32"}})}));
  Write(t, "damaged-shard",
        ShardedInput(R"({"weight_map": {"a": "s1.safetensors"}})",
                     {RawSafetensors(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                     R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                                     32)}));
  Write(t, "control-byte-name",
        ShardedInput(R"({"weight_map": {"\u001b[31mred": "s1.safetensors"}})", {s1}));
  Write(t, "index-names-itself",
        ShardedInput(R"({"weight_map": {"a": "model.safetensors.index.json"}})", {s1}));
  Write(t, "dotdot", ShardedInput(R"({"weight_map": {"a": "../s1.safetensors"}})", {s1}));
}

void ArenaHeaderSeeds() {
  format::ArenaTable table;
  table.sources.push_back({"/models/m.gguf", 4096, 1234});
  table.tensors.push_back({.name = "blk.0.ffn_up_exps.weight",
                           .dtype = "q8_0",
                           .shape = {32, 2, 2},
                           .source_index = 0,
                           .source_offset = 512,
                           .bytes = 136,
                           .checksum = 99});
  table.tensors.push_back({.name = "blk.0.ffn_down_exps.weight",
                           .dtype = "f32",
                           .shape = {2, 4, 2},
                           .source_index = 0,
                           .source_offset = 1024,
                           .bytes = 64});
  table.model_bytes_total = 200;
  table.model_tensors_total = 3;
  Check(format::AssignArenaOffsets(table));
  format::ComputeIdentity(table);
  auto layout = format::ComputeLayout(table, format::kHeaderPageBytes);
  Check(layout.status());
  std::vector<std::byte> region(layout->header_bytes);
  for (auto state : {format::FileState::kPublished, format::FileState::kLoading}) {
    Check(format::EncodeHeader(table, *layout, state, 42, 43, 44, 45, region));
    // Only the bytes up to the end of the name index: the target zero-extends the rest.
    format::HeaderFixed fixed;
    std::memcpy(&fixed, region.data(), sizeof fixed);
    uint64_t used = fixed.name_index_offset + fixed.name_index_slots * sizeof(uint32_t);
    for (uint8_t flags : {0, 1, 2}) {
      std::vector<std::byte> input(9 + used);
      input[0] = std::byte{flags};
      std::memcpy(input.data() + 1, &layout->file_bytes, 8);
      std::memcpy(input.data() + 9, region.data(), used);
      Write("arena_header",
            std::string(state == format::FileState::kPublished ? "published" : "loading") +
                "-flags" + std::to_string(flags),
            input);
    }
  }
  // The same table for arena_table_fuzzer.cc: its prefix, then the table bytes from the
  // source entries to the end of the name index.
  Check(format::EncodeHeader(table, *layout, format::FileState::kPublished, 42, 43, 44, 45,
                             region));
  format::HeaderFixed fixed;
  std::memcpy(&fixed, region.data(), sizeof fixed);
  const uint64_t index_end = fixed.name_index_offset + fixed.name_index_slots * sizeof(uint32_t);
  uint8_t alignment_log2 = 0;
  while ((uint64_t{1} << alignment_log2) < fixed.alignment) ++alignment_log2;
  for (uint8_t flags : {0, 1, 2}) {
    std::vector<std::byte> input(7);
    input[0] = std::byte{flags};
    input[1] = std::byte{static_cast<uint8_t>(fixed.source_count)};
    input[2] = std::byte{static_cast<uint8_t>(fixed.tensor_count)};
    input[3] = std::byte{alignment_log2};
    input[4] = std::byte{static_cast<uint8_t>(fixed.data_bytes / format::kHeaderPageBytes - 1)};
    const auto strings_bytes = static_cast<uint16_t>(fixed.strings_bytes);
    std::memcpy(input.data() + 5, &strings_bytes, 2);
    input.insert(input.end(), region.begin() + static_cast<std::ptrdiff_t>(fixed.sources_offset),
                 region.begin() + static_cast<std::ptrdiff_t>(index_end));
    Write("arena_table", "two-tensors-flags" + std::to_string(flags), input);
  }
  // Two tensors at the same offset (each checksum recomputed by the target): the table a
  // hostile writer makes so that one name reads another's bytes.
  format::ArenaTable overlapping = table;
  overlapping.tensors[1].arena_offset = overlapping.tensors[0].arena_offset;
  Check(format::EncodeHeader(overlapping, *layout, format::FileState::kPublished, 42, 43, 44, 45,
                             region));
  std::vector<std::byte> input(7);
  input[1] = std::byte{static_cast<uint8_t>(fixed.source_count)};
  input[2] = std::byte{static_cast<uint8_t>(fixed.tensor_count)};
  input[3] = std::byte{alignment_log2};
  input[4] = std::byte{static_cast<uint8_t>(fixed.data_bytes / format::kHeaderPageBytes - 1)};
  const auto strings_bytes = static_cast<uint16_t>(fixed.strings_bytes);
  std::memcpy(input.data() + 5, &strings_bytes, 2);
  input.insert(input.end(), region.begin() + static_cast<std::ptrdiff_t>(fixed.sources_offset),
               region.begin() + static_cast<std::ptrdiff_t>(index_end));
  Write("arena_table", "overlapping-offsets", input);
}

void StreamSeeds() {
  TensorDescriptor d;
  d.segment = "ea-stream-prefill-123-456-abcdef-1";
  d.slot = 3;
  d.generation = 9;
  d.offset = 2 << 20;
  d.length = 4096;
  d.dtype = "bf16";
  d.shape = {4, 512};
  d.key = "req-17";
  std::string valid = std::string(1, '\0') + d.Encode();
  Write("descriptor", "valid", valid);
  d.spilled = true;
  d.shape = {};
  Write("descriptor", "spilled-scalar", std::string(1, '\0') + d.Encode());
  TensorDescriptor bad = d;
  bad.segment = "../etc/passwd";
  Write("descriptor", "bad-name-fixed", std::string(1, '\1') + bad.Encode());
  bad = d;
  bad.offset = UINT64_MAX;
  Write("descriptor", "offset-overflow-fixed", std::string(1, '\1') + bad.Encode());
  Write("descriptor", "truncated", valid.substr(0, valid.size() - 9));
  // A listening producer's descriptor (docs/cross-host.md), and one with a hostile address.
  TensorDescriptor remote = d;
  remote.remote = "10.0.0.1:4791";
  remote.producer_instance = 0x1234567890abcdefull;
  remote.boot_id = "0123abcd-0123-4567-89ab-0123456789ab";
  Write("descriptor", "remote", std::string(1, '\0') + remote.Encode());
  remote.remote = "10.0.0.1:4791; rm -rf /";
  Write("descriptor", "remote-bad-address-fixed", std::string(1, '\1') + remote.Encode());
  // Signed as a producer with a listen_token signs (the target re-signs every input).
  remote.remote = "10.0.0.1:4791";
  Write("descriptor_signed", "remote", std::string(1, '\0') + remote.Encode("t0ken"));
  Write("descriptor_signed", "local-other-token", std::string(1, '\2') + d.Encode("t0ken"));
  Write("descriptor_signed", "no-mac-claimed", std::string(1, '\1') + remote.Encode());

  // A regular segment of 4 MiB of data, as CreateSegment writes its header.
  stream::SegmentHeader h{};
  std::memcpy(h.magic, stream::kSegmentMagic, sizeof h.magic);
  h.version = stream::kSegmentVersion;
  h.header_struct_bytes = sizeof h;
  h.data_offset = stream::kHeaderRegionBytes;
  h.data_bytes = 4 << 20;
  h.file_bytes = h.data_offset + h.data_bytes;
  h.readers_offset = stream::kReadersOffset;
  h.slots_offset = stream::kSlotsOffset;
  h.reader_entries = stream::kMaxReaders;
  h.reader_entry_bytes = sizeof(stream::ReaderEntry);
  h.slot_count = 64;
  h.slot_bytes = sizeof(stream::BlockSlot);
  h.kind = static_cast<uint32_t>(stream::SegmentKind::kRegular);
  h.owner_pid = 123;
  std::strncpy(h.logical_name, "prefill", sizeof h.logical_name - 1);
  for (uint32_t slots : {1u, 64u, stream::kMaxSlots}) {
    h.slot_count = slots;
    std::string input(8 + sizeof h, '\0');
    std::memcpy(input.data(), &h.file_bytes, 8);
    std::memcpy(input.data() + 8, &h, sizeof h);
    Write("segment_header", "slots-" + std::to_string(slots), input);
  }
  // With a block reference (slot, offset, length): the last block of the data region, then
  // one byte past it.
  for (uint64_t extra : {0, 1}) {
    uint64_t reference[3] = {h.slot_count - 1, h.file_bytes - 4096, 4096 + extra};
    std::string input(8 + sizeof h + sizeof reference, '\0');
    std::memcpy(input.data(), &h.file_bytes, 8);
    std::memcpy(input.data() + 8, &h, sizeof h);
    std::memcpy(input.data() + 8 + sizeof h, reference, sizeof reference);
    Write("segment_header", extra == 0 ? "reference" : "reference-past-end", input);
  }
  h.slot_count = stream::kMaxSlots + 1;
  std::string input(8 + sizeof h, '\0');
  std::memcpy(input.data(), &h.file_bytes, 8);
  std::memcpy(input.data() + 8, &h, sizeof h);
  Write("segment_header", "too-many-slots", input);
}

// The client's side of the front door: flags | challenge | admit | the server's worker address.
void FrontDoorClientSeeds() {
  auto seed = [](uint8_t flags, uint32_t challenge_status, uint32_t admit_status,
                 std::vector<uint8_t> address) {
    std::string out(1, static_cast<char>(flags));
    remote::DoorChallenge c{remote::kDoorMagic, remote::kDoorVersion, challenge_status, {}, {}};
    remote::DoorAdmit a{remote::kDoorMagic, admit_status,
                        static_cast<uint32_t>(admit_status == 0 ? address.size() : 0), {}};
    out.append(reinterpret_cast<const char*>(&c), sizeof c);
    out.append(reinterpret_cast<const char*>(&a), sizeof a);
    out.append(address.begin(), address.end());
    return out;
  };
  // UCX 1.13's packing (front_door.h): v2 with a worker uuid, then a device; v1 likewise.
  std::vector<uint8_t> v2 = {0x01, 0x02, 1, 2, 3, 4, 5, 6, 7, 8, 0x00, 0x06, 0x01, 0x00};
  std::vector<uint8_t> v1 = {0x20, 1, 2, 3, 4, 5, 6, 7, 8, 0x00, 0x06, 0x01, 0x00};
  std::vector<uint8_t> random(200);
  uint32_t x = 12345;
  for (uint8_t& b : random) b = static_cast<uint8_t>((x = x * 1103515245 + 12345) >> 16);
  random[0] = 0x0e;  // a version UCX asserts on (address.c:1051)
  Write("front_door_client", "v2-proved", seed(2, 0, 0, v2));
  Write("front_door_client", "v1-proved-token", seed(2 | 4, 0, 0, v1));
  Write("front_door_client", "random-address-no-token", seed(2 | 8, 0, 0, random));
  Write("front_door_client", "unproved", seed(0, 0, 0, v2));
  Write("front_door_client", "busy", seed(2, 0, 2, {}));
  Write("front_door_client", "wrong-token-challenge", seed(2, 1, 0, v2));
  Write("front_door_client", "no-transport", seed(2 | 8, 0, 0, {0x01, 0x00, 0xff}));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  g_out = argv[1];
  GgufSeeds();
  SafetensorsSeeds();
  ShardedSeeds();
  ArenaHeaderSeeds();
  StreamSeeds();
  FrontDoorClientSeeds();
  return 0;
}
