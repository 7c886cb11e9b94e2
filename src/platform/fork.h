// Noticing fork(): handlers run by the C library around every fork() of this process.
//
// A forked child inherits every mapping, every open file description and a copy of every
// allocator's state, but only the thread that called fork(). Objects that hand out shared
// space (stream producers and consumers) must neither serve the child from the parent's
// state nor tear the parent's state down when the child drops them; they register here.
#pragma once

#include "expert_arena/status.h"

namespace expert_arena::platform {

// Registers handlers with pthread_atfork: `prepare` runs in the forking thread before the
// fork, `parent` after it in the parent, `child` after it in the child (the only thread
// there). They stay registered for the life of the process; call once. Fails with kIoError
// naming the errno when the C library refuses (out of memory).
Status RegisterForkHandlers(void (*prepare)(), void (*parent)(), void (*child)());

}  // namespace expert_arena::platform
