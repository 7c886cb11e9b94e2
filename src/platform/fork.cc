#include "platform/fork.h"

#include <pthread.h>

#include <cstring>
#include <string>

namespace expert_arena::platform {

Status RegisterForkHandlers(void (*prepare)(), void (*parent)(), void (*child)()) {
  // pthread_atfork returns the error number (it does not set errno).
  if (int rc = ::pthread_atfork(prepare, parent, child); rc != 0) {
    return Status(StatusCode::kIoError, std::string("pthread_atfork: ") + std::strerror(rc));
  }
  return Status::Ok();
}

}  // namespace expert_arena::platform
