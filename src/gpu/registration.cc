#include "gpu/gpu.h"

namespace expert_arena::gpu {
namespace {

class NoRegistration final : public Registration {
 public:
  explicit NoRegistration(RegistrationReport report) : report_(std::move(report)) {}
  const RegistrationReport& report() const override { return report_; }

 private:
  RegistrationReport report_;
};

}  // namespace

Result<std::unique_ptr<Registration>> RegisterHostRange(std::span<std::byte> /*range*/,
                                                        const RegisterOptions& options) {
  if (options.device.empty() || options.device == "none") {
    return std::unique_ptr<Registration>(new NoRegistration({"none", 0, 0, "no GPU asked for"}));
  }
  return Unsupported("GPU registration with " + options.device +
                     ": this build has no CUDA or HIP backend");
}

}  // namespace expert_arena::gpu
