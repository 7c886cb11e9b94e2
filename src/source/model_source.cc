#include "source/model_source.h"

namespace expert_arena::source {

Result<ModelPlan> PlanModel(const ModelSpec& spec) {
  if (spec.files.empty()) return InvalidArgument("no model file given");
  // GGUF and safetensors readers are dispatched here once they land; until then every
  // file is loaded raw.
  return PlanRawFiles(spec);
}

}  // namespace expert_arena::source
