#include "platform/io_ring.h"

#include <liburing.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "common/fault_points.h"
#include "platform/kernel_features.h"

namespace expert_arena::platform {
namespace {

// Why the kernel refused a ring, in words an operator can act on.
std::string RefusalReason(int err) {
  std::string disabled;
  std::ifstream sysctl("/proc/sys/kernel/io_uring_disabled");
  if (sysctl) std::getline(sysctl, disabled);
  if (err == EPERM && !disabled.empty() && disabled != "0") {
    return "io_uring is disabled by kernel.io_uring_disabled=" + disabled;
  }
  if (err == EPERM) return "io_uring_setup was refused (EPERM: a seccomp filter or policy)";
  if (err == ENOSYS) return "io_uring_setup is not available (ENOSYS: old kernel or seccomp)";
  return std::string("io_uring_setup failed: ") + std::strerror(err);
}

}  // namespace

IoRing::IoRing() : ring_(std::make_unique<io_uring>()) {}

IoRing::IoRing(IoRing&& other) noexcept = default;
IoRing& IoRing::operator=(IoRing&& other) noexcept = default;

IoRing::~IoRing() {
  if (ring_) io_uring_queue_exit(ring_.get());
}

Result<IoRing> IoRing::Create(unsigned entries) {
  // Probed once (kernel_features.h): a refused or too old io_uring is not asked again per
  // thread, and the loader's note says why.
  const FeatureProbe& probe = Kernel().get(KernelFeature::kIoUring);
  if (!probe.present) {
    CountFallback(KernelFeature::kIoUring, 0, 0);
    return Unsupported(probe.error == EINVAL ? probe.answer : RefusalReason(probe.error));
  }
  IoRing ring;
  std::memset(ring.ring_.get(), 0, sizeof(io_uring));
  int rc = io_uring_queue_init(entries, ring.ring_.get(), 0);
  if (rc < 0) {
    ring.ring_.reset();  // nothing to tear down
    return Unsupported(RefusalReason(-rc));
  }
  return ring;
}

bool IoRing::QueueRead(int fd, void* buffer, uint32_t bytes, uint64_t offset, uint64_t user_data) {
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  if (sqe == nullptr) return false;
  io_uring_prep_read(sqe, fd, buffer, bytes, offset);
  io_uring_sqe_set_data64(sqe, user_data);
  return true;
}

Status IoRing::Submit() {
  if (const int injected = fault_points::RingSubmit(); injected < 0) {
    return ErrnoStatus(-injected, "io_uring_submit", "");
  }
  // The kernel may take part of the queue (it stops at a request it cannot allocate): submit
  // until it took everything, or a completion would be waited for that can never come.
  while (io_uring_sq_ready(ring_.get()) > 0) {
    int rc = io_uring_submit(ring_.get());
    if (rc == -EINTR || rc == -EAGAIN) continue;
    if (rc < 0) return ErrnoStatus(-rc, "io_uring_submit", "");
    if (rc == 0) return ErrnoStatus(EAGAIN, "io_uring_submit", "");
  }
  return Status::Ok();
}

unsigned IoRing::Queued() const { return io_uring_sq_ready(ring_.get()); }

bool IoRing::QueueCancelAll(uint64_t user_data) {
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  if (sqe == nullptr) return false;
  io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
  io_uring_sqe_set_data64(sqe, user_data);
  return true;
}

Result<IoCompletion> IoRing::WaitOne() {
  io_uring_cqe* cqe = nullptr;
  for (;;) {
    int rc = io_uring_wait_cqe(ring_.get(), &cqe);
    if (rc == 0) break;
    if (rc == -EINTR || rc == -EAGAIN) continue;
    return ErrnoStatus(-rc, "io_uring_wait_cqe", "");
  }
  IoCompletion out{io_uring_cqe_get_data64(cqe), cqe->res};
  io_uring_cqe_seen(ring_.get(), cqe);
  return out;
}

}  // namespace expert_arena::platform
