#include <filesystem>

#include "platform/file.h"
#include "source/model_source.h"

namespace expert_arena::source {

Result<ModelPlan> PlanRawFiles(const ModelSpec& spec) {
  ModelPlan plan;
  plan.format = "raw";
  plan.table.alignment = spec.alignment;
  for (size_t i = 0; i < spec.files.size(); ++i) {
    const std::string& path = spec.files[i];
    // Followed: model caches link to their blobs.
    EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(path, {.no_follow = false}));
    EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
    if (!st.regular) return InvalidArgument(path + ": not a regular file");
    std::error_code ec;
    std::string absolute = std::filesystem::absolute(path, ec).lexically_normal().string();
    plan.table.sources.push_back({ec ? path : absolute, st.size, st.mtime_ns});
    format::TensorRecord tensor;
    tensor.name = std::filesystem::path(path).filename().string();
    tensor.dtype = "u8";
    tensor.shape = {st.size};
    tensor.source_index = static_cast<uint32_t>(i);
    tensor.source_offset = 0;
    tensor.bytes = st.size;
    plan.table.tensors.push_back(std::move(tensor));
    plan.table.model_bytes_total += st.size;
  }
  plan.table.model_tensors_total = plan.table.tensors.size();
  EA_RETURN_IF_ERROR(format::AssignArenaOffsets(plan.table));
  format::ComputeIdentity(plan.table);
  return plan;
}

}  // namespace expert_arena::source
