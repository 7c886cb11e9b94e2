#include "stream/fork_guard.h"

#include <atomic>
#include <mutex>
#include <vector>

#include "platform/fork.h"
#include "platform/system_info.h"

namespace expert_arena::stream {
namespace {

// Never destroyed: fork handlers and destructors of static objects may run after exit began.
struct Registry {
  std::mutex mu;
  std::vector<ForkParticipant*> participants;
  std::mutex kept_mu;
  std::vector<const void*> kept;
};

Registry& Get() {
  static Registry* registry = new Registry;
  return *registry;
}

std::atomic<uint64_t> generation{0};

void Prepare() {
  Registry& r = Get();
  r.mu.lock();
  r.kept_mu.lock();
  for (ForkParticipant* p : r.participants) p->LockForFork();
}

void Parent() {
  Registry& r = Get();
  for (ForkParticipant* p : r.participants) p->UnlockAfterFork(false);
  r.kept_mu.unlock();
  r.mu.unlock();
}

void Child() {
  Registry& r = Get();
  generation.fetch_add(1, std::memory_order_relaxed);
  for (ForkParticipant* p : r.participants) p->UnlockAfterFork(true);
  // They belong to the parent: a fork of this child must not wait for their mutexes.
  r.participants.clear();
  r.kept_mu.unlock();
  r.mu.unlock();
}

}  // namespace

Status RegisterForFork(ForkParticipant* p) {
  static const Status installed = platform::RegisterForkHandlers(Prepare, Parent, Child);
  if (!installed.ok()) return installed;
  Registry& r = Get();
  std::lock_guard lock(r.mu);
  r.participants.push_back(p);
  return Status::Ok();
}

void UnregisterForFork(ForkParticipant* p) {
  Registry& r = Get();
  std::lock_guard lock(r.mu);
  std::erase(r.participants, p);
}

uint64_t ForkGeneration() { return generation.load(std::memory_order_relaxed); }

const void* ForkRegistryAddress() { return &Get(); }

void KeepForever(const void* object) {
  Registry& r = Get();
  std::lock_guard lock(r.kept_mu);
  r.kept.push_back(object);
}

std::string ForkedMessage(const char* what, pid_t creator) {
  return std::string(what) + " was created in process " + std::to_string(creator) +
         "; a forked child (process " + std::to_string(platform::CurrentPid()) +
         ") must create its own";
}

}  // namespace expert_arena::stream
