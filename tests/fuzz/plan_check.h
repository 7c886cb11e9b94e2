// Runs the rest of planning on a model file a reader accepted, the way `expert-arena load`
// does (PlanModel: detection, selection, arena offsets, identity), and checks what the loader
// and the arena header then trust: every tensor is named cleanly, lies inside its source file
// and inside the data region without overlapping another of that file, and the table survives
// the arena header's encode/decode unchanged. A refusal must not quote a control byte.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "common/escape.h"
#include "format/arena_format.h"
#include "format/arena_table.h"
#include "fuzz_util.h"
#include "source/model_source.h"

namespace expert_arena::fuzz {

// A refusal says what is wrong without quoting a control byte from the input (it would drive
// the terminal of whoever reads it): the paths the targets use are clean, so any control byte
// in a message came from the file.
inline void CheckCleanRefusal(const Status& status) {
  CheckRefusal(status);
  FUZZ_CHECK(ControlByteProblem(status.message()).empty());
}

// Headers of more tensors than this are not round-tripped: the region would take several
// 2 MiB pages per run and slow the fuzzer down for no new code.
inline constexpr size_t kMaxRoundTripTensors = 2000;

// Checks a plan's table: every source is one of `sizes` (path -> size, as the reader saw
// it) when given; every tensor is named cleanly, lies inside its source and the data region,
// and overlaps no other tensor of its source; the table survives the arena header's
// encode/decode unchanged.
inline void CheckPlanTable(const format::ArenaTable& table,
                           const std::map<std::string, uint64_t>* sizes) {
  FUZZ_CHECK(!table.sources.empty());
  if (sizes != nullptr) {
    for (const format::SourceRecord& s : table.sources) {
      auto it = sizes->find(s.path);
      FUZZ_CHECK(it != sizes->end() && it->second == s.size);
    }
  }
  FUZZ_CHECK(table.data_bytes % format::kHeaderPageBytes == 0);
  std::vector<const format::TensorRecord*> by_source;
  for (const format::TensorRecord& t : table.tensors) {
    FUZZ_CHECK(format::TensorNameProblem(t.name).empty());
    FUZZ_CHECK(t.source_index < table.sources.size());
    const uint64_t file_size = table.sources[t.source_index].size;
    FUZZ_CHECK(t.source_offset <= file_size && t.bytes <= file_size - t.source_offset);
    FUZZ_CHECK(t.arena_offset % format::TensorAlignment(table.alignment, t.bytes) == 0);
    FUZZ_CHECK(t.arena_offset <= table.data_bytes && t.bytes <= table.data_bytes - t.arena_offset);
    FUZZ_CHECK(t.shape.size() <= format::kMaxDims);
    if (t.bytes > 0) by_source.push_back(&t);
  }
  std::sort(by_source.begin(), by_source.end(), [](const auto* a, const auto* b) {
    return a->source_index != b->source_index ? a->source_index < b->source_index
                                              : a->source_offset < b->source_offset;
  });
  for (size_t i = 1; i < by_source.size(); ++i) {
    const format::TensorRecord& a = *by_source[i - 1];
    const format::TensorRecord& b = *by_source[i];
    FUZZ_CHECK(a.source_index != b.source_index || a.source_offset + a.bytes <= b.source_offset);
  }
  if (table.tensors.size() > kMaxRoundTripTensors) return;
  auto layout = format::ComputeLayout(table, format::kHeaderPageBytes);
  if (!layout.ok()) {
    CheckCleanRefusal(layout.status());
    return;
  }
  std::vector<std::byte> region(layout->header_bytes);
  Status encoded =
      format::EncodeHeader(table, *layout, format::FileState::kPublished, 1, 2, 3, 4, region);
  FUZZ_CHECK(encoded.ok());
  format::ArenaTable decoded;
  format::HeaderSummary summary;
  Status status =
      format::DecodeHeader(region, layout->file_bytes, "fuzz-arena", &decoded, &summary);
  if (!status.ok()) std::fprintf(stderr, "%s\n", status.ToString().c_str());
  FUZZ_CHECK(status.ok());
  FUZZ_CHECK(decoded.tensors.size() == table.tensors.size());
  FUZZ_CHECK(decoded.identity_hash == table.identity_hash);
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    const format::TensorRecord& a = table.tensors[i];
    const format::TensorRecord& b = decoded.tensors[i];
    FUZZ_CHECK(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape);
    FUZZ_CHECK(a.source_offset == b.source_offset && a.arena_offset == b.arena_offset &&
               a.bytes == b.bytes);
  }
}

inline void CheckPlanResult(const Result<source::ModelPlan>& plan,
                            const std::map<std::string, uint64_t>* sizes) {
  if (!plan.ok()) {
    CheckCleanRefusal(plan.status());
    return;
  }
  CheckPlanTable(plan->table, sizes);
}

// Plans the one file `path` (select all) and checks the plan.
inline void CheckPlan(const std::string& path, uint64_t file_size) {
  ModelSpec spec;
  spec.files = {path};
  spec.select_all = true;
  auto plan = source::PlanModel(spec);
  if (plan.ok()) {
    FUZZ_CHECK(plan->table.sources.size() == 1);
    FUZZ_CHECK(plan->table.sources[0].size == file_size);
  }
  CheckPlanResult(plan, nullptr);
}

}  // namespace expert_arena::fuzz
