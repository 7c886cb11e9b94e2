// Stream objects across fork(): a forked child never serves, releases or frees anything from
// the state it inherited.
//
// A child inherits a copy of a producer's allocator and of a consumer's holds, and the open
// file descriptions (with their OFD locks) of every segment. Serving the child from that copy
// would hand out a block the parent hands out too; tearing it down would unlink the parent's
// live segments or spend its readers' shares. So every producer and consumer registers here:
//   - before fork() its mutexes are taken (the forking thread waits for the other threads'
//     short critical sections), so the child's copy is consistent;
//   - in the child they are released, the inherited segment file descriptors are closed (the
//     parent's OFD locks stay with the parent's descriptors: a child that outlives its parent
//     must not make the parent's segments or reader entries look alive), and the object is
//     marked foreign: its methods fail with ForkedMessage, and dropping its last reference
//     keeps its memory (mappings a view may still read, mutexes and a condition variable
//     another thread of the parent was waiting on) instead of tearing it down.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "expert_arena/status.h"

namespace expert_arena::stream {

class ForkParticipant {
 public:
  virtual ~ForkParticipant() = default;
  // Takes every mutex of the object, in the forking thread before the fork.
  virtual void LockForFork() = 0;
  // Releases them after the fork; in the child also closes the inherited descriptors.
  virtual void UnlockAfterFork(bool in_child) = 0;
};

// Adds `p` (at creation, before it is shared) and installs the fork handlers the first time.
// Fails when the C library cannot register them.
Status RegisterForFork(ForkParticipant* p);
// Removes `p`; called first in its destructor, before any of its mutexes is taken.
void UnregisterForFork(ForkParticipant* p);

// 0 in a process that was not forked from one that used streams; each fork() adds one in the
// child. An object made at generation G belongs to another process when this differs from G.
uint64_t ForkGeneration();

// The address of this process's registry of fork participants (remote/core_identity.h).
const void* ForkRegistryAddress();

// Keeps `object` allocated for the life of the process (reachable, so not a leak to a leak
// checker): what a child inherited is never destroyed there.
void KeepForever(const void* object);

// "<what> was created in process P; a forked child (process C) must create its own".
std::string ForkedMessage(const char* what, pid_t creator);

}  // namespace expert_arena::stream
